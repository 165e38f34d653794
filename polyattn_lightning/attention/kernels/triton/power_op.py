"""The exact linear-time ``poly{p}`` form on Triton (CUDA; CPU under ``TRITON_INTERPRET=1``): launches of
``power_jit.py``, the causal decomposition into chunks, and autograd.

Non-causal: ``S = sum_j w m(k_j) v_j^T`` per kv head (``_power_state``), then ``out = s m(q) S``
(``_power_apply``), ``s = c(n) t^p``. Backward: ``dS = sum_i m(q_i) g_i^T`` over the group's queries
(``g = s dO``), ``dQ = J^T(S g^T)``, ``dV = (w m(k))^T dS``, ``dK = J^T(w dS v^T)`` (``_power_grad``).

Causal (bottom-right, ``Nq != Nk`` too): the first ``Nk - Nq`` keys (when positive) form a prefix state every
query sees; queries and the remaining keys pair one to one in chunks of ``C`` tokens. Within a chunk the
quadratic Triton kernel (``op.TritonAttention``, the chunks as extra heads, causal, the global ``n`` per row);
between chunks the chunk states ``dS_c`` of ``_power_state`` and their exclusive prefix sums (``cumsum``), read by
``_power_apply``; the backward sums the chunks' ``dS`` in reverse. The chunk states are the only memory above
O(N d): ``(N / C) D dv`` per kv head, so ``C`` grows with N to keep them within :data:`STATE_BUDGET` bytes (and
is at least :data:`MIN_CHUNK`).

Padded keys are zeroed before (``masked_fill``: their features vanish, their gradients are zero). Operands are
loaded in the inputs' dtype, features and states are fp32, products follow ``launch.product_types``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from .launch import Launch, LaunchConfig, product_types
from .op import TritonAttention, _device_guard, _run

#: Tile sizes ``(rows, features)`` and launch options per program and operand width (16-bit; fp32), sized offline
#: (``bench triton-static``, a sweep of 5-9 candidates each): the largest tiles without a spill for (p, d) in
#: (3, 32), (2, 64), (2, 128), (4, 32) on sm_80 and sm_90, every product on tensor cores. Rows are multiples of
#: 16 dividing 64, so a chunk of 64 tokens holds whole row blocks.
CONFIGS = {
    ("power_state", 16): LaunchConfig(64, 64, 8, 2),
    ("power_apply", 16): LaunchConfig(64, 64, 8, 2),
    ("power_grad", 16): LaunchConfig(64, 16, 4, 2),
    ("power_state", 32): LaunchConfig(32, 32, 4, 2),
    ("power_apply", 32): LaunchConfig(16, 32, 4, 2),
    ("power_grad", 32): LaunchConfig(16, 32, 8, 2),
}


def launch_config(program: str, dtype: torch.dtype) -> LaunchConfig:
    return CONFIGS[(program, 32 if dtype == torch.float32 else 16)]


#: Bytes of chunk states per kv head the causal form may hold; and the smallest chunk.
STATE_BUDGET = 64 * 2**20
MIN_CHUNK = 128


def _pow2(x: int) -> int:
    return max(16, 1 << (max(1, x) - 1).bit_length())


def _dot(dtype: torch.dtype) -> dict:
    types = product_types(dtype)
    return dict(DOT=types["PV"], PRECISION=types["PV_PRECISION"])


def state_launch(x3, y3, state, tables, rows, chunk, n_chunks, weighted, groups=1, grouped=False) -> Launch:
    """``state (H_kv, n_chunks, D, dv) = sum over each chunk of w? m(x) y^T`` (x, y ``(H, rows, .)``)."""
    from .power_jit import _power_state

    d, dv, D = x3.shape[-1], y3.shape[-1], state.shape[-2]
    config = launch_config("power_state", x3.dtype)
    n_fblocks = math.ceil(D / config.block_n)
    index, weight = tables
    p = index.shape[0]
    args = (x3, y3, x3, index, weight, state, rows, d, dv, D, chunk, n_chunks, n_fblocks, groups)
    meta = dict(
        P=p,
        WEIGHTED=weighted,
        HAS_KEEP=False,
        GROUPED=grouped,
        **_dot(x3.dtype),
        BLOCK_N=config.block_m,
        BLOCK_F=config.block_n,
        BLOCK_DV=_pow2(dv),
    )
    return Launch(_power_state, (state.shape[0] * n_chunks * n_fblocks,), args, meta, config)


def apply_launch(x3, state, scale, out, tables, rows, chunk, n_chunks, weighted, groups=1, accumulate=False) -> Launch:
    """``out (H, rows, dv) (+)= scale * w? m(x) S[h // groups, chunk]``."""
    from .power_jit import _power_apply

    d, dv, D = x3.shape[-1], out.shape[-1], state.shape[-2]
    config = launch_config("power_apply", x3.dtype)
    n_mblocks = math.ceil(rows / config.block_m)
    index, weight = tables
    p = index.shape[0]
    args = (x3, index, weight, state, scale, out, rows, d, dv, D, chunk, n_chunks, n_mblocks, groups)
    meta = dict(
        P=p,
        WEIGHTED=weighted,
        ACCUMULATE=accumulate,
        **_dot(x3.dtype),
        BLOCK_M=config.block_m,
        BLOCK_F=config.block_n,
        BLOCK_DV=_pow2(dv),
    )
    return Launch(_power_apply, (x3.shape[0] * n_mblocks,), args, meta, config)


def grad_launch(x3, y3, state, scale, dx, tables, rows, chunk, n_chunks, weighted, groups=1) -> Launch:
    """``dx (H, rows, d) = scale * J_m(x)^T (w? * (S[h // groups, chunk] y))``."""
    from .power_jit import _power_grad

    d, dv, D = x3.shape[-1], y3.shape[-1], state.shape[-2]
    config = launch_config("power_grad", x3.dtype)
    n_mblocks = math.ceil(rows / config.block_m)
    index, weight = tables
    p = index.shape[0]
    args = (x3, y3, index, weight, state, scale, dx, rows, d, dv, D, chunk, n_chunks, n_mblocks, groups)
    meta = dict(
        P=p,
        WEIGHTED=weighted,
        **_dot(x3.dtype),
        BLOCK_M=config.block_m,
        BLOCK_F=config.block_n,
        BLOCK_D=_pow2(d),
        BLOCK_DV=_pow2(dv),
    )
    return Launch(_power_grad, (x3.shape[0] * n_mblocks,), args, meta, config)


def _flat(x: Tensor) -> Tensor:
    return x.reshape(x.shape[0] * x.shape[1], x.shape[-2], x.shape[-1]).contiguous()


def _states(heads: int, n_chunks: int, D: int, dv: int, like: Tensor) -> Tensor:
    return torch.empty(heads, n_chunks, D, dv, device=like.device, dtype=torch.float32)


def _run_on(x: Tensor, launches: list[Launch]) -> None:
    with _device_guard(x):
        _run(launches)


class PowerAll(torch.autograd.Function):
    """Non-causal: every query reads the state of every key. ``s`` ``(B*Hq, Nq)`` = ``c(n) t^p``."""

    @staticmethod
    def forward(ctx, q, k, v, s, index, weight):
        q3, k3, v3 = _flat(q), _flat(k.to(q.dtype)), _flat(v.to(q.dtype))
        groups, nq, nk, dv = q.shape[1] // k.shape[1], q.shape[-2], k.shape[-2], v.shape[-1]
        tables = (index, weight)
        state = _states(k3.shape[0], 1, index.shape[1], dv, q3)
        out = torch.empty(q3.shape[0], nq, dv, device=q.device, dtype=torch.float32)
        _run_on(q3, [state_launch(k3, v3, state, tables, nk, max(nk, 1), 1, True)])
        _run_on(q3, [apply_launch(q3, state, s, out, tables, nq, _whole(nq), 1, False, groups)])
        ctx.save_for_backward(q3, k3, v3, s, state, index, weight)
        ctx.meta = (groups, q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype)
        return out.view(*q.shape[:3], dv).to(v.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q3, k3, v3, s, state, *tables = ctx.saved_tensors
        groups, qs, ks, vs, *dtypes = ctx.meta
        nq, nk = q3.shape[1], k3.shape[1]
        g = (grad_out.reshape(q3.shape[0], nq, -1).float() * s[..., None]).contiguous()
        dstate = torch.empty_like(state)
        dq, dk = torch.empty(q3.shape, device=q3.device), torch.empty(k3.shape, device=q3.device)
        dv = torch.empty(v3.shape, device=q3.device)
        ones_q, ones_k = s.new_ones(q3.shape[:2]), s.new_ones(k3.shape[:2])
        _run_on(q3, [state_launch(q3, g, dstate, tables, nq, max(nq, 1), 1, False, groups, grouped=True)])
        _run_on(
            q3,
            [
                grad_launch(q3, g, state, ones_q, dq, tables, nq, _whole(nq), 1, False, groups),
                apply_launch(k3, dstate, ones_k, dv, tables, nk, _whole(nk), 1, True),
                grad_launch(k3, v3, dstate, ones_k, dk, tables, nk, _whole(nk), 1, True),
            ],
        )
        return dq.view(qs).to(dtypes[0]), dk.view(ks).to(dtypes[1]), dv.view(vs).to(dtypes[2]), None, None, None


def _whole(rows: int) -> int:
    """A chunk length that puts every row block in chunk 0 (a multiple of 64: whole row blocks)."""
    return max(1, math.ceil(rows / 64)) * 64


class PowerBetweenChunks(torch.autograd.Function):
    """Causal, between chunks: query chunk c reads the prefix state plus the states of chunks ``< c``.

    ``q`` ``(B, Hq, L, d)``, ``k``, ``v`` ``(B, Hkv, L, .)`` aligned and padded to a multiple of ``chunk``;
    ``k_prefix``, ``v_prefix`` the keys every query sees (possibly none); ``s`` ``(B*Hq, L)``.
    """

    @staticmethod
    def forward(ctx, q, k, v, k_prefix, v_prefix, s, index, weight, chunk: int):
        tables = (index, weight)
        q3, k3, v3 = _flat(q), _flat(k.to(q.dtype)), _flat(v.to(q.dtype))
        kp3, vp3 = _flat(k_prefix.to(q.dtype)), _flat(v_prefix.to(q.dtype))
        groups, rows, dv = q.shape[1] // k.shape[1], q.shape[-2], v.shape[-1]
        n_chunks, D, prefix = rows // chunk, index.shape[1], kp3.shape[1]
        deltas = _states(k3.shape[0], n_chunks, D, dv, q3)
        launches = [state_launch(k3, v3, deltas, tables, rows, chunk, n_chunks, True)]
        if prefix:
            first = _states(k3.shape[0], 1, D, dv, q3)
            launches.append(state_launch(kp3, vp3, first, tables, prefix, prefix, 1, True))
        _run_on(q3, launches)
        states = deltas.cumsum(1).sub_(deltas)  # exclusive: the chunks before
        if prefix:
            states += first
        out = torch.empty(q3.shape[0], rows, dv, device=q.device, dtype=torch.float32)
        _run_on(q3, [apply_launch(q3, states, s, out, tables, rows, chunk, n_chunks, False, groups)])
        ctx.save_for_backward(q3, k3, v3, kp3, vp3, s, states, index, weight)
        ctx.meta = (chunk, groups, [(x.shape, x.dtype) for x in (q, k, v, k_prefix, v_prefix)])
        return out.view(*q.shape[:3], dv)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q3, k3, v3, kp3, vp3, s, states, *tables = ctx.saved_tensors
        chunk, groups, shapes = ctx.meta
        rows, n_chunks, prefix = q3.shape[1], states.shape[1], kp3.shape[1]
        g = (grad_out.reshape(q3.shape[0], rows, -1).float() * s[..., None]).contiguous()
        dstates = torch.empty_like(states)
        _run_on(q3, [state_launch(q3, g, dstates, tables, rows, chunk, n_chunks, False, groups, grouped=True)])
        total = dstates.sum(1, keepdim=True)
        after = total - dstates.cumsum(1)  # R_c: the chunks after c
        grads = [torch.empty(x.shape, device=q3.device) for x in (q3, k3, v3, kp3, vp3)]
        dq, dk, dv, dkp, dvp = grads
        ones_q, ones_k = s.new_ones(q3.shape[:2]), s.new_ones(k3.shape[:2])
        launches = [
            grad_launch(q3, g, states, ones_q, dq, tables, rows, chunk, n_chunks, False, groups),
            apply_launch(k3, after, ones_k, dv, tables, rows, chunk, n_chunks, True),
            grad_launch(k3, v3, after, ones_k, dk, tables, rows, chunk, n_chunks, True),
        ]
        if prefix:
            ones_p = s.new_ones(kp3.shape[:2])
            total = total.contiguous()
            launches += [
                apply_launch(kp3, total, ones_p, dvp, tables, prefix, _whole(prefix), 1, True),
                grad_launch(kp3, vp3, total, ones_p, dkp, tables, prefix, _whole(prefix), 1, True),
            ]
        _run_on(q3, launches)
        out = [g.view(shape).to(dtype) for g, (shape, dtype) in zip(grads, shapes)]
        return (*out, None, None, None, None)


def chunk_length(rows: int, D: int, dv: int) -> int:
    """The causal chunk: at least :data:`MIN_CHUNK`, long enough that ``rows / C`` states fit the budget."""
    needed = rows * D * dv * 4 / STATE_BUDGET
    return max(MIN_CHUNK, math.ceil(needed / 64) * 64)


def triton_power_attention(q, k, v, act, t: float, allowed, n, causal, index: Tensor, weight: Tensor) -> Tensor:
    """The linear form on resolved arguments (``power.power_attention``'s CUDA path); ``index`` ``(p, D)`` int32 and
    ``weight`` ``(D,)`` fp32 on q's device: each monomial's coordinates and multinomial count."""
    batch, heads, nq, d = q.shape
    kv_heads, nk, dv = k.shape[1], k.shape[-2], v.shape[-1]
    p, D = index.shape
    if allowed is not None:  # padded keys and values zeroed (selected: an inf there gives no NaN)
        padded = ~allowed.expand(batch, 1, 1, nk).transpose(-2, -1)
        k, v = k.masked_fill(padded, 0.0), v.masked_fill(padded, 0.0)
    counts = n.to(torch.float32).expand(batch, heads, nq, 1)
    s = (act.row_scale(counts) * t**p).reshape(batch * heads, nq)
    if causal is None:
        out = PowerAll.apply(q, k, v, s.contiguous(), index, weight)
        return out
    prefix, skipped = max(0, causal), max(0, -causal)
    rows = nq - skipped
    chunk = chunk_length(rows, D, dv)
    padded_rows = math.ceil(max(rows, 1) / chunk) * chunk
    pad = (0, 0, 0, padded_rows - rows)
    qa = F.pad(q[:, :, skipped:], pad)
    ka, va = F.pad(k[:, :, prefix:], pad), F.pad(v[:, :, prefix:], pad)
    sa = F.pad(s.view(batch, heads, nq)[:, :, skipped:], (0, padded_rows - rows)).reshape(batch * heads, -1)
    between = PowerBetweenChunks.apply(
        qa, ka, va, k[:, :, :prefix], v[:, :, :prefix], sa.contiguous(), index, weight, chunk
    )
    # within each chunk: the quadratic kernel, the chunks as heads, with the global n of each row
    groups, chunks = heads // kv_heads, padded_rows // chunk
    ka, va = (x.repeat_interleave(groups, dim=1) for x in (ka, va))
    na = F.pad(counts[:, :, skipped:], (0, 0, 0, padded_rows - rows), value=1.0)
    as_chunks = lambda x: x.reshape(batch, heads * chunks, chunk, x.shape[-1])  # noqa: E731
    within = TritonAttention.apply(
        as_chunks(qa), as_chunks(ka), as_chunks(va), None, act, t, None, as_chunks(na), 0.0, 0
    )
    out = (between + within.reshape(batch, heads, padded_rows, dv).float())[:, :, :rows]
    if skipped:
        out = torch.cat([out.new_zeros(batch, heads, skipped, dv), out], dim=2)
    return out.to(v.dtype)
