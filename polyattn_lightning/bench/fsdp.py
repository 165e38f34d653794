"""``python -m polyattn_lightning.bench fsdp``: FSDP2 against DDP and one process, a ~100M-parameter decoder on CPU.

One 2-rank launch (``torch.distributed.run``, gloo) trains the same decoder from the same saved initial state dict
under DDP, then under the sharded strategy (writing a sharded checkpoint at ``--save-at``), then resumes that
checkpoint on 2 ranks; this process then trains it on one process with the same global batch, resumes the
checkpoint consolidated to one file on one process, and, as the control, trains it on one process with the global
batch as two accumulated halves (the same gradient, summed in another order). Reported, with the machine and load:

* the per-rank parameter + optimizer memory each layout holds after training (the storage of the parameters,
  local shards under FSDP2, and of AdamW's moments), and FSDP2's over DDP's (target <= 0.6);
* the weight differences after ``--steps`` steps (largest element, the relative size of the difference of the
  updates, the elements more than 1e-5 apart): FSDP2 against DDP and against one process (target: largest
  <= 1e-5, fp32), and the control against one process (the floor any other summation order reaches);
* the resumed runs against the uninterrupted sharded run: on 2 ranks bit for bit, on one process within 1e-5.

Why the control: AdamW's first updates are ``lr * g / (|g| + eps)``; of 97.5M gradient elements some are ~1e-9
(median 1e-3), where the rounding of another summation order is a sizeable fraction of ``g`` and becomes a few
percent of ``lr`` in the update. Two runs that add the same per-sample gradients in different orders (2 ranks and
one process) drift apart by that much and more as training goes on; the control measures that floor.

The decoder (``--size 100m``): Llama-style, 12 layers of width 768 (12 heads, MLP 2048), vocabulary 8192, untied
embeddings: 97.5M parameters; poly3 attention; AdamW at 1e-4 (no warmup, no decay), fp32, 16 random sequences of 64
tokens per step (8 per rank), no dropout. ``--size tiny`` is the same at width 32.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy

from ..callbacks import ExactResume
from ..checkpoint import SafeCheckpointIO, atomic_save
from ..data.resumable import ResumableDataLoader
from ..distributed import distributed_teardown, gather_objects
from ..errors import ArgumentParser
from ..sharding import ShardedStrategy, full_state_dict, read_consolidated
from ..sharding.memory import held_bytes, human
from ..tasks import HFCausalLM, OptimRecipe
from .timing import machine, write_report

SIZES = {
    "100m": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12),
    "tiny": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4),
}
VOCAB, LENGTH, GLOBAL_BATCH, SEQUENCES = 8192, 64, 16, 512
TARGETS = {"memory_ratio": 0.6, "max_difference": 1e-5}


class RandomTokens(pl.LightningDataModule):
    """``SEQUENCES`` random sequences of ``LENGTH`` tokens (fixed seed), shuffled per epoch, resumable mid-epoch."""

    vocab_size = VOCAB

    def __init__(self, batch_size: int):
        super().__init__()
        self.batch_size = batch_size
        ids = torch.randint(0, VOCAB, (SEQUENCES, LENGTH), generator=torch.Generator().manual_seed(0))
        self.rows = [{"input_ids": row} for row in ids]

    def train_dataloader(self) -> ResumableDataLoader:
        return ResumableDataLoader(self.rows, batch_size=self.batch_size, shuffle=True)


class SaveAt(Callback):
    """``trainer.save_checkpoint(path)`` after optimizer step ``step`` (where Lightning's step checkpoints save)."""

    def __init__(self, step: int, path: Path):
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def decoder(size: str) -> HFCausalLM:
    config = dict(model_type="llama", **SIZES[size], max_position_embeddings=LENGTH, tie_word_embeddings=False)
    optim = OptimRecipe(lr=1e-4, reference_batch=None, weight_decay=0.0, warmup_epochs=0.0, warmup_lr=1e-4, min_lr=1e-4)
    return HFCausalLM(hf_config=config, attention="poly3", vocab_size=VOCAB, optim=optim, test_after_fit=False)


def train(
    size: str, layout: str, devices: int, init: Path, steps: int, callbacks=(), ckpt_path=None, accumulate: int = 1
) -> dict:
    """One fit from the initial state dict (the global batch in ``accumulate`` parts per rank); the whole weights
    (on rank 0) and what each rank held."""
    pl.seed_everything(0)
    model = decoder(size)
    model.load_state_dict(torch.load(init, weights_only=True))
    strategies = {"ddp": DDPStrategy(process_group_backend="gloo"), "fsdp": ShardedStrategy()}
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategies.get(layout, "auto"),
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        plugins=[SafeCheckpointIO()],
        callbacks=[ExactResume(), *callbacks],
        accumulate_grad_batches=accumulate,
    )
    trainer.fit(model, RandomTokens(GLOBAL_BATCH // (devices * accumulate)), ckpt_path=ckpt_path)
    held = gather_objects(held_bytes(model, trainer.optimizers))
    weights = {key: value.detach().cpu().clone() for key, value in full_state_dict(model).items()}
    parameters = sum(p.numel() for p in model.model.parameters())  # a DTensor's numel is its global size
    return {"weights": weights, "held": held, "parameters": parameters}


@distributed_teardown()
def worker(size: str, init: Path, out: Path, steps: int, save_at: int) -> None:
    """The 2-rank part: DDP, the sharded run (checkpoint at ``save_at``), the sharded resume."""
    folder = out / f"step{save_at}.ckpt"
    runs = {
        "ddp": train(size, "ddp", 2, init, steps),
        "fsdp": train(size, "fsdp", 2, init, steps, [SaveAt(save_at, folder)]),
        "fsdp_resumed": train(size, "fsdp", 2, init, steps, ckpt_path=str(folder)),
    }
    if torch.distributed.get_rank() == 0:
        for name, result in runs.items():
            torch.save(result, out / f"{name}.pt")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_two_ranks(size: str, init: Path, out: Path, steps: int, save_at: int) -> None:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        "-m",
        "polyattn_lightning.bench",
        "fsdp",
        "--worker",
        "--size",
        size,
        "--steps",
        str(steps),
        "--save-at",
        str(save_at),
        "--init",
        str(init),
        "--out",
        str(out),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(
            f"the 2-rank launch failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )


def difference(a: dict, b: dict, init: dict) -> dict[str, float]:
    """How far weights ``a`` are from ``b`` (both trained from ``init``): the largest element difference, the norm of
    the difference over the norm of ``b``'s update, and how many elements are more than 1e-5 apart."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    gaps = [(a[k].double() - b[k].double()).abs() for k in a]
    update = sum(float((b[k].double() - init[k].double()).pow(2).sum()) for k in a) ** 0.5
    return {
        "largest": max(float(gap.max()) for gap in gaps),
        "relative_to_update": sum(float(gap.pow(2).sum()) for gap in gaps) ** 0.5 / max(update, 1e-30),
        "elements_over_1e-5": sum(int((gap > 1e-5).sum()) for gap in gaps),
    }


def held_params_and_optimizer(result: dict) -> int:
    """The largest per-rank parameter + optimizer bytes of a run."""
    return max(h["parameters"] + h["optimizer"] for h in result["held"])


def measure(size: str, steps: int, save_at: int, work: Path) -> dict:
    init = work / "init.pt"
    pl.seed_everything(0)
    torch.save(decoder(size).state_dict(), init)
    launch_two_ranks(size, init, work, steps, save_at)
    runs = {name: torch.load(work / f"{name}.pt", weights_only=True) for name in ("ddp", "fsdp", "fsdp_resumed")}
    runs["single"] = train(size, "single", 1, init, steps)
    runs["single_halves"] = train(size, "single", 1, init, steps, accumulate=2)
    consolidated = work / f"step{save_at}_full.ckpt"
    atomic_save(read_consolidated(work / f"step{save_at}.ckpt"), consolidated)
    runs["single_resumed"] = train(size, "single", 1, init, steps, ckpt_path=str(consolidated))
    start = torch.load(init, weights_only=True)
    fsdp, single = runs["fsdp"]["weights"], runs["single"]["weights"]
    ddp_held, fsdp_held = held_params_and_optimizer(runs["ddp"]), held_params_and_optimizer(runs["fsdp"])
    resumed = runs["fsdp_resumed"]["weights"]
    return {
        "parameters": runs["fsdp"]["parameters"],
        "held_bytes": {name: runs[name]["held"] for name in ("ddp", "fsdp")},
        "params_plus_optimizer_per_rank": {"ddp": ddp_held, "fsdp": fsdp_held},
        "memory_ratio": fsdp_held / ddp_held,
        "differences": {
            "fsdp_vs_ddp": difference(fsdp, runs["ddp"]["weights"], start),
            "fsdp_vs_single": difference(fsdp, single, start),
            "control_halves_vs_single": difference(runs["single_halves"]["weights"], single, start),
            "resumed_1_rank_vs_fsdp": difference(runs["single_resumed"]["weights"], fsdp, start),
        },
        "resumed_2_ranks_bitwise": all(torch.equal(resumed[k], fsdp[k]) for k in fsdp),
    }


def verdicts(result: dict) -> dict[str, bool]:
    d = {name: entry["largest"] for name, entry in result["differences"].items()}
    limit = TARGETS["max_difference"]
    return {
        f"FSDP2 params+optimizer per rank <= {TARGETS['memory_ratio']}x DDP": result["memory_ratio"]
        <= TARGETS["memory_ratio"],
        "FSDP2 = DDP within 1e-5": d["fsdp_vs_ddp"] <= limit,
        "FSDP2 = one process within 1e-5": d["fsdp_vs_single"] <= limit,
        "resumed on 2 ranks bit for bit": result["resumed_2_ranks_bitwise"],
        "resumed on 1 rank (consolidated) within 1e-5": d["resumed_1_rank_vs_fsdp"] <= limit,
    }


def table(result: dict, steps: int, save_at: int) -> str:
    per_rank = result["params_plus_optimizer_per_rank"]

    def gap(name: str) -> str:
        entry = result["differences"][name]
        return (
            f"{entry['largest']:.2e} (difference / update {entry['relative_to_update']:.1e}, "
            f"{entry['elements_over_1e-5']} of {result['parameters']:,} elements > 1e-5)"
        )

    rows = [
        ("parameters", f"{result['parameters'] / 1e6:.1f}M", ""),
        ("params + AdamW moments per rank, DDP", human(per_rank["ddp"]), ""),
        (
            "params + AdamW moments per rank, FSDP2",
            human(per_rank["fsdp"]),
            f"{result['memory_ratio']:.3f}x DDP (target <= {TARGETS['memory_ratio']})",
        ),
        (f"after {steps} steps: FSDP2 vs DDP, largest weight difference", gap("fsdp_vs_ddp"), "<= 1e-5"),
        (f"after {steps} steps: FSDP2 vs 1 process", gap("fsdp_vs_single"), "<= 1e-5"),
        (
            "control: 1 process, the batch as 2 accumulated halves, vs 1 process",
            gap("control_halves_vs_single"),
            "(the floor)",
        ),
        (
            f"resumed at step {save_at} on 2 ranks vs uninterrupted",
            "bit for bit" if result["resumed_2_ranks_bitwise"] else "DIFFERS",
            "bit for bit",
        ),
        (
            f"resumed at step {save_at} on 1 process (consolidated) vs uninterrupted",
            gap("resumed_1_rank_vs_fsdp"),
            "<= 1e-5",
        ),
    ]
    return "| quantity | value | target |\n|---|---|---|\n" + "\n".join(f"| {a} | {b} | {c} |" for a, b, c in rows)


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m polyattn_lightning.bench fsdp", description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="100m")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--save-at", type=int, default=10, help="the step of the sharded checkpoint that is resumed")
    parser.add_argument("--json", default=None, help="write the full results here")
    parser.add_argument("--work", type=Path, default=None, help="folder for the checkpoints (default: a temporary)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one rank of the 2-rank launch
    parser.add_argument("--init", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.size, args.init, args.out, args.steps, args.save_at)
        return 0
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        result = measure(args.size, args.steps, args.save_at, work)
    result["command"] = " ".join(["python -m polyattn_lightning.bench fsdp", *argv])
    result["machine"] = machine(load_before)
    result["verdicts"] = verdicts(result)
    print(table(result, args.steps, args.save_at))
    for name, met in result["verdicts"].items():
        print(f"{'MET ' if met else 'MISS'} {name}")
    print(f"load average before {load_before}, after {result['machine']['load_average_after']}")
    write_report(result, args.json)
    return 0 if all(result["verdicts"].values()) else 1
