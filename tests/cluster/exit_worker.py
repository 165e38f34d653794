"""A 2-rank gloo run that ends right after collectives, as a training run does; the exit-code test repeats it.

    python -m torch.distributed.run --standalone --nproc_per_node 2 exit_worker.py

Without :func:`~polyattn_lightning.distributed.distributed_teardown` about 4 in 10 of these runs
died at exit with ``terminate called without an active exception`` (SIGABRT): a gloo thread
released the last all-gather's tensor while the interpreter was finalising.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  (the autograd all-gather Lightning's strategy.all_gather uses)

from polyattn_lightning.distributed import distributed_teardown


@distributed_teardown()
def main() -> None:
    dist.init_process_group("gloo")
    rank = torch.tensor([float(dist.get_rank())])
    gathered = torch.distributed.nn.functional.all_gather(rank)
    if torch.cat(gathered).tolist() != [0.0, 1.0]:
        raise SystemExit(f"all_gather gave {gathered}")


if __name__ == "__main__":
    main()
