"""The recurrent state of ``poly{p}`` attention, p = 1..4: what a causal layer may keep instead of its keys and values.

``(q . k)^p = <m(q), w m(k)>``, where ``m`` lists the ``D = C(d+p-1, p)`` monomials of degree p of a head's d
coordinates and ``w`` their multinomial counts (:func:`monomials`; ``m(x) = x``, ``D = d`` for p = 1). With the
scale ``c(n)`` (no row-sum denominator) a causal layer's output for query i is ``c(n_i) m(q_i t) S_i``, with

    ``S = sum_j w m(k_j) v_j^T``  (per kv head, ``D x dv``),   ``n`` = the keys folded into it.

:class:`RecurrentState` holds them, laid out once for every kernel that reads or writes one (the C++ and PyTorch
recurrent steps of ``power/recurrent.py``, which ``associative`` runs for poly1, and ``RecurrentCache`` through
``attention(..., state=...)``): ``kv`` ``(B, Hkv, D, dv)`` in fp32 (fp64 for fp64 inputs) whatever the model's
dtype, its rows in the lexicographic order of the monomials' coordinates ``e1 <= ... <= ep``; ``count`` ``(B, Hkv)``,
the keys folded in (padding excluded). A query head reads the state of its kv head (grouped-query attention).
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from ...forms import FusedForm
from ...registry import Activation

#: The powers a recurrent state exists for (poly1 on ``associative``, poly2-poly4 on ``power``).
RECURRENT_POWERS = (1, 2, 3, 4)


def power_of(act: Activation) -> int | None:
    """``p`` of a ``poly{p}`` activation, else None."""
    form = act.fused_form
    return form[1] if form is not None and form[0] is FusedForm.POLY else None


def monomial_count(d: int, p: int) -> int:
    """``D = C(d + p - 1, p)``: the monomials of degree ``p`` in ``d`` variables (the state's rows)."""
    return math.comb(d + p - 1, p)


@functools.cache
def monomials(d: int, p: int) -> tuple[Tensor, Tensor]:
    """``(index (D, p), weight (D,))``: each monomial's coordinates ``e1 <= ... <= ep`` and multinomial count,
    in the kernels' order (lexicographic). The state's rows follow it."""
    index = torch.tensor(list(itertools.combinations_with_replacement(range(d), p)), dtype=torch.long)
    counts = torch.stack([(index == e).sum(-1) for e in range(d)], dim=-1)  # multiplicity of each coordinate
    weight = math.factorial(p) / torch.exp(torch.lgamma(counts.double() + 1).sum(-1))
    return index.view(-1, p), weight.round()


@functools.cache
def device_monomials(d: int, p: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """:func:`monomials` as the Triton kernels read them: ``index`` ``(p, D)`` int32, ``weight`` fp32, on ``device``."""
    index, weight = monomials(d, p)
    return index.t().contiguous().to(device, torch.int32), weight.to(device, torch.float32)


def features(x: Tensor, p: int, weighted: bool = False) -> Tensor:
    """``m(x)`` (``w m(x)`` if ``weighted``): ``(..., d) -> (..., D)``, for a few rows (decoding, references)."""
    index, weight = monomials(x.shape[-1], p)
    out = x[..., index.to(x.device)].prod(-1)
    return out * weight.to(out) if weighted else out


@dataclass
class RecurrentState:
    """``S = sum_j w m(k_j) v_j^T`` (``kv``, ``(B, Hkv, D, dv)``) and the keys in it (``count``, ``(B, Hkv)``) of
    ``poly{power}``. A step from it (``attention(..., state=...)``) folds the new keys in place: the state it was
    given is the state after those tokens when it returns (a copy of ``D x dv`` per head and token would cost more
    than the step)."""

    kv: Tensor
    count: Tensor
    power: int

    @classmethod
    def empty(cls, batch: int, kv_heads: int, d: int, dv: int, power: int, like: Tensor) -> RecurrentState:
        """A state with no key yet, on ``like``'s device, fp32 (fp64 for fp64 ``like``)."""
        dtype = torch.promote_types(like.dtype, torch.float32)
        kv = like.new_zeros(batch, kv_heads, monomial_count(d, power), dv, dtype=dtype)
        return cls(kv, like.new_zeros(batch, kv_heads, dtype=dtype), power)

    def shape_for(self, k: Tensor, v: Tensor) -> tuple[int, int, int, int]:
        """The ``(B, Hkv, D, dv)`` of ``kv`` that new keys ``k`` and values ``v`` ``(B, Hkv, Q, d / dv)`` fold into."""
        return k.shape[0], k.shape[1], monomial_count(k.shape[-1], self.power), v.shape[-1]

    def takes(self, k: Tensor, v: Tensor) -> bool:
        """Whether ``k`` and ``v`` fold into this state as they are: ``kv`` of :meth:`shape_for`, ``count`` of its
        ``(B, Hkv)``, on ``k``'s device (``kernels.base.state_reasons`` says what is wrong otherwise)."""
        kv = self.kv
        return kv.shape == self.shape_for(k, v) and self.count.shape == kv.shape[:2] and kv.device == k.device

    def select(self, index: Callable[[Tensor], Tensor]) -> None:
        """Apply ``index`` to the batch of both tensors (beam search's reorder and selection)."""
        self.kv, self.count = index(self.kv), index(self.count)
