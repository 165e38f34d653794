"""What a run shows beyond Lightning's own output: where it writes, before it starts, and what it wrote, at the end;
its progress bar; and none of the noise every run printed that no user can act on."""

from __future__ import annotations

import importlib.util
import logging
import warnings
from pathlib import Path

from lightning.pytorch.callbacks import Callback, ProgressBar
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from ..callbacks.progress import StepsRichProgressBar

#: Whether ``rich`` is installed: Lightning's default progress bar is then its RichProgressBar.
RICH_AVAILABLE = importlib.util.find_spec("rich") is not None


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


def default_progress_bar(trainer_config: dict, listed: list[Callback]) -> Callback | None:
    """Lightning's default bar where rich is installed, without its ``Epoch 6/-2`` in runs counted in steps
    (:class:`~.callbacks.progress.StepsRichProgressBar`); None when the run has no bar or lists its own."""
    if trainer_config.get("enable_progress_bar") is False or not RICH_AVAILABLE:
        return None
    return None if any(isinstance(callback, ProgressBar) for callback in listed) else StepsRichProgressBar()


def without_version(get_metrics):
    """A progress bar's ``get_metrics`` without ``v_num`` (shown as ``0.000``; the run's folder is logged at start)."""
    return lambda *args, **kwargs: {k: v for k, v in get_metrics(*args, **kwargs).items() if k != "v_num"}


def say_where(subcommand: str, log_dir: Path | None, resumed: str | None) -> None:
    """One line naming the folder the run writes in (``resumed``: the checkpoint of the run it goes on in)."""
    if resumed is not None:
        rank_zero_info(f"fit: resuming {resumed}: logs, config and checkpoints/ go on in {log_dir}")
    elif log_dir is not None:
        what = {"fit": "logs, config and checkpoints/", "predict": "logs, config and predictions/"}
        rank_zero_info(f"{subcommand}: writing {what.get(subcommand, 'logs and config')} to {log_dir}")


def say_written(subcommand: str, log_dir: Path | None) -> None:
    """One line listing the files the run's folder holds at its end (the first eleven and a count of the rest)."""
    if log_dir is not None and log_dir.is_dir():
        files = sorted(str(path.relative_to(log_dir)) for path in log_dir.rglob("*") if path.is_file())
        shown = files if len(files) <= 12 else [*files[:11], f"... ({len(files) - 11} more)"]
        rank_zero_info(f"{subcommand}: wrote {log_dir}/: {', '.join(shown)}")
