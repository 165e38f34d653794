"""modeling_polyattn.py (``standalone.py``), the attention a saved folder carries for ``trust_remote_code``, against
the project's own ``AttentionInterface`` function (``attention()``'s kernels) on the same inputs: every built-in
activation, padding masks, causal rows without a mask, grouped kv heads, a static cache's empty slots; and the
one-line refusals of what it does not implement."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from polyattn_lightning.attention.switch.hf.saved import standalone
from polyattn_lightning.attention.switch.hf.interface import polyattn_attention

SPECS = ["poly1", "poly3", {"name": "poly3", "scale": 0.25}, "poly4", "relu", "softplus", "sigmoid",
         {"name": "relu", "scale": "inv_sqrt_n"}]


def modules(spec, causal: bool = True) -> tuple[nn.Module, nn.Module]:
    """The project's module (switched: ``activation_spec``) and the standalone's (the spec in its config)."""
    project, plain = nn.Module(), nn.Module()
    project.activation_spec = spec
    plain.config = types.SimpleNamespace(polyattn_attention=spec)
    for module in (project, plain):
        module.is_causal = causal
        module.eval()
    return project, plain


def qkv(batch=2, heads=4, kv_heads=2, rows=5, keys=7, dim=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    shapes = ((batch, heads, rows, dim), (batch, kv_heads, keys, dim), (batch, kv_heads, keys, dim))
    return [torch.randn(shape, generator=generator) for shape in shapes]


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_the_standalone_attention_is_the_projects(spec):
    project, plain = modules(spec)
    q, k, v = qkv()
    padding = torch.ones(2, 1, 5, 7, dtype=torch.bool)
    padding[0, ..., :2] = False  # left padding of the first sequence
    causal_padded = padding & torch.ones(5, 7, dtype=torch.bool).tril(2)
    for mask in (padding, causal_padded, None):
        expected = polyattn_attention(project, q, k, v, mask, scaling=0.3)[0]
        got = standalone.polyattn_attention(plain, q, k, v, mask, scaling=0.3)[0]
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5, msg=f"{spec} {None if mask is None else 'mask'}")
    square = qkv(rows=6, keys=6)  # causal without a mask: rows attend keys 0..i
    torch.testing.assert_close(standalone.polyattn_attention(plain, *square, None)[0],
                               polyattn_attention(project, *square, None)[0], atol=1e-5, rtol=1e-5)
    static = qkv(rows=4, keys=9)  # a static cache's prefill: the keys past the prompt are empty slots
    torch.testing.assert_close(standalone.polyattn_attention(plain, *static, None)[0],
                               polyattn_attention(project, *static, None)[0], atol=1e-5, rtol=1e-5)


def test_a_decoding_row_attends_every_key_and_the_result_is_not_softmax():
    project, plain = modules("poly3")
    q, k, v = qkv(rows=1, keys=9)
    got = standalone.polyattn_attention(plain, q, k, v, None)[0]
    torch.testing.assert_close(got, polyattn_attention(project, q, k, v, None)[0], atol=1e-5, rtol=1e-5)
    softmax = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))
    assert (got - softmax.transpose(1, 2)).abs().max() > 1e-2


def test_what_it_does_not_implement_is_refused_in_one_line():
    _, plain = modules("poly3")
    q, k, v = qkv()
    with pytest.raises(NotImplementedError, match=r"does not implement \['softcap'\]"):
        standalone.polyattn_attention(plain, q, k, v, None, softcap=30.0)
    with pytest.raises(NotImplementedError, match="boolean masks only"):
        standalone.polyattn_attention(plain, q, k, v, torch.zeros(2, 1, 5, 7))
    for spec, message in (("poly9", "'poly9' is not one"), ("gelu", "'gelu' is not one"),
                          ({"name": "poly3", "power": 2}, r"options \['power'\]")):
        _, plain = modules(spec)
        with pytest.raises(ValueError, match=message):
            standalone.polyattn_attention(plain, q, k, v, None)
