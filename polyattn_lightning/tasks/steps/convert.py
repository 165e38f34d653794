"""Step two: pretrained softmax weights converted to the task's activation, once (the ``convert`` option).

The method (``calibrate``, ``transfer``: :class:`~...conversion.ConvertRecipe`) runs on the first ``samples``
training samples, on the switched ``attention_target()``, before the first fit, validate or test, once a trainer
with data is attached. It is logged, its report (``conversion.json`` and a per-layer figure) written to the run's
folder and saved in every checkpoint under :data:`CONVERSION_KEY`, so a run resumed from one, or a model rebuilt
from one, does not convert again (its weights are the converted ones). It is skipped when a checkpoint is about to
replace the weights (the task's ``weights_from_checkpoint()``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import move_data_to_device
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.utils.data import default_collate

from ...conversion import ConvertRecipe, convert
from ...conversion.report import ConversionReport
from ...errors import ConfigError
from ..hparams import as_dataclass, check_recipe

#: The checkpoint key of the convert step's report (plain values).
CONVERSION_KEY = "polyattn_conversion"


def recipe(task: pl.LightningModule) -> ConvertRecipe:
    """The ``convert`` hyperparameter (method none for a task without the option)."""
    return as_dataclass(task.hparams.get("convert") or ConvertRecipe(), ConvertRecipe)


def check_init_args(init_args: Mapping[str, Any]) -> None:
    """The ``convert`` recipe of a config and the deprecated ``calibrate_attention`` against it, before anything is
    built."""
    check_recipe(init_args, "convert", ConvertRecipe)
    if init_args.get("calibrate_attention"):
        from_deprecated_calibrate(dict(init_args))


def from_deprecated_calibrate(hparams: dict[str, Any]) -> None:
    """Map the deprecated ``calibrate_attention: true`` onto ``convert.method: calibrate`` (in place, as plain values),
    with one deprecation line; a ``convert.method`` given too must agree."""
    calibrate = hparams.pop("calibrate_attention", None)
    if not calibrate:
        return
    rank_zero_warn(
        "model.init_args.calibrate_attention is deprecated: it is model.init_args.convert.method: calibrate "
        "(mapped onto it; method: transfer keeps more of a pretrained model, docs/benchmarks/conversion.md)",
        category=FutureWarning,
    )
    given = as_dataclass(hparams.get("convert") or ConvertRecipe(), ConvertRecipe)
    if given.method not in ("none", "calibrate"):
        raise ConfigError(
            f"the conversion is given twice, as model.init_args.convert.method {given.method} and as "
            "calibrate_attention: true; give it once, as model.init_args.convert.method"
        )
    hparams["convert"] = asdict(replace(given, method="calibrate"))


def run(task: pl.LightningModule, new: bool) -> None:
    """Convert, unless it ran already (this run, or the one whose checkpoint the task was restored from), no trainer
    with data is attached (a model rebuilt by ``load_from_checkpoint``: its weights are the converted ones), or a
    checkpoint is about to replace the weights."""
    settings = recipe(task)
    trainer = task._trainer
    if settings.method == "none" or task.conversion is not None or trainer is None or trainer.datamodule is None:
        return
    if task.weights_from_checkpoint():
        rank_zero_info(f"convert {settings.method}: skipped, the weights come from the checkpoint")
        return
    target = task.attention_target()
    batches = samples(task, settings, next(target.parameters()).device)
    options = settings.options if settings.method == "transfer" else {}
    report = convert(target, task.attention_spec(), batches, settings.method, **options)
    task.conversion = report.as_dict()
    rank_zero_info(report.summary())
    if trainer.is_global_zero and trainer.loggers:  # the run's folder (none without a logger)
        write_report(trainer, report)


def write_report(trainer: pl.Trainer, report: ConversionReport) -> None:
    """The report's files in the run's folder, and its mean errors before and after to every logger (step 0)."""
    data, figure = report.write(Path(trainer.log_dir))
    rank_zero_info(f"convert: per-layer errors in {data}, figure {figure}")
    for logger in trainer.loggers:
        logger.log_metrics(
            {
                "convert/error_before": sum(report.error_before) / len(report.error_before),
                "convert/error_after": sum(report.error_after) / len(report.error_after),
            },
            step=0,
        )


def samples(task: pl.LightningModule, settings: ConvertRecipe, device) -> list[Any]:
    """The first ``settings.samples`` training samples, collated in batches of ``settings.batch_size`` (None: the
    data's), as the task's ``conversion_inputs()`` makes them, on ``device``."""
    datamodule = task.trainer.datamodule
    dataset = getattr(datamodule, "train_set", None)
    if dataset is None:
        raise ConfigError(
            f"model.init_args.convert.method {settings.method}: the convert step runs on the training data, but "
            f"{type(datamodule).__name__} has no train_set after setup"
        )
    count = min(settings.samples, len(dataset))
    size = settings.batch_size or getattr(datamodule, "batch_size", None) or count
    collate = getattr(datamodule, "collate_fn", None) or default_collate
    return [
        move_data_to_device(
            task.conversion_inputs(collate([dataset[i] for i in range(start, min(start + size, count))])), device
        )
        for start in range(0, count, size)
    ]


def on_save_checkpoint(task: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
    """The report goes in every checkpoint once there is one."""
    if task.conversion is not None:
        checkpoint[CONVERSION_KEY] = task.conversion


def on_load_checkpoint(task: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
    """A checkpoint's report is the task's from then on (its weights are converted); one that replaces the weights
    this run converted says so."""
    saved = checkpoint.get(CONVERSION_KEY)
    if saved is not None and task.conversion is not None and saved != task.conversion:
        rank_zero_warn(
            "convert: this run converted the weights, and the checkpoint it now loads replaces them (converted "
            "once in the run that saved it); set trainer.ckpt_path before fit, or use --ckpt_path, to skip it"
        )
    if saved is not None:
        task.conversion = saved
