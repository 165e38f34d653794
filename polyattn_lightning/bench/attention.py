"""Attention benchmark: every activation and kernel against SDPA softmax, same shapes, same run.

``python -m polyattn_lightning.bench attention [--shapes vit-s,lra,4k,16k] [--repeats 5]
[--device cpu|cuda] [--dtype float32|bfloat16|float16] [--key-padding 0-0.5] [--dropout 0.1] [--causal]
[--json out.json]``

``--key-padding LO-HI`` pads the last LO..HI of each sequence's keys (spread
evenly over the batch) and passes that ``key_padding_mask`` to every case, as
LRA batches are padded; ``--dropout P`` adds a twin of each case that supports
attention dropout, with ``dropout_p=P`` (softmax: SDPA's own dropout);
``--causal`` adds an ``is_causal=True`` twin of each kernel case (softmax: SDPA's
own ``is_causal``), checked against the non-causal case and causal SDPA of the
same run, and causal poly1 (linear time) against causal poly3.

Time: after one warm-up call per case, the cases run round-robin ``repeats``
times (an untimed forward+backward, a timed forward, a timed forward+backward)
and each reports its median. Running them interleaved rather than one after
the other keeps the ratios honest on a shared machine whose load drifts; the
untimed call leaves memory and caches in the case's own state. On CUDA each
timing spans from an idle device to the end of the case's kernels.

Memory: on CPU, one forward+backward per case under ``torch.profiler`` with
``profile_memory=True``; replaying its allocator events in time order gives the
peak of bytes allocated during the step on top of what was allocated before it
(the inputs are excluded; outputs, saved tensors, tiles and gradients count).
The allocator's own accounting, unlike process RSS, does not depend on what
the C allocator caches, so the small-tensor kernels are not lost in noise. On
CUDA, the caching allocator's peak counter, reset before the step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
from torch import Tensor

from ..attention import attention
from ..attention.kernels.base import cpp
from ..attention.kernels import KERNELS
from ..errors import ArgumentParser
from .timing import machine, step_peak_bytes, write_report

#: Named shapes (B, H, N, d).
SHAPES = {
    "vit-s": (32, 6, 197, 64),
    "lra": (4, 2, 1024, 32),
    "4k": (2, 2, 4096, 32),
    "16k": (1, 2, 16384, 32),
    "lra-4k": (4, 2, 4096, 32),  # LRA Text / one Retrieval tower, the recipe's 2 heads of 32
}
DEFAULT_SHAPES = ("vit-s", "lra", "4k", "16k")
BASELINE = "softmax/sdpa"


def naive_poly3(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Textbook ``x^3 / sqrt(N)`` attention: the whole ``S`` and autograd's saved copies of it."""
    s = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    return (s**3 * k.shape[-2] ** -0.5) @ v


@dataclass(frozen=True)
class Case:
    label: str
    fn: Callable[[Tensor, Tensor, Tensor], Tensor]
    max_n: int | None = None  # skipped above this length (N x N tensors would not fit)
    device: str | None = None  # the one device type the case runs on; None: any
    masks: bool = True  # fn takes a key_padding_mask (else the case is left out of padded runs)


def _kernel(
    activation: str, kernel: str, device: str | None = None, dropout_p: float = 0.0, causal: bool = False
) -> Case:
    label = f"{activation}/{kernel}" + (f"+dropout{dropout_p:g}" if dropout_p else "") + ("+causal" if causal else "")
    fn = partial(attention, activation=activation, kernel=kernel, dropout_p=dropout_p, is_causal=causal)
    return Case(label, fn, device=device)


CASES = [
    _kernel("softmax", "sdpa"),
    _kernel("poly3", "fused_cpu", "cpu"),
    _kernel("poly3", "triton", "cuda"),
    _kernel("poly3", "blocked"),
    Case("poly3/naive", naive_poly3, max_n=4096, masks=False),
    _kernel("poly1", "associative"),
    _kernel("poly1", "fused_cpu", "cpu"),
    _kernel("poly1", "triton", "cuda"),
    _kernel("poly1", "blocked"),
    *(
        _kernel(name, kernel, device)
        for name in ("relu", "softplus", "sigmoid")
        for kernel, device in (("fused_cpu", "cpu"), ("triton", "cuda"))
    ),
]
#: The kernels the targets are checked on, best first: what ``attention()`` picks on the
#: device, else the blocked fallback (e.g. a machine where the C++ kernels cannot be built).
TARGET_KERNELS = ("fused_cpu", "triton", "blocked")
#: Kernels that take attention dropout (``--dropout`` makes a twin of their cases).
DROPOUT_KERNELS = ("sdpa", "fused_cpu", "triton", "blocked")


def dropout_twins(cases: list[Case], dropout_p: float) -> list[Case]:
    """Each ``activation/kernel`` case whose kernel has dropout, again with ``dropout_p``."""
    twins = []
    for case in cases:
        activation, _, kernel = case.label.partition("/")
        if kernel in DROPOUT_KERNELS:
            twins.append(_kernel(activation, kernel, case.device, dropout_p))
    return twins


def causal_twins(cases: list[Case]) -> list[Case]:
    """Each ``activation/kernel`` case again with ``is_causal=True`` (every kernel has it; the naive one not)."""
    twins = []
    for case in cases:
        activation, _, kernel = case.label.partition("/")
        if kernel in KERNELS:
            twins.append(_kernel(activation, kernel, case.device, causal=True))
    return twins


def padding_mask(batch: int, n: int, fractions: tuple[float, float]) -> Tensor:
    """``key_padding_mask`` (True = padding): sequence ``b`` pads its last ``lo + (hi - lo) * b / (B - 1)`` of keys."""
    lo, hi = fractions
    padded = torch.linspace(lo, hi, batch) if batch > 1 else torch.tensor([lo])
    lengths = n - (padded * n).round().long()
    return torch.arange(n) >= lengths[:, None]


def _inputs(
    shape: tuple[int, int, int, int],
    device: str = "cpu",
    seed: int = 0,
    key_padding: tuple[float, float] | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, ...]:
    """``(q, k, v, grad, key_padding_mask or None)``."""
    generator = torch.Generator().manual_seed(seed)
    q, k, v, grad = (torch.randn(shape, generator=generator).to(device, dtype) for _ in range(4))
    mask = None if key_padding is None else padding_mask(shape[0], shape[2], key_padding).to(device)
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), grad, mask


def _step(case: Case, q: Tensor, k: Tensor, v: Tensor, grad: Tensor | None, mask: Tensor | None = None) -> None:
    """One forward, plus a backward when ``grad`` is given; gradients start unallocated, as after zero_grad."""
    q.grad = k.grad = v.grad = None
    out = case.fn(q, k, v) if mask is None else case.fn(q, k, v, key_padding_mask=mask)
    if grad is not None:
        out.backward(grad)


def _timed(fn: Callable[[], None], device: torch.device) -> float:
    """Wall time of ``fn``; on CUDA, from an idle device to the end of its kernels."""
    _synchronize(device)
    start = time.perf_counter()
    fn()
    _synchronize(device)
    return time.perf_counter() - start


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_cases(cases: list[Case], inputs, repeats: int) -> dict[str, dict[str, list[float]]]:
    """Seconds per call, ``{label: {"fwd": [...], "fwd_bwd": [...]}}``, cases interleaved round-robin."""
    q, k, v, grad, mask = inputs
    samples = {case.label: {"fwd": [], "fwd_bwd": []} for case in cases}
    for case in cases:  # warm-up: first-call allocations and library initialisation
        _step(case, q, k, v, grad, mask)
    for _ in range(repeats):
        for case in cases:
            _step(case, q, k, v, grad, mask)  # untimed: memory and caches hold this case's state, not the last case's
            samples[case.label]["fwd"].append(_timed(partial(_step, case, q, k, v, None, mask), q.device))
            samples[case.label]["fwd_bwd"].append(_timed(partial(_step, case, q, k, v, grad, mask), q.device))
    return samples


def peak_bytes(case: Case, inputs) -> int:
    """Peak bytes allocated during one forward+backward, above the allocation level before it."""
    return step_peak_bytes(partial(_step, case, *inputs), inputs[0].device)


def run_shape(
    name: str,
    shape,
    cases: list[Case],
    repeats: int,
    memory: bool,
    device: str = "cpu",
    key_padding: tuple[float, float] | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict:
    cases = [c for c in cases if (c.max_n is None or shape[2] <= c.max_n) and (c.masks or key_padding is None)]
    inputs = _inputs(shape, device, key_padding=key_padding, dtype=dtype)
    samples = time_cases(cases, inputs, repeats)
    result = {"shape": dict(zip("BHNd", shape)), "cases": {}}
    if key_padding is not None:
        result["key_lengths"] = (~inputs[-1]).sum(dim=-1).tolist()
    for case in cases:
        entry = {f"{kind}_s": statistics.median(times) for kind, times in samples[case.label].items()}
        entry["samples_s"] = samples[case.label]
        if memory:
            entry["peak_bytes"] = peak_bytes(case, inputs)
        result["cases"][case.label] = entry
    base = result["cases"][BASELINE]
    for entry in result["cases"].values():
        entry["ratio"] = {key: entry[key] / base[key] for key in ("fwd_s", "fwd_bwd_s", "peak_bytes") if key in entry}
    return result


def _check(target: str, value: float, limit: float, at_most: bool = True) -> dict:
    return {
        "target": f"{target} {'<=' if at_most else '>='} {limit}",
        "value": value,
        "met": value <= limit if at_most else value >= limit,
    }


def check_targets(results: dict[str, dict]) -> list[dict]:
    """The issue's targets, each with the measured value and whether it was met."""
    checks = []
    for name, result in results.items():
        cases, n = result["cases"], result["shape"]["N"]
        poly3 = _first_present(cases, "poly3")
        if poly3:
            ratio = cases[poly3]["ratio"]
            limit = 1.0 if n >= 1024 else 1.3
            checks.append(_check(f"{poly3} fwd+bwd time / SDPA at {name}", ratio["fwd_bwd_s"], limit))
            if n == 16384 and "peak_bytes" in ratio:
                checks.append(_check(f"{poly3} fwd+bwd peak memory / SDPA at {name}", ratio["peak_bytes"], 2.0))
        quadratic = _first_present(cases, "poly1")
        if n == 4096 and quadratic and "poly1/associative" in cases:
            speedup = cases[quadratic]["fwd_bwd_s"] / cases["poly1/associative"]["fwd_bwd_s"]
            checks.append(
                _check(f"poly1/associative speed-up over {quadratic} (fwd+bwd) at {name}", speedup, 50, at_most=False)
            )
        if n == 4096 and "key_lengths" in result and "poly1/associative" in cases:  # LRA: against softmax itself
            speedup = cases[BASELINE]["fwd_bwd_s"] / cases["poly1/associative"]["fwd_bwd_s"]
            checks.append(
                _check(f"poly1/associative speed-up over {BASELINE} (fwd+bwd) at {name}", speedup, 5, at_most=False)
            )
        checks += _causal_checks(name, result)
        for softmax in (label for label in cases if label.startswith(BASELINE + "+")):
            twin = _first_present(cases, "poly3", softmax[len(BASELINE) :])
            if twin:
                ratio = cases[twin]["fwd_bwd_s"] / cases[softmax]["fwd_bwd_s"]
                checks.append(_check(f"{twin} fwd+bwd time / {softmax} at {name}", ratio, 1.0))
    return checks + linear_memory_check(results)


#: The linear-time case whose peak memory must grow as O(N).
LINEAR_CAUSAL = "poly1/associative+causal"


def linear_memory_check(results: dict[str, dict]) -> list[dict]:
    """Peak bytes of causal poly1 per query row (``B*H*N``) at the longest shape / at the shortest: ~1 if O(N)."""
    rows = {}
    for name, result in results.items():
        entry, shape = result["cases"].get(LINEAR_CAUSAL, {}), result["shape"]
        if "peak_bytes" in entry:
            rows[name] = (shape["N"], entry["peak_bytes"] / (shape["B"] * shape["H"] * shape["N"]))
    if len(rows) < 2:
        return []
    short = min(rows, key=lambda name: rows[name][0])
    long = max(rows, key=lambda name: rows[name][0])
    (n0, per_row0), (n1, per_row1) = rows[short], rows[long]
    if n1 == n0:
        return []
    return [
        _check(
            f"{LINEAR_CAUSAL} peak bytes per query row, {long} / {short} (O(N): ~1; O(N^2): {n1 / n0:g})",
            per_row1 / per_row0,
            1.25,
        )
    ]


def _causal_checks(name: str, result: dict) -> list[dict]:
    """Causal poly3 against non-causal poly3 (<= 0.6) and causal poly1 against causal poly3 (>= 10x), at N >= 4096.

    (Causal poly3 against causal SDPA, <= 1.0, is the twin check in ``check_targets``.)
    """
    cases, n = result["cases"], result["shape"]["N"]
    poly3 = _first_present(cases, "poly3", "+causal")
    if n < 4096 or not poly3:
        return []
    checks = []
    dense = poly3[: -len("+causal")]
    if dense in cases:
        ratio = cases[poly3]["fwd_bwd_s"] / cases[dense]["fwd_bwd_s"]
        checks.append(_check(f"{poly3} fwd+bwd time / {dense} at {name}", ratio, 0.6))
    if LINEAR_CAUSAL in cases:
        speedup = cases[poly3]["fwd_bwd_s"] / cases[LINEAR_CAUSAL]["fwd_bwd_s"]
        checks.append(_check(f"{LINEAR_CAUSAL} speed-up over {poly3} (fwd+bwd) at {name}", speedup, 10, at_most=False))
    return checks


def _first_present(cases: dict, activation: str, suffix: str = "") -> str | None:
    """The label of ``activation`` (``suffix``: e.g. its dropout twin) on the first of ``TARGET_KERNELS`` that ran."""
    return next((f"{activation}/{k}{suffix}" for k in TARGET_KERNELS if f"{activation}/{k}{suffix}" in cases), None)


def format_table(results: dict[str, dict]) -> str:
    """Ratios to SDPA softmax: forward time, forward+backward time, peak memory; one column group per shape."""
    names = list(results)
    labels = list(dict.fromkeys(label for r in results.values() for label in r["cases"]))
    header = "| case | " + " | ".join(f"{n} fwd | {n} fwd+bwd | {n} mem" for n in names) + " |"
    lines = [header, "|" + "---|" * (1 + 3 * len(names))]
    for label in labels:
        cells = []
        for name in names:
            ratio = results[name]["cases"].get(label, {}).get("ratio", {})
            cells += [f"{ratio[key]:.2f}" if key in ratio else "-" for key in ("fwd_s", "fwd_bwd_s", "peak_bytes")]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    absolute = "; ".join(f"{name}: {_absolute(results[name]['cases'][BASELINE])}" for name in names)
    lines += ["", f"SDPA softmax absolute (fwd / fwd+bwd, peak): {absolute}"]
    return "\n".join(lines)


def _absolute(entry: dict) -> str:
    text = f"{entry['fwd_s'] * 1e3:.1f} / {entry['fwd_bwd_s'] * 1e3:.1f} ms"
    return text + (f", {entry['peak_bytes'] / 2**20:.1f} MiB" if "peak_bytes" in entry else "")


def _parse_fractions(text: str) -> tuple[float, float]:
    try:
        lo, hi = (float(x) for x in text.split("-"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"key padding {text!r}: expected LO-HI fractions, e.g. 0-0.5") from None
    if not 0.0 <= lo <= hi <= 1.0:
        raise argparse.ArgumentTypeError(f"key padding {text!r}: expected 0 <= LO <= HI <= 1")
    return lo, hi


def _parse_shapes(text: str) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for item in text.split(","):
        if item in SHAPES:
            shapes[item] = SHAPES[item]
        else:
            dims = tuple(int(x) for x in item.split("x"))
            if len(dims) != 4:
                raise argparse.ArgumentTypeError(f"shape {item!r}: expected one of {sorted(SHAPES)} or BxHxNxd")
            shapes[item] = dims
    return shapes


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m polyattn_lightning.bench attention", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--shapes",
        type=_parse_shapes,
        default=",".join(DEFAULT_SHAPES),
        help=f"comma list of {', '.join(SHAPES)} or BxHxNxd (default: {','.join(DEFAULT_SHAPES)})",
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per case (median reported)")
    parser.add_argument("--cases", default=None, help="comma list of case labels to run (SDPA always runs)")
    parser.add_argument("--no-memory", action="store_true", help="skip the profiler memory pass")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to run (default: cpu)")
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="dtype of q, k, v (default: float32)",
    )
    parser.add_argument(
        "--key-padding",
        type=_parse_fractions,
        default=None,
        metavar="LO-HI",
        help="pad the last LO..HI fraction of each sequence's keys (spread over the batch), e.g. 0-0.5",
    )
    parser.add_argument(
        "--dropout", type=float, default=0.0, help="also run each case that has dropout with this dropout_p"
    )
    parser.add_argument("--causal", action="store_true", help="also run each kernel case with is_causal=True")
    parser.add_argument("--json", default=None, help="write the full results here")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: PyTorch sees no CUDA device here")

    if not 0.0 <= args.dropout < 1.0:
        parser.error(f"--dropout {args.dropout}: expected 0 <= p < 1")
    all_cases = CASES + (dropout_twins(CASES, args.dropout) if args.dropout else [])
    all_cases += causal_twins(CASES) if args.causal else []
    cases = [c for c in all_cases if c.device in (None, args.device)]
    if args.device == "cpu" and not cpp.load():
        print("the C++ kernels are unavailable (see the warning); the fused_cpu cases are left out", file=sys.stderr)
        cases = [c for c in cases if not c.label.endswith("/fused_cpu")]
    if args.cases:
        wanted = set(args.cases.split(",")) | {BASELINE}
        unknown = wanted - {c.label for c in all_cases}
        if unknown:
            parser.error(f"unknown cases {sorted(unknown)}; known: {[c.label for c in all_cases]}")
        cases = [c for c in cases if c.label in wanted]

    results, load_before = {}, os.getloadavg()
    for name, shape in args.shapes.items():
        print(f"running {name} {shape} ...", file=sys.stderr, flush=True)
        results[name] = run_shape(
            name,
            shape,
            cases,
            args.repeats,
            memory=not args.no_memory,
            device=args.device,
            key_padding=args.key_padding,
            dtype=getattr(torch, args.dtype),
        )
    checks = check_targets(results)
    print(format_table(results))
    for check in checks:
        print(f"{'MET ' if check['met'] else 'MISS'} {check['target']}: {check['value']:.2f}")
    if args.json:
        command = " ".join(["python -m polyattn_lightning.bench attention", *argv])
        report = {
            "command": command,
            "machine": machine(load_before, args.device),
            "results": results,
            "targets": checks,
        }
        write_report(report, args.json)
    return 0
