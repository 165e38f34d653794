"""A callback for the jobs of the real-SLURM tests: what each rank trained on, and a hold for SLURM's signal.

    --trainer.callbacks+='{"class_path": "slurm_probe.JobProbe", "init_args": {"folder": DIR, "hold_at": 8}}'

(``tests/cluster`` on PYTHONPATH). Every run of the job, the requeued one too, appends to

* ``DIR/batches-rank<r>.txt`` one line per training batch, ``<global step> <sha1 of the batch>``: the batches the
  rank trained on, in order, none left out or repeated across a requeue;
* ``DIR/starts-rank<r>.txt`` one line per run, ``<SLURM_RESTART_COUNT> <global step it starts from>``.

With ``hold_at``, every rank stops at the end of that training step, writes ``DIR/held-rank<r>`` and waits (at most
``hold_s`` seconds, then fails) until the process gets the requeue signal, SIGUSR1, which the test has SLURM send
(``scancel --signal=USR1``). The signal goes on to the handler that was there (the preemption callback's), so the
preemption lands at a known step instead of wherever a few-millisecond step happens to be when the scheduler
delivers it.
"""

from __future__ import annotations

import hashlib
import os
import signal
import time
from pathlib import Path

from lightning.pytorch.callbacks import Callback


class JobProbe(Callback):
    def __init__(self, folder: str, hold_at: int | None = None, hold_s: float = 600.0) -> None:
        self.folder, self.hold_at, self.hold_s = Path(folder), hold_at, hold_s

    def write(self, trainer, kind: str, line: str) -> None:
        with open(self.folder / f"{kind}-rank{trainer.global_rank}.txt", "a") as file:
            file.write(line + "\n")

    def on_train_start(self, trainer, pl_module) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.write(trainer, "starts", f"{os.environ.get('SLURM_RESTART_COUNT', '0')} {trainer.global_step}")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        digest = hashlib.sha1()
        for tensor in batch:
            digest.update(tensor.detach().cpu().numpy().tobytes())
        self.write(trainer, "batches", f"{trainer.global_step} {digest.hexdigest()}")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.hold_at:
            self.hold(trainer)

    def hold(self, trainer) -> None:
        """Wait here for SIGUSR1, then hand it to the handler that was installed."""
        got = []
        previous = signal.getsignal(signal.SIGUSR1)

        def noted(signum, frame) -> None:
            got.append(signum)
            if callable(previous):
                previous(signum, frame)

        signal.signal(signal.SIGUSR1, noted)
        try:
            (self.folder / f"held-rank{trainer.global_rank}").write_text(str(trainer.global_step))
            deadline = time.monotonic() + self.hold_s
            while not got:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"JobProbe: no SIGUSR1 within {self.hold_s} s of holding at step {self.hold_at}")
                time.sleep(0.05)
        finally:
            signal.signal(signal.SIGUSR1, previous)
