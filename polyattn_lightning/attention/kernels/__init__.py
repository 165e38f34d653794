"""The attention kernels, one module per backend, and the one ``pick()`` that chooses among them.

Modelled on xformers' ``ops/fmha``: each backend module holds one :class:`~.base.Backend` (``BACKEND``) that
says what it supports (``supports``), why it cannot take given inputs (``not_supported_reasons``), why
``auto`` should leave inputs it could take to another (``declined_reasons``), optionally a cost, and runs them.

================ ======================================================================================
``sdpa``         softmax, on PyTorch's fused SDPA (``sdpa.py``)
``associative``  poly1 as ``q (k^T v)``: exact, linear in N, causal by chunked prefix sums (``associative.py``)
``power``        poly2-poly4 as ``phi(q) (phi(k)^T v)``: exact, linear in N, C++ and Triton (``power.py``)
``triton``       the fused CUDA kernel (``triton/``: launch tables, jit code, operators, self-check)
``fused_cpu``    the fused C++ CPU kernel (``fused_cpu.py``, sources in ``csrc/``, built by ``cpp.py``)
``blocked``      tiles in plain PyTorch, any elementwise activation, CPU and GPU (``blocked.py``)
``materialized`` the whole ``N x N`` at once: a reference, never picked by ``auto`` (``materialized.py``)
================ ======================================================================================

``kernel="auto"`` walks :data:`PRIORITY` and takes the first backend with no reason against the inputs;
when that one states a cost (:meth:`~.base.Backend.cost`), the cheapest of the able backends with a cost wins
instead (the quadratic kernels and ``power`` compare so, at the crossover measured on the machine:
``base.crossover_length``). :func:`pick` says which backend that is and why each other one was passed over
(``polyattn_lightning.attention.kernel_choice`` asks it for ``attention()``'s own arguments); a named kernel
that cannot take the inputs raises one :class:`~.base.KernelNotSupported` listing its reasons.

Grouped-query attention (k, v with fewer heads than q): a backend with ``grouped_heads`` takes them as they
are, every other one gets them repeated to q's heads.

Every backend computes non-softmax scores and ``phi(S)`` in fp32 with autocast off (``attention.dtypes``),
returns ``v``'s dtype, and has a hand-written backward that is differentiable once (a second derivative
raises rather than being wrong).

To add a backend: a module here with a :class:`~.base.Backend` subclass (``name``, ``supports``,
``not_supported_reasons`` naming each input it refuses, ``forward``) and ``BACKEND = YourBackend()``; add it
to :data:`BACKENDS` where ``auto`` should try it (that order is :data:`PRIORITY`), and add its refusals to
``tests/attention/kernels/test_kernel_interface.py``.

To add a fused activation form (one the fused kernels compute in place, like ``relu``): a member of
:class:`~polyattn_lightning.attention.forms.FusedForm`, its ``f`` and ``f'`` in ``csrc/fused_cpu.cpp``
(``enum Form``), in ``triton/jit.py`` (``_phi``, ``_dphi``, by its ``tl.constexpr``) and, if it has an
in-place form, in ``blocked.py``'s ``phi_``; the activation's factory sets ``kernel=("<name>",)``
(``attention/registry.py``). ``tests/attention/test_forms.py`` checks the C++ enum against the table.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor

from . import associative, blocked, fused_cpu, materialized, power, sdpa, triton
from .base import Backend, KernelInputs, KernelNotSupported

#: Every backend, by name, in the order ``auto`` tries them.
BACKENDS: dict[str, Backend] = {
    backend.name: backend
    for backend in (
        sdpa.BACKEND,
        associative.BACKEND,
        power.BACKEND,
        triton.BACKEND,
        fused_cpu.BACKEND,
        blocked.BACKEND,
        materialized.BACKEND,
    )
}
#: The backends ``kernel="auto"`` considers, in the order it tries them (a backend run only when named is left out).
PRIORITY: tuple[str, ...] = tuple(name for name, backend in BACKENDS.items() if backend.in_auto)
#: What ``attention(kernel=...)`` accepts.
KERNELS: tuple[str, ...] = ("auto", *BACKENDS)


class KernelChoice(NamedTuple):
    """What ``auto`` picks for some inputs, and why it passed over each other backend (name -> reasons)."""

    kernel: str
    passed_over: dict[str, list[str]]

    def __str__(self) -> str:
        lines = [f"auto picks {self.kernel!r}"]
        lines += [f"  {name}: {'; '.join(reasons)}" for name, reasons in self.passed_over.items()]
        return "\n".join(lines)


def pick(inputs: KernelInputs) -> KernelChoice:
    """The backend ``kernel="auto"`` runs for ``inputs``, with the reasons of every backend it did not take."""
    passed_over: dict[str, list[str]] = {}
    able: list[str] = []
    for name in PRIORITY:
        backend = BACKENDS[name]
        reasons = backend.not_supported_reasons(inputs)
        if not reasons:
            reasons = backend.declined_reasons(inputs)
        if reasons:
            passed_over[name] = reasons
        else:
            able.append(name)
    costs = {}
    first = BACKENDS[able[0]].cost(inputs)
    if first is not None:  # the first choice has a cost model: compare the able ones
        costs[able[0]] = first
        for name in able[1:]:
            cost = BACKENDS[name].cost(inputs)
            if cost is not None:
                costs[name] = cost
    chosen = min(costs, key=costs.get) if len(costs) > 1 else able[0]
    for name in able:
        if name != chosen:
            detail = (
                f" (cost {costs[name]:.3g} s against {costs[chosen]:.3g} s)" if len(costs) > 1 and name in costs else ""
            )
            passed_over[name] = [f"{chosen!r} is preferred{detail}"]
    passed_over = {name: passed_over[name] for name in BACKENDS if name in passed_over}
    passed_over.setdefault("materialized", ["a reference: only by name (O(N^2) memory)"])
    return KernelChoice(chosen, passed_over)


def run(kernel: str, inputs: KernelInputs) -> Tensor:
    """Run ``kernel`` (``auto`` or a name of :data:`BACKENDS`) on ``inputs``; ``auto`` picks one."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown attention kernel {kernel!r}; expected one of {KERNELS}")
    backend = BACKENDS[pick(inputs).kernel if kernel == "auto" else kernel]
    reasons = [] if kernel == "auto" else backend.not_supported_reasons(inputs)
    if reasons:
        able = [name for name, other in BACKENDS.items() if not other.not_supported_reasons(inputs)]
        raise KernelNotSupported(
            f"attention kernel {kernel!r} cannot take these inputs: {'; '.join(reasons)} "
            f"(kernels that can: {', '.join(able)})"
        )
    if inputs.empty and not inputs.act.is_softmax:  # nothing to tile: an empty batch, no queries or no keys
        backend = BACKENDS["materialized"]
    return backend.forward(inputs if backend.grouped_heads else inputs.repeated_kv())


__all__ = [
    "BACKENDS",
    "KERNELS",
    "PRIORITY",
    "Backend",
    "KernelChoice",
    "KernelInputs",
    "KernelNotSupported",
    "pick",
    "run",
]
