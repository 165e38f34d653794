"""Tiny Hugging Face models built from configs (random weights), weights drawn at a trained model's scale, and the
tests' own attention reference.

The reference (``references.py``: :func:`~references.attention_reference`) is written from the formula,
independently of the project: ``S = q k^T * scaling``; the pairs HF's boolean mask (or causality) forbids are
dropped; ``N`` counts the keys a query may attend; ``out = (S^3 / sqrt(N)) v``. It is registered with
transformers as :data:`REFERENCE` so a model can run it through the same ``AttentionInterface`` door.
"""
from __future__ import annotations

import copy

import torch
from references import REFERENCE
from torch import nn
from transformers import BertConfig, BertModel, LlamaConfig, LlamaForCausalLM, ViTConfig, ViTModel

from polyattn_lightning.bench.hf_support import POSITION_TABLES


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


def trained_like(model: nn.Module, seed: int = 0) -> nn.Module:
    """``model`` with every parameter drawn again at unit scale, as a trained model's are (HF's init is small:
    scores near 0, where x^3 attention is ~0 and mistakes in it do not show): embedding and position tables, biases,
    norms' weights, scales and the rest from N(0, 1); each weight matrix of a projection (2-D or more, not an
    embedding table) divided by the square root of its fan-in, so activations stay at unit scale through the layers
    and finite in float32."""
    generator = torch.Generator().manual_seed(seed)
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    with torch.no_grad():
        for name, p in model.named_parameters():
            draw = torch.randn(p.shape, generator=generator, dtype=torch.float64)
            if p.dim() >= 2 and id(p) not in tables and not POSITION_TABLES.search(name):
                draw /= p[0].numel() ** 0.5
            p.copy_(draw)
    return model


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
