"""Long context: the exact linear poly{p} kernel against the fused quadratic one, and what ``auto`` picks.

    python -m polyattn_lightning.bench long-context [--configs poly3/32,poly2/64] [--causal]
        [--lengths 1024,2048,...,65536] [--repeats 5] [--batch 1] [--heads 2] [--no-accuracy] [--json out.json]

At each length, forward+backward of ``B x H = --batch x --heads`` heads, interleaved (median of ``--repeats``):
the quadratic kernel (``fused_cpu`` on CPU), the linear one (``power``) and ``kernel="auto"`` (which picks one of
them from the crossover table, ``bench crossover --write``). Reported: each time, quadratic / linear, and auto
against the better of the two (the goal: within 10% at every length). At the longest lengths of the first
config (16k and 65k by default) also: the linear form's output against a float64 run of the quadratic kernel
(||a - b|| / ||b||, goal <= 1e-5), and its extra memory per (batch, head): the step's peak allocation above the
inputs, less the output and the three gradients (goal <= 64 MB at 65k). The goals (d = 32, poly3): linear
>= 2x faster at 16,384 (1.2x the floor), >= 5x at 65,536; poly2 at d = 64 faster from 4,096 (non-causal).
"""

from __future__ import annotations

import os
import statistics
import sys

import torch

from ..attention import attention
from ..errors import ArgumentParser
from .timing import interleaved, machine, step_peak_bytes, write_report

DEFAULT_LENGTHS = tuple(2**i for i in range(10, 17))  # 1,024 .. 65,536
QUADRATIC = {"cpu": "fused_cpu", "cuda": "triton"}
#: (config, length, at least x faster): the issue's speed goals for the linear form.
SPEED_GOALS = [("poly3/32", 16384, 2.0), ("poly3/32", 65536, 5.0), ("poly2/64", 4096, 1.0)]
ACCURACY_GOAL, MEMORY_GOAL = 1e-5, 64 * 2**20


def inputs(n, d, batch, heads, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    q, k, v = (torch.randn(batch, heads, n, d, generator=g, device=device).requires_grad_() for _ in range(3))
    return q, k, v, torch.randn(batch, heads, n, d, generator=g, device=device)


def step_of(kernel, activation, causal, q, k, v, grad):
    def step(_):
        attention(q, k, v, activation, is_causal=causal, kernel=kernel).backward(grad)
        q.grad = k.grad = v.grad = None
        if q.is_cuda:
            torch.cuda.synchronize(q.device)

    return step


def relative_error(activation, causal, q, k, v) -> float:
    """The linear form in fp32 against the quadratic kernel in float64 (a tiled, exact reference)."""
    with torch.no_grad():
        got = attention(q, k, v, activation, is_causal=causal, kernel="power").double()
        want = attention(*(x.double() for x in (q, k, v)), activation, is_causal=causal, kernel="fused_cpu")
    return float((got - want).norm() / want.norm())


def extra_memory(activation, causal, q, k, v, grad) -> float:
    """Peak bytes of one linear forward+backward above the inputs, less the output and gradients, per head."""
    step = step_of("power", activation, causal, q, k, v, grad)
    peak = step_peak_bytes(lambda: step(0), q.device)
    produced = q.numel() * q.element_size() * 4  # the output and dq, dk, dv
    return (peak - produced) / (q.shape[0] * q.shape[1])


def run_config(config, lengths, causal, repeats, batch, heads, device, checks) -> dict:
    name, _, d = config.partition("/")
    d = int(d)
    points = []
    quadratic = QUADRATIC[device.type]
    for n in lengths:
        q, k, v, grad = inputs(n, d, batch, heads, device)
        cases = {
            label: step_of(kernel, name, causal, q, k, v, grad)
            for label, kernel in (("quadratic", quadratic), ("linear", "power"), ("auto", "auto"))
        }
        times = {label: statistics.median(t) for label, t in interleaved(cases, repeats).items()}
        best = min(times["quadratic"], times["linear"])
        point = {
            "n": n,
            **{f"{label}_s": t for label, t in times.items()},
            "quadratic_over_linear": times["quadratic"] / times["linear"],
            "auto_over_best": times["auto"] / best,
        }
        if n in checks:
            point["relative_error"] = relative_error(name, causal, q, k, v)
            point["extra_bytes_per_head"] = extra_memory(name, causal, q, k, v, grad)
        points.append(point)
        extra = "".join(
            f", {key} {point[key]:.3g}" for key in ("relative_error", "extra_bytes_per_head") if key in point
        )
        print(
            f"  {config} {'causal' if causal else 'full'} N={n}: quadratic {times['quadratic']:.3f} s, linear "
            f"{times['linear']:.3f} s (x{point['quadratic_over_linear']:.2f}), auto x{point['auto_over_best']:.2f} "
            f"of the best{extra}",
            flush=True,
        )
    return {"config": config, "causal": causal, "points": points}


def goal_lines(results: list[dict]) -> list[str]:
    lines = []
    found = {(r["config"], p["n"]): p for r in results if not r["causal"] for p in r["points"]}
    for config, n, goal in SPEED_GOALS:
        if (config, n) in found:
            ratio = found[(config, n)]["quadratic_over_linear"]
            lines.append(
                f"{'MET ' if ratio >= goal else 'MISS'} {config} N={n}: linear x{ratio:.2f} faster (goal >= {goal}x)"
            )
    for result in results:
        worst = max(result["points"], key=lambda p: p["auto_over_best"])
        lines.append(
            f"{'MET ' if worst['auto_over_best'] <= 1.1 else 'MISS'} {result['config']} "
            f"{'causal' if result['causal'] else 'full'}: auto within {worst['auto_over_best']:.2f}x of "
            f"the better form at every N (worst at {worst['n']}; goal <= 1.10x)"
        )
        for point in result["points"]:
            if "relative_error" in point:
                lines.append(
                    f"{'MET ' if point['relative_error'] <= ACCURACY_GOAL else 'MISS'} {result['config']} "
                    f"N={point['n']}: error {point['relative_error']:.2e} of float64 (goal <= 1e-5)"
                )
                mb = point["extra_bytes_per_head"] / 2**20
                lines.append(
                    f"{'MET ' if point['extra_bytes_per_head'] <= MEMORY_GOAL else 'MISS'} "
                    f"{result['config']} N={point['n']}: extra memory {mb:.1f} MB per (batch, head) "
                    "(goal <= 64 MB)"
                )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m polyattn_lightning.bench long-context", description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default="poly3/32,poly2/64", help="activation/head dim, comma separated")
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=list(DEFAULT_LENGTHS))
    parser.add_argument("--causal", action="store_true", help="also the causal form")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument(
        "--checks",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[16384, 65536],
        help="lengths of the first config where accuracy and memory are measured",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default=None)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    load_before = os.getloadavg()
    configs = args.configs.split(",")
    results = []
    for causal in (False, True) if args.causal else (False,):
        for i, config in enumerate(configs):
            checks = args.checks if i == 0 and not causal else []
            results.append(
                run_config(config, args.lengths, causal, args.repeats, args.batch, args.heads, device, checks)
            )
    report = {
        "command": " ".join(["python -m polyattn_lightning.bench long-context", *argv]),
        "results": results,
        "machine": machine(load_before, device.type),
    }
    report["goals"] = goal_lines(results)
    print("| config | N | quadratic s | linear s | quadratic / linear | auto / best |\n|---|---|---|---|---|---|")
    for result in results:
        for p in result["points"]:
            print(
                f"| {result['config']}{' causal' if result['causal'] else ''} | {p['n']} | {p['quadratic_s']:.3f} | "
                f"{p['linear_s']:.3f} | {p['quadratic_over_linear']:.2f} | {p['auto_over_best']:.2f} |"
            )
    print("\n".join(report["goals"]))
    print(f"load average before {load_before}, after {report['machine']['load_average_after']}")
    write_report(report, args.json)
    return 0
