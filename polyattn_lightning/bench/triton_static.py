"""The Triton kernels compiled offline for A100 (sm_80) and H100/H200 (sm_90) on a fixed matrix; no GPU needed.

    python -m polyattn_lightning.bench triton-static --jobs 2 --json triton_static.json [--markdown]

For every case of ``matrix()`` the three kernels (forward, dK/dV, dQ) are
compiled as the launch table ships them (``bench/triton_compile.py``), and
the figures (shared memory, registers, spills, the MMA kind of each product)
are checked against ``GOALS``. The goals hold for Triton ``GOAL_TRITON``;
under another Triton the figures are reported without a verdict.

Exit status: 0 the goals hold (or another Triton: not judged), 1 a goal fails,
2 no Triton.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import platform
import sys
import time
from concurrent.futures import ProcessPoolExecutor

from ..attention.kernels.triton.launch import SHORT
from ..errors import ArgumentParser

#: The Triton the goals were set for (what the CUDA torch build installs).
GOAL_TRITON = "3.8.0"
GOALS = (
    "every product on tensor cores (bf16, fp16, and fp32 at 'high' and 'medium' precision)",
    "shared memory within the device's limit (A100 166,912 B; H100/H200 232,448 B)",
    "no spills without mask/bias/dropout at d <= 128; at most 1 KB per thread with them (not judged, reported: fp32 "
    "at 'highest', IEEE products on FMA; short windows with them, one or two tiles a head)",
)
ARCHS = (80, 90)
#: (form, head dim) of the linear form's rows: LRA's poly3 at 32, poly2 at 64 and 128, poly4 at 32.
LINEAR_FORMS = (("poly3", 32), ("poly2", 64), ("poly2", 128), ("poly4", 32))
SPILL_LIMIT_EXTRAS = 1024


def matrix() -> list[tuple[dict, int]]:
    """``(case fields, arch)`` pairs: poly3 at every dtype x head dim x {plain, mask+bias+dropout} x arch, then
    deltas once each: the other forms, N = 197 (unaligned), Swin's N = 49 (the short-window tile; also at each
    dtype's widest short tile and past it, on A100's smaller shared memory), fp32 at 'medium' precision (tf32; the
    main fp32 rows are 'high', tf32x3) and at 'highest' (IEEE), and causal with mask + bias + dropout (bf16, d 64
    and 128, both architectures)."""
    cases = [
        (dict(dtype=dtype, d=d, extras=extras), arch)
        for arch in ARCHS
        for dtype in ("bfloat16", "float16", "float32")
        for d in (32, 64, 128, 256)
        for extras in (False, True)
    ]
    cases += [(dict(form=form), 90) for form in ("poly1", "relu", "softplus", "sigmoid")]
    cases += [
        (dict(n=197, extras=True), 80),
        (dict(n=49, d=32, extras=True), 80),
        (dict(dtype="float32", precision="medium"), 90),
    ]
    cases += [  # short windows at each dtype's widest short tile, and past it (the tuned tile of the bucket)
        (dict(n=49, dtype=dtype, d=d, extras=True), arch)
        for dtype, d, arch in (
            ("bfloat16", 128, 80),
            ("bfloat16", 128, 90),
            ("bfloat16", 256, 80),
            ("float16", 64, 80),
            ("float16", 128, 80),
            ("float32", 32, 80),
            ("float32", 64, 80),
        )
    ]
    cases += [  # fp32 at PyTorch's default precision: IEEE products, what auto runs for fp32
        (dict(dtype="float32", d=d, precision="highest"), arch) for arch in ARCHS for d in (64, 128, 256)
    ]
    cases += [
        (dict(dtype=dtype, d=d, extras=True, causal=True), arch)
        for arch in ARCHS
        for d in (64, 128)
        for dtype in ("bfloat16",)
    ]
    cases += [  # the exact linear form's three programs (the causal form adds only the quadratic kernel)
        (dict(kernel="linear", form=form, dtype=dtype, d=d), arch)
        for arch in ARCHS
        for dtype in ("bfloat16", "float16", "float32")
        for form, d in LINEAR_FORMS
    ]
    return cases


def _compile(item: tuple[dict, int]) -> list[dict]:
    from .triton_compile import Case, compile_case

    fields, arch = item
    case = Case(**fields)
    start = time.perf_counter()
    rows = compile_case(case, arch)
    seconds = (time.perf_counter() - start) / len(rows)
    return [{**case._asdict(), "arch": arch, **row, "compile_s": round(seconds, 2)} for row in rows]


def verdicts(row: dict) -> list[str]:
    """The goals ``row`` misses (empty: all held)."""
    missed = []
    if any(kind == "fma" for kind in row["dots"]) and (row["dtype"] != "float32" or row["precision"] != "highest"):
        missed.append(f"products without tensor cores: {row['mma']}")
    if row["shared"] > row["shared_limit"]:
        missed.append(f"shared memory {row['shared']} B > {row['shared_limit']} B")
    ieee = row["dtype"] == "float32" and row["precision"] == "highest"
    short_extras = row["extras"] and row["n"] <= SHORT
    if row["d"] <= 128 and not ieee and not short_extras:
        limit = SPILL_LIMIT_EXTRAS if row["extras"] else 0
        if row["spill_stores"] > limit:
            missed.append(f"{row['spill_stores']} B spilled per thread (goal: <= {limit})")
    return missed


def run(jobs: int = 2, items: list[tuple[dict, int]] | None = None) -> dict:
    """Compile ``items`` (default: ``matrix()``) on ``jobs`` processes; the report with each row's verdict."""
    import torch
    import triton

    items = matrix() if items is None else items
    start = time.perf_counter()
    load_before = os.getloadavg()
    context = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    with ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        rows = [row for chunk in pool.map(_compile, items) for row in chunk]
    judged = triton.__version__ == GOAL_TRITON
    for row in rows:
        row["missed"] = verdicts(row) if judged else None
    return {
        "command": "python -m polyattn_lightning.bench triton-static",
        "triton": triton.__version__,
        "torch": torch.__version__,
        "judged": judged,
        "goals": GOALS,
        "machine": f"{platform.node()} ({os.cpu_count()} CPUs)",
        "jobs": jobs,
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "seconds": round(time.perf_counter() - start, 1),
        "compiles": len(rows),
        "rows": rows,
    }


def _case_label(row: dict) -> str:
    label = f"{row['form']} {row['dtype']} d{row['d']} N{row['n']}" + (" +mask+bias+dropout" if row["extras"] else "")
    label += " linear" if row.get("kernel") == "linear" else ""
    label += " +causal" if row.get("causal") else ""
    return label + (f" ({row['precision']})" if row["dtype"] == "float32" else "")


def markdown(report: dict) -> str:
    """A table: one line per case and arch; per kernel ``tile/warps/stages, shared KB, registers, spill B, MMA``."""
    lines = ["| case | sm | forward (linear: state) | dK/dV (apply) | dQ (grad) |", "| --- | --- | --- | --- | --- |"]
    groups: dict[tuple, list[dict]] = {}
    for row in report["rows"]:
        groups.setdefault((_case_label(row), row["arch"]), []).append(row)
    for (label, arch), rows in groups.items():
        cells = []
        for row in rows:
            c = row["config"]
            kinds = sorted(set(row["dots"]))
            cells.append(
                f"{c['block_m']}x{c['block_n']}/{c['num_warps']}w/{c['num_stages']}s, "
                f"{row['shared'] / 1024:.0f} KB, {row['registers']} regs, {row['spill_stores']} B spill, "
                f"{'+'.join(kinds)}" + (" **MISSED**" if row["missed"] else "")
            )
        lines.append(f"| {label} | {arch} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m polyattn_lightning.bench triton-static", description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=2, help="compiling processes (default: 2)")
    parser.add_argument("--json", default=None, help="write the report here")
    parser.add_argument("--markdown", action="store_true", help="print the table of docs/benchmarks/kernels-cuda.md")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        import triton  # noqa: F401
    except ImportError:
        print("triton is not installed (CPU-only torch build): nothing to compile", file=sys.stderr)
        return 2
    report = run(args.jobs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    missed = [row for row in report["rows"] if row["missed"]]
    if args.markdown:
        print(markdown(report))
    print(
        f"{report['compiles']} compiles in {report['seconds']} s on {args.jobs} processes (load average "
        f"{report['load_average_before']} -> {report['load_average_after']}); triton {report['triton']}: "
        + (f"{len(missed)} kernels miss a goal" if report["judged"] else "goals not judged for this version")
    )
    for row in missed:
        print(f"  {_case_label(row)} sm_{row['arch']} {row['kernel']}: {'; '.join(row['missed'])}")
    return 1 if missed else 0
