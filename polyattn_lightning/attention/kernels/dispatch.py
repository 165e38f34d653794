"""The backends, in the order ``auto`` tries them, and the one :func:`pick` that chooses among them for every kind of
call: a parallel call, a KV-cache step, a step from a recurrent state (``base/contract.py``).

Modelled on xformers' ``ops/fmha``: each backend module holds one :class:`~.base.Backend` (``BACKEND``) that says
what it supports (``supports``), why it cannot take given inputs (``not_supported_reasons``), why ``auto`` should
leave inputs it could take to another (``declined_reasons``), optionally a cost, and runs them in its forms.

================ ======================================================================================
``sdpa``         softmax, on PyTorch's fused SDPA (``sdpa.py``)
``associative``  poly1 as ``q (k^T v)``: exact, linear in N, causal by chunked prefix sums; a step from a state
                 (``associative.py``)
``power``        poly2-poly4 as ``m(q) (w m(k)^T v)``: exact, linear in N, C++ and Triton; a step from a state
                 (``power/``: parallel, recurrent and naive forms)
``triton``       the fused CUDA kernel (``triton/``: launch tables, jit code, operators, self-check)
``fused_cpu``    the fused C++ CPU kernel, and a KV-cache step in one call (``fused_cpu.py``, sources in ``csrc/``,
                 built by ``base/cpp.py``)
``blocked``      tiles in plain PyTorch, any elementwise activation, CPU and GPU (``blocked.py``)
``materialized`` the whole ``N x N`` at once: a reference, never picked by ``auto`` for a parallel call; its
                 KV-cache step is (``materialized.py``)
================ ======================================================================================

While ``torch.compiler.is_exporting()``, ``auto`` takes the first :attr:`~.base.Backend.decomposable` backend that
takes the inputs (``sdpa`` for softmax, else ``materialized``): plain PyTorch operators, for any batch and sequence
length, that ONNX and a process without the project run (the C++ and Triton kernels stay the training path).
Otherwise ``kernel="auto"`` walks :data:`PRIORITY` and takes the first backend with no reason against the inputs;
when that one states a cost (:meth:`~.base.Backend.cost`), the cheapest of the able backends with a cost wins instead
(the quadratic kernels and ``power`` compare so, at the crossover measured on the machine:
``base.costs.crossover_length``).
:func:`pick` says which backend that is and why each other one was passed over (``polyattn_lightning.attention.
kernel_choice`` asks it for ``attention()``'s own arguments, a state included); a named kernel that cannot take the
inputs raises one :class:`~.base.KernelNotSupported` listing its reasons.

A decoding step (a KV-cache step, a step from a state) runs between a model's other code, where every Python line
counts: the function of the backend ``pick`` chose is kept per activation, device, dtype and kind
(:func:`step_function`), so the next step of the kind is one lookup and one call (:func:`decoding_step`).

Grouped-query attention (k, v with fewer heads than q): a backend with ``grouped_heads`` takes them as they are in its
parallel form, every other one gets them repeated; the step forms always take them as they are.

Every backend computes non-softmax scores and ``phi(S)`` in fp32 with autocast off (``attention.dtypes``), returns
``v``'s dtype, and has a hand-written backward that is differentiable once (a second derivative raises rather than
being wrong).

To add a backend: a module here with a :class:`~.base.Backend` subclass (``name``, ``supports``,
``not_supported_reasons`` naming each input it refuses, ``forward``; ``forms``, ``kv_step`` or ``state_step`` for
its decoding forms; ``decomposable = True`` where it is plain PyTorch operators for any shape, which an export may
then hold) and ``BACKEND = YourBackend()``; add it to :data:`BACKENDS` where ``auto`` should try it (that
order is :data:`PRIORITY`), and add its refusals to ``tests/attention/kernels/test_kernel_interface.py``.

To add a fused activation form (one the fused kernels compute in place, like ``relu``): a member of
:class:`~polyattn_lightning.attention.forms.FusedForm`, its ``f`` and ``f'`` in ``csrc/fused_cpu.cpp`` (``enum
Form``), in ``triton/jit.py`` (``_phi``, ``_dphi``, by its ``tl.constexpr``) and, if it has an in-place form, in
``blocked.py``'s ``phi_``; the activation's factory sets ``kernel=("<name>",)`` (``attention/registry.py``).
``tests/attention/test_forms.py`` checks the C++ enum against the table.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..registry import Activation, ActivationSpec, get_activation
from . import associative, blocked, fused_cpu, materialized, power, sdpa, triton
from .base.contract import (
    KV_STEP,
    PARALLEL,
    STATE_STEP,
    STEP_ROWS,
    Backend,
    KernelInputs,
    KernelNotSupported,
    KVStep,
    StateStep,
    gradient_flows,
)
from .base.state import RecurrentState, power_of

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
#: What ``auto`` tries for a KV-cache step: :data:`PRIORITY`, then the references with a KV-cache step form.
KV_STEP_PRIORITY: tuple[str, ...] = PRIORITY + tuple(
    name for name, backend in BACKENDS.items() if name not in PRIORITY and KV_STEP in backend.forms
)


class KernelChoice(NamedTuple):
    """What ``auto`` picks for some inputs, and why it passed over each other backend (name -> reasons)."""

    kernel: str
    passed_over: dict[str, list[str]]
    kind: str = PARALLEL

    def __str__(self) -> str:
        lines = [f"auto picks {self.kernel!r}" + ("" if self.kind == PARALLEL else f" for a {self.kind}")]
        lines += [f"  {name}: {'; '.join(reasons)}" for name, reasons in self.passed_over.items()]
        return "\n".join(lines)


def pick(inputs: KernelInputs) -> KernelChoice:
    """The backend ``kernel="auto"`` runs for ``inputs``, with the reasons of every backend it did not take."""
    kind = inputs.kind
    if torch.compiler.is_exporting():
        return _decomposable(inputs, kind)
    passed_over: dict[str, list[str]] = {}
    able: list[str] = []
    for name in KV_STEP_PRIORITY if kind == KV_STEP else PRIORITY:
        backend = BACKENDS[name]
        reasons = backend.not_supported_reasons(inputs)
        if not reasons:
            reasons = backend.declined_reasons(inputs)
        if reasons:
            passed_over[name] = reasons
        else:
            able.append(name)
    if not able:
        listed = "; ".join(f"{name}: {', '.join(reasons)}" for name, reasons in passed_over.items())
        raise KernelNotSupported(f"no attention kernel can take these inputs ({kind}): {listed}")
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
                f" (cost {_seconds(costs[name])} against {_seconds(costs[chosen])})"
                if len(costs) > 1 and name in costs
                else ""
            )
            passed_over[name] = [f"{chosen!r} is preferred{detail}"]
    if chosen != "materialized":
        passed_over.setdefault("materialized", ["a reference: only by name (O(N^2) memory)"])
    passed_over = {name: passed_over[name] for name in BACKENDS if name in passed_over}
    return KernelChoice(chosen, passed_over, kind)


def _seconds(cost) -> str:
    """A cost in words: a number to three figures, a symbolic one (shapes traced by ``torch.compile``) as its
    expression, which formatting would not take."""
    return f"{cost:.3g} s" if isinstance(cost, (int, float)) else f"{cost} s"


def _decomposable(inputs: KernelInputs, kind: str) -> KernelChoice:
    """:func:`pick` while ``torch.export`` traces: the first :attr:`~.base.Backend.decomposable` backend with a
    form for ``kind`` that takes ``inputs`` (``sdpa`` for softmax, else ``materialized``), so the exported graph
    holds standard operators for any batch and sequence length; every other backend is passed over unasked (their
    reasons and costs would read symbolic shapes)."""
    passed_over: dict[str, list[str]] = {}
    chosen = None
    for name, backend in BACKENDS.items():
        if not backend.decomposable:
            passed_over[name] = ["not decomposable: torch.export would keep it as an opaque C++ or Triton call"]
        elif chosen is not None:
            passed_over[name] = [f"{chosen!r} is preferred"]
        elif kind not in backend.forms:
            passed_over[name] = [f"no form for a {kind}"]
        elif reasons := backend.not_supported_reasons(inputs):
            passed_over[name] = reasons
        else:
            chosen = name
    if chosen is None:
        listed = "; ".join(f"{name}: {', '.join(reasons)}" for name, reasons in passed_over.items())
        raise KernelNotSupported(f"no attention kernel can be exported for these inputs ({kind}): {listed}")
    return KernelChoice(chosen, passed_over, kind)


def run(kernel: str, inputs: KernelInputs) -> Tensor:
    """Run ``kernel`` (``auto`` or a name of :data:`BACKENDS`) on ``inputs``; ``auto`` picks one."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown attention kernel {kernel!r}; expected one of {KERNELS}")
    kind = inputs.kind
    if kernel == "auto":
        if kind != PARALLEL:
            return run_step(step_function(inputs), inputs)
        backend = BACKENDS[pick(inputs).kernel]
    else:
        backend = BACKENDS[kernel]
        reasons = backend.not_supported_reasons(inputs)
        if reasons:
            able = [name for name, other in BACKENDS.items() if not other.not_supported_reasons(inputs)]
            raise KernelNotSupported(
                f"attention kernel {kernel!r} cannot take these inputs: {'; '.join(reasons)} "
                f"(kernels that can: {', '.join(able)})"
            )
        if kind in backend.forms and kind != PARALLEL:
            return run_step(_form(backend, inputs), inputs)
    if inputs.empty and not inputs.act.is_softmax:  # nothing to tile: an empty batch, no queries or no keys
        backend = BACKENDS["materialized"]
    return backend.forward(inputs if backend.grouped_heads else inputs.repeated_kv())


# --------------------------------------------------------------------------- decoding steps

#: ``(id(activation), device, dtype, kind) -> (activation, step function, p)``: what ``auto`` runs for a decoding step,
#: ``p`` the power of the states it steps from. The activation is held so that its id is not reused while kept.
_STEPS: dict[tuple, tuple[Activation, KVStep | StateStep, int | None]] = {}
#: Kept choices at most: an activation built anew for every call (a spec with an unhashable option) is resolved on
#: every call, and must not grow the table without end.
MAX_KEPT_STEPS = 64


def step_function(inputs: KernelInputs) -> KVStep | StateStep:
    """The function ``auto`` runs for a decoding step's ``inputs`` (:data:`~.base.KV_STEP` or
    :data:`~.base.STATE_STEP`): the form of the backend :func:`pick` chooses, kept for the next step of the same
    activation, device, dtype and kind (:func:`decoding_step`). A step's choice reads nothing else: every backend's
    reasons for a step are about the activation, the device, the dtype and the state, which :func:`decoding_step`
    checks against the new tokens before it takes a kept function."""
    function = _form(BACKENDS[pick(inputs).kernel], inputs)
    act, q = inputs.act, inputs.q
    if torch.compiler.is_exporting():  # the exported choice is not what eager decoding should keep
        return function
    if len(_STEPS) >= MAX_KEPT_STEPS:
        _STEPS.clear()
    _STEPS[(id(act), q.device, q.dtype, inputs.kind)] = (act, function, power_of(act))
    return function


def decoding_step(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    activation: ActivationSpec,
    temperature: float | None,
    key_padding_mask: Tensor | None,
    is_causal: bool,
    state: RecurrentState | None,
) -> Tensor | None:
    """``attention()``'s decoding step by the shortest path (called on checked shapes, with no score mask, bias,
    dropout or ``scale``): the function :func:`step_function` keeps for this step's activation, device, dtype and
    kind, on the arguments as they are. None: not a decoding step, the first of its kind, or a step the kept function
    does not take as it is (a state of another power or shape, keys that are not the new tokens, a padding mask of
    another shape); ``attention()`` then resolves it, or says why it cannot."""
    if gradient_flows(q, k, v) or torch.compiler.is_exporting():  # exported: pick() chooses a decomposable form
        return None
    shape = q.shape  # read once: a generation step runs between the model's other code, where every line counts
    rows = shape[2]
    if state is None:  # a KV-cache step: a few rows against more keys, no mask
        if key_padding_mask is not None or rows > STEP_ROWS or rows >= k.shape[2] or 0 in shape:
            return None
        kind = KV_STEP
    elif (
        type(state) is not RecurrentState
        or rows != k.shape[2]
        or (rows > 1 and not is_causal)
        or not state.takes(k, v)
        or not (key_padding_mask is None or _padding_of(key_padding_mask, shape[0], rows))
    ):
        return None
    else:
        kind = STATE_STEP
    act = get_activation(activation)
    entry = _STEPS.get((id(act), q.device, q.dtype, kind))
    if entry is None or (state is not None and state.power != entry[2]):
        return None  # not kept yet, or a state of another power (attention() says why it cannot step from it)
    t = shape[3] ** -0.5 if temperature is None else float(temperature)
    if state is None:
        return entry[1](q, k, v, t, is_causal)
    return entry[1](q, k, v, None if key_padding_mask is None else ~key_padding_mask, state, t)


def _padding_of(mask: Tensor, batch: int, rows: int) -> bool:
    """Whether ``mask`` is a key padding mask of the new tokens as ``attention()`` takes one: bool ``(B, Q)``."""
    return mask.dtype == torch.bool and mask.shape == (batch, rows)


def run_step(function: KVStep | StateStep, inputs: KernelInputs) -> Tensor:
    """Call a step ``function`` on resolved ``inputs``."""
    q, k, v, t = inputs.q, inputs.k, inputs.v, inputs.t
    if inputs.kind == KV_STEP:
        return function(q, k, v, t, inputs.causal is not None)
    allowed = inputs.allowed  # a key padding mask (B?, 1, 1, Q), or None
    keep = None if allowed is None else allowed.reshape(allowed.shape[0], -1).expand(q.shape[0], -1)
    return function(q, k, v, keep, inputs.state, t)


def _form(backend: Backend, inputs: KernelInputs) -> KVStep | StateStep:
    return backend.kv_step(inputs.act) if inputs.kind == KV_STEP else backend.state_step(inputs.act)


__all__ = [
    "BACKENDS",
    "KERNELS",
    "KV_STEP_PRIORITY",
    "PRIORITY",
    "KernelChoice",
    "decoding_step",
    "pick",
    "run",
    "run_step",
    "step_function",
]
