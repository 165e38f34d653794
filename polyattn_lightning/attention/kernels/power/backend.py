"""The ``power`` backend: what it takes (poly2-poly4, key padding, causal, grouped heads; a state) and why not the
rest, and which of its forms runs: ``parallel.py`` for a call, ``recurrent.py`` for a step from a state."""

from __future__ import annotations

from torch import Tensor

from ..base.contract import Backend, KernelInputs, elementwise_reasons, key_padding_reasons, state_reasons
from ..base.costs import crossover_length, linear_cost
from ..base.cpp import load
from ..base.state import monomial_count, power_of
from .parallel import power_attention
from .recurrent import RecurrentForm

#: The powers this form takes (p = 1 is ``associative``'s ``q (k^T v)``).
POWERS = (2, 3, 4)
#: The Triton form's largest head dim (its launch configs are checked offline up to it: ``bench triton-static``).
CUDA_MAX_HEAD_DIM = 128


class Power(RecurrentForm, Backend):
    """The ``power`` backend: poly2-poly4 in linear time, its parallel form (C++ on CPU, Triton on CUDA) and its
    recurrent form (a step from a state, :class:`~.recurrent.RecurrentForm`)."""

    name = "power"
    supports = (
        "poly2-poly4, exact in linear time (memory O(N d + D dv)), key padding, causal, grouped-query heads, a step "
        "from a recurrent state; CPU (C++) and CUDA (Triton); no pairwise mask, score bias or dropout (they do not "
        "factor)"
    )
    grouped_heads = True

    def not_supported_reasons(self, inputs: KernelInputs) -> list[str]:
        reasons = elementwise_reasons(inputs)
        if not reasons and power_of(inputs.act) not in POWERS:
            reasons.append(
                f"activation {inputs.act.name!r} is not poly2-poly4 (the linear form of poly1 is 'associative')"
            )
        if inputs.state is not None:  # the recurrent form: C++ on CPU, PyTorch elsewhere
            return reasons + state_reasons(inputs) + key_padding_reasons(inputs, "power")
        q = inputs.q
        if q.device.type == "cpu":
            if not load():
                reasons.append("the C++ kernels could not be built on this machine (see the warning above)")
        elif not q.is_cuda:
            reasons.append(f"q is on {q.device}; this kernel runs on CPU and CUDA tensors")
        else:
            from ..triton import DTYPES, triton_available

            if not triton_available():
                reasons.append("the triton package is not installed (the CUDA form is a Triton kernel)")
            if q.dtype not in DTYPES:
                reasons.append(f"dtype {q.dtype} on CUDA (the Triton form takes float16, bfloat16 and float32)")
            if max(q.shape[-1], inputs.v.shape[-1]) > CUDA_MAX_HEAD_DIM:
                reasons.append(f"head dim > {CUDA_MAX_HEAD_DIM} on CUDA (the Triton form's tiles are sized up to it)")
        return reasons + key_padding_reasons(inputs, "power")

    def cost(self, inputs: KernelInputs) -> float | None:
        d, dv, p = inputs.q.shape[-1], inputs.v.shape[-1], power_of(inputs.act)
        return linear_cost(inputs, monomial_count(d, p) * dv, crossover_length(inputs, d, p))

    def forward(self, inputs: KernelInputs) -> Tensor:
        i = inputs
        return power_attention(i.q, i.k, i.v, i.act, i.t, i.allowed, i.n, i.causal)


#: The backend ``kernels.dispatch`` lists.
BACKEND = Power()
