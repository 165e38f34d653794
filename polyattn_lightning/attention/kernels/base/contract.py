"""The kernel interface: what ``attention()`` hands a backend, and what a backend declares about itself.

A backend is one module (or folder) of ``kernels/`` holding one :class:`Backend` instance. It says, in words, which
inputs it cannot take (:meth:`Backend.not_supported_reasons`), which it could take but ``kernel="auto"`` should leave
to another (:meth:`Backend.declined_reasons`), optionally what a call would cost (:meth:`Backend.cost`), and runs
them. ``kernels.pick`` walks the backends in one priority list and asks them.

Three kinds of call (:attr:`KernelInputs.kind`), and the forms a backend has for them (:attr:`Backend.forms`):

* :data:`PARALLEL`: every query row at once (training, a prompt, an encoder): :meth:`Backend.forward`, which every
  backend has;
* :data:`KV_STEP`: a few new query rows against a KV cache of more keys, with no mask and no gradient (a generation
  step): :meth:`Backend.kv_step`, one call where a backend has it; the others could run the call in their parallel
  form, and ``auto`` passes them over;
* :data:`STATE_STEP`: new tokens folded into a recurrent state (``attention(..., state=...)``):
  :meth:`Backend.state_step`, which only the linear forms have; every other backend says why it cannot take one
  (:func:`stateless_reasons`).
"""

from __future__ import annotations

from typing import Callable, ClassVar, NamedTuple

import torch
from torch import Tensor

from ...masks import Masks
from ...registry import Activation
from .state import RecurrentState, power_of

#: The kinds of call (:attr:`KernelInputs.kind`).
PARALLEL, KV_STEP, STATE_STEP = "parallel", "KV-cache step", "step from a state"
#: Query rows up to which a call with no mask and no gradient is a KV-cache step (against more keys) or takes a
#: one-call form (one generation step is one row; a short causal prompt, or an encoder's short input, a few).
STEP_ROWS = 8

#: A KV-cache step's function: ``(q, k, v, t, causal) -> (B, H, R, dv)`` (``causal``: bottom-right).
KVStep = Callable[[Tensor, Tensor, Tensor, float, bool], Tensor]
#: A step from a state: ``(q, k, v, keep, state, t) -> (B, H, Q, dv)``, ``state`` updated in place, ``keep``
#: ``(B, Q)`` 1/0 per new key or None (every key).
StateStep = Callable[[Tensor, Tensor, Tensor, "Tensor | None", RecurrentState, float], Tensor]


def gradient_flows(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether a gradient will flow back through a call on ``q``, ``k``, ``v``."""
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


class KernelInputs(NamedTuple):
    """``attention()``'s arguments, resolved once: what every backend receives.

    ``masks`` holds the boolean ``allowed`` mask (None: every pair), softmax's ``additive`` mask and the causal
    offset ``Nk - Nq`` (None: not causal); ``n`` is the number of keys each query row may attend (fp32,
    broadcastable to ``(B, H, Nq, 1)``; None for softmax and for a step from a state, which counts its own).
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
    state: RecurrentState | None = None  # a step from a recurrent state: k, v are the new tokens

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

    @property
    def few_rows(self) -> bool:
        """At most :data:`STEP_ROWS` query rows of a non-softmax activation with no mask, score bias, dropout or
        gradient (causal, bottom-right, is fine): what a one-call form takes."""
        return (
            self.q.shape[-2] <= STEP_ROWS
            and self.masks.allowed is None
            and self.bias is None
            and not self.dropout_p
            and not self.act.is_softmax
            and not gradient_flows(self.q, self.k, self.v)
        )

    @property
    def kind(self) -> str:
        """:data:`STATE_STEP` with a state; :data:`KV_STEP` for :attr:`few_rows` against more keys (the new rows of a
        sequence whose earlier keys are cached); else :data:`PARALLEL` (an :attr:`empty` call too)."""
        if self.state is not None:
            return STATE_STEP
        return KV_STEP if self.q.shape[-2] < self.k.shape[-2] and self.few_rows and not self.empty else PARALLEL

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
    #: Whether ``kernel="auto"`` may pick it for a parallel call (``materialized`` is a reference: only by name;
    #: ``auto`` may take its KV-cache step form, which is small).
    in_auto: ClassVar[bool] = True
    #: Whether its parallel form takes k and v with fewer heads than q (grouped-query attention) as they are (its
    #: step forms always do: a cache or a state is never repeated).
    grouped_heads: ClassVar[bool] = False
    #: The kinds of call it has a form of its own for (:data:`PARALLEL` always: :meth:`forward`).
    forms: ClassVar[frozenset[str]] = frozenset({PARALLEL})
    #: Whether it is plain PyTorch operators that ``torch.export`` decomposes for any batch and sequence length (no
    #: C++ op, no Triton, no autograd Function): what ``auto`` picks while ``torch.compiler.is_exporting()``.
    decomposable: ClassVar[bool] = False

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
        """The parallel form: every query row at once."""
        raise NotImplementedError

    def kv_step(self, act: Activation) -> KVStep:
        """The function of a KV-cache step with ``act`` (backends with :data:`KV_STEP` in :attr:`forms`), resolved
        once: ``kernels.dispatch`` keeps it, so a generation step is one lookup and this call."""
        raise NotImplementedError(f"the {self.name} kernel has no KV-cache step form")

    def state_step(self, act: Activation) -> StateStep:
        """The function of a step from a recurrent state with ``act`` (backends with :data:`STATE_STEP` in
        :attr:`forms`), resolved once as :meth:`kv_step`'s."""
        raise NotImplementedError(f"the {self.name} kernel has no recurrent form")

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


def stateless_reasons(inputs: KernelInputs, kernel: str) -> list[str]:
    """The reason of a backend without a recurrent form, given a state: it attends the keys themselves."""
    if inputs.state is None:
        return []
    return [
        f"a step from a recurrent state: the {kernel} kernel attends the keys themselves and keeps no state "
        "(poly1 decodes from one on 'associative', poly2-poly4 on 'power')"
    ]


def state_reasons(inputs: KernelInputs) -> list[str]:
    """Why a recurrent form cannot take ``inputs``' state: another power or shape, another device, a gradient, keys
    that are not the new tokens, several rows that are not causal."""
    state, q, k, v = inputs.state, inputs.q, inputs.k, inputs.v
    reasons = []
    p = power_of(inputs.act)
    if p is not None and state.power != p:
        reasons.append(f"the state holds poly{state.power}'s features; the activation is {inputs.act.name!r}")
    if inputs.act.shift is not None:
        reasons.append(f"activation {inputs.act.name!r} shifts the scores by b(n), which does not factor")
    expected = state.shape_for(k, v)
    if tuple(state.kv.shape) != expected or tuple(state.count.shape) != expected[:2]:
        reasons.append(
            f"a state of shape {tuple(state.kv.shape)} (count {tuple(state.count.shape)}) for inputs whose "
            f"(B, Hkv, D, dv) is {expected}"
        )
    if state.kv.device != q.device:
        reasons.append(f"the state is on {state.kv.device}, q on {q.device}")
    if gradient_flows(q, k, v):
        reasons.append("a step from a state is for generation: no gradient flows through the state")
    if q.shape[-2] != k.shape[-2]:
        reasons.append(
            f"k and v must be the new tokens, one per query row (got {q.shape[-2]} rows, {k.shape[-2]} keys)"
        )
    elif q.shape[-2] > 1 and inputs.causal != 0:
        reasons.append(
            "a step from a state is causal (query i attends the state and the new keys up to i): pass is_causal=True"
        )
    return reasons
