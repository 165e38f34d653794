"""What a Lightning checkpoint lacks for an exact resume: RNG states, (a Lightning bug) the loader position, and its
checkpoint callbacks' state when their folder is spelled another way."""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import CombinedLoader, rank_zero_warn

from ..data.resumable import ResumableDataLoader
from .. import deprecated
from ..distributed import gather_objects
from ..rng import capture_rng_state, restore_rng_state

#: The checkpoint key: a list of RNG state dicts indexed by global rank.
RNG_KEY = "rng_states"
#: The checkpoint key: the ``max_epochs`` and ``max_steps`` of the run that saved it, which its lr schedule was made
#: for.
LIMITS_KEY = "trainer_limits"


class ExactResume(Callback):
    """Makes a resumed fit continue exactly where the checkpoint was taken.

    * RNG states: Lightning's checkpoints hold none, so after a resume dropout,
      drop path, Mixup/CutMix and in-process augmentations would draw
      differently. Every rank's states are saved under ``checkpoint["rng_states"]``.
    * Loader position: Lightning saves a :class:`ResumableDataLoader`'s state but
      does not hand it back when ``configure_optimizers`` asked for
      ``trainer.estimated_stepping_batches`` (Lightning issue #20550), so the
      interrupted epoch would start over. This callback hands it back.

    Both are restored in ``on_train_start``: after the sanity check, before the
    first batch is drawn, which is where the original run stood when it saved.
    Resuming on another number of ranks restores no RNG state (with a warning).

    * Checkpoint folders: Lightning gives a ModelCheckpoint its saved state (best-k
      scores, last path) only if its folder is spelled as the checkpoint spells it,
      and warns "dirpath has changed" otherwise; a run resumed in its own folder
      under another spelling (absolute, relative, through a link) keeps that state.
    * Schedule: the lr scheduler's state comes from the checkpoint (timm's
      schedulers store every parameter, the length of the cosine included), so a
      resumed run keeps the schedule of the run that saved it; a larger
      ``max_epochs`` trains on at the schedule's final lr rather than stretching
      it. A fit resumed with other ``max_epochs``/``max_steps`` than the
      checkpoint's gets one warning saying so.
    """

    def __init__(self) -> None:
        self._rng_states: list[dict[str, Any]] | None = None
        self._loader_states: list[dict[str, Any]] = []

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        checkpoint[RNG_KEY] = gather_objects(capture_rng_state())  # every rank saves; only rank 0 writes the file
        checkpoint[LIMITS_KEY] = {"max_epochs": trainer.max_epochs, "max_steps": trainer.max_steps}

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        _same_checkpoint_folders(trainer, checkpoint)
        self._rng_states = checkpoint.get(RNG_KEY)
        fit_loop = checkpoint.get("loops", {}).get("fit_loop", {})
        self._loader_states = fit_loop.get("state_dict", {}).get("combined_loader", [])
        saved = checkpoint.get(LIMITS_KEY)
        now = {"max_epochs": trainer.max_epochs, "max_steps": trainer.max_steps}
        if trainer.state.fn == TrainerFn.FITTING and saved is not None and saved != now:
            rank_zero_warn(
                f"resuming from {trainer.ckpt_path} with {_limits(now)}, but the run that saved it had"
                f" {_limits(saved)}: the resumed run keeps the checkpoint's lr schedule (it is not stretched or"
                " shortened; steps past its end train at its final lr). To train on with a schedule of its own,"
                " start a new run from the checkpoint's weights without --ckpt_path (classification:"
                f" --model.init_args.pretrained {trainer.ckpt_path})"
            )

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore_loader_position(trainer)
        states, self._rng_states = self._rng_states, None
        if states is None:
            return
        if len(states) != trainer.world_size:
            rank_zero_warn(
                f"the checkpoint holds RNG states for {len(states)} ranks but this run has {trainer.world_size}:"
                " random draws will differ from the original run"
            )
            return
        restore_rng_state(states[trainer.global_rank])

    def _restore_loader_position(self, trainer: pl.Trainer) -> None:
        states, self._loader_states = self._loader_states, []
        # Lightning saves the states of the loaders with state_dict(), in CombinedLoader's flattened order
        stateful = [dl for dl in CombinedLoader(trainer.train_dataloader).flattened if hasattr(dl, "state_dict")]
        if len(stateful) != len(states):
            return
        for loader, state in zip(stateful, states):
            if isinstance(loader, ResumableDataLoader):  # it starts iterating lazily, so a late load is in time
                loader.load_state_dict(state)


def _same_checkpoint_folders(trainer: pl.Trainer, checkpoint: dict[str, Any]) -> None:
    """Every ModelCheckpoint state of ``checkpoint`` whose folder is one of this run's under another spelling names
    it as this run does (Lightning compares the strings)."""
    callbacks = [c for c in trainer.checkpoint_callbacks if getattr(c, "dirpath", None)]
    folders = {os.path.realpath(c.dirpath): c.dirpath for c in callbacks}
    for state in (checkpoint.get("callbacks") or {}).values():
        saved = state.get("dirpath") if isinstance(state, dict) else None
        if isinstance(saved, str) and os.path.realpath(saved) in folders:
            state["dirpath"] = folders[os.path.realpath(saved)]


def _limits(limits: dict[str, int]) -> str:
    return ", ".join(f"{key}={value}" for key, value in limits.items())


def __getattr__(name: str):
    return deprecated.attribute(__name__, name)
