"""The kernel interface: what ``attention()`` hands a backend, and what a backend declares about itself.

A backend is one module of this package holding one :class:`Backend` instance. It says, in words, which inputs
it cannot take (:meth:`Backend.not_supported_reasons`), which it could take but ``kernel="auto"`` should leave
to another (:meth:`Backend.declined_reasons`), optionally what a call would cost (:meth:`Backend.cost`), and
runs (:meth:`Backend.forward`). ``kernels.pick`` walks the backends in one priority list and asks them.

Costs (the end of this module): the quadratic kernels share one model, ``alpha * B * H * pairs * (d + dv)``;
the linear forms' is scaled so that the two are equal at the crossover length measured on the machine and
shipped in ``crossover.json`` (``python -m polyattn_lightning.bench crossover`` writes it). ``pick`` compares
costs only when its first choice states one, so a form without a cost model keeps its place in the list.
"""

from __future__ import annotations

import functools
import json
import math
import os
from pathlib import Path
from typing import ClassVar, NamedTuple

import torch
from torch import Tensor

from ..masks import Masks
from ..registry import Activation


class KernelInputs(NamedTuple):
    """``attention()``'s arguments, resolved once: what every backend receives.

    ``masks`` holds the boolean ``allowed`` mask (None: every pair), softmax's ``additive`` mask and the causal
    offset ``Nk - Nq`` (None: not causal); ``n`` is the number of keys each query row may attend (fp32,
    broadcastable to ``(B, H, Nq, 1)``; None for softmax).
    """

    q: Tensor
    k: Tensor  # (B, Hkv, Nk, d): Hkv divides q's H (grouped-query attention; backends without
    v: Tensor  # ``grouped_heads`` get k and v repeated to H heads by ``kernels.run``)
    act: Activation
    t: float
    masks: Masks
    bias: Tensor | None
    n: Tensor | None
    dropout_p: float

    @property
    def allowed(self) -> Tensor | None:
        return self.masks.allowed

    @property
    def causal(self) -> int | None:
        return self.masks.causal

    @property
    def tiled(self) -> tuple:
        """``(q, k, v, act, t, allowed, bias, n, dropout_p, causal)``: what the tiled kernels' functions take."""
        return self.q, self.k, self.v, self.act, self.t, self.allowed, self.bias, self.n, self.dropout_p, self.causal

    @property
    def key_padding_only(self) -> bool:
        """``allowed`` depends on the key alone (``(B?, 1, 1, Nk)``: key padding), or there is none."""
        allowed = self.masks.allowed
        return allowed is None or (allowed.shape[-2] == 1 and allowed.shape[-3] == 1)

    @property
    def empty(self) -> bool:
        """An empty batch, no queries or no keys: nothing to tile (the output is zeros)."""
        return 0 in (*self.q.shape[:3], self.k.shape[-2])

    def repeated_kv(self) -> "KernelInputs":
        """These inputs with k and v repeated to q's heads (each kv head serving its group of query heads)."""
        groups = self.q.shape[1] // self.k.shape[1]
        if groups == 1:
            return self
        return self._replace(k=self.k.repeat_interleave(groups, dim=1), v=self.v.repeat_interleave(groups, dim=1))


class Backend:
    """One attention kernel. Subclasses set ``name`` and ``supports`` (one line: what it takes and why)."""

    name: ClassVar[str]
    supports: ClassVar[str]
    #: Whether ``kernel="auto"`` may pick it (``materialized`` is a reference: only by name).
    in_auto: ClassVar[bool] = True
    #: Whether it takes k and v with fewer heads than q (grouped-query attention) as they are.
    grouped_heads: ClassVar[bool] = False

    def not_supported_reasons(self, inputs: KernelInputs) -> list[str]:
        """Why this backend cannot run ``inputs`` (empty: it can)."""
        raise NotImplementedError

    def declined_reasons(self, inputs: KernelInputs) -> list[str]:
        """Why ``auto`` passes this backend over although it could run ``inputs`` (a faster one applies)."""
        return []

    def cost(self, inputs: KernelInputs) -> float | None:
        """An estimate ``pick`` may compare with other backends' (same units: seconds); None: no cost model."""
        return None

    def forward(self, inputs: KernelInputs) -> Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<attention kernel {self.name!r}: {self.supports}>"


class KernelNotSupported(ValueError):
    """``attention(..., kernel=name)`` on inputs that backend cannot take; the message lists its reasons."""


def elementwise_reasons(inputs: KernelInputs) -> list[str]:
    """The reason every non-softmax backend shares: softmax runs on SDPA only."""
    return ["softmax runs on the 'sdpa' kernel only"] if inputs.act.is_softmax else []


def key_padding_reasons(inputs: KernelInputs, kernel: str) -> list[str]:
    """Reasons of a backend that takes key padding but no pairwise mask, score bias or dropout."""
    reasons = []
    if not inputs.key_padding_only:
        reasons.append(f"a pairwise attn_mask (the {kernel} kernel takes only a key_padding_mask)")
    if inputs.bias is not None:
        reasons.append(f"an attn_bias (score bias) does not factor through the {kernel} form")
    if inputs.dropout_p:
        reasons.append(f"attention dropout does not factor through the {kernel} form")
    return reasons


# --------------------------------------------------------------------------- costs

#: The measured crossover lengths per device, written by ``python -m polyattn_lightning.bench crossover``.
CROSSOVER_TABLE = Path(__file__).with_name("crossover.json")


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
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (inputs.q, inputs.k, inputs.v))
    return "train" if grad else "forward"


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
