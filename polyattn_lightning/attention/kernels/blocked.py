"""``blocked``: tiled attention in plain PyTorch for any elementwise activation, CPU and GPU.

The forward walks batch x query x key blocks and never holds the whole
``Nq x Nk`` score matrix, only ``(bb*H, bq, bk)`` tiles of it. Without softmax
there is no running max and no rescaling: the partial products of the key
blocks simply add up. The backward recomputes each tile of ``S``::

    dV = phi(S)^T dO,   dS = phi'(S) * (dO V^T),   dQ = dS K t,   dK = dS^T Q t

Causal (``causal`` = the diagonal offset ``Nk - Nq``): key blocks are cut
square-ish instead of whole rows, the tiles wholly above the diagonal are
never visited (forward and backward), and only the tiles the diagonal crosses
are masked, from their coordinates.

Some bookkeeping keeps the tile loop to matmuls plus one to three
elementwise passes:

* the row scale ``c(n)`` (and the dropout ``1 / (1 - p)``) multiplies rows of
  ``out`` and ``dO``, never a tile; a constant factor of ``phi'`` (``p`` for
  ``S^p``) multiplies the final gradients;
* the temperature ``t`` is folded into ``q`` once; the row shift ``b(n)`` and
  the score bias are added to the tile in place;
* tiles are written into buffers reused from tile to tile, and operands are
  kept in whichever layout lets every product run untransposed.

Everything runs in fp32 (fp64 when the inputs are fp64, for gradcheck) with
autocast off; the output and gradients come back in the inputs' dtypes.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..dtypes import autocast_off, compute_dtype
from ..forms import FusedForm
from ..registry import Activation
from .base.contract import KV_STEP, Backend, KernelInputs, elementwise_reasons, stateless_reasons
from .base.costs import quadratic_cost
from .base.layout import as_4d, flatten_heads

#: Score-tile budget in elements (``bb*H*bq*bk``; 512K fp32 is 2 MiB). Smaller tiles
#: stay in cache but pay PyTorch's per-op cost (a dispatch and a thread
#: fork/join) more often; this was the best compromise measured on the 2-core
#: benchmark machine (docs/benchmarks/kernels-cpu.md).
TILE_ELEMENTS = 1 << 19
#: Key blocks cover whole rows up to this many keys: then dK and dV accumulate
#: in place and each tile is one long, efficient matmul.
MAX_KEY_BLOCK = 4096


def block_sizes(shape4: tuple[int, int, int, int], tile_elements: int, causal: bool = False) -> tuple[int, int, int]:
    """``(bb, bq, bk)`` batch, query and key block sizes: whole key rows first, then query rows, then batches.

    Causal: square tiles of one batch entry, so that the tiles above the diagonal can be skipped.
    """
    batch, heads, nq, nk = shape4
    bk = min(nk, MAX_KEY_BLOCK)
    if causal:
        bk = min(bk, max(16, math.isqrt(tile_elements // heads)))
    bq = min(nq, max(16, tile_elements // (heads * bk)))
    bb = min(batch, max(1, tile_elements // (heads * bq * bk)))
    return bb, bq, bk


# --------------------------------------------------------------------------- activation on a tile


def phi_(z: Tensor, act: Activation) -> Tensor:
    """``f(z)`` on a score tile that the caller owns; in place for the built-in forms."""
    form, power = act.fused_form or (None, 1)
    if form is FusedForm.POLY:
        return z if power == 1 else z.pow_(power)
    if form is FusedForm.RELU:
        return z.relu_()
    if form is FusedForm.SIGMOID:
        return z.sigmoid_()
    return act.fn(z)


def grad_gain(act: Activation) -> float:
    """The constant factor of ``f'`` that ``phi_and_grad_`` leaves out (``p`` for ``z^p``).

    It is applied once to the final gradients instead of to every tile.
    """
    form, power = act.fused_form or (None, 1)
    return float(power) if form is FusedForm.POLY else 1.0


def phi_and_grad_(z: Tensor, act: Activation, spare: Tensor) -> tuple[Tensor, Tensor | None]:
    """``(f(z), f'(z) / grad_gain)`` from a tile the caller owns (it is overwritten).

    ``spare`` is a free buffer of ``z``'s shape for the polynomial forms' ``f``.
    The derivative is None where it is identically 1 (``poly1``).
    """
    form, p = act.fused_form or (None, 1)
    if form is FusedForm.POLY:
        if p == 1:
            return z, None
        f = torch.pow(z, p, out=spare)
        return f, (z if p == 2 else z.pow_(p - 1))
    if form is FusedForm.SIGMOID:
        f = z.sigmoid_()
        return f, f - f * f
    return act.fn(z), act.grad(z)


# --------------------------------------------------------------------------- the tile walk


class _Tiles(NamedTuple):
    """Per-call constants of the tile walk, shared by forward and backward.

    A tile covers ``bb`` whole batch entries (all heads), ``bq`` queries and
    ``bk`` keys. Operands live as ``(B*H, N, d)``, so a batch block is a
    contiguous range of their first dimension; masks and bias keep their
    broadcastable 4-D shapes and are sliced along the dimensions they have.
    """

    shape4: tuple[int, int, int, int]  # (B, H, Nq, Nk)
    block: tuple[int, int, int]  # (bb, bq, bk)
    row_shift: Tensor | None  # b(n), broadcastable to (B, H, Nq, 1); None when zero
    blocked: Tensor | None  # ~allowed, broadcastable to (B, H, Nq, Nk)
    bias: Tensor | None
    dropout_p: float
    seed: int
    causal: int | None  # query i attends keys j <= i + causal; None: not causal

    def blocks(self):
        """Yield ``(index, (batch, rows, cols))`` in a fixed order, so dropout can be replayed.

        Causal: the tiles wholly above the diagonal (first key beyond the last row's reach) are left out.
        """
        (batch, _, nq, nk), (bb, bq, bk) = self.shape4, self.block
        grid = [(b, r, c) for b in range(0, batch, bb) for r in range(0, nq, bq) for c in range(0, nk, bk)]
        for index, (b, r, c) in enumerate(grid):
            if self.causal is not None and c > min(r + bq, nq) - 1 + self.causal:
                continue
            yield index, (slice(b, b + bb), slice(r, r + bq), slice(c, c + bk))

    def heads(self, where) -> slice:
        """The ``(B*H, ...)`` first-dimension range of a batch block."""
        h = self.shape4[1]
        return slice(where[0].start * h, min(where[0].stop, self.shape4[0]) * h)

    def scores(self, q_t: Tensor, k_t: Tensor, where, out: "_Scratch") -> Tensor:
        """``S + b(n) + bias`` for one tile, ``(bb*H, bq, bk)``, into scratch; ``k_t`` is ``(B*H, d, Nk)``."""
        bh, rows, cols = self.heads(where), where[1], where[2]
        z = out.product(q_t[bh, rows], k_t[bh, :, cols])
        z4 = self.view4(z)
        for extra in (self._sliced(self.row_shift, where), self._sliced(self.bias, where)):
            if extra is not None:
                z4.add_(extra)
        return z

    def mask_(self, tile: Tensor, index: int, where) -> Tensor:
        """Zero the disallowed pairs of a tile and apply this tile's dropout draw, in place."""
        blocked = self._sliced(self.blocked, where)
        if blocked is not None:
            self.view4(tile).masked_fill_(blocked, 0.0)
        rows, cols = where[1], where[2]
        if (
            self.causal is not None and cols.start + tile.shape[2] - 1 > rows.start + self.causal
        ):  # crosses the diagonal
            i = torch.arange(rows.start, rows.start + tile.shape[1], device=tile.device)
            j = torch.arange(cols.start, cols.start + tile.shape[2], device=tile.device)
            tile.masked_fill_(j > i[:, None] + self.causal, 0.0)
        if self.dropout_p:
            generator = torch.Generator(tile.device).manual_seed(self.seed + index)
            tile.mul_(torch.empty_like(tile).bernoulli_(1.0 - self.dropout_p, generator=generator))
        return tile

    def view4(self, tile: Tensor) -> Tensor:
        return tile.view(-1, self.shape4[1], tile.shape[1], tile.shape[2])

    @staticmethod
    def _sliced(t: Tensor | None, where) -> Tensor | None:
        """``t[where]`` along the dimensions ``t`` does not broadcast (size > 1)."""
        if t is None:
            return None
        batch, rows, cols = where
        return t[
            batch if t.shape[0] > 1 else slice(None),
            :,
            rows if t.shape[2] > 1 else slice(None),
            cols if t.shape[3] > 1 else slice(None),
        ]


class _Scratch:
    """A tile-sized buffer reused from tile to tile.

    A fresh multi-MiB tensor per tile is a fresh ``mmap`` whose pages fault in
    one by one; measured, that made an out-of-place ``pow`` several times slower than
    an in-place one.
    """

    def __init__(self, tiles: _Tiles, like: Tensor):
        (bb, bq, bk), heads = tiles.block, tiles.shape4[1]
        self.flat = like.new_empty(bb * heads * bq * bk)

    def view(self, shape: tuple[int, int, int]) -> Tensor:
        return self.flat[: shape[0] * shape[1] * shape[2]].view(shape)

    def like(self, tile: Tensor) -> Tensor:
        return self.view(tile.shape)

    def product(self, a: Tensor, b: Tensor) -> Tensor:
        """``a @ b`` (batched), written into the buffer."""
        return torch.bmm(a, b, out=self.view((a.shape[0], a.shape[1], b.shape[2])))


def _add_product(dst: Tensor, a: Tensor, b: Tensor) -> None:
    """``dst += a @ b`` (batched); in place when ``dst`` is contiguous, else through a temporary.

    ``baddbmm_`` into a strided view falls back to one ``addmm_`` per batch entry.
    """
    if dst.is_contiguous():
        dst.baddbmm_(a, b)
    else:
        dst.add_(torch.bmm(a, b))


def _transposed(x: Tensor) -> Tensor:
    """``(B*H, N, d)`` -> contiguous ``(B*H, d, N)``: MKL multiplies untransposed operands faster."""
    return x.transpose(1, 2).contiguous()


class BlockedAttention(torch.autograd.Function):
    """``out = c(n) * mask(f(S + b(n) + bias)) @ v``, computed and differentiated tile by tile."""

    @staticmethod
    def forward(
        ctx,
        q,
        k,
        v,
        bias,
        act: Activation,
        t: float,
        allowed,
        n,
        dropout_p: float,
        tile_elements: int,
        causal: int | None,
    ):
        shape4 = (*q.shape[:3], k.shape[-2])
        dtype = compute_dtype(q)
        with autocast_off(q.device.type):
            n = n.to(dtype)
            row_scale = act.row_scale(n) / (1.0 - dropout_p)
            tiles = _Tiles(
                shape4,
                block_sizes(shape4, tile_elements, causal is not None),
                as_4d(act.row_shift(n)) if act.shift else None,
                None if allowed is None else as_4d(~allowed),
                None if bias is None else as_4d(bias.detach().to(dtype)),
                dropout_p,
                int(torch.randint(0, 2**62, (1,)).item()) if dropout_p else 0,
                causal,
            )
            q_t, k_t, v3 = flatten_heads(q, dtype) * t, _transposed(flatten_heads(k, dtype)), flatten_heads(v, dtype)
            out = torch.zeros(*q_t.shape[:2], v.shape[-1], dtype=dtype, device=q.device)
            scores = _Scratch(tiles, q_t)
            for index, where in tiles.blocks():
                p = tiles.mask_(phi_(tiles.scores(q_t, k_t, where, scores), act), index, where)
                bh = tiles.heads(where)
                _add_product(out[bh, where[1]], p, v3[bh, where[2]])
            out = (out.view(*shape4[:3], -1) * row_scale).to(v.dtype)
        ctx.save_for_backward(q, k, v, bias, row_scale)
        ctx.act, ctx.t, ctx.tiles = act, t, tiles
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, bias, row_scale = ctx.saved_tensors
        act, t, tiles = ctx.act, ctx.t, ctx.tiles
        dtype = row_scale.dtype
        with autocast_off(q.device.type):
            # Operands in both layouts, so that no product needs a transposed tile;
            # dK and dV accumulate transposed, (B*H, d, Nk).
            q_t, k3 = flatten_heads(q, dtype) * t, flatten_heads(k, dtype)
            do = flatten_heads(grad_out.to(dtype) * row_scale, dtype)  # c(n) folded into dO
            q_tt, k_t, v_t, do_t = (
                _transposed(q_t),
                _transposed(k3),
                _transposed(flatten_heads(v, dtype)),
                _transposed(do),
            )
            dq, dk_t, dv_t = torch.zeros_like(q_t), torch.zeros_like(k_t), torch.zeros_like(v_t)
            want_bias = bias is not None and ctx.needs_input_grad[3]
            dbias = torch.zeros_like(tiles.bias) if want_bias else None
            scores, values, score_grads = (_Scratch(tiles, q_t) for _ in range(3))
            for index, where in tiles.blocks():
                bh, rows, cols = tiles.heads(where), where[1], where[2]
                z = tiles.scores(q_t, k_t, where, scores)
                f, grad = phi_and_grad_(z, act, values.like(z))
                _add_product(dv_t[bh, :, cols], do_t[bh, :, rows], tiles.mask_(f, index, where))
                ds = score_grads.product(do[bh, rows], v_t[bh, :, cols])
                ds = tiles.mask_(ds if grad is None else ds.mul_(grad), index, where)
                _add_product(dq[bh, rows], ds, k3[bh, cols])
                _add_product(dk_t[bh, :, cols], q_tt[bh, :, rows], ds)
                if want_bias:
                    _accumulate_bias_grad(dbias, tiles.view4(ds), where)
            gain = grad_gain(act)
            grads = (
                dq.mul_(t * gain).view(q.shape).to(q.dtype),
                dk_t.mul_(gain).transpose(1, 2).reshape(k.shape).to(k.dtype),
                dv_t.transpose(1, 2).reshape(v.shape).to(v.dtype),
                dbias.mul_(gain).reshape(bias.shape).to(bias.dtype) if want_bias else None,
            )
        return (*grads, None, None, None, None, None, None, None)


def _accumulate_bias_grad(dbias: Tensor, ds4: Tensor, where) -> None:
    """Add a tile's ``dS`` into ``dbias``, summed over the dimensions the bias broadcasts along."""
    broadcast = [dim for dim in range(4) if dbias.shape[dim] == 1 and ds4.shape[dim] > 1]
    _Tiles._sliced(dbias, where).add_(ds4.sum(dim=broadcast, keepdim=True) if broadcast else ds4)


def blocked(q, k, v, act, t, allowed, bias, n, dropout_p, causal=None, tile_elements: int | None = None) -> Tensor:
    """The blocked kernel on resolved arguments (``KernelInputs``' fields); ``tile_elements`` overrides
    ``TILE_ELEMENTS``."""
    return BlockedAttention.apply(q, k, v, bias, act, t, allowed, n, dropout_p, tile_elements or TILE_ELEMENTS, causal)


class Blocked(Backend):
    name = "blocked"
    supports = "any elementwise activation (custom ones too), every mask, bias, dropout, causal; CPU and GPU"

    def not_supported_reasons(self, inputs: KernelInputs) -> list[str]:
        return stateless_reasons(inputs, self.name) + elementwise_reasons(inputs)

    def declined_reasons(self, inputs: KernelInputs) -> list[str]:
        if inputs.kind == KV_STEP:
            return ["a KV-cache step: the few rows go in one call of a step form ('fused_cpu', 'materialized')"]
        return []

    def cost(self, inputs: KernelInputs) -> float:
        """The fused kernels' model: never cheaper than them (ties keep the priority order), so ``auto`` takes
        the linear form over it no earlier than over them."""
        return quadratic_cost(inputs)

    def forward(self, inputs: KernelInputs) -> Tensor:
        return blocked(*inputs.tiled)


BACKEND = Blocked()
