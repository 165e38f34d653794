"""Tiny Hugging Face models built from configs (random weights), and the tests' own attention reference.

The reference (``references.py``: :func:`~references.attention_reference`) is written from the formula,
independently of the project: ``S = q k^T * scaling``; the pairs HF's boolean mask (or causality) forbids are
dropped; ``N`` counts the keys a query may attend; ``out = (S^3 / sqrt(N)) v``. It is registered with
transformers as :data:`REFERENCE` so a model can run it through the same ``AttentionInterface`` door.
"""
from __future__ import annotations

import copy

import torch
from references import REFERENCE
from transformers import BertConfig, BertModel, LlamaConfig, LlamaForCausalLM, ViTConfig, ViTModel


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
