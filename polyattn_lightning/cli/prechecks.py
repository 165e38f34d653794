"""What is checked before any model is built: the ``--config`` files as YAML, ahead of jsonargparse (a removed
experiment config, their syntax, the YAML pieces they name, the attention they give), and the parsed values, by the
classes' own checks.

jsonargparse parses a file's text and reports a syntax error ``in "<unicode string>"``; a bad name or path found only
when its model is built costs minutes. Both are found here, in a line that names the file or the key. So is a config
path of an earlier release: the per-activation experiment configs became one base config per model and a grid per
paper table (:data:`MOVED_CONFIGS`), and the line says which base config and settings make the removed run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import yaml

from ..errors import ConfigError, MissingPathError
from .config import component_class, init_args


def _moved_configs() -> dict[str, tuple[str, str, str | None]]:
    """The removed per-activation experiment configs: path under ``configs/`` -> (the base config that replaced it,
    the command-line settings that make it the removed run, the grid of its paper table or None)."""
    fixed = 0.07142857142857142  # the paper's ImageNet scale 1/14
    cubic, linear = f"{{name: poly3, scale: {fixed}}}", f"{{name: poly1, scale: {fixed}}}"
    moved: dict[str, tuple[str, str, str | None]] = {}

    def attention(spec: str, extra: str = "") -> str:
        return f"--model.init_args.attention '{spec}'{extra}"

    paper = (
        "vit_small",
        "vit_base",
        "deit_small",
        "deit_base",
        "swin_small",
        "swin_base",
        "xcit_small_12",
        "xcit_medium_24",
    )
    for model in paper:
        for suffix, spec in (("softmax", "softmax"), ("poly3", cubic), ("poly1", linear)):
            moved[f"classification/imagenet/{model}_{suffix}.yaml"] = (
                f"classification/imagenet/{model}.yaml",
                attention(spec),
                "grids/imagenet_table2.yaml",
            )
    for model in ("eva02_small", "beit_base", "maxvit_tiny", "swinv2_tiny"):
        for suffix, spec in (("softmax", "softmax"), ("poly3", "{name: poly3, scale: inv_sqrt_n}")):
            moved[f"classification/imagenet/{model}_{suffix}.yaml"] = (
                f"classification/imagenet/{model}.yaml",
                attention(spec),
                "grids/imagenet_families.yaml",
            )
    moved["classification/imagenet/vit_large_poly3.yaml"] = ("classification/imagenet/vit_large.yaml", "", None)
    for suffix, spec in (
        ("softmax", "softmax"),
        ("poly3", "{name: poly3, scale: none}"),
        ("poly3_inv_sqrt_n", "{name: poly3, scale: inv_sqrt_n}"),
        ("poly1", "{name: poly1, scale: none}"),
        ("poly1_inv_sqrt_n", "{name: poly1, scale: inv_sqrt_n}"),
    ):
        moved[f"classification/tiny_imagenet/vit_tiny_{suffix}.yaml"] = (
            "classification/tiny_imagenet/vit_tiny.yaml",
            attention(spec),
            "grids/tiny_imagenet_table1.yaml",
        )
    for model, suffixes, grid in (
        ("xcit_small_12", ("softmax", "poly3", "poly1"), "grids/coco_table3.yaml"),
        ("xcit_medium_24", ("softmax", "poly3"), None),
    ):
        for suffix in suffixes:
            spec = {"softmax": "softmax", "poly3": cubic, "poly1": linear}[suffix]
            pretrained = f" --model.init_args.pretrained <the {suffix} ImageNet run's last.ckpt>"
            moved[f"detection/coco/mask_rcnn_{model}_{suffix}_3x.yaml"] = (
                f"detection/coco/mask_rcnn_{model}_3x.yaml",
                attention(spec, pretrained),
                grid,
            )
    lra = {
        "softmax": attention("softmax"),
        "poly3": attention("{name: poly3, scale: 0.0714}"),
        "poly3_inv_sqrt_n": attention("{name: poly3, scale: inv_sqrt_n}"),
        "poly1": attention("{name: poly1, scale: 0.0714}"),
        "relu": attention("{name: relu, scale: inv_n}"),
        "poly1_attn_dropout0": attention("{name: poly1, scale: 0.0714}", " --model.init_args.attn_dropout 0.0"),
    }
    for task in ("listops", "text", "retrieval", "image", "pathfinder"):
        for suffix, settings in lra.items():
            moved[f"lra/{task}/{task}_{suffix}.yaml"] = (f"lra/{task}.yaml", settings, f"grids/lra_table4/{task}.yaml")
    for task in ("pathx", "path256"):
        moved[f"lra/{task}/{task}_poly3.yaml"] = (f"lra/{task}.yaml", "", None)
    return moved


#: The per-activation experiment configs that became one base config per model and a grid per paper table (issue 36).
MOVED_CONFIGS = _moved_configs()


def config_args(args: list[str]) -> list[str]:
    """The ``--config`` values of a command line (``--config FILE``, ``-c FILE``, ``--config=FILE``)."""
    given = [value for flag, value in zip(args, args[1:]) if flag in ("--config", "-c")]
    return given + [arg.split("=", 1)[1] for arg in args if arg.startswith("--config=")]


def check_moved_configs(args: list[str]) -> None:
    """A ``--config`` path that does not exist and is a removed experiment config (:data:`MOVED_CONFIGS`): an error
    naming the base config and the settings that make that run, and the grid of its paper table. A file the user
    keeps at such a path is theirs and is read as it is."""
    by_file = {tuple(key.split("/")[-2:]): key for key in MOVED_CONFIGS}  # folder/name: unique among them
    for given in config_args(args):
        path = Path(given)
        moved = by_file.get(path.parts[-2:])
        if moved is None or path.is_file():
            continue
        base, settings, grid = MOVED_CONFIGS[moved]
        # the new paths as the old one was given: from the same configs/ folder, else from the repository's root
        whole = path.as_posix()
        root = whole[: -len(moved)] if whole.endswith(f"configs/{moved}") else "configs/"
        run = f"--config {root}{base}" + (f" {settings}" if settings else "")
        table = f"; its paper table: polyattn grid {root}{grid}" if grid else ""
        raise MissingPathError(
            f"{given} was removed (one base config per model, a grid per paper table): the same run is {run}{table}"
        )


def yaml_references(config: Any) -> Iterator[str]:
    """Every string value of a parsed config that names another YAML file (a piece, relative to that config)."""
    stack = [config]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, str) and node.endswith((".yaml", ".yml")):
            yield node


def check_yaml_syntax(args: list[str]) -> None:
    """A ``--config`` file, or a YAML piece it names, that is not valid YAML: an error naming that file and line
    (jsonargparse parses the text and says ``in "<unicode string>"``). Missing files are left to jsonargparse."""
    pending = [Path(value) for value in config_args(args)]
    seen: set[Path] = set()
    while pending:
        path = pending.pop()
        if path in seen or not path.is_file():
            continue
        seen.add(path)
        try:
            with path.open() as file:
                config = yaml.safe_load(file)
        except yaml.YAMLError as err:
            raise ConfigError(f"{path} is not valid YAML: {err}") from err
        pending += [path.parent / name for name in yaml_references(config)]  # the pieces it names, relative to it


def config_attention(files) -> Any:
    """The ``model.init_args.attention`` the ``--config`` files give (the last that gives one), or None."""
    for file in reversed([Path(str(path)) for path in files]):
        model = (yaml.safe_load(file.read_text()) or {}).get("model") if file.is_file() else None
        if isinstance(model, str) and model.endswith((".yaml", ".yml")):
            model = yaml.safe_load((file.parent / model).read_text())
        attention = (model.get("init_args") or {}).get("attention") if isinstance(model, dict) else None
        if attention is not None:
            return attention
    return None


def check_config(config) -> None:
    """Fail on what can be checked before any model is built: the model's init arguments, by its class's
    ``check_init_args`` (:meth:`~polyattn_lightning.tasks.base.TaskModule.check_init_args`: the attention spec, the
    timm model name, the pretrained file, dropped beforehand when ``--ckpt_path`` is given) and the data paths, by the
    DataModule's ``check_paths(**init_args)`` (:meth:`~polyattn_lightning.data.base.DataModule.check_paths`)."""
    for key, method in (("model", "check_init_args"), ("data", "check_paths")):
        component = config.get(key)
        check = getattr(component_class(component), method, None)  # None: not on our bases
        if check is not None:
            check(init_args(component)) if key == "model" else check(**init_args(component))
