"""The kernel interface: what ``attention()`` hands a backend, and what a backend declares about itself.

A backend is one module of this package holding one :class:`Backend` instance. It says, in words, which inputs
it cannot take (:meth:`Backend.not_supported_reasons`), which it could take but ``kernel="auto"`` should leave
to another (:meth:`Backend.declined_reasons`), optionally what a call would cost (:meth:`Backend.cost`), and
runs (:meth:`Backend.forward`). ``kernels.pick`` walks the backends in one priority list and asks them.
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

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
    k: Tensor
    v: Tensor
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


class Backend:
    """One attention kernel. Subclasses set ``name`` and ``supports`` (one line: what it takes and why)."""

    name: ClassVar[str]
    supports: ClassVar[str]
    #: Whether ``kernel="auto"`` may pick it (``materialized`` is a reference: only by name).
    in_auto: ClassVar[bool] = True

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
