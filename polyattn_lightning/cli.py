"""``lightning`` / ``polyattn`` / ``python -m polyattn_lightning``: a LightningCLI over this project's tasks.

Usage: ``lightning fit --config configs/classification/quickstart.yaml``. Any
LightningModule or LightningDataModule can be named in ``class_path``; this
project's are imported first, so their short names (``ClassificationModule``,
``DigitsDataModule``...) work.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import inspect
import logging
import os
import re
import shlex
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any, Iterator, Literal, get_args

import torch
import yaml
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.fabric.utilities.cloud_io import get_filesystem
from jsonargparse import ArgumentError, DefaultHelpFormatter
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only

from . import data, tasks  # noqa: F401  (registers the short class names)
from .callbacks.preemption import EXIT_INTERRUPTED, StopOnSignal
from .callbacks.progress import StepsRichProgressBar
from .callbacks.standard import STANDARD_CALLBACKS, STANDARD_KEYS, merge_callbacks, resolve_checkpoint_monitor
from .checkpoint import CheckpointLoadError, load_checkpoint
from .errors import (
    DEBUG_ENV,
    EXIT_USER_ERROR,
    UNRECOGNIZED,
    ConfigError,
    MissingPathError,
    closest_option,
    reported,
    unknown_options_message,
)
from .distributed import distributed_teardown
from .sharding import ShardedStrategy, build_later, is_sharded_checkpoint
from .sharding.checkpoints import META_FILE, check_sharded_folder

#: Whether ``rich`` is installed: Lightning's default progress bar is then its RichProgressBar.
RICH_AVAILABLE = importlib.util.find_spec("rich") is not None
#: TensorBoardLogger's default run name, which the CLI replaces with the config file's name.
DEFAULT_RUN_NAME = "lightning_logs"
#: Where runs are logged by default: ``runs/<task family>/<config name>/version_N``.
RUNS_DIR = "runs"
#: The loggers a resumed run can go on in its own folder with: TensorBoard adds an events file beside the first
#: run's (Lightning's CSVLogger would write its metrics.csv over the first run's).
FOLDER_LOGGERS = (".TensorBoardLogger",)


def default_precision() -> str:
    """bf16 mixed precision where the GPU has it, fp16 mixed on older GPUs, fp32 on CPU."""
    if not torch.cuda.is_available():
        return "32-true"
    return "bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed"


#: The Trainer's options where an int and a float mean different things: an int counts batches, a float is a
#: fraction of them (``limit_train_batches: 1`` is one batch, ``1.0`` the whole epoch).
BATCH_LIMITS = ("limit_train_batches", "limit_val_batches", "limit_test_batches", "limit_predict_batches")


def batch_limits_read_as_counts(trainer_class: type) -> None:
    """Make the CLI read ``--trainer.limit_train_batches 1`` as one batch, as Lightning's signature says, in every
    environment.

    Lightning annotates the :data:`BATCH_LIMITS` ``Optional[Union[int, float]]``, but Python's typing cache hands
    back an equal union made earlier, whatever its order, and ``lightning.fabric`` makes
    ``Optional[Union[float, int]]`` as it is imported. Unless an earlier import made the int-first union
    (torchvision's transforms do, and torchmetrics 1.9, which Lightning imports first, imports them; 1.4 does not),
    the Trainer's annotations list float first; jsonargparse tries a union's types in order, and reads ``1`` as
    ``1.0``: the whole epoch instead of one batch. Such an annotation is put back in the signature's order as
    ``int | float | None`` (a ``types.UnionType``, which typing does not cache)."""
    for cls in getattr(trainer_class, "__mro__", ()):  # a class (LightningCLI also takes a function)
        init = cls.__dict__.get("__init__")
        annotations = getattr(inspect.unwrap(init), "__annotations__", {}) if init else {}
        for name in BATCH_LIMITS:
            if get_args(annotations.get(name)) == (float, int, type(None)):
                annotations[name] = int | float | None


class KeepingSaveConfigCallback(SaveConfigCallback):
    """Saves the resolved config in the run's log directory, never over an earlier run's.

    A run that logs into an existing directory (a requeued SLURM job keeps its
    ``slurm-<job id>`` version; ``--trainer.logger.init_args.version`` given
    again) writes ``config.1.yaml``, ``config.2.yaml``... beside ``config.yaml``
    where Lightning's callback would abort the run.
    """

    def setup(self, trainer, pl_module, stage: str) -> None:
        if not self.already_saved and self.save_to_log_dir and not self.overwrite:
            log_dir = trainer.log_dir  # broadcast from rank 0
            stem, suffix = os.path.splitext(self.config_filename)
            name, count = self.config_filename, 0
            if trainer.is_global_zero:
                fs = get_filesystem(log_dir)
                while fs.isfile(os.path.join(log_dir, name)):
                    count += 1
                    name = f"{stem}.{count}{suffix}"
            self.config_filename = trainer.strategy.broadcast(name)
        super().setup(trainer, pl_module, stage)


class _DropAdverts(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip")


_DROP_ADVERTS = _DropAdverts()  # one instance: adding it again is a no-op


def quiet_known_noise() -> None:
    """Silence what every run printed and no user can act on: Lightning's litlogger advert and its use of a
    deprecated torch pytree API (``isinstance(treespec, LeafSpec)``). Warnings about the run itself stay."""
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logging.getLogger(name).addFilter(_DROP_ADVERTS)
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)` is deprecated")


def without_version(get_metrics):
    """A progress bar's ``get_metrics`` without ``v_num`` (shown as ``0.000``; the run's folder is logged at start)."""
    return lambda *args, **kwargs: {k: v for k, v in get_metrics(*args, **kwargs).items() if k != "v_num"}


def short_parse_message(message: str) -> str:
    """jsonargparse's message without its ``Does not validate against any of the Union subtypes`` dumps (nested
    ones too): the errors of the subtypes that were meant (not ``Expected a <class 'NoneType'>``), with the value."""
    if "Does not validate against any of the Union subtypes" not in message:
        return message
    dropped = (
        "Does not validate against any of the Union subtypes",
        "Subtypes: [",
        "Errors:",
        "Given value type:",
        "Expected a <class 'NoneType'>",
        "Given value: NestedArg(",
    )
    lines = [line.strip().removeprefix("- ").strip() for line in message.splitlines()]
    lines = [line for line in lines if line and not line.startswith(dropped)]
    given = [line for line in lines if line.startswith("Given value: ")]
    lines = [line for line in lines if not line.startswith("Given value: ")]
    if given and lines:
        lines[-1] += f". Got value: {given[0].removeprefix('Given value: ')}"
    return lines[0] + "".join(f"\n  {line}" for line in lines[1:])


def class_from_path(class_path: Any) -> type | None:
    """The class a resolved ``class_path`` names (None when it names none)."""
    module, _, name = str(class_path or "").rpartition(".")
    try:
        return getattr(importlib.import_module(module), name) if module else None
    except (ImportError, AttributeError):
        return None


def task_family(model_config) -> str:
    """The folder a task's runs go in: its module's name (``classification``, ``lra``, ``detection``), or its
    class name for a task defined in a script."""
    cls = class_from_path(model_config.get("class_path") if hasattr(model_config, "get") else None)
    if cls is None:
        return "model"
    module = cls.__module__.rpartition(".")[2]
    return cls.__name__ if module == "__main__" else module


def resolve_task_defaults(config) -> None:
    """The best checkpoint's ``monitor``/``mode`` left unset take the task's (``--print_config`` and the saved
    ``config.yaml`` show the values used)."""
    model, checkpoint = config.get("model"), config.get("checkpoint")
    if checkpoint is None or not hasattr(checkpoint, "get"):
        return
    settings = {"monitor": checkpoint.get("monitor"), "mode": checkpoint.get("mode")}
    resolve_checkpoint_monitor(settings, class_from_path(model.get("class_path") if hasattr(model, "get") else None))
    checkpoint.monitor, checkpoint.mode = settings["monitor"], settings["mode"]


#: Where ``--data.root`` meets a data set that reads no folder (the quickstart's bundled digits): the README's line.
OWN_IMAGES_HINT = (
    "this data set reads no folder (the quickstart's are bundled digits); to train on your own "
    "images (<root>/train/<class>/*, <root>/val/<class>/*): --data ImageFolderDataModule --data.root DIR "
    "(README, 'Your own images')"
)


class KeepLinesHelpFormatter(DefaultHelpFormatter):
    """jsonargparse's help, with the description and epilog (the list of verbs) kept line by line."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "".join(indent + line for line in text.splitlines(keepends=True))


#: A class parser's words for an option it does not have: given on the command line, or as a key of a config file.
NESTED_UNKNOWN = re.compile(rf"{UNRECOGNIZED}(?P<argument>--\S+)|Option '(?P<key>[^']+)' is not accepted")
#: jsonargparse's words for a config file's key that a group (``trainer``, ``checkpoint``) or the verb does not have.
GROUP_UNKNOWN = re.compile(r"(?:Group '(?P<group>[^']+)'|Subcommand '[^']+') does not accept option '(?P<key>[^']+)'")


class ShortErrorParser(LightningArgumentParser):
    """Command-line errors in a few lines, the error first: no 40-line usage, no Union-subtype dump; a dumped
    config (``--print_config``) shows the best checkpoint's monitor as the task gives it.

    Options are matched in full (``--trainer.max_epoch`` is an error, not ``max_epochs``), here and in the parsers
    jsonargparse builds for a class's arguments (``--model.init_args.*``): it builds those from this class; an
    unknown option is one line naming the closest one (:meth:`unknown_option_message`)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def dump(self, cfg, *args, **kwargs):
        if "checkpoint" in cfg and "model" in cfg:
            cfg = cfg.clone()
            resolve_task_defaults(cfg)
        return super().dump(cfg, *args, **kwargs)

    def error(self, message: str, ex: Exception | None = None):
        if not self.exit_on_error:  # a class's parser: the outer parser reports it, with the option found here
            try:
                super().error(message, ex)
            except ArgumentError as error:
                error.unknown_option = self.unknown_option(message)
                raise
        if os.environ.get(DEBUG_ENV, "0") not in ("", "0"):
            return super().error(message, ex)
        prog = self.prog.replace(" [options]", "")
        hint = f"\n{OWN_IMAGES_HINT}" if 'key "data"' in message and "Option 'root' is not accepted" in message else ""
        text = (
            self.unknown_option_message(message, ex)
            or self.unknown_group_key_message(message)
            or unknown_options_message(short_parse_message(message), self.option_names())
        )
        sys.stderr.write(
            f"error: {text}{hint}\n"
            f"(`{prog} --help` lists every option; `{prog} --model.help CLASS` a model class's, "
            "e.g. ClassificationModule)\n"
        )
        raise SystemExit(EXIT_USER_ERROR)

    def option_names(self) -> list[str]:
        """Every option string of this parser and of its subcommands' (``--trainer.max_epochs``...)."""
        names = [option for action in self._actions for option in action.option_strings]
        subcommands = self._subcommands_action._name_parser_map if self._subcommands_action else {}
        for parser in subcommands.values():
            names += parser.option_names()
        return list(dict.fromkeys(names))

    def unknown_group_key_message(self, message: str) -> str | None:
        """``trainer.max_epoch is not an option (did you mean trainer.max_epochs?)`` for a config file's key that
        its group does not have, else None."""
        match = GROUP_UNKNOWN.search(message)
        if match is None:
            return None
        key = f"{match['group']}.{match['key']}" if match["group"] else match["key"]
        closest = closest_option(f"--{key}", self.option_names())
        return f"{key} is not an option" + (f" (did you mean {closest[2:]}?)" if closest else "")

    def unknown_option(self, message: str) -> tuple[str, str | None] | None:
        """The option a class's parser does not have (``convert.step``), with its closest one (``convert.steps``),
        or None when ``message`` is about something else."""
        match = NESTED_UNKNOWN.search(message)
        if match is None:
            return None
        given = (match["argument"] or f"--{match['key']}").split("=", 1)[0]
        closest = closest_option(given, [option for option in self.option_names() if option.startswith("--")])
        return given[2:], closest[2:] if closest else None

    @staticmethod
    def unknown_option_message(message: str, ex: Exception | None) -> str | None:
        """``model.init_args.convert.step is not an option of ClassificationModule (did you mean ...steps?)`` for an
        option a class's parser did not have (found in the chain of ``ex``), else None."""
        found = None
        while ex is not None and found is None:
            found, ex = getattr(ex, "unknown_option", None), ex.__cause__ or ex.__context__
        key = re.match(r'Parser key "([^"]+)"', message)
        owner = re.search(r"Problem with given class_path '([^']+)'", message)
        if found is None or key is None or owner is None:
            return None
        prefix, (given, closest) = f"{key[1]}.init_args.", found
        return f"{prefix}{given} is not an option of {owner[1].rpartition('.')[2]}" + (
            f" (did you mean {prefix}{closest}?)" if closest else ""
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


def is_lightning_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds a dict with a ``state_dict`` (memory-mapped: no tensor is read); True when that cannot
    be told this way (a legacy-format or damaged file: the safe load that follows names what is wrong)."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:
        return True
    return isinstance(checkpoint, dict) and "state_dict" in checkpoint


def as_list(value) -> list:
    """A ``trainer.callbacks`` value as a list (None: empty; one callback: a list of it)."""
    return [] if value is None else list(value) if isinstance(value, list) else [value]


def init_args(component) -> dict:
    """A parsed ``class_path``/``init_args`` component's arguments as a dict (empty for None or a plain value)."""
    args = component.get("init_args") if hasattr(component, "get") else None
    return args.as_dict() if hasattr(args, "as_dict") else dict(args or {})


def check_config(config) -> None:
    """Fail on what can be checked before any model is built: the model's init arguments, by its class's
    ``check_init_args`` (:meth:`~polyattn_lightning.tasks.base.TaskModule.check_init_args`: the attention spec, the
    timm model name, the pretrained file, dropped beforehand when ``--ckpt_path`` is given) and the data paths, by the
    DataModule's ``check_paths(**init_args)`` (:meth:`~polyattn_lightning.data.base.DataModule.check_paths`)."""
    for key, method in (("model", "check_init_args"), ("data", "check_paths")):
        component = config.get(key)
        class_path = component.get("class_path") if hasattr(component, "get") else None
        check = getattr(class_from_path(class_path), method, None)  # None: not on our bases
        if check is not None:
            check(init_args(component)) if key == "model" else check(**init_args(component))


def activation_label(spec) -> str:
    """A folder-name-safe label of an attention spec: ``relu``, ``poly3_scale0.0714``."""
    if isinstance(spec, str):
        label = spec
    else:
        options = dict(spec)
        label = "_".join(
            [
                str(options.pop("name", "attention")),
                *(f"{k}{v:g}" if isinstance(v, float) else f"{k}{v}" for k, v in sorted(options.items())),
            ]
        )
    return re.sub(r"[^\w.=-]+", "", label)


def checkpoint_run_dir(ckpt_path: str | os.PathLike) -> Path:
    """The run folder a checkpoint belongs to: the folder above its ``checkpoints/``, else its own folder."""
    ckpt = Path(ckpt_path)
    return ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt.parent


def evaluation_dir(ckpt_path: str, subcommand: str) -> tuple[Path, str]:
    """Where ``validate``/``test``/``predict`` of a checkpoint write: ``(folder, name)`` of
    ``<run>/<subcommand>_<checkpoint stem>`` (:func:`checkpoint_run_dir`), or ``..._2``, ``..._3``... when an
    earlier call wrote that folder: one folder per call, never overwritten (predictions included)."""
    run_dir, stem = checkpoint_run_dir(ckpt_path), f"{subcommand}_{Path(ckpt_path).stem}"
    name, count = stem, 1
    while (run_dir / name).exists():
        count += 1
        name = f"{stem}_{count}"
    return run_dir, name


def saved_configs(run_dir: Path) -> list[Path]:
    """The configs a run folder holds: ``config.yaml``, and the ``config.<n>.yaml`` each resumed run added."""
    return [path for path in run_dir.glob("config*.yaml") if re.fullmatch(r"config(\.\d+)?\.yaml", path.name)]


def resumed_run_dir(ckpt_path: str | os.PathLike | None) -> Path | None:
    """The run folder ``fit --ckpt_path`` continues in: the one above the checkpoint's ``checkpoints/`` folder, when
    a run of this CLI wrote it (a saved config is there); None for a checkpoint anywhere else."""
    if not ckpt_path or str(ckpt_path) in ("last", "best", "hpc", "registry") or "://" in str(ckpt_path):
        return None
    ckpt = Path(ckpt_path)
    if ckpt.parent.name != "checkpoints" or not (ckpt.is_file() or is_sharded_checkpoint(ckpt)):
        return None
    run_dir = checkpoint_run_dir(ckpt)
    return run_dir if saved_configs(run_dir) else None


def resume_command(args: list[str], ckpt_path: str) -> str:
    """The command line that resumes this run from ``ckpt_path``: the program as it was started (``lightning``,
    ``polyattn``, ``python -m polyattn_lightning``; under torchrun, with the user's torchrun options) and ``args``,
    with ``--ckpt_path ckpt_path`` in place of any ``--ckpt_path`` they gave."""
    kept, value_of_ckpt_path = [], False
    for arg in args:
        if not value_of_ckpt_path and arg != "--ckpt_path" and not arg.startswith("--ckpt_path="):
            kept.append(arg)
        value_of_ckpt_path = arg == "--ckpt_path"
    program = Path(sys.argv[0]).name
    program = program if program in ("lightning", "polyattn") else "python -m polyattn_lightning"
    if "TORCHELASTIC_RUN_ID" in os.environ:
        program = "torchrun <your torchrun options> -m polyattn_lightning"
    return f"{program} {shlex.join([*kept, '--ckpt_path', str(ckpt_path)])}"


#: The verbs that evaluate a checkpoint, which can take their config from the checkpoint's run.
EVALUATION_VERBS = ("validate", "test", "predict")


def saved_run_config(args: list[str]) -> Path | None:
    """For ``validate``/``test``/``predict --ckpt_path <run>/checkpoints/<name>.ckpt`` given without ``--config``
    or ``--model``: the config that run saved beside it (``<run>/config.yaml``, or the newest ``config.<n>.yaml`` a
    resumed run wrote); an error when it saved none. None for other command lines."""
    if not args or args[0] not in EVALUATION_VERBS:
        return None
    options = [arg.split("=", 1)[0] for arg in args[1:]]
    if any(option in ("--config", "-c", "--model", "--model.class_path") for option in options):
        return None
    paths = [value for flag, value in zip(args, args[1:]) if flag == "--ckpt_path"]
    paths += [arg.split("=", 1)[1] for arg in args if arg.startswith("--ckpt_path=")]
    if not paths or paths[-1] in ("last", "best", "hpc", "registry") or "://" in paths[-1]:
        return None
    if not Path(paths[-1]).is_file():
        raise MissingPathError(f"--ckpt_path {paths[-1]}: no such checkpoint file")
    run_dir = checkpoint_run_dir(paths[-1])
    saved = saved_configs(run_dir)
    if not saved:
        raise ConfigError(
            f"--ckpt_path {paths[-1]}: no --config given and no config.yaml beside it in {run_dir} (a run's "
            "checkpoints/ folder has one above it); give --config, the config it was trained with"
        )
    return max(saved, key=lambda path: int(path.suffixes[0][1:]) if len(path.suffixes) > 1 else 0)


def renamed_options(args: list[str], renamed: dict[str, str]) -> tuple[list[str], list[str]]:
    """``args`` with each ``--model[.init_args].<old>...`` option of ``renamed`` (old path -> new path) spelled
    with its new path, and one deprecation line for each."""
    if not renamed:
        return args, []
    pattern = re.compile(
        r"--model\.(init_args\.)?(" + "|".join(re.escape(old) for old in renamed) + r")(?=[.=]|$)(.*)", re.DOTALL
    )
    rewritten, messages = [], []
    for arg in args:
        match = pattern.fullmatch(arg)
        if match is None:
            rewritten.append(arg)
            continue
        prefix, old, rest = match.groups()
        new = f"--model.{prefix or ''}{renamed[old]}{rest}"
        rewritten.append(new)
        given, used = arg.split("=", 1)[0], new.split("=", 1)[0]
        messages.append(f"{given} is deprecated: it is {used} now (given as that)")
    return rewritten, messages


#: Init arguments that say where a run writes, not what its model is: given to a run resumed with ``--ckpt_path``
#: (config or command line), they win over the value saved in the checkpoint's hyperparameters (which is the default:
#: a run resumed in its own folder rewrites its own export; ``tasks/hf.py``).
RUN_OUTPUTS = ("export_dir",)


class PolyattnCLI(LightningCLI):
    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        batch_limits_read_as_counts(self.trainer_class)  # before the parser reads the Trainer's signature
        return super().init_parser(**kwargs)

    def add_arguments_to_parser(self, parser) -> None:
        """The defaults of ``trainer.precision``, ``trainer.logger`` (TensorBoard under ``runs/``) and
        ``trainer.plugins`` (``SafeCheckpointIO``); :data:`STANDARD_CALLBACKS` under their short keys and
        ``callbacks_off``."""
        parser.set_defaults(
            {
                "trainer.precision": default_precision(),
                "trainer.logger": {
                    "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                    "init_args": {"save_dir": RUNS_DIR, "default_hp_metric": False},
                },
                "trainer.plugins": [{"class_path": "polyattn_lightning.checkpoint.SafeCheckpointIO"}],
            }
        )
        for spec in STANDARD_CALLBACKS:
            parser.add_lightning_class_args(spec.cls, spec.key)
            parser.set_defaults({f"{spec.key}.{key}": value for key, value in spec.defaults.items()})
        parser.add_argument(
            "--callbacks_off",
            type=list[Literal[STANDARD_KEYS]],
            default=[],
            help="standard callbacks to leave out, e.g. [norms, predictions] (each is set under its own key: "
            f"{', '.join(STANDARD_KEYS)}); trainer.enable_checkpointing false leaves out both checkpoints, "
            "trainer.logger false the lr_monitor",
        )

    def standard_off(self, config) -> set[str]:
        """The standard callbacks this run leaves out: ``callbacks_off``, and those the trainer settings rule out."""
        off = set(config.get("callbacks_off") or [])
        if config.trainer.get("enable_checkpointing") is False:
            off |= {"checkpoint", "last_checkpoint"}
        if config.trainer.get("logger") is False:
            off.add("lr_monitor")  # LearningRateMonitor raises without a logger
        return off

    def given_short_keys(self, config) -> set[str]:
        """The standard callbacks' short keys this run gives: named on the command line, or set (by a config file)
        to other than their defaults, the best checkpoint's monitor being the task's by default."""
        named = {key for key in STANDARD_KEYS if any(re.match(rf"--{key}(\.|=|$)", arg) for arg in self.given_args)}
        defaults = self._parser(self.subcommand).get_defaults()
        default_checkpoint = init_args({"init_args": defaults.get("checkpoint")})
        model = config.get("model")
        task = class_from_path(model.get("class_path") if hasattr(model, "get") else None)
        resolve_checkpoint_monitor(default_checkpoint, task)
        changed = {
            key
            for key in STANDARD_KEYS
            if init_args({"init_args": config.get(key)})
            != (default_checkpoint if key == "checkpoint" else init_args({"init_args": defaults.get(key)}))
        }
        return named | changed

    def instantiate_trainer(self, **kwargs: Any):
        """The trainer with the user's ``trainer.callbacks`` and the standard callbacks this run does not leave out
        (:meth:`standard_off`), merged by their identity (:func:`~.callbacks.standard.merge_callbacks`, one info
        line per decision). A listed entry left out for its short key is removed from the config the run saves,
        so that config resumes with the same callbacks."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        off = self.standard_off(config)
        standard = {
            key: self._get(self.config_init, key)
            for key in self._parser(self.subcommand).callback_keys
            if key not in off
        }
        trainer_config = {**self._get(self.config_init, "trainer", default={}), **kwargs}
        listed, entries = as_list(trainer_config.get("callbacks")), as_list(config.trainer.get("callbacks"))
        settings = {key: init_args({"init_args": config.get(key)}) for key in standard}
        entry_args = [init_args(entry) for entry in entries] if len(entries) == len(listed) else [{}] * len(listed)
        merged = merge_callbacks(standard, list(zip(listed, entry_args)), settings, self.given_short_keys(config))
        for message in merged.messages:
            rank_zero_info(message)
        if merged.dropped:
            config.trainer.callbacks = [entry for index, entry in enumerate(entries) if index not in merged.dropped]
        listed = [callback for index, callback in enumerate(listed) if index not in merged.dropped]
        trainer_config["callbacks"] = listed
        callbacks = [callback for key, callback in standard.items() if key not in merged.off]
        if (
            trainer_config.get("enable_progress_bar") is not False
            and RICH_AVAILABLE
            and not any(isinstance(callback, ProgressBar) for callback in listed)
        ):
            callbacks.append(StepsRichProgressBar())  # Lightning's default bar, without "Epoch 6/-2"
        return self._instantiate_trainer(trainer_config, callbacks)

    def parse_arguments(self, parser, args) -> None:
        """Parse, first reading :func:`saved_run_config` in for ``validate``/``test``/``predict`` of a checkpoint
        given without a config; then, where the model's class renames init arguments (``renamed_args``), parse
        again with each deprecated key given on the command line read as its new one (:func:`renamed_options`),
        so it overrides that one field where the config sets the new key."""
        self.given_args = (
            [str(arg) for arg in (sys.argv[1:] if args is None else args)] if not isinstance(args, dict) else []
        )
        check_yaml_syntax(self.given_args)
        saved = saved_run_config(self.given_args)
        if saved is not None:
            rank_zero_info(
                f"{self.given_args[0]}: no --config given: using {saved}, the config of the checkpoint's run"
            )
            args = self.given_args = [self.given_args[0], "--config", str(saved), *self.given_args[1:]]
        super().parse_arguments(parser, args)
        if not self.given_args:
            return
        subcommand = self.config.get("subcommand")
        model = (self.config[subcommand] if subcommand else self.config).get("model")
        renamed = getattr(
            class_from_path(model.get("class_path") if hasattr(model, "get") else None), "renamed_args", {}
        )
        rewritten, messages = renamed_options(self.given_args, renamed)
        if messages:
            for message in messages:
                warnings.warn(message, FutureWarning, stacklevel=1)
            self.given_args = rewritten
            self.config = parser.parse_args(rewritten)

    def _parse_ckpt_path(self) -> None:
        """Lightning reads ``--ckpt_path``'s hyperparameters with a bare ``torch.load``, whose errors
        (``OSError: [Errno 22] Invalid argument`` for a truncated file) do not name the file: when that
        fails, load the file the safe way, which raises a :class:`CheckpointLoadError` naming it and why.
        A local ``--ckpt_path`` that does not exist stops the run here, before any model is built. The saved
        hyperparameters replace the config's, except where this run writes (:data:`RUN_OUTPUTS`) when it is given."""
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if not ckpt_path:
            return super()._parse_ckpt_path()
        before = init_args(self.config[subcommand].model)
        if ckpt_path not in ("last", "best", "hpc", "registry") and "://" not in str(ckpt_path):
            if Path(ckpt_path).is_dir():
                self._parse_sharded_ckpt_path(subcommand, check_sharded_folder(ckpt_path))
                return self._keep_run_outputs(subcommand, before)
            if not Path(ckpt_path).is_file():
                raise MissingPathError(f"--ckpt_path {ckpt_path}: no such checkpoint file or sharded folder")
        if Path(ckpt_path).is_file() and not is_lightning_checkpoint(ckpt_path):
            raise CheckpointLoadError(
                f"--ckpt_path {ckpt_path} is not a Lightning checkpoint (it has no 'state_dict'): "
                "to start from a weight file, pass it as --model.pretrained instead"
            )
        try:
            super()._parse_ckpt_path()
            self._keep_run_outputs(subcommand, before)
            replaced = {
                key: value
                for key, value in init_args(self.config[subcommand].model).items()
                if key in before and before[key] != value and key != "pretrained"
            }  # not used, see below
            if replaced:
                rank_zero_info(
                    f"checkpoint {ckpt_path}: its saved hyperparameters replace the config's: "
                    + "; ".join(
                        f"model.init_args.{key} {before[key]!r} -> {value!r}" for key, value in replaced.items()
                    )
                )
        except Exception:
            if not Path(ckpt_path).is_file():
                raise
            try:
                load_checkpoint(ckpt_path)
            except CheckpointLoadError as err:
                raise err from err.__cause__  # without the bare torch.load traceback as context
            raise

    def _keep_run_outputs(self, subcommand: str, given: dict) -> None:
        """Put back the :data:`RUN_OUTPUTS` this run was given (``given``: the model's init arguments before the
        checkpoint's replaced them)."""
        model = self.config[subcommand].model
        for key in RUN_OUTPUTS:
            if given.get(key) is not None and key in init_args(model):
                setattr(model.init_args, key, given[key])

    def _parse_sharded_ckpt_path(self, subcommand: str, folder: Path) -> None:
        """A sharded checkpoint folder's hyperparameters come from its ``meta.pt`` (read the safe way, as a file)."""
        self.config[subcommand].ckpt_path = str(folder / META_FILE)
        try:
            super()._parse_ckpt_path()  # LightningCLI's: torch.load(weights_only=True) of a file
        finally:
            self.config[subcommand].ckpt_path = str(folder)

    def before_instantiate_classes(self) -> None:
        """Log to ``runs/<task family>/<config name>/version_N`` unless the logger was given a name (``<config
        name>_<activation>`` when ``--model.attention`` gives another activation than the config's; the family is
        :func:`task_family`, so the three quickstarts never share a folder); ``validate``/``test``/``predict`` of a
        checkpoint log to :func:`evaluation_dir` instead, and ``fit`` resuming a checkpoint of a run's
        ``checkpoints/`` folder logs on in that run's folder (:func:`resumed_run_dir`; unless the logger was given a
        version, as the SLURM script does). With ``--ckpt_path``, build the model without its ``pretrained`` file: the
        checkpoint's weights replace those anyway, and resuming or evaluating a fine-tuned run must not need that
        file. The best checkpoint's monitor defaults to the task's. Then :func:`check_config`, so a bad name or path
        stops the run before any model is built."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        logger, files = config.trainer.logger, config.get("config")
        model_args = config.model.get("init_args") if hasattr(config.model, "get") else None
        if files and hasattr(logger, "init_args") and logger.init_args.get("name") == DEFAULT_RUN_NAME:
            name = Path(str(files[-1])).stem
            if model_args is not None and any(
                re.match(r"--model\.(init_args\.)?attention\b", arg) for arg in getattr(self, "given_args", [])
            ):
                label = activation_label(model_args.attention)
                if label != activation_label(config_attention(files) or ""):
                    name = f"{name}_{label}"
            logger.init_args.name = f"{task_family(config.model)}/{name}"
        if (
            self.subcommand in ("validate", "test", "predict")
            and config.get("ckpt_path")
            and hasattr(logger, "init_args")
        ):
            if "://" not in str(config.ckpt_path) and (
                Path(config.ckpt_path).is_file() or is_sharded_checkpoint(config.ckpt_path)
            ):
                save_dir, version = evaluation_dir(config.ckpt_path, self.subcommand)
                logger.init_args.save_dir, logger.init_args.name, logger.init_args.version = str(save_dir), "", version
        run_dir = resumed_run_dir(config.get("ckpt_path")) if self.subcommand == "fit" else None
        folder_logger = str(getattr(logger, "class_path", "")).endswith(FOLDER_LOGGERS)
        if run_dir is not None and folder_logger and logger.init_args.get("version") is None:
            logger.init_args.save_dir, logger.init_args.name = str(run_dir.parent), ""
            logger.init_args.version = run_dir.name
        if config.get("ckpt_path") and model_args is not None and model_args.get("pretrained"):
            model_args.pretrained = None
        resolve_task_defaults(config)
        check_config(config)

    def instantiate_classes(self) -> None:
        """Also tell the model which checkpoint's saved hyperparameters built it (``hparams_checkpoint``), so its
        errors can name that checkpoint rather than the config the values no longer come from. Under the sharded
        strategy the model is built later, in ``configure_model`` (:func:`~.sharding.build_later`)."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        strategy = class_from_path(getattr(config.trainer.get("strategy"), "class_path", None))
        sharded = isinstance(strategy, type) and issubclass(strategy, ShardedStrategy)
        with build_later() if sharded else contextlib.nullcontext():
            super().instantiate_classes()
        ckpt_path = self.config[self.subcommand].get("ckpt_path") if self.subcommand else None
        if ckpt_path and self.model is not None:
            self.model.hparams_checkpoint = ckpt_path

    def _run_subcommand(self, subcommand: str) -> None:
        """Say where the run writes, run it, then list what it wrote. A run that fails before its first
        training step removes the log folder it created (a config and an empty events file). ``fit`` resuming in its
        own folder does not warn that its checkpoint folder is not empty; a Ctrl-C names the command that resumes
        (:class:`~.callbacks.StopOnSignal`), and one Lightning stopped on (before the first step, or a second one)
        exits with the same status 130, not Lightning's 1."""
        trainer = self.trainer
        log_dir = trainer.log_dir if trainer.logger is not None and rank_zero_only.rank == 0 else None
        log_dir = Path(log_dir) if log_dir else None  # fast_dev_run's DummyLogger has none
        created = log_dir if log_dir is not None and not log_dir.exists() else None
        while created is not None and not created.parent.exists():
            created = created.parent  # the outermost folder this run will create (runs/ itself on a first run)
        ckpt_path = self.config[subcommand].get("ckpt_path")
        run_dir = resumed_run_dir(ckpt_path) if subcommand == "fit" else None
        resumed_here = run_dir is not None and log_dir is not None and run_dir.resolve() == log_dir.resolve()
        if resumed_here:
            rank_zero_info(f"fit: resuming {ckpt_path}: logs, config and checkpoints/ go on in {log_dir}")
        elif log_dir is not None:
            what = {"fit": "logs, config and checkpoints/", "predict": "logs, config and predictions/"}
            rank_zero_info(f"{subcommand}: writing {what.get(subcommand, 'logs and config')} to {log_dir}")
        if subcommand != "fit":  # a checkpoint's ModelCheckpoint state names its run's folder: expected here
            warnings.filterwarnings("ignore", message=r".*dirpath has changed")
        if trainer.progress_bar_callback is not None:
            trainer.progress_bar_callback.get_metrics = without_version(trainer.progress_bar_callback.get_metrics)
        for callback in trainer.callbacks:
            if isinstance(callback, StopOnSignal) and self.given_args:
                callback.resume_command = functools.partial(resume_command, self.given_args)
        try:
            with warnings.catch_warnings():
                if resumed_here:  # ModelCheckpoint's setup warns about any folder with files in it
                    own = re.escape(os.path.join(trainer.log_dir, "checkpoints"))
                    warnings.filterwarnings("ignore", message=rf"Checkpoint directory {own} exists and is not empty")
                super()._run_subcommand(subcommand)
        except BaseException as error:
            if (
                created is not None
                and trainer.global_step == 0
                and log_dir.is_dir()
                and not any(log_dir.rglob("*.ckpt"))
            ):
                shutil.rmtree(log_dir, ignore_errors=True)
                for folder in [log_dir, *log_dir.parents][1 : len(log_dir.relative_to(created).parts) + 1]:
                    with contextlib.suppress(OSError):  # only if empty: another run may be writing beside it
                        folder.rmdir()
            if isinstance(error, SystemExit) and error.code == 1 and isinstance(error.__context__, KeyboardInterrupt):
                raise SystemExit(EXIT_INTERRUPTED) from None  # Lightning's sys.exit(1) after its Ctrl-C shutdown
            raise
        if log_dir is not None and log_dir.is_dir():
            files = sorted(str(path.relative_to(log_dir)) for path in log_dir.rglob("*") if path.is_file())
            shown = files if len(files) <= 12 else [*files[:11], f"... ({len(files) - 11} more)"]
            rank_zero_info(f"{subcommand}: wrote {log_dir}/: {', '.join(shown)}")


def make_cli(
    args: list[str] | None = None, run: bool = True, cli_class: type[PolyattnCLI] | None = None
) -> LightningCLI:
    """Parse ``args`` (``sys.argv`` when None) and, with ``run``, execute the subcommand."""
    quiet_known_noise()
    return (cli_class or PolyattnCLI)(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        auto_configure_optimizers=False,  # the tasks build their own optimizer from their recipe
        save_config_callback=KeepingSaveConfigCallback,
        parser_class=ShortErrorParser,
        parser_kwargs={
            "epilog": "other verbs (`polyattn VERB --help`):\n"
            + "\n".join(f"  {verb:<11} {what}" for verb, what in COMMANDS.items()),
            "formatter_class": KeepLinesHelpFormatter,
        },
        args=args,
        run=run,
    )


#: Verbs beside LightningCLI's fit/validate/test/predict: ``polyattn maps|norms|sweep|check-data ...``, one module
#: each in ``polyattn_lightning.commands`` (``-`` spelled ``_``) with a ``main(argv)``; listed by ``polyattn --help``.
COMMANDS = {
    "maps": "phi(S) heat maps and where a checkpoint's model looks, over image files",
    "norms": "draw the attention norms that runs logged against the training step",
    "sweep": "validation accuracy against the activation's scale, per sequence length (short fits)",
    "check-data": "decode every image file of a config's data set once and list every bad file",
    "consolidate": "a sharded checkpoint folder as one checkpoint file, or as a save_pretrained folder",
}


@reported  # a user-input error prints as one short `error: ...` line (POLYATTN_DEBUG=1: the traceback)
@distributed_teardown()  # every verb ends with the process group torn down in order, on every backend
def main(args: list[str] | None = None) -> None:
    """Console-script entry point."""
    argv = sys.argv[1:] if args is None else args
    if argv and argv[0] in COMMANDS:
        importlib.import_module(f"{__package__}.commands.{argv[0].replace('-', '_')}").main(argv[1:])
        return
    make_cli(args)
