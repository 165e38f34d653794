"""The ``triton`` backend: what the fused CUDA kernel takes (the package's docstring says how it computes) and why
not the rest; the self-check under which ``auto`` leaves it to another."""

from __future__ import annotations

import importlib.util

import torch
from torch import Tensor

from ..base.contract import KV_STEP, Backend, KernelInputs, elementwise_reasons, stateless_reasons
from ..base.costs import quadratic_cost
from .launch import interpreting

#: Operand dtypes the kernels take; head dims up to ``MAX_HEAD_DIM``.
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: The largest head dim (of q, k and v) the kernels' tiles are sized for.
MAX_HEAD_DIM = 256


@torch.compiler.assume_constant_result
def triton_available() -> bool:
    """Whether the ``triton`` package is installed (CUDA builds of torch bring it)."""
    return importlib.util.find_spec("triton") is not None


class Triton(Backend):
    """The ``triton`` backend: the fused CUDA kernel (the package's docstring says what it computes and how)."""

    name = "triton"
    supports = (
        "CUDA tensors (CPU under TRITON_INTERPRET=1), fp16/bf16/fp32, head dim <= 256, the built-in forms, "
        "every mask, bias, dropout, causal"
    )

    def not_supported_reasons(self, inputs: KernelInputs) -> list[str]:
        q, act = inputs.q, inputs.act
        reasons = stateless_reasons(inputs, self.name) + elementwise_reasons(inputs)
        if not act.is_softmax and act.fused_form is None:
            reasons.append(f"the triton kernel does not know activation {act.name!r} (a custom one)")
        if not (q.is_cuda or interpreting()):
            reasons.append(
                f"q is on {q.device}; this kernel runs on CUDA tensors (on CPU only under TRITON_INTERPRET=1)"
            )
        elif not triton_available():
            reasons.append("the triton package is not installed")
        if q.dtype not in DTYPES:
            reasons.append(f"dtype {q.dtype} (it takes float16, bfloat16 and float32)")
        if max(q.shape[-1], inputs.v.shape[-1]) > MAX_HEAD_DIM:
            reasons.append(f"head dim {max(q.shape[-1], inputs.v.shape[-1])} > {MAX_HEAD_DIM}")
        return reasons

    def declined_reasons(self, inputs: KernelInputs) -> list[str]:
        q = inputs.q
        if inputs.kind == KV_STEP:
            return [
                "a KV-cache step: the few rows go in one call of the 'materialized' step form (this kernel's tiles "
                "and launches are sized for long sequences)"
            ]
        from .selfcheck import triton_verified

        if not triton_verified(
            q, inputs.k, inputs.v, inputs.act, inputs.allowed, inputs.bias, inputs.dropout_p, inputs.causal
        ):
            return ["this launch configuration failed its self-check against the blocked kernel (warned once)"]
        return []

    def cost(self, inputs: KernelInputs) -> float:
        return quadratic_cost(inputs)

    def forward(self, inputs: KernelInputs) -> Tensor:
        from .op import triton_attention

        return triton_attention(*inputs.tiled)


#: The backend ``kernels.dispatch`` lists.
BACKEND = Triton()
