"""The base every task (LightningModule) of this project builds on: one job, making a task's model and training it
the same way for every family (in the spirit of torchgeo's ``BaseTask``).

A task declares and implements; the base does the rest, with nothing for the task to remember to call:

* **Declare** the options (``__init__``'s arguments: ``attention``, ``optim`` and every name of :attr:`data_args`
  among them), the values the data determines (:attr:`data_args`, :attr:`optional_data_args`; ``tasks/hparams.py``)
  and the best checkpoint's metric (:attr:`monitor`, :attr:`mode`).
* **Implement** :meth:`TaskModule.build`, ``forward``, ``training_step``, :meth:`TaskModule.evaluate` and, when
  ``forward``'s output is not what ``lightning predict`` should keep, :meth:`TaskModule.predict`; override the hooks
  whose defaults do not fit (the module attention runs on, the probe, the trainable parts beside LoRA...).

The base's ``__init__`` saves the arguments as hyperparameters (Lightning's ``save_hyperparameters``, read from the
``__init__`` calls that led to it); once the whole ``__init__`` has run, :class:`TaskType` builds the model when the
hyperparameters give every value it needs (a checkpoint's always do), else ``configure_model`` builds it once the
data is set up. Right after building, the steps of ``tasks/preparation.py`` prepare it, in one fixed order: switch
the attention, convert pretrained weights, add LoRA adapters, shard. The optimizer and schedule come from the
``optim`` hyperparameter (``tasks/optim.py``); with ``test_after_fit``, the best checkpoint is tested at the end of
``fit`` (``tasks/best_checkpoint.py``). Scoring (metrics per stage, exact losses, the evaluation and predict steps)
is ``tasks/evaluation.py``'s.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn

from .. import deprecated, waits
from ..attention import ActivationSpec
from ..diagnostics.probe import default_probe
from ..errors import check_options
from ..sharding import building_later
from . import preparation
from .best_checkpoint import BestCheckpointTest
from .evaluation import Evaluation
from .hparams import as_dataclass, fill_from_data, require_data_values
from .optim import OptimRecipe, configure_recipe, step_scheduler
from .steps import shard


#: Methods the base had before its steps and callback took their work, which it no longer calls, and what to
#: override instead: a task class that defines one is told when it is defined.
RETIRED_HOOKS = {
    "convert_once": "the convert step (tasks/steps/convert.py) runs by itself",
    "conversion_samples": "override conversion_inputs (one batch as the attention target takes it)",
    "test_best_checkpoint": "the best checkpoint's test is the BestCheckpointTest callback (tasks/best_checkpoint.py)",
    "mismatch_message": "the message is tasks/hparams.py's; override check_data to check more",
}


class TaskType(type(pl.LightningModule)):
    """How a task is made: a keyword option its ``__init__`` does not take refused first (one line naming it, the
    closest option and every option the task takes: Python's own error is a bare ``TypeError``), then the
    ``__init__`` of every class in its line, then the model built when it can be (:meth:`TaskModule.build_if_known`).
    Copying and unpickling make no call: they restore a task as it was."""

    def __init__(cls, name: str, bases: tuple, namespace: dict[str, Any], **kwargs: Any) -> None:
        super().__init__(name, bases, namespace, **kwargs)
        for hook in sorted(RETIRED_HOOKS.keys() & namespace.keys()):
            warnings.warn(f"{name}.{hook} is no longer called by the task base: {RETIRED_HOOKS[hook]}", stacklevel=2)

    def __call__(cls, *args: Any, **kwargs: Any):
        check_options(cls.__init__, kwargs, owner=cls.__name__)
        task = super().__call__(*args, **kwargs)
        task.build_if_known()
        return task

    @property
    def __signature__(cls) -> inspect.Signature:
        """The task's ``__init__`` signature without ``self``, what ``inspect.signature`` gives a plain class."""
        signature = inspect.signature(cls.__init__)
        return signature.replace(parameters=list(signature.parameters.values())[1:])


class TaskModule(Evaluation, pl.LightningModule, metaclass=TaskType):
    """Base of every task: see the module docstring for what a task declares and implements."""

    #: the validation metric the best checkpoint is chosen by, and whether larger (``max``) or smaller is better
    monitor: ClassVar[str] = "val/top1"
    mode: ClassVar[str] = "max"
    #: hyperparameters the DataModule determines (read from its attributes of the same names): None takes the
    #: data's value; the model cannot be built without these
    data_args: ClassVar[tuple[str, ...]] = ()
    #: like :attr:`data_args`, but the model has a default when neither the config nor the data gives one
    optional_data_args: ClassVar[tuple[str, ...]] = ()
    #: the checkpoint whose saved hyperparameters built this task (the CLI's ``--ckpt_path``): errors name it
    hparams_checkpoint: str | None = None

    def __init__(self) -> None:
        """Save the arguments of the subclasses' ``__init__`` as hyperparameters: call it first, before an argument
        is changed (the CLI and ``load_from_checkpoint`` give them as they were)."""
        super().__init__()
        self.save_hyperparameters(frame=inspect.currentframe())
        self.built = False
        #: the convert step's report (a plain dict): this run's, or the checkpoint's it was restored from
        self.conversion: dict[str, Any] | None = None

    # ---- building ----------------------------------------------------------------------------------

    def build_if_known(self) -> None:
        """Build when no required value is left to the data, unless the sharded strategy will (``build_later``) or
        there is no :meth:`build` yet; :class:`TaskType` calls it."""
        known = all(self.hparams.get(name) is not None for name in self.data_args)
        if known and not self.built and not building_later() and is_overridden("build", self, TaskModule):
            self.configure_model()

    def configure_model(self) -> None:
        """Build the model once (with the values left to the data taken from it; a build that lasts says so:
        :class:`~polyattn_lightning.waits.Wait`), then prepare it (``tasks/preparation.py``): right after building,
        and again under the trainer (to convert and shard)."""
        new = not self.built
        if new:
            self.check_data(self._trainer.datamodule if self._trainer is not None else None)
            require_data_values(self)
            with waits.Wait(f"{type(self).__name__}: building the model", after=waits.QUIET_SECONDS):
                self.build()
        preparation.prepare(self, new)
        self.built = True

    def build(self) -> None:
        """Make the model, heads, losses and metrics from the (complete) hyperparameters."""
        raise NotImplementedError

    def init_context(self) -> contextlib.AbstractContextManager:
        """Where :meth:`build` makes a model from a config (no weight file): the meta device when sharded."""
        return shard.init_context(self)

    # ---- the hooks of the steps (tasks/steps/) -----------------------------------------------------

    def attention_target(self) -> nn.Module | None:
        """The module whose attention layers run the registry activation (None: nothing to switch)."""
        return self.model

    def attention_spec(self) -> ActivationSpec:
        """The activation :meth:`attention_target` is switched to."""
        return self.hparams.attention

    def attention_options(self) -> dict[str, Any]:
        """Further ``set_attention`` arguments (``strict``, ``probe``); the default is none: strict, a derived probe."""
        return {}

    def conversion_inputs(self, batch: Any) -> Any:
        """What the attention target takes from one training batch: the images of an ``(images, labels)`` pair."""
        return batch[0] if isinstance(batch, (tuple, list)) else batch

    def weights_from_checkpoint(self) -> bool:
        """Whether a checkpoint will replace the weights before the first step (nothing is converted then):
        ``--ckpt_path`` (:attr:`hparams_checkpoint`) or ``trainer.ckpt_path`` set before ``fit`` (a path given to
        ``trainer.fit`` is known only once loaded: its weights replace the converted ones, with a warning)."""
        return bool(self.hparams_checkpoint) or bool(self._trainer is not None and self._trainer.ckpt_path)

    def lora_trainable(self) -> list[nn.Module]:
        """The modules that train beside the LoRA adapters (a new head); the default is none."""
        return []

    def optimized_module(self) -> nn.Module:
        """The module whose parameters are trained and sharded (a timm model gives its no-weight-decay list)."""
        return self.model

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        preparation.on_save_checkpoint(self, checkpoint)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        preparation.on_load_checkpoint(self, checkpoint)

    # ---- the data against the model ----------------------------------------------------------------

    def setup(self, stage: str) -> None:
        self.check_data(self.trainer.datamodule)

    def check_data(self, datamodule: pl.LightningDataModule | None) -> None:
        """The values of :attr:`data_args` and :attr:`optional_data_args` from ``datamodule`` (set up), checked and
        taken into the hyperparameters. Override to check more (and call this one)."""
        fill_from_data(self, datamodule)

    @classmethod
    def check_init_args(cls, init_args: Mapping[str, Any]) -> None:
        """Called by the CLI before any model is built: fail on a bad value that needs no model to tell (by
        default the attention spec and the steps' options). Errors name the key."""
        preparation.check_init_args(init_args)

    # ---- optimization ------------------------------------------------------------------------------

    @property
    def optim(self) -> OptimRecipe:
        """The ``optim`` hyperparameter: the optimizer and schedule."""
        return as_dataclass(self.hparams.optim, OptimRecipe)

    def configure_optimizers(self) -> dict[str, Any]:
        return configure_recipe(self, self.optimized_module(), self.optim)

    def lr_scheduler_step(self, scheduler, metric) -> None:
        step_scheduler(self, scheduler)

    # ---- callbacks and commands --------------------------------------------------------------------

    def configure_callbacks(self) -> list[Callback]:
        """With the ``test_after_fit`` hyperparameter, :class:`~.best_checkpoint.BestCheckpointTest` (unless the
        trainer has one already)."""
        present = any(isinstance(callback, BestCheckpointTest) for callback in self.trainer.callbacks)
        return [BestCheckpointTest()] if self.hparams.get("test_after_fit") and not present else []

    def attention_probe(self, batch: Any, size: int) -> Any:
        """The diagnostics' fixed probe (:mod:`~polyattn_lightning.callbacks.attention_norms`): the argument of
        ``forward`` for the first ``size`` samples of ``batch`` (a tuple is passed as positional arguments)."""
        return default_probe(self, batch, size)

    def save_predictions(self, predictions: list, out_dir: Path) -> bool:
        """Write this rank's ``predict_step`` outputs (flattened) to ``out_dir`` in the task's own format; return
        False (the default) to let :class:`~polyattn_lightning.callbacks.PredictionWriter` save tensors itself."""
        return False


def __getattr__(name: str):
    return deprecated.attribute(__name__, name)
