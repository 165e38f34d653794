"""A callback for the CLI runs of the rank-failure tests: one rank SIGKILLs itself mid-epoch, as the OOM killer would.

    --trainer.callbacks+='{"class_path": "rank_kill.SigkillRank", "init_args": {"rank": 1, "step": 8, "marker": PATH}}'

(``tests/cluster`` on PYTHONPATH). Just before the kill it writes the time to ``marker``, so the test can
tell how long the rest of the job took to end.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from lightning.pytorch.callbacks import Callback


class SigkillRank(Callback):
    def __init__(self, rank: int, step: int, marker: str) -> None:
        self.rank, self.step, self.marker = rank, step, Path(marker)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            self.marker.write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
