"""The Long Range Arena transformer of Xiong et al. (Nystromformer's PyTorch LRA code), on the attention registry.

Token + learned position embeddings, pre-LayerNorm blocks (attention, then a
GELU MLP), a final LayerNorm, mean pooling over the real tokens and an MLP head
``Linear(dim, mlp_dim) - ReLU - Linear(mlp_dim, classes)``. Defaults are the
paper's: dim 64, MLP 128, 2 heads of 32, 2 layers, dropout 0.1 (also on the
attention map). The two-tower variant (Retrieval) encodes both documents with
the same encoder and classifies ``[x0, x1, x0 * x1, x0 - x1]``.

Differences from that code, on purpose: padding is passed as a key padding
mask to :func:`~polyattn_lightning.attention.attention` (so ``N`` in an
``inv_sqrt_n`` scale counts real tokens, and the fused kernels see padding
rather than a dense mask), and the mean pools over real tokens only (theirs
divides the masked sum by the padded length).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from timm.layers import Mlp
from torch import Tensor, nn

from ..attention import ActivationSpec, get_activation
from ..attention.switch.base import SwitchedAttention


class LRAAttention(SwitchedAttention):
    """Multi-head self-attention with a key padding mask, through ``attention()``.

    It is a :class:`~polyattn_lightning.attention.switch.base.SwitchedAttention`, so
    ``set_attention`` re-switches it and the diagnostics find it with
    ``attention_modules`` and read it through ``capture`` like a switched timm module.
    The captured :class:`AttentionInputs` carry the padding as ``key_padding_mask`` (True = padding).
    """

    def __init__(self, dim: int, num_heads: int, head_dim: int, activation: ActivationSpec, attn_drop: float):
        super().__init__()
        get_activation(activation)  # an unknown name fails here, naming it
        self.num_heads, self.head_dim = num_heads, head_dim
        self.scale = head_dim**-0.5
        self.qkv = nn.Linear(dim, 3 * num_heads * head_dim)
        self.attn_drop = nn.Dropout(attn_drop)  # its p is attention()'s dropout_p, as in the switched timm modules
        self.proj = nn.Linear(num_heads * head_dim, dim)
        self.activation_spec = dict(activation) if isinstance(activation, Mapping) else activation
        self.capture = None

    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        """x ``(B, N, dim)``; key_padding_mask bool ``(B, N)``, True = padding."""
        B, N, _ = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        x = self._attend(q, k, v, self.scale, key_padding_mask=key_padding_mask)
        return self.proj(x.transpose(1, 2).reshape(B, N, -1))


class LRABlock(nn.Module):
    """Pre-LayerNorm transformer block: ``x + drop(attn(ln(x)))``, then ``x + mlp(ln(x))``."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        head_dim: int,
        mlp_dim: int,
        dropout: float,
        attn_dropout: float,
        activation: ActivationSpec,
    ):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = LRAAttention(dim, num_heads, head_dim, activation, attn_dropout)
        self.drop = nn.Dropout(dropout)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, mlp_dim, act_layer=nn.GELU, drop=dropout)

    def forward(self, x: Tensor, key_padding_mask: Tensor | None) -> Tensor:
        x = x + self.drop(self.attn(self.norm1(x), key_padding_mask))
        return x + self.mlp(self.norm2(x))


class LRAEncoder(nn.Module):
    """Token ids ``(B, N)`` and their mask (True = real token) -> one pooled vector ``(B, dim)`` per sequence."""

    def __init__(
        self,
        vocab_size: int,
        max_length: int,
        dim: int = 64,
        depth: int = 2,
        num_heads: int = 2,
        head_dim: int = 32,
        mlp_dim: int = 128,
        dropout: float = 0.1,
        attn_dropout: float = 0.1,
        attention: ActivationSpec = "softmax",
    ):
        super().__init__()
        self.max_length = max_length
        self.token_embed = nn.Embedding(vocab_size, dim)
        self.pos_embed = nn.Embedding(max_length, dim)
        for embedding in (self.token_embed, self.pos_embed):
            nn.init.normal_(embedding.weight, std=0.02)  # as Xiong et al.
        self.embed_drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            LRABlock(dim, num_heads, head_dim, mlp_dim, dropout, attn_dropout, attention) for _ in range(depth)
        )
        self.norm = nn.LayerNorm(dim)

    def forward(self, input_ids: Tensor, mask: Tensor) -> Tensor:
        if input_ids.dim() != 2 or mask.shape != input_ids.shape or mask.dtype != torch.bool:
            raise ValueError(
                f"LRAEncoder takes input_ids (B, N) and a bool mask of the same shape; got input_ids "
                f"{tuple(input_ids.shape)} and mask {tuple(mask.shape)} {mask.dtype}"
            )
        if input_ids.shape[1] > self.max_length:
            raise ValueError(
                f"sequence length {input_ids.shape[1]} exceeds the encoder's max_length {self.max_length} "
                "(its position embeddings); truncate in the data or raise max_length"
            )
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.embed_drop(self.token_embed(input_ids) + self.pos_embed(positions))
        padding = None if bool(mask.all()) else ~mask
        for block in self.blocks:
            x = block(x, padding)
        x = self.norm(x)
        weights = mask.unsqueeze(-1).to(x.dtype)
        return (x * weights).sum(1) / weights.sum(1).clamp(min=1.0)


class LRAClassifier(nn.Module):
    """:class:`LRAEncoder` and an MLP head; ``two_tower`` takes ``(B, 2, N)`` document pairs (Retrieval).

    The head's hidden width is the blocks' ``mlp_dim``, as in Xiong et al.; further
    encoder arguments (``depth``, ``attention``...) pass through ``encoder_kwargs``.
    """

    def __init__(
        self,
        vocab_size: int,
        max_length: int,
        num_classes: int,
        two_tower: bool = False,
        dim: int = 64,
        mlp_dim: int = 128,
        **encoder_kwargs,
    ):
        super().__init__()
        self.two_tower = two_tower
        self.encoder = LRAEncoder(vocab_size, max_length, dim=dim, mlp_dim=mlp_dim, **encoder_kwargs)
        self.head = nn.Sequential(
            nn.Linear(4 * dim if two_tower else dim, mlp_dim), nn.ReLU(), nn.Linear(mlp_dim, num_classes)
        )

    def forward(self, input_ids: Tensor, mask: Tensor) -> Tensor:
        if not self.two_tower:
            return self.head(self.encoder(input_ids, mask))
        if input_ids.dim() != 3 or input_ids.shape[1] != 2:
            raise ValueError(f"a two-tower model takes input_ids (B, 2, N), got {tuple(input_ids.shape)}")
        # both towers share the encoder: one pass over the 2B documents
        x0, x1 = self.encoder(input_ids.flatten(0, 1), mask.flatten(0, 1)).unflatten(0, (-1, 2)).unbind(1)
        return self.head(torch.cat([x0, x1, x0 * x1, x0 - x1], dim=-1))
