"""``torch.compile`` of switched timm models: no graph break beyond timm's own, and the compiled model's
outputs and gradients equal eager ones (CPU; the C++ kernels are fake-tensor-aware ``TORCH_LIBRARY`` ops).

Tiny configurations: 2 blocks, small images, a two-stage Swin with 2x2 windows (its shifted-window
mask and relative position bias are still there), so tracing stays cheap.
"""
from __future__ import annotations

import pytest
import timm
import torch
import torch._dynamo

from polyattn_lightning.attention import attention
from polyattn_lightning.attention import set_attention
from timm_families import make

MODELS = {
    "vit": (lambda: timm.create_model("vit_tiny_patch16_224", depth=2, img_size=32, patch_size=8, num_classes=5), 32),
    "xcit": (lambda: timm.create_model("xcit_nano_12_p16_224", depth=2, img_size=32, num_classes=5), 32),
    "swin": (lambda: timm.create_model("swin_tiny_patch4_window7_224", depths=(2, 2), embed_dim=16,
                                       num_heads=(1, 2), window_size=2, img_size=32, num_classes=5,
                                       drop_path_rate=0.0), 32),  # no stochastic depth: eager == compiled
    # the generic switch: RoPE (EVA02), a relative-position bias as SDPA's float mask (BEiT), SDPA called
    # through torch.nn.functional with window and grid partitions (MaxViT)
    "eva02": (lambda: make("eva02"), 28),
    "beit": (lambda: make("beit"), 32),
    "maxvit": (lambda: make("maxvit"), 64),
    # cosine attention, continuous position bias and the shift mask (timm_adapters.swin_v2)
    "swin_v2": (lambda: timm.create_model("swinv2_tiny_window8_256", depths=(2, 2), embed_dim=16, num_heads=(1, 2),
                                          window_size=2, img_size=32, num_classes=5, drop_path_rate=0.0), 32),
}


def _model(name: str, activation: str | None):
    build, size = MODELS[name]
    torch.manual_seed(0)
    model = build()
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(1))
    if activation is not None:
        set_attention(model, activation, probe=lambda: model(x))
    return model, x


def _graph_breaks(model, x) -> tuple[int, list[str]]:
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(x)
    return explained.graph_break_count, [reason.reason.split("\n")[0] for reason in explained.break_reasons]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_switching_adds_no_graph_break(name):
    timm_breaks, _ = _graph_breaks(*_model(name, None))
    for activation in ("softmax", "poly3"):
        breaks, reasons = _graph_breaks(*_model(name, activation))
        assert breaks <= timm_breaks, f"{name} {activation}: {breaks} graph breaks (timm: {timm_breaks}): {reasons}"


@pytest.mark.parametrize("name, activation", [
    ("vit", "poly3"),
    ("swin", "poly3"),
    ("eva02", "poly3"),
    pytest.param("xcit", "relu", marks=pytest.mark.slow),
    pytest.param("swin", "softmax", marks=pytest.mark.slow),
])
def test_compiled_model_matches_eager(name, activation):
    model, x = _model(name, activation)
    model.train()
    eager = model(x)
    eager_grads = torch.autograd.grad(eager.square().sum(), list(model.parameters()))
    torch._dynamo.reset()
    compiled_model = torch.compile(model, backend="aot_eager", fullgraph=True)
    compiled = compiled_model(x)
    compiled_grads = torch.autograd.grad(compiled.square().sum(), list(model.parameters()))
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    for got, want in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    if activation != "softmax":  # the hand-written backward stays differentiable once, compiled too
        x.requires_grad_()
        [grad] = torch.autograd.grad(compiled_model(x).square().sum(), x, create_graph=True)
        with pytest.raises(RuntimeError, match="double backward|does not require grad"):
            torch.autograd.grad(grad.sum(), x)


@pytest.mark.parametrize("activation, masks", [
    ("poly3", "key_padding"),  # key-only mask: the C++ kernel's key lengths, worked out without a graph break
    ("relu", "bias_and_pairwise"),
    ("poly1", "key_padding"),  # the associative kernel
])
def test_attention_call_compiles_in_one_graph(activation, masks):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 12, 8, generator=g).requires_grad_() for _ in range(3))
    kwargs = {}
    if masks == "key_padding":
        padding = torch.zeros(2, 12, dtype=torch.bool)
        padding[1, 7:] = True
        kwargs["key_padding_mask"] = padding
    else:
        kwargs["attn_bias"] = torch.randn(1, 2, 12, 12, generator=g).requires_grad_()
        kwargs["attn_mask"] = torch.rand(2, 1, 12, 12, generator=g) > 0.3

    def call(q, k, v):
        return attention(q, k, v, activation, **kwargs)

    inputs = [q, k, v, *[x for x in kwargs.values() if x.requires_grad]]
    eager = call(q, k, v)
    eager_grads = torch.autograd.grad(eager.sum(), inputs)
    torch._dynamo.reset()
    compiled = torch.compile(call, backend="aot_eager", fullgraph=True)(q, k, v)  # fullgraph: a break raises
    torch.testing.assert_close(compiled, eager)
    for got, want in zip(torch.autograd.grad(compiled.sum(), inputs), eager_grads):
        torch.testing.assert_close(got, want)
