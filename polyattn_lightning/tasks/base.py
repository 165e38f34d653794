"""The contract every task (LightningModule) of this project follows, in one place.

A task family writes its model, its data and its ``training_step``; this base does the rest the same way for all
(in the spirit of torchgeo's ``BaseTask``):

* **Values the data determines** (:attr:`TaskModule.data_args`: class count, vocabulary, length, image size): a
  hyperparameter left ``None`` takes the DataModule's value of the same name once its ``setup()`` has run, and is
  saved with the hyperparameters, so a checkpoint rebuilds the same model without the data; a given value that
  differs from the data's is a :class:`~polyattn_lightning.errors.ConfigError` naming both.
* **The model is built in** ``configure_model()`` by :meth:`TaskModule.build`, right away in ``__init__`` when every
  required data value is given (a checkpoint's hyperparameters always give them). Attention is switched to the
  registry activation in exactly one place, right after building, on the module :meth:`TaskModule.attention_target`
  names; with the ``lora`` hyperparameter, peft adapters go on its attention's q/k/v/o layers there too, and only
  they (and :meth:`TaskModule.lora_trainable`, a new head) train.
* **The convert step** (the ``convert`` hyperparameter, :class:`~polyattn_lightning.conversion.ConvertRecipe`):
  pretrained softmax weights converted to the activation (``calibrate``, ``transfer``) on the first training
  samples, once, before the first fit, validate or test: logged, its report (``conversion.json`` and a per-layer
  figure) written to the run's folder and saved in every checkpoint (``polyattn_conversion``), so a run resumed
  from one, or a model rebuilt from one, does not convert again (its weights are the converted ones).
* **Sharding**: under :class:`~polyattn_lightning.sharding.ShardedStrategy` ``configure_model()`` also shards
  :meth:`TaskModule.optimized_module` (FSDP2, one block per unit); a model a task builds inside
  :meth:`TaskModule.init_context` (from a config) is then made on the meta device and initialised once sharded.
* **Optimizer and schedule** from the ``optim`` hyperparameter (:class:`~polyattn_lightning.tasks.optim.OptimRecipe`)
  for the parameters of :meth:`TaskModule.optimized_module`.
* **Evaluation**: ``validation_step`` / ``test_step`` call :meth:`TaskModule.evaluate` with the stage, and
  ``predict_step`` :meth:`TaskModule.predict`; metrics made once by :meth:`TaskModule.set_metrics` are cloned per
  stage (``val/``, ``test/`` prefixes). Under a sharded strategy a rank with fewer evaluation samples ends with a
  padding batch (``data/evaluation.py``): the same forward, so every rank joins every all-gather, scored and
  predicted as nothing.
* **The best checkpoint** is kept by :attr:`TaskModule.monitor` / :attr:`TaskModule.mode` (the CLI's default for its
  best-checkpoint callback) and, with ``test_after_fit``, tested at the end of ``fit`` through its explicit path.
* Hooks with defaults that callbacks and commands call: :meth:`TaskModule.attention_probe` (the diagnostics' probe
  batch), :meth:`TaskModule.save_predictions` (``lightning predict``'s files), :meth:`TaskModule.check_data` (the data
  against the model) and :meth:`TaskModule.check_init_args` (a config checked before any model is built).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import move_data_to_device
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torch.utils.data import default_collate
from torchmetrics import MeanMetric, MetricCollection

from ..attention import ActivationSpec, get_activation
from ..attention.switch import set_attention
from ..conversion import ConvertRecipe, convert
from ..conversion.lora import LoraRecipe, add_lora
from ..data.evaluation import PaddingBatch
from ..diagnostics.probe import default_probe
from ..errors import ConfigError, UserInputError, check_options
from ..sharding import building_later, sharded_strategy
from .optim import OptimRecipe, configure_recipe, step_scheduler

#: The checkpoint key of the convert step's report (plain values).
CONVERSION_KEY = "polyattn_conversion"


T = TypeVar("T")


def as_dataclass(value: T | Mapping[str, Any], cls: type[T]) -> T:
    """``value`` as a ``cls`` dataclass: the CLI saves hyperparameters as plain mappings, which rebuild it."""
    return cls(**value) if isinstance(value, Mapping) else value


class TaskModule(pl.LightningModule):
    """Base of every task: see the module docstring for what it does and which hooks a task overrides.

    A subclass's ``__init__`` calls ``super().__init__()`` and ``self.save_hyperparameters()`` (its hyperparameters
    include ``attention``, ``optim`` and every name in :attr:`data_args`), then :meth:`build_if_known`; it implements
    :meth:`build`, ``forward``, ``training_step``, :meth:`evaluate` and, when ``forward``'s output is not what
    ``lightning predict`` should keep, :meth:`predict`.
    """

    #: the validation metric the best checkpoint is chosen by, and whether larger (``max``) or smaller is better
    monitor: ClassVar[str] = "val/top1"
    mode: ClassVar[str] = "max"
    #: hyperparameters the DataModule determines (read from its attributes of the same names): None takes the
    #: data's value; the model cannot be built without these
    data_args: ClassVar[tuple[str, ...]] = ()
    #: like :attr:`data_args`, but the model has a default when neither the config nor the data gives one
    optional_data_args: ClassVar[tuple[str, ...]] = ()
    #: deprecated init argument paths and the ones that replace them (``{"recipe.optim": "optim"}``): the CLI
    #: reads ``--model.recipe.optim.lr 0`` as ``--model.optim.lr 0``, with a deprecation line
    renamed_args: ClassVar[dict[str, str]] = {}

    #: the checkpoint whose saved hyperparameters built this module; the CLI sets it for ``--ckpt_path``, so that
    #: errors name it rather than the config those values no longer come from
    hparams_checkpoint: str | None = None

    def __new__(cls, *args: Any, **kwargs: Any):
        """Refuse a keyword option the task's ``__init__`` does not take, before anything is built: one line naming
        it, the closest option and every option the task takes (Python's own error is a bare ``TypeError``), for
        every task without it remembering to. (Unpickling and copying call this without arguments.)"""
        check_options(cls.__init__, kwargs, owner=cls.__name__)
        return super().__new__(cls)

    def __init__(self) -> None:
        super().__init__()
        self.built = False
        #: the convert step's report (a plain dict): this run's, or the checkpoint's it was restored from
        self.conversion: dict[str, Any] | None = None

    # ---- building ----------------------------------------------------------------------------------

    def build_if_known(self) -> None:
        """Build now when no required value is left to the data (a checkpoint's hyperparameters give them all), unless
        the sharded strategy will build it (:func:`~polyattn_lightning.sharding.build_later`)."""
        if not building_later() and all(self.hparams.get(name) is not None for name in self.data_args):
            self.configure_model()

    def configure_model(self) -> None:
        """Fill the values left to the data, :meth:`build` the model, switch its attention, add LoRA adapters
        (once); then the convert step (:meth:`convert_once`). Under the sharded strategy, shard it too: before
        switching when :meth:`build` left it on the meta device (the switch's probe forward needs weights), after
        switching and converting when it has weights (both run on the plain model)."""
        sharded = sharded_strategy(self)
        if self.built:
            self.convert_once()
            if sharded is not None:
                sharded.shard(self, self.optimized_module())
            return
        self.check_data(self._trainer.datamodule if self._trainer is not None else None)
        missing = [name for name in self.data_args if self.hparams.get(name) is None]
        if missing:
            raise ConfigError(
                f"{type(self).__name__} needs {', '.join(missing)}: give model.init_args.{missing[0]} or use a "
                "DataModule that has it"
            )
        self.build()
        if sharded is not None and any(p.is_meta for p in self.optimized_module().parameters()):
            if self.lora_recipe is not None or self.convert_recipe.method != "none":
                raise ConfigError(
                    "model.init_args.lora / convert under the sharded strategy need a model loaded with its weights "
                    "(model: a pretrained folder or checkpoint), which is adapted, then sharded; this one is built "
                    "from a config on the meta device and sharded first"
                )
            sharded.shard(self, self.optimized_module())
        target = self.attention_target()
        if target is not None:
            # softmax too, so every model takes the registry path
            set_attention(target, self.attention_spec(), **self.attention_options())
            if self.lora_recipe is not None:
                summary = add_lora(target, self.lora_recipe, self.lora_trainable())
                rank_zero_info(
                    f"lora: {summary['adapters']:,} adapter parameters ({100 * summary['adapter_fraction']:.2f}% "
                    f"of {summary['base']:,}); {summary['trainable']:,} trainable with the new head"
                )
        self.built = True
        self.convert_once()
        if sharded is not None:
            sharded.shard(self, self.optimized_module())

    def init_context(self) -> contextlib.AbstractContextManager:
        """Where :meth:`build` makes a model that comes from a config (random init, no weight file): the meta
        device under the sharded strategy (no rank holds it whole), else a no-op."""
        sharded = sharded_strategy(self)
        return sharded.init_context() if sharded is not None else contextlib.nullcontext()

    def build(self) -> None:
        """Make the model, heads, losses and metrics from the (complete) hyperparameters."""
        raise NotImplementedError

    def attention_target(self) -> nn.Module | None:
        """The module whose attention layers run the registry activation (None: nothing to switch)."""
        return self.model

    def attention_spec(self) -> ActivationSpec:
        """The activation :meth:`attention_target` is switched to."""
        return self.hparams.attention

    def attention_options(self) -> dict[str, Any]:
        """Further ``set_attention`` arguments (``strict``, ``probe``); the default is none: strict, a derived probe."""
        return {}

    @property
    def convert_recipe(self) -> ConvertRecipe:
        """The ``convert`` hyperparameter (none when the task has no such option)."""
        return as_dataclass(self.hparams.get("convert") or ConvertRecipe(), ConvertRecipe)

    @property
    def lora_recipe(self) -> LoraRecipe | None:
        """The ``lora`` hyperparameter: LoRA adapters instead of full fine-tuning (None: full)."""
        value = self.hparams.get("lora")
        return None if value is None else as_dataclass(value, LoraRecipe)

    def lora_trainable(self) -> list[nn.Module]:
        """The modules that train beside the LoRA adapters (a new head); the default is none."""
        return []

    def convert_once(self) -> None:
        """The convert step: on the first ``convert.samples`` training samples, unless it ran already (this run, or
        the one whose checkpoint this module was restored from), no trainer with data is attached (a model rebuilt
        by ``load_from_checkpoint``: its weights are the converted ones), or a checkpoint is about to replace the
        weights (:meth:`weights_from_checkpoint`)."""
        recipe = self.convert_recipe
        trainer = self._trainer
        if recipe.method == "none" or self.conversion is not None or trainer is None or trainer.datamodule is None:
            return
        if self.weights_from_checkpoint():
            rank_zero_info(f"convert {recipe.method}: skipped, the weights come from the checkpoint")
            return
        target = self.attention_target()
        samples = self.conversion_samples(recipe, next(target.parameters()).device)
        options = recipe.options if recipe.method == "transfer" else {}
        report = convert(target, self.attention_spec(), samples, recipe.method, **options)
        self.conversion = report.as_dict()
        rank_zero_info(report.summary())
        if trainer.is_global_zero and trainer.loggers:  # the run's folder (none without a logger)
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

    def weights_from_checkpoint(self) -> bool:
        """Whether a checkpoint will replace the weights before the first step: ``--ckpt_path`` (the CLI sets
        :attr:`hparams_checkpoint`) or ``trainer.ckpt_path`` set before ``fit``. (A path given to
        ``trainer.fit(ckpt_path=...)`` itself is only known once it is loaded: the conversion then runs, and the
        checkpoint's weights replace it, with a warning.)"""
        return bool(self.hparams_checkpoint) or bool(self._trainer is not None and self._trainer.ckpt_path)

    def conversion_samples(self, recipe: ConvertRecipe, device) -> list[Any]:
        """The first ``recipe.samples`` training samples, collated in batches of ``recipe.batch_size`` (None: the
        data's), as :meth:`conversion_inputs` makes them, on ``device``."""
        datamodule = self.trainer.datamodule
        dataset = getattr(datamodule, "train_set", None)
        if dataset is None:
            raise ConfigError(
                f"model.init_args.convert.method {recipe.method}: the convert step runs on the training data, but "
                f"{type(datamodule).__name__} has no train_set after setup"
            )
        count = min(recipe.samples, len(dataset))
        size = recipe.batch_size or getattr(datamodule, "batch_size", None) or count
        collate = getattr(datamodule, "collate_fn", None) or default_collate
        return [
            move_data_to_device(
                self.conversion_inputs(collate([dataset[i] for i in range(start, min(start + size, count))])), device
            )
            for start in range(0, count, size)
        ]

    def conversion_inputs(self, batch: Any) -> Any:
        """What the attention target takes from one training batch: the images of an ``(images, labels)`` pair."""
        return batch[0] if isinstance(batch, (tuple, list)) else batch

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.conversion is not None:
            checkpoint[CONVERSION_KEY] = self.conversion

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get(CONVERSION_KEY)
        if saved is not None and self.conversion is not None and saved != self.conversion:
            rank_zero_warn(
                "convert: this run converted the weights, and the checkpoint it now loads replaces them (converted "
                "once in the run that saved it); set trainer.ckpt_path before fit, or use --ckpt_path, to skip it"
            )
        if saved is not None:
            self.conversion = saved

    def optimized_module(self) -> nn.Module:
        """The module whose parameters are trained; timm models give their no-weight-decay and layer lists."""
        return self.model

    def set_metrics(self, metrics: MetricCollection) -> None:
        """One copy of ``metrics`` per evaluation stage: ``val_metrics`` (``val/...``) and ``test_metrics``; and the
        stages' mean losses (:meth:`log_loss`)."""
        self.val_metrics = metrics.clone(prefix="val/")
        self.test_metrics = metrics.clone(prefix="test/")
        # a NaN loss stays NaN in the mean (torchmetrics would leave it out, with a warning)
        self.val_loss, self.test_loss = MeanMetric(nan_strategy="disable"), MeanMetric(nan_strategy="disable")

    def log_loss(self, stage: str, loss: Tensor, weight: int) -> None:
        """Log ``<stage>/loss``: the mean of ``loss`` (one batch's mean over ``weight`` samples or tokens) over the
        whole split and every rank, exactly. torchmetrics' ``MeanMetric`` sums the weighted losses and the weights
        across ranks; Lightning's ``sync_dist`` mean divides the summed weights by the world size in integers,
        rounding down, which weighs the loss wrongly whenever the ranks' counts add up to no multiple of it."""
        metric = self.val_loss if stage == "val" else self.test_loss
        metric.update(loss, weight)
        self.log(f"{stage}/loss", metric, on_step=False, on_epoch=True)

    # ---- the data against the model ----------------------------------------------------------------

    def setup(self, stage: str) -> None:
        self.check_data(self.trainer.datamodule)

    def check_data(self, datamodule: pl.LightningDataModule | None) -> None:
        """Take the values of :attr:`data_args` and :attr:`optional_data_args` left None from ``datamodule`` (set
        up) into the hyperparameters; a value given that differs from the data's is an error naming both.

        Override to check more (and call this one)."""
        if datamodule is None:
            return
        data_name = type(datamodule).__name__
        for name in (*self.data_args, *self.optional_data_args):
            data_value = getattr(datamodule, name, None)
            value = self.hparams.get(name)
            if data_value is None or value == data_value:
                continue
            if value is None and not self.built:
                self.hparams[name] = data_value  # saved with the checkpoint's hyperparameters
            elif value is not None:
                raise ConfigError(self.mismatch_message(name, value, data_name, data_value))

    def mismatch_message(self, name: str, value: Any, data_name: str, data_value: Any) -> str:
        """Why a value given for ``name`` cannot be used with this data, and what to do."""
        if self.hparams_checkpoint:
            return (
                f"checkpoint {self.hparams_checkpoint} has {name}={value} (its saved hyperparameters replace the "
                f"config's model.init_args.{name}) but {data_name} has {name}={data_value}; use it on data like "
                "the data it was trained on, or fine-tune from it with --model.pretrained instead of --ckpt_path"
            )
        return (
            f"model.init_args.{name} is {value} but {data_name} has {name}={data_value}; leave "
            f"model.init_args.{name} out (the data's value is used) or set it to {data_value}"
        )

    @classmethod
    def check_init_args(cls, init_args: Mapping[str, Any]) -> None:
        """Called by the CLI before any model is built: fail on a bad value that needs no model to tell
        (by default the attention spec). Errors name the key."""
        if init_args.get("attention") is not None:
            try:
                get_activation(init_args["attention"])
            except UserInputError as err:
                raise type(err)(f"model.init_args.attention: {err}") from err
        for key, recipe in (("convert", ConvertRecipe), ("lora", LoraRecipe)):
            if init_args.get(key) is not None:
                try:
                    as_dataclass(init_args[key], recipe)
                except UserInputError as err:
                    raise type(err)(f"model.init_args.{err}") from err
                except TypeError as err:
                    raise ConfigError(f"model.init_args.{key}: {err}") from None
        if init_args.get("calibrate_attention"):
            from_deprecated_calibrate(dict(init_args))  # the deprecated key against convert.method, before building

    # ---- steps -------------------------------------------------------------------------------------

    def evaluate(self, batch: Any, stage: str | None) -> None:
        """Score one validation (``stage="val"``) or test (``"test"``) batch and log it under ``<stage>/``; with
        ``stage`` None (a padding batch, :class:`~polyattn_lightning.data.evaluation.PaddingBatch`) run the same
        forward and score and log nothing."""
        raise NotImplementedError

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.evaluate(*_scored(batch, "val"))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.evaluate(*_scored(batch, "test"))

    def predict(self, batch: Any) -> Any:
        """What ``lightning predict`` keeps of one batch (the default: ``forward``'s output)."""
        return self(batch)

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        """:meth:`predict`; for a padding batch its forward and None, which the prediction writer leaves out."""
        if isinstance(batch, PaddingBatch):
            self.predict(batch.batch)
            return None
        return self.predict(batch)

    def stage_metrics(self, stage: str) -> MetricCollection:
        """The metrics of ``stage`` (``val`` or ``test``) that :meth:`set_metrics` made."""
        return self.val_metrics if stage == "val" else self.test_metrics

    # ---- optimization ------------------------------------------------------------------------------

    @property
    def optim(self) -> OptimRecipe:
        """The ``optim`` hyperparameter: the optimizer and schedule."""
        return as_dataclass(self.hparams.optim, OptimRecipe)

    def configure_optimizers(self) -> dict[str, Any]:
        return configure_recipe(self, self.optimized_module(), self.optim)

    def lr_scheduler_step(self, scheduler, metric) -> None:
        step_scheduler(self, scheduler)

    # ---- hooks of the callbacks and commands -------------------------------------------------------

    def attention_probe(self, batch: Any, size: int) -> Any:
        """The diagnostics' fixed probe (:mod:`~polyattn_lightning.callbacks.attention_norms`): the argument of
        ``forward`` for the first ``size`` samples of ``batch`` (a tuple is passed as positional arguments)."""
        return default_probe(self, batch, size)

    def save_predictions(self, predictions: list, out_dir: Path) -> bool:
        """Write this rank's ``predict_step`` outputs (flattened) to ``out_dir`` in the task's own format; return
        False (the default) to let :class:`~polyattn_lightning.callbacks.PredictionWriter` save tensors itself."""
        return False

    def on_fit_end(self) -> None:
        """With the ``test_after_fit`` hyperparameter, test the best checkpoint (by :attr:`monitor`)."""
        trainer = self.trainer
        if self.hparams.get("test_after_fit") and trainer.datamodule is not None:
            self.test_best_checkpoint()

    def test_best_checkpoint(self) -> None:
        """``trainer.test`` with the best checkpoint's explicit path (the checkpoint callback monitoring
        :attr:`monitor`, else the first that monitors something), logged; the last weights when none was saved."""
        trainer = self.trainer
        keeping = [cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint) and cb.monitor]
        keeping.sort(key=lambda cb: cb.monitor != self.monitor)
        best = next((cb for cb in keeping if cb.best_model_path), None)
        if best is not None:
            score = best.best_model_score
            rank_zero_info(
                f"testing the best checkpoint by {best.monitor}: {best.best_model_path}"
                + (f" ({best.monitor} {float(score):.4f})" if score is not None else "")
            )
            trainer.test(self, datamodule=trainer.datamodule, ckpt_path=best.best_model_path)
        else:
            # an explicit file, never None: under SLURM Lightning resolves None to the newest requeue ("hpc") one;
            # in the run's folder (the working directory only without a logger), where no other run overwrites it
            ckpt_path = os.path.join(trainer.log_dir or trainer.default_root_dir, "checkpoints", "end_of_fit.ckpt")
            rank_zero_warn(f"no best checkpoint was saved: testing the weights at the end of training ({ckpt_path})")
            trainer.save_checkpoint(ckpt_path)
            trainer.test(self, datamodule=trainer.datamodule, ckpt_path=ckpt_path)


def from_deprecated_calibrate(hparams: dict[str, Any]) -> None:
    """Map the deprecated ``calibrate_attention: true`` onto ``convert.method: calibrate`` (in place, as plain values),
    with one deprecation line; a ``convert.method`` given too must agree."""
    calibrate = hparams.pop("calibrate_attention", None)
    if not calibrate:
        return
    rank_zero_warn(
        "model.init_args.calibrate_attention is deprecated: it is model.init_args.convert.method: calibrate "
        "(mapped onto it; method: transfer keeps more of a pretrained model, configs/README.md)",
        category=FutureWarning,
    )
    recipe = as_dataclass(hparams.get("convert") or ConvertRecipe(), ConvertRecipe)
    if recipe.method not in ("none", "calibrate"):
        raise ConfigError(
            f"the conversion is given twice, as model.init_args.convert.method {recipe.method} and as "
            "calibrate_attention: true; give it once, as model.init_args.convert.method"
        )
    hparams["convert"] = asdict(replace(recipe, method="calibrate"))


def _scored(batch: Any, stage: str) -> tuple[Any, str | None]:
    """:meth:`TaskModule.evaluate`'s arguments for ``batch``: a padding batch's contents and no stage (the same forward
    on every rank, under a sharded strategy, scoring nothing: ``data/evaluation.py``), else ``batch`` and ``stage``."""
    return (batch.batch, None) if isinstance(batch, PaddingBatch) else (batch, stage)


def logits_evaluation(module: TaskModule, logits: Tensor, labels: Tensor, stage: str | None) -> None:
    """Log ``<stage>/loss`` (cross entropy) and update and log the stage's accuracy metrics for one batch (nothing
    with ``stage`` None: a padding batch)."""
    if stage is None:
        return
    module.log_loss(stage, nn.functional.cross_entropy(logits, labels), len(labels))
    metrics = module.stage_metrics(stage)
    metrics.update(logits, labels)
    # logging the metric objects lets torchmetrics reduce their counts across DDP ranks at epoch end
    module.log_dict(metrics, on_step=False, on_epoch=True, prog_bar=True)
