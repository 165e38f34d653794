#!/usr/bin/env bash
# Lightning DDP without SLURM: torchrun starts one process per GPU and Lightning reads its environment.
# Each rank tears its process group down before exiting (any backend), so torchrun's exit status is the run's.
#
# One node, every GPU:   scripts/torchrun.sh CONFIG [lightning fit arguments...]
# Some GPUs:             CUDA_VISIBLE_DEVICES=0,1 GPUS=2 scripts/torchrun.sh CONFIG
# Two nodes (run on both; node 0 is the one at MASTER_ADDR):
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 scripts/torchrun.sh CONFIG
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 scripts/torchrun.sh CONFIG
set -euo pipefail

config=${1:?usage: scripts/torchrun.sh CONFIG [lightning fit arguments...]}
shift
gpus=${GPUS:-$(nvidia-smi --list-gpus | wc -l)}
nnodes=${NNODES:-1}

# the interpreter by path (PYTHON, default python3): no activated venv needed for a `torchrun` on PATH
exec "${PYTHON:-python3}" -m torch.distributed.run --nnodes "$nnodes" --nproc_per_node "$gpus" --node_rank "${NODE_RANK:-0}" \
    --master_addr "${MASTER_ADDR:-127.0.0.1}" --master_port "${MASTER_PORT:-29500}" \
    -m polyattn_lightning fit --config "$config" \
    --trainer.devices "$gpus" --trainer.num_nodes "$nnodes" --trainer.strategy ddp \
    "$@"
