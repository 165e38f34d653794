"""The LRA encoder: padding changes nothing for real tokens, the attention matches a hand-written reference,
the two-tower head, the diagnostics hook, and errors on bad input."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from polyattn_lightning.attention import Activation, registry
from polyattn_lightning.attention.switch.base import attention_map
from polyattn_lightning.attention import attention_modules, set_attention
from polyattn_lightning.models import LRAAttention, LRAClassifier, LRAEncoder


def tanh_grad(s):
    return 1 - torch.tanh(s) ** 2


@pytest.fixture
def tanh_attn(monkeypatch):
    """A custom activation registered for one test (runs on the blocked kernel)."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_RESOLVED", {})
    registry.register_activation(
        "lra_test_tanh", lambda scale="inv_n": Activation("lra_test_tanh", torch.tanh, tanh_grad, scale=scale)
    )
    return "lra_test_tanh"


ACTIVATIONS = [
    "softmax",
    "poly3",
    {"name": "poly3", "scale": 0.0714},
    {"name": "poly1", "scale": 0.0714},
    "poly1",
    "relu",
    "softplus",
    "sigmoid",
]


def _padded(ids: torch.Tensor, lengths: list[int], extra: int, pad_id: int = 0):
    """``ids`` (B, N) with each row cut to its length and ``extra`` more padding positions."""
    B, N = ids.shape
    padded = torch.full((B, N + extra), pad_id, dtype=torch.long)
    mask = torch.zeros(B, N + extra, dtype=torch.bool)
    for row, length in enumerate(lengths):
        padded[row, :length] = ids[row, :length]
        mask[row, :length] = True
    return padded, mask


@pytest.mark.parametrize("activation", ACTIVATIONS + ["custom"], ids=str)
def test_padding_changes_nothing_for_the_real_tokens(activation, tanh_attn):
    """Every sequence encoded alone, unpadded, gives the same pooled vector as in a padded batch."""
    activation = tanh_attn if activation == "custom" else activation
    torch.manual_seed(0)
    encoder = LRAEncoder(vocab_size=11, max_length=48, attention=activation).eval()
    lengths = [37, 20, 5]
    ids, mask = _padded(torch.randint(1, 11, (3, 37)), lengths, extra=11)
    ids[~mask] = torch.randint(1, 11, (int((~mask).sum()),))  # what a padded position holds must not matter
    with torch.no_grad():
        batched = encoder(ids, mask)
        alone = torch.cat([encoder(ids[i : i + 1, :n], mask[i : i + 1, :n]) for i, n in enumerate(lengths)])
    torch.testing.assert_close(batched, alone, rtol=1e-4, atol=1e-5)


def _reference_attention(module: LRAAttention, x: torch.Tensor, keep: torch.Tensor, phi) -> torch.Tensor:
    """The layer written out with the whole score matrix: ``phi(S, n) @ v`` with padded keys at zero weight."""
    B, N, _ = x.shape
    q, k, v = module.qkv(x).reshape(B, N, 3, module.num_heads, module.head_dim).permute(2, 0, 3, 1, 4)
    s = q @ k.transpose(-2, -1) / math.sqrt(module.head_dim)
    n = keep.sum(-1).view(B, 1, 1, 1).float()
    weights = phi(s.masked_fill(~keep[:, None, None, :], -math.inf), n).masked_fill(~keep[:, None, None, :], 0.0)
    return module.proj((weights @ v).transpose(1, 2).reshape(B, N, -1))


REFERENCES = {
    "softmax": lambda s, n: s.softmax(-1),
    "poly3": lambda s, n: s.nan_to_num(0.0, 0.0, 0.0) ** 3 / n.sqrt(),  # N = real tokens, not the padded length
    "relu": lambda s, n: s.clamp(min=0) / n,
}


@pytest.mark.parametrize("activation", sorted(REFERENCES))
def test_attention_layer_matches_the_written_out_formula(activation):
    torch.manual_seed(1)
    module = LRAAttention(dim=16, num_heads=2, head_dim=8, activation=activation, attn_drop=0.0)
    x = torch.randn(2, 12, 16)
    keep = torch.ones(2, 12, dtype=torch.bool)
    keep[1, 7:] = False
    with torch.no_grad():
        out = module(x, ~keep)
        expected = _reference_attention(module, x, keep, REFERENCES[activation])
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


def test_two_tower_head_sees_both_documents_their_product_and_difference():
    torch.manual_seed(2)
    model = LRAClassifier(vocab_size=9, max_length=20, num_classes=2, two_tower=True, attention="poly3").eval()
    ids = torch.randint(1, 9, (3, 2, 20))
    mask = torch.ones(3, 2, 20, dtype=torch.bool)
    mask[0, 1, 12:] = False
    with torch.no_grad():
        logits = model(ids, mask)
        x0, x1 = model.encoder(ids[:, 0], mask[:, 0]), model.encoder(ids[:, 1], mask[:, 1])
        expected = model.head(torch.cat([x0, x1, x0 * x1, x0 - x1], dim=-1))
        swapped = model(ids.flip(1), mask.flip(1))
    assert model.head[0].in_features == 4 * 64
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(logits, swapped)  # the towers are ordered: x0 - x1 changes sign
    with pytest.raises(ValueError, match=r"two-tower model takes input_ids \(B, 2, N\)"):
        model(ids[:, 0], mask[:, 0])


def test_default_sizes_are_xiong_et_al():
    model = LRAClassifier(vocab_size=32, max_length=2000, num_classes=10)
    encoder = model.encoder
    assert len(encoder.blocks) == 2 and encoder.token_embed.embedding_dim == 64
    attn = encoder.blocks[0].attn
    assert (attn.num_heads, attn.head_dim, attn.attn_drop.p) == (2, 32, 0.1)
    assert encoder.blocks[0].mlp.fc1.out_features == 128
    assert [type(m) for m in model.head] == [nn.Linear, nn.ReLU, nn.Linear] and model.head[0].out_features == 128


def test_attention_dropout_only_in_training():
    torch.manual_seed(3)
    encoder = LRAEncoder(vocab_size=9, max_length=16, dropout=0.0, attn_dropout=0.5, attention="poly3")
    ids, mask = torch.randint(1, 9, (2, 16)), torch.ones(2, 16, dtype=torch.bool)
    with torch.no_grad():
        assert not torch.allclose(encoder(ids, mask), encoder(ids, mask))
        encoder.eval()
        torch.testing.assert_close(encoder(ids, mask), encoder(ids, mask))


def test_capture_hook_gives_the_map_of_the_real_tokens_and_set_attention_switches():
    torch.manual_seed(4)
    encoder = LRAEncoder(vocab_size=9, max_length=16, attention="softmax").eval()
    assert set_attention(encoder, {"name": "poly3", "scale": 0.0714}) == 2
    layers = attention_modules(encoder)
    assert [name for name, _ in layers] == ["blocks.0.attn", "blocks.1.attn"]
    seen = []
    layers[0][1].capture = lambda module, inputs: seen.append((module, inputs))
    ids, mask = torch.randint(1, 9, (2, 16)), torch.ones(2, 16, dtype=torch.bool)
    mask[1, 10:] = False
    with torch.no_grad():
        encoder(ids, mask)
    (module, inputs), = seen
    weights = attention_map(inputs, module.activation)
    assert weights.shape == (2, 2, 16, 16)
    assert (weights[1, :, :, 10:] == 0).all() and (weights[1, :, :, :10] != 0).any()
    s = inputs.q @ inputs.k.transpose(-2, -1) * inputs.temperature
    torch.testing.assert_close(weights[0], s[0] ** 3 * 0.0714)


def test_bad_input_is_named():
    encoder = LRAEncoder(vocab_size=9, max_length=16)
    with pytest.raises(ValueError, match="exceeds the encoder's max_length 16"):
        encoder(torch.ones(1, 17, dtype=torch.long), torch.ones(1, 17, dtype=torch.bool))
    with pytest.raises(ValueError, match="bool mask"):
        encoder(torch.ones(1, 8, dtype=torch.long), torch.ones(1, 8))
    with pytest.raises(KeyError, match="cubic"):
        LRAEncoder(vocab_size=9, max_length=16, attention="cubic")
