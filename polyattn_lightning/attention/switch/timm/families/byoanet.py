"""ByoaNet's attention layers (``timm.layers``, built by ``timm.models.byoanet``): BoTNet and HaloNet.

The relative-position logits ``pos_embed(q)`` depend on the query: a full ``attn_bias`` with its gradient
(times ``scale`` when ``scale_pos_embed``).

* ``BottleneckAttn``: global attention over the ``H * W`` positions (N of them).
* ``HaloAttn``: each ``block x block`` query block attends its ``(block + 2 halo)^2`` window. The batch
  of blocks is ``attention()``'s head axis (``(B * heads, blocks, ...)``, as timm lays it out), so a
  diagnostic's "head" is a block. timm zero-pads the border windows and attends the padding (softmax
  counts it); so does the switched layer: N = the window size, a padded key has v = 0.
"""

from __future__ import annotations

import torch.nn.functional as F
from timm.layers.bottleneck_attn import BottleneckAttn
from timm.layers.halo_attn import HaloAttn
from timm.layers.trace_utils import _assert
from torch import Tensor

from ...base import register_adapter
from ._common import SwitchedWithoutDropout


def _position_bias(module: BottleneckAttn | HaloAttn, q: Tensor) -> Tensor:
    """``pos_embed(q)`` as a bias added to ``q k^T * scale``, timm's two orders of scaling."""
    bias = module.pos_embed(q)
    return bias * module.scale if module.scale_pos_embed else bias


@register_adapter(BottleneckAttn)
class BottleneckAttention(SwitchedWithoutDropout, BottleneckAttn):
    """``timm.layers.BottleneckAttn`` (BoTNet)."""

    def forward(self, x: Tensor) -> Tensor:
        B, C, H, W = x.shape
        _assert(H == self.pos_embed.height and W == self.pos_embed.width, "feature map of the layer's feat_size")
        q, k, v = self.qkv(x).split([self.dim_out_qk, self.dim_out_qk, self.dim_out_v], dim=1)
        q, k = (t.reshape(B * self.num_heads, self.dim_head_qk, -1).transpose(-1, -2) for t in (q, k))
        v = v.reshape(B * self.num_heads, self.dim_head_v, -1).transpose(-1, -2)
        bias = _position_bias(self, q).view(B, self.num_heads, H * W, H * W)
        q, k, v = (t.view(B, self.num_heads, H * W, -1) for t in (q, k, v))
        out = self._attend(q, k, v, self.scale, attn_bias=bias)
        return self.pool(out.transpose(-1, -2).reshape(B, self.dim_out_v, H, W))


@register_adapter(HaloAttn)
class HaloAttention(SwitchedWithoutDropout, HaloAttn):
    """``timm.layers.HaloAttn`` (HaloNet)."""

    def forward(self, x: Tensor) -> Tensor:
        B, C, H, W = x.shape
        _assert(H % self.block_size == 0 and W % self.block_size == 0, "feature map of whole blocks")
        nh, nw = H // self.block_size, W // self.block_size
        blocks = nh * nw
        q = self.q(x).reshape(-1, self.dim_head_qk, nh, self.block_size_ds, nw, self.block_size_ds)
        q = q.permute(0, 1, 3, 5, 2, 4).reshape(B * self.num_heads, self.dim_head_qk, -1, blocks).transpose(1, 3)
        kv = F.pad(self.kv(x), [self.halo_size] * 4)
        kv = kv.unfold(2, self.win_size, self.block_size).unfold(3, self.win_size, self.block_size)
        kv = kv.reshape(B * self.num_heads, self.dim_head_qk + self.dim_head_v, blocks, -1).permute(0, 2, 3, 1)
        k, v = kv.split([self.dim_head_qk, self.dim_head_v], dim=-1)
        out = self._attend(q, k, v, self.scale, attn_bias=_position_bias(self, q)).transpose(1, 3)
        out = out.reshape(-1, self.block_size_ds, self.block_size_ds, nh, nw).permute(0, 3, 1, 4, 2)
        return self.pool(out.reshape(B, self.dim_out_v, H // self.block_stride, W // self.block_stride))
