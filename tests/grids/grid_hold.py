"""A callback for the cells of the SLURM grid test: the training steps each attempt ran, and a hold for scancel.

    args: {trainer.callbacks+: {class_path: grid_hold.HoldOnce, init_args: {folder: DIR, hold_at: 12}}}

(``tests/grids`` on PYTHONPATH). Every attempt of a cell appends to ``<cell>/steps.txt`` (the fit's
``default_root_dir``) one line per training batch, its global step: a cell trained exactly once lists each step once.

Until ``DIR/release`` exists, a cell stops at the end of training step ``hold_at``, writes ``DIR/held-<n>`` (its
folder) and waits, at most ``hold_s`` seconds, for SIGTERM or SIGUSR2, which the test has SLURM send (``scancel``,
``scancel --signal=USR2``); the signal goes on to the handler that was there (the project's ``StopOnSignal``), so the
cancel or the preemption lands mid-training, at a known step, instead of wherever a few-millisecond step happens to
be. Once the test writes ``DIR/release``, held cells go on and no cell holds any more.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from lightning.pytorch.callbacks import Callback


class HoldOnce(Callback):
    def __init__(self, folder: str, hold_at: int, hold_s: float = 600.0) -> None:
        self.folder, self.hold_at, self.hold_s = Path(folder), hold_at, hold_s

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        with open(Path(trainer.default_root_dir) / "steps.txt", "a") as file:
            file.write(f"{trainer.global_step}\n")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.hold_at and not (self.folder / "release").exists():
            self.hold(Path(trainer.default_root_dir))

    def hold(self, cell: Path) -> None:
        got = []
        previous = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGUSR2)}

        def noted(signum, frame) -> None:
            got.append(signum)
            if callable(previous[signum]):
                previous[signum](signum, frame)

        for signum in previous:
            signal.signal(signum, noted)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            (self.folder / f"held-{os.getpid()}").write_text(str(cell))
            deadline = time.monotonic() + self.hold_s
            while not got and not (self.folder / "release").exists():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"HoldOnce: no signal and no {self.folder / 'release'} in {self.hold_s} s")
                time.sleep(0.05)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
