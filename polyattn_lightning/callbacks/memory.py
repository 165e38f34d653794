"""Per-rank memory said out loud: one line before the first step, one after the first steps.

Before the first optimizer step: the estimated per-rank memory (parameters, gradients, optimizer, activations at the
configured batch, :mod:`polyattn_lightning.sharding.memory`) under DDP and under FSDP2 over the run's ranks, naming
which one the run uses. The activations are measured, not modelled: one forward of one sample of the first batch
with autograd recording what it saves (eval mode, so no dropout draw; every RNG state and ``training`` flag is put
back, so training continues as it would have). Every rank runs it (a sharded model's forward needs all of them).

After ``after_steps`` steps: what each rank holds (its parameters, gradients and optimizer states, shards counted
as stored) and its peak memory so far (CUDA allocator peak; on CPU the resident set's, which also counts Python).
"""

from __future__ import annotations

from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from ..diagnostics.probe import probe_batch, run_probe
from ..distributed import gather_objects
from ..errors import ConfigError
from ..rng import capture_rng_state, restore_rng_state
from ..sharding import shardable_blocks, sharded_strategy
from ..sharding.memory import estimate, held_bytes, human, peak_bytes, saved_bytes_of, states_per_element


class MemoryReport(Callback):
    """The per-rank memory lines of the module docstring.

    Args:
        when: ``sharded`` (the default): for runs under the sharded strategy; ``always``: every run; ``never``.
        after_steps: optimizer steps after which each rank's held and peak memory are said.
    """

    def __init__(self, when: Literal["sharded", "always", "never"] = "sharded", after_steps: int = 3) -> None:
        if when not in ("sharded", "always", "never") or after_steps < 1:
            raise ConfigError(
                f"MemoryReport: when must be sharded, always or never and after_steps >= 1, got {when!r}, {after_steps}"
            )
        self.when, self.after_steps = when, after_steps
        self._estimated = self._measured = False
        self.lines: list[str] = []

    def _active(self, trainer: pl.Trainer) -> bool:
        return self.when == "always" or (self.when == "sharded" and sharded_strategy(trainer) is not None)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int):
        if self._estimated or not self._active(trainer):
            return
        self._estimated = True
        self.say(self.estimate_line(trainer, pl_module, batch))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx):
        if self._measured or trainer.global_step < self.after_steps or not self._active(trainer):
            return
        self._measured = True
        held = {**held_bytes(pl_module, trainer.optimizers), "peak": peak_bytes(trainer.strategy.root_device)}
        peak = "allocator peak" if trainer.strategy.root_device.type == "cuda" else "peak resident set"
        ranks = gather_objects(held)
        self.say(
            f"memory per rank after {trainer.global_step} steps: "
            + "; ".join(
                f"rank {rank} holds {human(h['parameters'] + h['gradients'] + h['optimizer'])} (parameters "
                f"{human(h['parameters'])}, gradients {human(h['gradients'])}, optimizer {human(h['optimizer'])}), "
                f"{peak} {human(h['peak'])}"
                for rank, h in enumerate(ranks)
            )
        )

    def estimate_line(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> str:
        """The estimate for DDP and FSDP2 over the run's ranks (every rank runs the one-sample forward)."""
        sharded = sharded_strategy(trainer)
        per_sample = self.activations_per_sample(pl_module, batch)
        batch_size = extract_batch_size(batch)
        root = pl_module.optimized_module() if hasattr(pl_module, "optimized_module") else pl_module
        blocks = sharded.blocks if sharded is not None else shardable_blocks(root)
        ddp, fsdp = estimate(
            root,
            blocks,
            trainer.world_size,
            states_per_element(trainer.optimizers[0] if trainer.optimizers else None),
            per_sample * batch_size,
            sharded.compute_dtype() if sharded is not None else None,
        )
        chosen = "FSDP2" if sharded is not None else "DDP"
        return (
            f"memory per rank, estimated (activations: one sample measured, x batch {batch_size}; this run: "
            f"{chosen}): {ddp.line()}; {fsdp.line()}"
        )

    @staticmethod
    def activations_per_sample(pl_module: pl.LightningModule, batch: Any) -> int:
        """Bytes autograd saves for one sample of ``batch`` (eval mode; RNG states and modes put back)."""
        modes = [(m, m.training) for m in pl_module.modules()]
        rng = capture_rng_state()
        pl_module.eval()
        try:
            probe = probe_batch(pl_module, batch, 1)
            return saved_bytes_of(lambda: run_probe(pl_module, probe))
        finally:
            for m, training in modes:
                m.training = training
            restore_rng_state(rng)

    def say(self, line: str) -> None:
        self.lines.append(line)
        rank_zero_info(line)
