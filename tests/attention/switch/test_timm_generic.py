"""The generic SDPA switch on every family of its reviewed list (tiny builds from ``timm_families``).

Per family: softmax gives timm's own outputs; poly3 and relu equal timm's own forward with SDPA
materialized as ``phi(S) @ v`` (``timm_reference``); the probe finds no softmax left; weights and
state_dict keys are unchanged; one AdamW step trains every parameter the forward uses.
"""
from __future__ import annotations


import pytest
import timm
import timm.layers.diff_attention
import timm.models.eva
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from polyattn_lightning.attention import attention_modules, set_attention
from polyattn_lightning.attention.switch.timm.probe import softmax_calls
from polyattn_lightning.attention.switch.timm.sdpa import Reviewed, _generic_adapter
from timm_families import FAMILIES, images, make
from timm_reference import MaterializedSDPA, reference_forward


def switch(model, activation, x):
    """set_attention with the probe run on the test's own images (the model's default size can be large)."""
    return set_attention(model, activation, probe=lambda: model(x))


@pytest.mark.parametrize("family", FAMILIES)
def test_softmax_is_timms_own_and_the_probe_finds_no_softmax_left(family):
    model, x = make(family), images(family)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        expected = model(x)
        switched = switch(model, "softmax", x)
        assert switched == len(attention_modules(model)) > 0
        assert torch.allclose(model(x), expected, atol=1e-5, rtol=1e-4)
    state = model.state_dict()
    assert list(state) == list(original) and all(torch.equal(state[k], original[k]) for k in original)

    switch(model, "poly3", x)
    with torch.no_grad():
        assert softmax_calls(model, lambda: model(x)) == []


@pytest.mark.parametrize("activation", ["poly3", "relu"])
@pytest.mark.parametrize("family", FAMILIES)
def test_activation_matches_timms_forward_with_materialized_attention(family, activation):
    x = images(family)
    expected = reference_forward(make(family), x, activation)
    model = make(family)
    switch(model, activation, x)
    with torch.no_grad():
        out = model(x)
    scale = expected.abs().max().clamp_min(1.0)
    assert (out - expected).abs().max() <= 1e-4 * scale, (out - expected).abs().max()


@pytest.mark.parametrize("family", FAMILIES)
def test_one_training_step(family):
    model, x = make(family), images(family)
    switch(model, "poly3", x)
    model.train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = model(x).square().mean()
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert torch.isfinite(loss) and grads and all(torch.isfinite(g).all() for g in grads.values())
    optimizer.step()
    attention_params = {f"{name}.{p}".lstrip(".") for name, m in attention_modules(model) for p, _ in m.named_parameters()}
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert attention_params & set(grads) <= moved and attention_params & moved


def test_unswitched_instances_keep_sdpa_and_timm_is_not_patched():
    model, other, x = make("eva02"), make("eva02"), images("eva02")
    switch(model, "poly3", x)
    assert torch.nn.functional.scaled_dot_product_attention.__module__ != __name__
    assert timm.models.eva.F is torch.nn.functional
    with torch.no_grad():
        calls = softmax_calls(other, lambda: other(x))
    assert [c.function for c in calls] == ["scaled_dot_product_attention"] * len(other.blocks)


@pytest.mark.parametrize("family", FAMILIES)
def test_capture_contract_holds(family):
    """What ``capture`` sees, attended by ``attention_map``, is what ``attention()`` computes from it."""
    from polyattn_lightning.attention import attention
    from polyattn_lightning.attention.switch.base import attention_map

    model, x = make(family), images(family)
    switch(model, "poly3", x)
    captured = []
    for _, module in attention_modules(model):
        module.capture = lambda module, inputs: captured.append(inputs)
    with torch.no_grad():
        model(x)
    assert len(captured) >= len(attention_modules(model))
    for inputs in captured:
        expected = attention(inputs.q, inputs.k, inputs.v, "poly3", temperature=inputs.temperature,
                             attn_mask=inputs.attn_mask, attn_bias=inputs.attn_bias)
        assert torch.allclose(attention_map(inputs, "poly3") @ inputs.v.float(), expected.float(), atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("family", ["eva02", "maxvit", "hiera", "sam"])
def test_attention_maps_are_drawn_for_new_layouts(family):
    """RoPE'd tokens, MaxViT's windows and grids, Hiera's mask units, SAM's (B * heads) rows: heat maps per layer."""
    from polyattn_lightning.diagnostics.maps import collect_maps

    model, x = make(family), images(family)
    switch(model, "poly3", x)
    maps = collect_maps(model, x[:1])
    assert len(maps) == len(attention_modules(model))
    for layer_maps in maps:
        assert torch.isfinite(layer_maps.heat).all() and layer_maps.heat.dim() == 3


class Called(TorchFunctionMode):
    """The names of the torch functions called under it."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.add(getattr(func, "__name__", ""))
        return func(*args, **(kwargs or {}))


#: The reviewed self-attention classes whose forward passes ``is_causal`` on to SDPA.
CAUSAL_MODULES = {
    "vit": lambda: timm.layers.Attention(16, num_heads=2, qkv_bias=True),
    "eva": lambda: timm.models.eva.EvaAttention(16, num_heads=2, num_prefix_tokens=0, scale_norm=False),
    "diff": lambda: timm.layers.diff_attention.DiffAttention(16, num_heads=2),
}


@pytest.mark.parametrize("name", sorted(CAUSAL_MODULES))
def test_is_causal_is_timms_and_the_materialized_references(name):
    """Softmax gives timm's own causal outputs; poly3 SDPA's top-left causal map, materialized; what ``capture``
    sees (the causal mask written out) gives the same."""
    from polyattn_lightning.attention import attention
    from polyattn_lightning.attention.switch.base import attention_map

    torch.manual_seed(0)
    module = CAUSAL_MODULES[name]().eval()
    module.fused_attn = True
    x = torch.randn(2, 7, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected_softmax = module(x, is_causal=True)
        mode = MaterializedSDPA("poly3")
        with mode:
            expected_poly3 = module(x, is_causal=True)
        assert mode.calls > 0
        set_attention(module, "softmax")
        assert torch.allclose(module(x, is_causal=True), expected_softmax, atol=1e-6)
        set_attention(module, "poly3")
        with Called() as called:  # attention()'s is_causal: the kernel skips the upper tiles, no mask is built
            assert torch.allclose(module(x, is_causal=True), expected_poly3, atol=1e-5)
        assert "tril" not in called.names and "triu" not in called.names
        captured = []
        module.capture = lambda module, inputs: captured.append(inputs)
        module(x, is_causal=True)
    for inputs in captured:
        n = inputs.q.shape[-2]
        assert torch.equal(inputs.attn_mask, torch.ones(n, n, dtype=torch.bool).tril())
        out = attention(inputs.q, inputs.k, inputs.v, "poly3", temperature=inputs.temperature, is_causal=True)
        assert torch.allclose(attention_map(inputs, "poly3") @ inputs.v, out, atol=1e-5)


class CrossCausal(nn.Module):
    """SDPA with ``is_causal`` and ``Nq != Nk``: no reviewed timm class does this, the shim still must keep
    SDPA's top-left meaning (query ``i`` keeps keys ``0 .. i``), where ``attention()``'s is bottom-right."""

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


SwitchedCrossCausal = _generic_adapter(Reviewed(CrossCausal))  # the generic switch, built as for a reviewed class


@pytest.mark.parametrize("nq, nk", [(3, 6), (6, 3)])
def test_is_causal_with_other_key_count_keeps_sdpas_top_left_alignment(nq, nk):
    from polyattn_lightning.attention import attention

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, nq, 8, generator=g)
    k, v = torch.randn(2, 2, nk, 8, generator=g), torch.randn(2, 2, nk, 8, generator=g)
    module = CrossCausal()
    expected_softmax = module(q, k, v)
    with MaterializedSDPA("poly3"):
        expected_poly3 = module(q, k, v)
    module.__class__ = SwitchedCrossCausal
    module.capture = None
    for activation, expected in (("softmax", expected_softmax), ("poly3", expected_poly3)):
        module.activation_spec = activation
        assert torch.allclose(module(q, k, v), expected, atol=1e-5), activation
    bottom_right = attention(q, k, v, "poly3", is_causal=True)
    assert not torch.allclose(bottom_right, expected_poly3, atol=1e-3)  # the alignments differ: the test can tell
