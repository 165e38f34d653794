"""LRA benchmark: training steps of the Xiong et al. encoder at Text and Retrieval lengths, softmax vs poly3 vs poly1.

``python -m polyattn_lightning.bench lra [--parts throughput,retrieval4k] [--batch 4] [--repeats 2]
[--length 4096] [--retrieval-batch 32] [--retrieval-length 4000] [--json out.json]``

A step is what training does: forward, cross entropy, backward and an AdamW step
(``LRAClassifier`` with the paper's sizes: dim 64, 2 layers, 2 heads of 32).

* ``throughput``: Text (one 4096-token sequence per sample) and Retrieval (two towers of
  4096) with LRA-style padding: the batch's sequences keep 100% down to 50% of their tokens
  (attention bench's ``padding_mask``); a Retrieval sample is a pair. Cases: softmax, poly3 and
  poly1 (both scaled 1/14),
  each with the recipe's attention dropout 0.1 and without it (``+drop0``; poly1 then runs
  in linear time). After one warm-up step each, the cases run round-robin ``--repeats``
  times (median reported) as sequences per second; then one step each under the allocator
  profiler gives the peak memory above what was allocated before the step (the weights and
  the AdamW state are excluded; activations, saved tensors and gradients count).
* ``retrieval4k``: the Retrieval step at 4000 tokens per document (no padding), batch
  ``--retrieval-batch`` (32, the recipe's): poly3 with attention dropout 0.1 in fp32 and under
  bf16 autocast, against softmax on SDPA without dropout (with dropout PyTorch's CPU SDPA falls
  back to its math kernel, which holds several N x N matrices: tens of GB here). Each case also
  runs at 2000 tokens: memory that is linear in N doubles from 2000 to 4000 tokens, an N x N
  tensor quadruples. Each case is one timed step and one profiled step.
* ``pathx`` (not in the default parts; hours on a CPU): ``--pathx-steps`` training steps (300) of the
  encoder on Path-X (128 x 128 = 16,384 pixel tokens; ``--pathx-images`` images drawn on first use by
  ``data/lra/snakes.py`` and cached), x^3 at 1/sqrt(N) without attention dropout (so ``kernel="auto"`` may
  take a linear-time form), batch ``--pathx-batch``, AdamW at Pathfinder's lr 1e-4, on ``--device`` (bf16
  autocast on CUDA). Reports the kernel ``auto`` picks at this shape, the median step time after 5 warm-up
  steps, samples and tokens per second, one step's peak memory, and the loss and training accuracy of the
  first and last 50 steps (a 300-step run is a speed and stability check, not a Path-X result).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..errors import ArgumentParser
from ..models import LRAClassifier
from . import chosen_parts
from .attention import padding_mask
from .timing import interleaved, machine, step_peak_bytes, write_report

POLY3 = {"name": "poly3", "scale": 0.0714}
POLY1 = {"name": "poly1", "scale": 0.0714}
#: (label, activation, attention dropout) of the throughput part
THROUGHPUT_CASES = [
    ("softmax", "softmax", 0.1),
    ("poly3", POLY3, 0.1),
    ("poly1", POLY1, 0.1),
    ("softmax+drop0", "softmax", 0.0),
    ("poly3+drop0", POLY3, 0.0),
    ("poly1+drop0", POLY1, 0.0),
]
#: (label, activation, attention dropout, autocast to bf16) of the Retrieval 4k part
RETRIEVAL_CASES = [
    ("softmax+drop0", "softmax", 0.0, False),
    ("poly3", POLY3, 0.1, False),
    ("poly3+bf16", POLY3, 0.1, True),
]
VOCAB = 257  # bytes + padding, as the Text and Retrieval data
PARTS = ("throughput", "retrieval4k", "pathx")


@dataclass
class Trainee:
    """One model, its optimizer and a fixed batch: ``step()`` is one training step."""

    model: LRAClassifier
    optimizer: torch.optim.Optimizer
    batch: dict[str, Tensor]
    bf16: bool = False

    def step(self, seed: int = 0) -> float:
        torch.manual_seed(seed)  # the same dropout draws for every repeat
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16) if self.bf16 else nullcontext():
            logits = self.model(self.batch["input_ids"], self.batch["mask"])
        loss = nn.functional.cross_entropy(logits.float(), self.batch["label"])
        loss.backward()
        self.optimizer.step()
        return loss.item()


def lra_batch(batch: int, towers: int, length: int, padded: tuple[float, float] | None, seed: int = 0) -> dict:
    """Random byte tokens; ``padded``: the fractions of each sequence that are padding (None: none)."""
    generator = torch.Generator().manual_seed(seed)
    shape = (batch, towers, length) if towers > 1 else (batch, length)
    ids = torch.randint(1, VOCAB, shape, generator=generator)
    mask = torch.ones(shape, dtype=torch.bool)
    if padded is not None:
        mask = ~padding_mask(batch * towers, length, padded).reshape(shape)
        ids = ids.masked_fill(~mask, 0)
    return {"input_ids": ids, "mask": mask, "label": torch.randint(0, 2, (batch,), generator=generator)}


def trainee(activation, attn_dropout: float, batch: dict, bf16: bool = False) -> Trainee:
    torch.manual_seed(0)  # every case starts from the same weights
    model = LRAClassifier(
        VOCAB,
        batch["input_ids"].shape[-1],
        2,
        two_tower=batch["input_ids"].dim() == 3,
        attention=activation,
        attn_dropout=attn_dropout,
    ).train()
    return Trainee(model, torch.optim.AdamW(model.parameters(), lr=1e-4, eps=1e-6, weight_decay=0.0), batch, bf16)


def throughput(batch_size: int, repeats: int, length: int = 4096) -> dict:
    results = {}
    for task, towers in (("text", 1), ("retrieval", 2)):
        batch = lra_batch(batch_size, towers, length, padded=(0.0, 0.5))
        trainees = {label: trainee(act, p, batch) for label, act, p in THROUGHPUT_CASES}
        print(
            f"throughput {task}: {len(trainees)} cases x {repeats} at {batch_size} x {towers} x {length}",
            file=sys.stderr,
            flush=True,
        )
        times = interleaved({label: t.step for label, t in trainees.items()}, repeats)
        cases = {}
        for label, t in trainees.items():
            seconds = statistics.median(times[label])
            cases[label] = {
                "step_s": seconds,
                "sequences_per_s": batch_size / seconds,
                "samples_s": times[label],
                "peak_bytes": step_peak_bytes(t.step, torch.device("cpu")),
            }
        base = cases["softmax"]
        for entry in cases.values():
            entry["ratio"] = {
                "sequences_per_s": entry["sequences_per_s"] / base["sequences_per_s"],
                "peak_bytes": entry["peak_bytes"] / base["peak_bytes"],
            }
        results[task] = {
            "batch": batch_size,
            "towers": towers,
            "length": length,
            "real_tokens": batch["mask"].sum(-1).tolist(),
            "cases": cases,
        }
    return results


def retrieval4k(batch_size: int, length: int = 4000) -> dict:
    results, lengths = {}, (length // 2, length)
    for label, act, p, bf16 in RETRIEVAL_CASES:
        entry = {}
        for length in lengths:
            print(f"retrieval4k {label}: {batch_size} x 2 x {length}", file=sys.stderr, flush=True)
            t = trainee(act, p, lra_batch(batch_size, 2, length, padded=None), bf16)
            start = time.perf_counter()
            t.step()  # also allocates the AdamW state, which the profiled step's peak excludes
            seconds = time.perf_counter() - start
            peak = step_peak_bytes(t.step, torch.device("cpu"))
            score_matrix = batch_size * 2 * 2 * length * length * 4  # one fp32 N x N per document and head (2 heads)
            entry[str(length)] = {"step_s": seconds, "peak_bytes": peak, "peak_over_nxn_fp32": peak / score_matrix}
            del t
        small, large = (entry[str(n)]["peak_bytes"] for n in lengths)
        entry["peak_growth"] = large / small
        results[label] = entry
    base = results["softmax+drop0"][str(lengths[-1])]["peak_bytes"]
    for entry in results.values():
        entry["peak_ratio_to_softmax"] = entry[str(lengths[-1])]["peak_bytes"] / base
    return results


def pathx(steps: int, batch_size: int, images: int, resolution: int = 128, device: str = "cpu") -> dict:
    """Training steps on a generated Path-X set (see the module docstring); ``resolution`` 32 for a quick check."""
    from ..attention import kernel_choice
    from ..data.lra import PathfinderDataModule, PathfinderSpec

    start = time.perf_counter()
    data = PathfinderDataModule(
        generate=PathfinderSpec(num_images=images), resolution=resolution, batch_size=batch_size
    )
    data.prepare_data()
    data.setup("fit")
    prepared_s = time.perf_counter() - start
    torch.manual_seed(0)
    model = LRAClassifier(256, resolution**2, 2, attention="poly3", attn_dropout=0.0).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, eps=1e-6, weight_decay=0.0)
    heads, head_dim = model.encoder.blocks[0].attn.num_heads, model.encoder.blocks[0].attn.head_dim
    q = torch.empty(batch_size, heads, resolution**2, head_dim, device=device)
    choice = kernel_choice(q, q, q, "poly3", temperature=head_dim**-0.5)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.startswith("cuda") else nullcontext()

    def step(batch: dict) -> tuple[float, float]:
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            logits = model(batch["input_ids"].to(device), batch["mask"].to(device))
        loss = nn.functional.cross_entropy(logits.float(), batch["label"].to(device))
        loss.backward()
        optimizer.step()
        return loss.item(), (logits.argmax(-1).cpu() == batch["label"]).float().mean().item()

    print(
        f"pathx: {steps} steps of {batch_size} x {resolution**2} tokens on {device}, kernel {choice.kernel}",
        file=sys.stderr,
        flush=True,
    )
    times, losses, accuracy, batches = [], [], [], iter(())
    for _ in range(steps):
        batch = next(batches, None)
        if batch is None:  # a new epoch, reshuffled
            batches = iter(data.train_dataloader())
            batch = next(batches)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        begin = time.perf_counter()
        loss, correct = step(batch)
        times.append(time.perf_counter() - begin)
        losses.append(loss)
        accuracy.append(correct)
    seconds = statistics.median(times[5:] or times)
    window = min(50, steps)
    return {
        "resolution": resolution,
        "tokens": resolution**2,
        "batch": batch_size,
        "steps": steps,
        "images": images,
        "device": device,
        "kernel": choice.kernel,
        "passed_over": choice.passed_over,
        "data_prepare_s": prepared_s,
        "step_s": seconds,
        "samples_per_s": batch_size / seconds,
        "tokens_per_s": batch_size * resolution**2 / seconds,
        "peak_bytes": step_peak_bytes(lambda: step(next(iter(data.train_dataloader()))), torch.device(device)),
        "loss_first": statistics.mean(losses[:window]),
        "loss_last": statistics.mean(losses[-window:]),
        "train_accuracy_first": statistics.mean(accuracy[:window]),
        "train_accuracy_last": statistics.mean(accuracy[-window:]),
        "samples_s": times,
        "losses": losses,
    }


def format_report(report: dict) -> str:
    lines = []
    for task, result in report.get("throughput", {}).items():
        lines += [
            f"\n{task}: batch {result['batch']} x {result['towers']} x {result['length']} tokens "
            "(50-100% real), training step",
            "| case | samples/s | x softmax | peak MiB | x softmax |",
            "|---|---|---|---|---|",
        ]
        for label, e in result["cases"].items():
            lines.append(
                f"| {label} | {e['sequences_per_s']:.3f} | {e['ratio']['sequences_per_s']:.2f} | "
                f"{e['peak_bytes'] / 2**20:.0f} | {e['ratio']['peak_bytes']:.2f} |"
            )
    if "retrieval4k" in report:
        small, large = (key for key in next(iter(report["retrieval4k"].values())) if key.isdigit())
        lines += [
            f"\nretrieval: training step, batch {report['retrieval_batch']} x 2 documents, peak memory",
            f"| case | {small} tok: s, MiB | {large} tok: s, MiB | growth | peak / one fp32 NxN | x softmax |",
            "|---|---|---|---|---|---|",
        ]
        for label, e in report["retrieval4k"].items():
            small, large = (e[key] for key in e if key.isdigit())
            lines.append(
                f"| {label} | {small['step_s']:.1f}, {small['peak_bytes'] / 2**20:.0f} | "
                f"{large['step_s']:.1f}, {large['peak_bytes'] / 2**20:.0f} | {e['peak_growth']:.2f}x | "
                f"{large['peak_over_nxn_fp32']:.3f} | {e['peak_ratio_to_softmax']:.2f} |"
            )
    if "pathx" in report:
        e = report["pathx"]
        lines += [
            f"\nPath-X: {e['steps']} training steps of {e['batch']} x {e['tokens']} tokens on {e['device']}, "
            f"kernel {e['kernel']!r}",
            "| s/step | samples/s | tokens/s | peak MiB | loss first / last 50 | train acc first / last 50 |",
            "|---|---|---|---|---|---|",
            f"| {e['step_s']:.2f} | {e['samples_per_s']:.2f} | {e['tokens_per_s']:.0f} | "
            f"{e['peak_bytes'] / 2**20:.0f} | {e['loss_first']:.3f} / {e['loss_last']:.3f} | "
            f"{e['train_accuracy_first']:.2f} / {e['train_accuracy_last']:.2f} |",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m polyattn_lightning.bench lra", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--parts", default="throughput,retrieval4k", help=f"comma list of {', '.join(PARTS)} (pathx: not by default)"
    )
    parser.add_argument("--batch", type=int, default=4, help="throughput batch (default 4: a CPU-sized batch)")
    parser.add_argument("--repeats", type=int, default=2, help="timed throughput steps per case (median reported)")
    parser.add_argument("--length", type=int, default=4096, help="throughput tokens per sequence (default 4096)")
    parser.add_argument("--retrieval-batch", type=int, default=32, help="batch of the Retrieval step (default 32)")
    parser.add_argument("--retrieval-length", type=int, default=4000, help="its tokens per document (default 4000)")
    parser.add_argument("--pathx-steps", type=int, default=300, help="Path-X training steps (default 300)")
    parser.add_argument("--pathx-batch", type=int, default=2, help="Path-X batch (default 2)")
    parser.add_argument("--pathx-images", type=int, default=2048, help="Path-X images generated (default 2048)")
    parser.add_argument("--pathx-resolution", type=int, default=128, help="128 (Path-X); 32 for a quick check")
    parser.add_argument("--device", default="cpu", help="device of the pathx part (cpu, cuda)")
    parser.add_argument("--json", default=None, help="write the full results here")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    parts = chosen_parts(parser, args.parts, PARTS)

    load_before = os.getloadavg()
    report = {"command": " ".join(["python -m polyattn_lightning.bench lra", *argv])}
    if "throughput" in parts:
        report["throughput"] = throughput(args.batch, args.repeats, args.length)
    if "retrieval4k" in parts:
        report["retrieval_batch"] = args.retrieval_batch
        report["retrieval4k"] = retrieval4k(args.retrieval_batch, args.retrieval_length)
    if "pathx" in parts:
        report["pathx"] = pathx(
            args.pathx_steps, args.pathx_batch, args.pathx_images, args.pathx_resolution, args.device
        )
    report["machine"] = machine(load_before, "cuda" if args.device.startswith("cuda") else "cpu")
    print(format_report(report))
    write_report(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
