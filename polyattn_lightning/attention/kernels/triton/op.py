"""The Triton kernels as PyTorch operators (``torch.library.triton_op``) and their autograd Function.

``polyattn::triton_forward`` and ``polyattn::triton_backward`` launch the programs of ``jit.py`` with the
launches of ``launch.py``, under a device guard (on ``q``'s CUDA device, whatever the current one), so that
``torch.compile`` sees through them without a graph break. :class:`TritonAttention` folds the row scale and
dropout into the operands and sums the bias gradient over the bias's broadcast dimensions.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .launch import Launch, backward_launches, forward_launches


def _device_guard(x: Tensor):
    """Triton launches on the current CUDA device: make it ``x``'s for the launches (not while tracing with
    fake tensors, where nothing is launched)."""
    from torch._subclasses.fake_tensor import is_fake

    return torch.cuda.device(x.device) if x.is_cuda and not is_fake(x) else contextlib.nullcontext()


def _run(launches: list[Launch]) -> None:
    """The launches (where Triton compiles each on first use)."""
    for launch in launches:
        torch.library.wrap_triton(launch.kernel)[launch.grid](
            *launch.args,
            **launch.meta,
            num_warps=launch.config.num_warps,
            num_stages=launch.config.num_stages,
        )


@torch.library.triton_op("polyattn::triton_forward", mutates_args=())
def triton_forward(
    q3: Tensor,
    k3: Tensor,
    v3: Tensor,
    c: Tensor,
    shift: Tensor,
    mask: Optional[Tensor],
    bias: Optional[Tensor],
    seed: Optional[Tensor],
    heads: int,
    t: float,
    form: int,
    power: int,
    dropout_p: float,
    causal: Optional[int] = None,
) -> Tensor:
    """``out (B*H, Nq, dv)`` from contiguous ``(B*H, N, d)`` operands; mask/bias 4-D, broadcastable."""
    out = q3.new_empty(q3.shape[0], q3.shape[1], v3.shape[2])
    with _device_guard(q3):
        _run(forward_launches(q3, k3, v3, out, c, shift, mask, bias, seed, heads, t, form, power, dropout_p, causal))
    return out


@torch.library.triton_op("polyattn::triton_backward", mutates_args=())
def triton_backward(
    q3: Tensor,
    k3: Tensor,
    v3: Tensor,
    do: Tensor,
    c: Tensor,
    shift: Tensor,
    mask: Optional[Tensor],
    bias: Optional[Tensor],
    seed: Optional[Tensor],
    heads: int,
    t: float,
    form: int,
    power: int,
    dropout_p: float,
    causal: Optional[int],
    bias_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``dq, dk, dv`` and, with ``bias_grad``, ``dS`` as fp32 ``(B*H, Nq, Nk)`` (else an empty tensor)."""
    bh, nq, nk = q3.shape[0], q3.shape[1], k3.shape[1]
    dq, dk, dv = torch.empty_like(q3), torch.empty_like(k3), torch.empty_like(v3)
    ds = (q3.new_zeros if causal is not None else q3.new_empty)(  # causal: skipped tiles stay 0
        (bh, nq, nk) if bias_grad else (0,), dtype=torch.float32
    )
    with _device_guard(q3):
        _run(
            backward_launches(
                q3,
                k3,
                v3,
                do,
                dq,
                dk,
                dv,
                ds if bias_grad else dq,
                c,
                shift,
                mask,
                bias,
                seed,
                heads,
                t,
                form,
                power,
                dropout_p,
                causal,
                bias_grad,
            )
        )
    return dq, dk, dv, ds


def draw_seed(device: torch.device) -> Tensor:
    """The dropout seed of one call: a one-element int64 tensor drawn on ``device`` by its default generator
    (on CUDA: no host copy, no stream sync, capturable in a CUDA graph)."""
    return torch.randint(2**63 - 1, (1,), dtype=torch.int64, device=device)


def kernel_operands(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor | None, bias: Tensor | None):
    """``q, k, v`` as contiguous ``(B*H, N, d)`` in ``q``'s dtype, the mask as a 4-D uint8 view of ``allowed``
    (its strides kept, no copy) and the bias as 4-D: what the operators get."""
    q3, k3, v3 = (x.to(q.dtype).reshape(-1, x.shape[-2], x.shape[-1]).contiguous() for x in (q, k, v))
    mask = None if allowed is None else _as_4d(allowed).view(torch.uint8)
    return q3, k3, v3, mask, None if bias is None else _as_4d(bias)


class TritonAttention(torch.autograd.Function):
    """``out = c(n) / (1 - p) * dropout(mask(f(S + b(n) + bias))) @ v`` on the Triton operators.

    Operands go in as contiguous ``(B*H, N, d)`` in ``q``'s dtype; the output
    comes back in ``v``'s dtype and each gradient in its input's. ``seed``: the
    dropout seed tensor (default: drawn by ``draw_seed``).
    """

    @staticmethod
    def forward(
        ctx, q, k, v, bias, act, t: float, allowed, n, dropout_p: float, causal: int | None, seed: Tensor | None = None
    ):
        B, H, nq, _ = q.shape
        nk, dv = k.shape[-2], v.shape[-1]
        q3, k3, v3, mask, bias4 = kernel_operands(q, k, v, allowed, bias)
        c, shift = act.per_row(n, (B, H, nq, nk), torch.float32)
        if dropout_p:
            c = c / (1.0 - dropout_p)
        if dropout_p and seed is None:
            seed = draw_seed(q.device)
        elif not dropout_p:
            seed = None
        form, power = (int(x) for x in act.fused_form)
        ctx.op_args = (H, float(t), form, power, float(dropout_p), causal)
        out = torch.ops.polyattn.triton_forward(q3, k3, v3, c, shift, mask, bias4, seed, *ctx.op_args)
        ctx.save_for_backward(q3, k3, v3, c, shift, mask, bias4, seed)
        ctx.inputs = [(x.shape, x.dtype) for x in (q, k, v)] + [None if bias is None else (bias.shape, bias.dtype)]
        return out.view(B, H, nq, dv).to(v.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q3, k3, v3, c, shift, mask, bias4, seed = ctx.saved_tensors
        want_bias = bias4 is not None and ctx.needs_input_grad[3]
        do = grad_out.to(q3.dtype).reshape(q3.shape[0], q3.shape[1], -1).contiguous()
        dq, dk, dv, ds = torch.ops.polyattn.triton_backward(
            q3, k3, v3, do, c, shift, mask, bias4, seed, *ctx.op_args, want_bias
        )
        grads = [g.view(shape).to(dtype) for g, (shape, dtype) in zip((dq, dk, dv), ctx.inputs)]
        dbias = None
        if want_bias:  # dS summed over the dimensions the bias broadcasts along
            heads = ctx.op_args[0]
            ds4 = ds.view(-1, heads, q3.shape[1], k3.shape[1])
            broadcast = [dim for dim in range(4) if bias4.shape[dim] == 1 and ds4.shape[dim] > 1]
            summed = ds4.sum(dim=broadcast, keepdim=True) if broadcast else ds4
            shape, dtype = ctx.inputs[3]
            dbias = summed.reshape(shape).to(dtype)
        return (*grads, dbias, None, None, None, None, None, None, None)


def _as_4d(x: Tensor) -> Tensor:
    return x.reshape((1,) * (4 - x.dim()) + tuple(x.shape))


def triton_attention(q, k, v, act, t, allowed, bias, n, dropout_p, causal=None) -> Tensor:
    """The Triton kernel on resolved arguments (``KernelInputs``' fields)."""
    return TritonAttention.apply(q, k, v, bias, act, t, allowed, n, float(dropout_p), causal)
