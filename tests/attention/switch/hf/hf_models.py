"""Tiny Hugging Face models built from configs (random weights), and the tests' own attention reference.

The reference (:func:`reference_attention`) is written from the formula, independently of the project:
``S = q k^T * scaling``; the pairs HF's boolean mask (or causality) forbids are dropped; ``N`` counts the
keys a query may attend; ``out = (S^3 / sqrt(N)) v``. It is registered with transformers as
:data:`REFERENCE` so a model can run it through the same ``AttentionInterface`` door.
"""
from __future__ import annotations

import copy

import torch
from transformers import (
    AttentionInterface,
    BertConfig,
    BertModel,
    LlamaConfig,
    LlamaForCausalLM,
    ViTConfig,
    ViTModel,
)
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

REFERENCE = "tests_poly3_reference"


def reference_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """x^3 / sqrt(N) attention, the whole score matrix, fp64; HF's (output (B, L, H, D), None)."""
    q, k, v = query.double(), key.double(), value.double()
    heads_per_kv = q.shape[1] // k.shape[1]
    k = torch.cat([k[:, h // heads_per_kv : h // heads_per_kv + 1] for h in range(q.shape[1])], dim=1)
    v = torch.cat([v[:, h // heads_per_kv : h // heads_per_kv + 1] for h in range(q.shape[1])], dim=1)
    s = q @ k.transpose(-1, -2) * scaling
    nq, nk = s.shape[-2:]
    if attention_mask is not None:
        keep = attention_mask.expand(s.shape)
    elif getattr(module, "is_causal", True) and nq > 1:
        keep = torch.tensor([[j <= i for j in range(nk)] for i in range(nq)]).expand(s.shape)
    else:
        keep = torch.ones(s.shape, dtype=torch.bool)
    n = keep.sum(-1, keepdim=True).clamp_min(1).double()
    phi = torch.where(keep, s**3 / n.sqrt(), 0.0)
    return (phi @ v).to(query.dtype).transpose(1, 2), None


AttentionInterface.register(REFERENCE, reference_attention)
AttentionMaskInterface.register(REFERENCE, sdpa_mask)


# initializer_range 0.2 (HF's default is 0.02): scores of order 1, so x^3 attention is not ~0 and the tests see it

def tiny_bert(**overrides) -> BertModel:
    torch.manual_seed(0)
    config = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
                  max_position_embeddings=32, initializer_range=0.2, attn_implementation="sdpa")
    return BertModel(BertConfig(**{**config, **overrides})).eval()


def tiny_vit(**overrides) -> ViTModel:
    torch.manual_seed(0)
    config = dict(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=48, initializer_range=0.2, attn_implementation="sdpa")
    return ViTModel(ViTConfig(**{**config, **overrides})).eval()


def tiny_llama(**overrides) -> LlamaForCausalLM:
    """Grouped-query by default: 4 query heads share 2 key/value heads."""
    torch.manual_seed(0)
    config = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2, attn_implementation="sdpa")
    return LlamaForCausalLM(LlamaConfig(**{**config, **overrides})).eval()


def with_reference(model):
    """A copy of ``model`` (same weights) attending through the tests' own reference."""
    twin = copy.deepcopy(model)
    twin.set_attn_implementation(REFERENCE)
    return twin


def token_batch(vocab: int = 64, length: int = 9, seed: int = 1):
    """Two rows of token ids; the second row's last 3 positions are padding (attention_mask 0)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (2, length), generator=g)
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, -3:] = 0
    return ids, mask
