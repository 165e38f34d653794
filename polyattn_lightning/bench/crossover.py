"""The crossover table: from which length the exact linear ``poly{p}`` form beats the fused quadratic kernel.

    python -m polyattn_lightning.bench crossover [--powers 2,3] [--dims 32,64] [--causal both]
        [--modes train,forward] [--lengths 512,1024,...,65536] [--repeats 5] [--write] [--json out.json]

For each power, head dim, causality and mode (``train``: forward+backward; ``forward``) the quadratic kernel
(``fused_cpu`` on CPU, ``triton`` on CUDA) and the linear one (``power``) run interleaved at each length
(``timing.interleaved``, median of ``--repeats``), shortest first, ``B x H = --batch x --heads``. The
crossover is where their time ratio crosses 1, interpolated in log-log between the two lengths around it;
from there on the linear form stays faster at every measured length (a later return above 1 moves it). The
sweep of one row stops once the linear form has been 1.5x faster at two lengths in a row. ``null``: not
within the lengths. ``quadratic_seconds``, the seconds per unit of the quadratic cost model (``kernels/base/costs.py``:
``B H pairs (d + dv)``), is the median over the non-causal ``train`` points of length >= 2,048.

``--placeholder KEY`` writes an unmeasured entry for a device from the FLOP model instead (the GPUs until
measured). ``--write`` merges this device's entry into ``polyattn_lightning/attention/kernels/crossover.json`` (or
``--write PATH``), the table ``kernel="auto"`` reads (its ``decode`` rows come from ``bench decode --write``).
Measure on a quiet machine (``uptime`` load < 1): the table is what ``auto`` trusts.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
from pathlib import Path

import torch

from ..attention import attention
from ..attention.kernels import base
from ..errors import ArgumentParser
from .timing import crossing, interleaved, machine, write_report, write_table_rows

DEFAULT_LENGTHS = tuple(2**i for i in range(9, 17))  # 512 .. 65,536
QUADRATIC = {"cpu": "fused_cpu", "cuda": "triton"}


def steps(kernel: str, p: int, n: int, d: int, causal: bool, mode: str, batch: int, heads: int, device, dtype):
    """The timed call of one kernel at one length: a forward, or a forward+backward."""
    g = torch.Generator(device=device).manual_seed(n)
    q, k, v = (torch.randn(batch, heads, n, d, generator=g, device=device, dtype=dtype) for _ in range(3))
    train = mode == "train"
    if train:
        for x in (q, k, v):
            x.requires_grad_()
        grad = torch.randn(batch, heads, n, d, generator=g, device=device, dtype=dtype)

    def step(_):
        with torch.set_grad_enabled(train):
            out = attention(q, k, v, f"poly{p}", is_causal=causal, kernel=kernel)
            if train:
                out.backward(grad)
                q.grad = k.grad = v.grad = None
        if q.is_cuda:
            torch.cuda.synchronize(q.device)

    return step


def sweep(p, d, causal, mode, lengths, repeats, batch, heads, device, dtype) -> dict:
    quadratic = QUADRATIC[device.type]
    points, ratios, measured = [], [], []
    fast = 0
    for n in lengths:
        cases = {
            name: steps(kernel, p, n, d, causal, mode, batch, heads, device, dtype)
            for name, kernel in (("quadratic", quadratic), ("linear", "power"))
        }
        times = {name: statistics.median(t) for name, t in interleaved(cases, repeats).items()}
        ratio = times["linear"] / times["quadratic"]
        points.append({"n": n, "quadratic_s": times["quadratic"], "linear_s": times["linear"], "ratio": ratio})
        print(
            f"  poly{p} d={d} {'causal' if causal else 'full'} {mode} N={n}: quadratic {times['quadratic']:.4f} s, "
            f"linear {times['linear']:.4f} s, x{1 / ratio:.2f}",
            flush=True,
        )
        ratios.append(ratio)
        measured.append(n)
        fast = fast + 1 if ratio < 1 / 1.5 else 0
        if fast >= 2:
            break
    n_star = crossing(measured, ratios)
    return {
        "p": p,
        "d": d,
        "causal": causal,
        "mode": mode,
        "n": None if n_star is None else round(n_star),
        "points": points,
    }


def quadratic_seconds(rows: list[dict], batch: int, heads: int) -> float:
    units = [
        point["quadratic_s"] / (batch * heads * point["n"] ** 2 * 2 * row["d"])
        for row in rows
        if row["mode"] == "train" and not row["causal"]
        for point in row["points"]
        if point["n"] >= 2048
    ]
    if not units:  # a short run: every non-causal train point
        units = [
            point["quadratic_s"] / (batch * heads * point["n"] ** 2 * 2 * row["d"])
            for row in rows
            if not row["causal"]
            for point in row["points"]
        ]
    return statistics.median(units)


#: Placeholder entries (``--placeholder``): the FLOP crossover times this factor (power attention's H100 figures put
#: the real one several times past the FLOP count's for p = 2, d = 64, causal: thin products are memory-bound), and
#: the decode crossover at twice the length where a state (D dv) holds as many numbers as a KV cache (N (d + dv)).
PLACEHOLDER_FACTOR, PLACEHOLDER_DECODE_FACTOR = 4.0, 2.0


def placeholder_rows(powers, dims) -> list[dict]:
    """Unmeasured rows from the FLOP model, for a device no one has measured yet."""
    rows = []
    for p in powers:
        for d in dims:
            for causal in (False, True):
                n = PLACEHOLDER_FACTOR * base.flop_crossover(d, p, causal)
                rows += [dict(p=p, d=d, causal=causal, mode=mode, n=round(n)) for mode in ("train", "forward")]
    for p in (1, *powers):
        for d in dims:
            n = PLACEHOLDER_DECODE_FACTOR * math.comb(d + p - 1, p) * d / (d + d)  # D dv / (d + dv), dv = d
            rows.append(dict(p=p, d=d, causal=True, mode="decode", n=round(n)))
    return rows


def markdown(rows: list[dict]) -> str:
    lines = [
        "| power | d | causal | mode | crossover N | linear / quadratic time at each N |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        cells = ", ".join(f"{p['n']}: {p['ratio']:.2f}" for p in row["points"])
        lines.append(f"| {row['p']} | {row['d']} | {row['causal']} | {row['mode']} | {row['n']} | {cells} |")
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m polyattn_lightning.bench crossover", description=__doc__.split("\n")[0])
    parser.add_argument("--powers", type=_ints, default=[2, 3])
    parser.add_argument("--dims", type=_ints, default=[32, 64])
    parser.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    parser.add_argument("--modes", default="train,forward")
    parser.add_argument("--lengths", type=_ints, default=list(DEFAULT_LENGTHS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--write",
        nargs="?",
        const=str(base.CROSSOVER_TABLE),
        default=None,
        help="merge this device's rows into the table (default: the shipped one)",
    )
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--placeholder",
        default=None,
        metavar="KEY",
        help="instead of measuring, write FLOP-model rows for device KEY (e.g. 'cuda/NVIDIA H100 80GB "
        "HBM3'), marked unmeasured, into --write's table",
    )
    parser.add_argument(
        "--placeholder-seconds",
        type=float,
        default=5e-14,
        help="the placeholder's quadratic_seconds (fused forward+backward per pair and channel)",
    )
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.placeholder:
        path = Path(args.write or base.CROSSOVER_TABLE)
        table = json.loads(path.read_text()) if path.exists() else {"devices": {}}
        table["devices"][args.placeholder] = {
            "measured": False,
            "note": f"placeholder: {PLACEHOLDER_FACTOR}x the FLOP crossover, decode at {PLACEHOLDER_DECODE_FACTOR}x "
            "the equal-size length; measure with python -m polyattn_lightning.bench crossover --device cuda --write",
            "quadratic_seconds": args.placeholder_seconds,
            "crossover": placeholder_rows(args.powers, args.dims),
        }
        path.write_text(json.dumps(table, indent=1) + "\n")
        return 0
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    load_before = os.getloadavg()
    causal = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    rows = [
        sweep(p, d, c, mode, args.lengths, args.repeats, args.batch, args.heads, device, dtype)
        for p in args.powers
        for d in args.dims
        for c in causal
        for mode in args.modes.split(",")
    ]
    report = {
        "command": " ".join(["python -m polyattn_lightning.bench crossover", *argv]),
        "device_key": base.device_key(device),
        "quadratic_seconds": quadratic_seconds(rows, args.batch, args.heads),
        "rows": rows,
        "machine": machine(load_before, device.type),
    }
    print(markdown(rows))
    print(
        f"quadratic_seconds {report['quadratic_seconds']:.3e}; load average before {load_before}, "
        f"after {report['machine']['load_average_after']}"
    )
    if args.write:
        table_rows = [{key: row[key] for key in ("p", "d", "causal", "mode", "n")} for row in rows]
        write_table_rows(
            args.write,
            report["device_key"],
            table_rows,
            quadratic_seconds=report["quadratic_seconds"],
            command=report["command"],
            load=[load_before, report["machine"]["load_average_after"]],
            threads=torch.get_num_threads(),
        )
    write_report(report, args.json)
    return 0
