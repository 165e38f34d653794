"""Tiny models of each projection layout a conversion edits, with weights whose scores are of pretrained size, and
their sample batches."""
from __future__ import annotations

import timm
import torch
from transformers import (
    BertConfig,
    BertModel,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

VOCAB = 64
DECODER = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2, attn_implementation="sdpa")


def llama():
    """Separate q/k/v/o ``nn.Linear``; 4 query heads share 2 key/value heads."""
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**DECODER)).eval()


def qwen3():
    """A q-norm ``(head_dim,)`` shared by all heads."""
    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(**DECODER, head_dim=8)).eval()


def olmo2():
    """A q-norm over all heads at once, ``(heads * head_dim,)``: per-head slices."""
    torch.manual_seed(0)
    return Olmo2ForCausalLM(Olmo2Config(**DECODER)).eval()


def gpt2():
    """A fused ``Conv1D`` ``c_attn`` (weight ``(in, 3 * width)``: q, k, v are columns) and a ``Conv1D`` ``c_proj``."""
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, initializer_range=0.2,
                        attn_implementation="sdpa")
    return GPT2LMHeadModel(config).eval()


def bert():
    """The heads projected outside the attention module (``attention.output.dense``), query bias."""
    torch.manual_seed(0)
    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=48, max_position_embeddings=64, initializer_range=0.2,
                        attn_implementation="sdpa")
    return BertModel(config).eval()


def _pretrained_sized(model):
    """timm initialises attention small (std 0.02): scale q, k, v and the output projection up to pretrained
    sizes (scores of order ten), so the attention's output is felt in the block's."""
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv.weight.mul_(8)
            block.attn.proj.weight.mul_(8)
            if getattr(block.attn, "q_bias", None) is not None:
                block.attn.q_bias.normal_(0, 0.5)
    return model.eval()


def vit():
    """timm's fused ``qkv`` ``nn.Linear`` (rows ``[q; k; v]``) and ``proj``."""
    torch.manual_seed(0)
    return _pretrained_sized(timm.create_model("vit_tiny_patch16_224", img_size=16, patch_size=4, embed_dim=32,
                                               depth=2, num_heads=4, num_classes=5))


def eva():
    """timm's EVA: fused ``qkv`` without bias and a separate ``q_bias``."""
    torch.manual_seed(0)
    return _pretrained_sized(timm.create_model("eva02_tiny_patch14_224", img_size=28, depth=2, num_classes=5))


def token_samples(batches: int = 3, rows: int = 4, length: int = 12, padded: bool = False, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(batches):
        ids = torch.randint(1, VOCAB, (rows, length), generator=g)
        batch = {"input_ids": ids}
        if padded:
            mask = torch.ones_like(ids)
            mask[-1, -4:] = 0
            batch["attention_mask"] = mask
        samples.append(batch)
    return samples


def image_samples(size: int, batches: int = 3, rows: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, 3, size, size, generator=g) for _ in range(batches)]
