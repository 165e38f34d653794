"""MViTv2 (``timm.models.mvitv2``): pooling attention with its decomposed relative-position term.

N in the length scale is the number of pooled keys (class token included). The relative-position term
``q . R_h + q . R_w`` depends on the query, so it is a full ``(B, H, Nq, Nk)`` ``attn_bias``: timm's own
``cal_rel_pos_type`` adds it to zero scores, and it keeps its gradient to q and to ``rel_pos_h/w``.

Not adapted: ``MultiScaleAttentionPoolFirst`` (``pool_first=True``): no registered model builds it, and
its 1.0.31 forward multiplies q by an untransposed k, which fails for every shape but ``Nk == heads``.
"""

from __future__ import annotations

from timm.models.mvitv2 import MultiScaleAttention, cal_rel_pos_type, reshape_post_pool, reshape_pre_pool
from torch import Tensor

from ...base import register_adapter
from ._common import SwitchedWithoutDropout


@register_adapter(MultiScaleAttention)
class MViTv2Attention(SwitchedWithoutDropout, MultiScaleAttention):
    """``timm.models.mvitv2.MultiScaleAttention``: q, k, v pooled as timm pools them, then attended."""

    def forward(self, x: Tensor, feat_size: list[int]) -> tuple[Tensor, list[int]]:
        B, N, _ = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(dim=0)
        q, q_size = self._pool(q, self.pool_q, self.norm_q, feat_size)
        k, k_size = self._pool(k, self.pool_k, self.norm_k, feat_size)
        v, _ = self._pool(v, self.pool_v, self.norm_v, feat_size)
        bias = None
        if self.rel_pos_type == "spatial":
            zeros = q.new_zeros(B, self.num_heads, q.shape[2], k.shape[2])
            bias = cal_rel_pos_type(zeros, q, self.has_cls_token, q_size, k_size, self.rel_pos_h, self.rel_pos_w)
        x = self._attend(q, k, v, self.scale, attn_bias=bias)
        if self.residual_pooling:
            x = x + q
        return self.proj(x.transpose(1, 2).reshape(B, -1, self.dim_out)), q_size

    def _pool(self, t: Tensor, pool, norm, feat_size: list[int]) -> tuple[Tensor, list[int]]:
        """timm's pooling of one of q, k, v (with its norm) and the grid it leaves."""
        size = feat_size
        if pool is not None:
            t, tok = reshape_pre_pool(t, feat_size, self.has_cls_token)
            t, size = reshape_post_pool(pool(t), self.num_heads, tok)
        if norm is not None:
            t = norm(t)
        return t, size
