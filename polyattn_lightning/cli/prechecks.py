"""What is checked before any model is built: the ``--config`` files as YAML, ahead of jsonargparse (their syntax,
the YAML pieces they name, the attention they give), and the parsed values, by the classes' own checks.

jsonargparse parses a file's text and reports a syntax error ``in "<unicode string>"``; a bad name or path found only
when its model is built costs minutes. Both are found here, in a line that names the file or the key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import yaml

from ..errors import ConfigError
from .config import component_class, init_args


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
    pending = [Path(value) for flag, value in zip(args, args[1:]) if flag in ("--config", "-c")]
    pending += [Path(arg.split("=", 1)[1]) for arg in args if arg.startswith("--config=")]
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
