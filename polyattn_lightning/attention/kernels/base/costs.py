"""The cost model ``pick`` compares backends with: the quadratic kernels' and the linear forms', in seconds.

The quadratic kernels share one model, ``alpha * B * H * pairs * (d + dv)``; the linear forms' is scaled so that the
two are equal at the crossover length measured on the machine and shipped in ``crossover.json`` (``python -m
polyattn_lightning.bench crossover`` writes it; its ``decode`` rows are where a step from a recurrent state beats a
KV-cache step). ``pick`` compares costs only when its first choice states one, so a form without a cost model keeps
its place in the list.
"""

from __future__ import annotations

import functools
import json
import math
import os
from pathlib import Path

import torch

from ...registry import Activation
from .contract import KernelInputs, gradient_flows
from .state import RECURRENT_POWERS, power_of

#: The measured crossover lengths per device, written by ``python -m polyattn_lightning.bench crossover``.
CROSSOVER_TABLE = Path(__file__).parents[1] / "crossover.json"


@functools.cache
def crossover_table(path: str | None = None) -> dict:
    """The table ``{"devices": {key: entry}}``: the shipped one, ``$POLYATTN_CROSSOVER``'s or ``path``'s.

    An entry holds ``quadratic_seconds`` (seconds per unit of the quadratic model, fused forward+backward) and
    ``crossover`` rows ``{p, d, causal, mode, n}``: from ``n`` tokens (``Nq = Nk``) on, the linear form is faster
    (``n`` null: not within the lengths measured). ``measured: false`` marks a placeholder (FLOP estimates).
    """
    source = Path(path or os.environ.get("POLYATTN_CROSSOVER") or CROSSOVER_TABLE)
    try:
        return json.loads(source.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(
            f"the crossover table {source} is missing; run python -m polyattn_lightning.bench crossover"
        ) from None


@functools.cache
def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), as the benchmarks record it."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        import platform

        return platform.processor() or "unknown"


def device_key(device: torch.device) -> str:
    """The table's key for ``device``: ``cpu/<model>`` or ``cuda/<device name>`` (the thread count a CPU entry was
    measured with is in its ``measured_by``)."""
    if device.type == "cuda":
        return f"cuda/{torch.cuda.get_device_name(device)}"
    return f"{device.type}/{cpu_model()}"


def device_entry(device: torch.device) -> tuple[str, dict] | None:
    """``(key, entry)`` for ``device``: its own entry, else the first of its kind (cpu, cuda); None: no entry."""
    return _entry(device_key(device))


def reload_crossover_table() -> None:
    """Read the table again on next use (after ``$POLYATTN_CROSSOVER`` changed or the file was rewritten)."""
    for cached in (crossover_table, _entry, _quadratic_seconds, _measured_crossover):
        cached.cache_clear()


@functools.cache
def _entry(key: str) -> tuple[str, dict] | None:
    devices = crossover_table()["devices"]
    if key in devices:
        return key, devices[key]
    kind = key.split("/", 1)[0] + "/"
    return next(((other, entry) for other, entry in devices.items() if other.startswith(kind)), None)


def causal_pairs(nq: float, nk: float, causal: int | None) -> float:
    """The (query, key) pairs a quadratic kernel computes: ``Nq Nk``, or those of the bottom-right triangle
    (query i sees ``min(Nk, max(0, i + 1 + causal))`` keys)."""
    if causal is None:
        return float(nq) * nk
    a = 1 + causal
    lo = min(nq, max(0, 1 - a))  # rows [0, lo) see no key
    hi = min(nq, max(lo, nk - a))  # rows [lo, hi) see i + a keys, the rest all Nk
    return (hi - lo) * (lo + hi - 1 + 2 * a) / 2 + (nq - hi) * nk


@torch.compiler.assume_constant_result  # read at trace time: a constant of the graph
def quadratic_seconds(device: str) -> float:
    """The table's ``quadratic_seconds`` for ``device`` (``str(tensor.device)``); 1e-12 without an entry."""
    return _quadratic_seconds(device)


@functools.cache  # read on every auto pick: once per device (a few us a call otherwise)
def _quadratic_seconds(device: str) -> float:
    found = device_entry(torch.device(device))
    return 1e-12 if found is None else float(found[1]["quadratic_seconds"])


def quadratic_cost(inputs: KernelInputs) -> float:
    """The quadratic kernels' cost model in seconds: ``alpha * B * H * pairs * (d + dv)``, ``alpha`` measured for
    the fused kernel's forward+backward (the table's ``quadratic_seconds``)."""
    q, v = inputs.q, inputs.v
    pairs = causal_pairs(q.shape[-2], inputs.k.shape[-2], inputs.causal)
    return quadratic_seconds(str(q.device)) * q.shape[0] * q.shape[1] * pairs * (q.shape[-1] + v.shape[-1])


def cost_mode(inputs: KernelInputs) -> str:
    """``train`` when a gradient will flow back through the call, else ``forward``."""
    return "train" if gradient_flows(inputs.q, inputs.k, inputs.v) else "forward"


def flop_crossover(d: int, p: int, causal: bool) -> float:
    """Where the forward+backward FLOPs meet (quadratic ``14 N^2 d``, linear ``12 N D d``, ``D = C(d+p-1, p)``;
    causal halves the quadratic side): ``6/7 D``, twice that causal."""
    return 12 * math.comb(d + p - 1, p) / 14 * (2 if causal else 1)


def crossover_length(inputs: KernelInputs, d: int, p: int) -> float:
    """The length (``Nq = Nk``) from which the linear ``poly{p}`` form beats the quadratic kernel on this device,
    for these inputs' causality and mode (:func:`cost_mode`); ``inf``: never within the measured lengths."""
    return measured_crossover(str(inputs.q.device), d, p, inputs.causal is not None, cost_mode(inputs))


@torch.compiler.assume_constant_result  # read at trace time: a constant of the graph
def measured_crossover(device: str, d: int, p: int, causal: bool, mode: str) -> float:
    """:func:`crossover_length` from the table: at a measured head dim its length; at another one the FLOP
    crossover scaled by the ratio measured at the nearest head dim (the kernels' efficiency relative to their
    FLOPs); ``inf`` where the table has no row for this power, causality and mode."""
    return _measured_crossover(device, d, p, causal, mode)


# Cached apart from the functions above: torch.compile calls those at trace time, and does not take a cached one.
@functools.cache  # read on every auto pick (some 8 us a call otherwise)
def _measured_crossover(device: str, d: int, p: int, causal: bool, mode: str) -> float:
    found = device_entry(torch.device(device))
    if found is None:
        return math.inf
    rows = [r for r in found[1]["crossover"] if r["causal"] == causal and r["mode"] == mode and r["p"] == p]
    if not rows:
        return math.inf
    exact = [r for r in rows if r["d"] == d]
    nearest = exact[0] if exact else min(rows, key=lambda r: abs(math.log(r["d"] / d)))
    if nearest["n"] is None:
        return math.inf
    if exact:
        return float(nearest["n"])
    return nearest["n"] / flop_crossover(nearest["d"], p, causal) * flop_crossover(d, p, causal)


def linear_cost(inputs: KernelInputs, state: int, crossover: float) -> float:
    """A linear form's cost in the quadratic model's seconds: ``beta * B * (H Nq + Hkv Nk) * state`` (``state``
    = ``D * dv``), ``beta`` making it equal to :func:`quadratic_cost` at ``Nq = Nk = crossover``."""
    if math.isinf(crossover):
        return math.inf
    q, k, v = inputs.q, inputs.k, inputs.v
    causal = None if inputs.causal is None else 0
    at_crossover = (
        quadratic_seconds(str(q.device)) * causal_pairs(crossover, crossover, causal) * (q.shape[-1] + v.shape[-1])
    )
    beta = at_crossover / (2 * crossover * state)
    return beta * q.shape[0] * (q.shape[1] * q.shape[-2] + k.shape[1] * k.shape[-2]) * state


def decode_crossover(device: torch.device, d: int, act: Activation) -> float:
    """Context length from which a step from a state beats a KV-cache step for this head dim and activation (the
    crossover table's ``decode`` rows for ``device``); ``inf`` for an activation without a recurrent form or a
    device without a row."""
    p = power_of(act)
    if p not in RECURRENT_POWERS or act.shift is not None:
        return math.inf
    return measured_crossover(str(device), d, p, True, "decode")
