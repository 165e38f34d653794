"""The Triton kernel under ``TRITON_INTERPRET=1``; run by ``test_attention_triton.py`` in a subprocess.

Not collected directly (no ``test_`` prefix): the interpreter must be switched
on before Triton decorates the kernels, i.e. before the package is imported.
"""
from __future__ import annotations

import os

import pytest
import torch
from attention_reference import (
    ELEMENTWISE, FORMULAS, bottom_right, causal_reference, make_qkv, philox_keep, reference_attention,
)

from polyattn_lightning.attention import attention, get_activation
from polyattn_lightning.attention.functional import _pick_kernel
from polyattn_lightning.attention.triton_kernel import triton_supports

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


def _grads(out, inputs):
    weight = torch.linspace(-1, 1, out.numel()).view(out.shape)
    return torch.autograd.grad((out.float() * weight).sum(), inputs)


def test_interpreter_is_active():
    import triton.runtime.interpreter  # noqa: F401  (the module the interpreted kernels run on)

    q = torch.zeros(1, 1, 1, 16)
    assert triton_supports(q, get_activation("poly3")) and not triton_supports(q.double(), get_activation("poly3"))
    assert _pick_kernel(q, get_activation("relu"), None, None, 0.0, None) == "triton"
    assert _pick_kernel(q, get_activation("relu"), None, None, 0.1, None) == "triton"  # dropout in-kernel
    assert _pick_kernel(q, get_activation("relu"), None, torch.zeros(1, 1, 1, 1), 0.0, None) == "triton"  # bias


@pytest.mark.parametrize("name", [n for n in ELEMENTWISE if n != "poly2"])
def test_forward_and_backward_match_reference(name):
    # 70 queries and 33 keys: ragged against the 64-wide blocks; dv != d; a pairwise mask with an empty row
    q, k, v = make_qkv(B=2, H=2, Nq=70, Nk=33, d=8, dv=12, dtype=torch.float32)
    keep = torch.rand(2, 1, 70, 33, generator=torch.Generator().manual_seed(0)) > 0.25
    keep[:, :, 5] = False
    out = attention(q, k, v, name, attn_mask=keep, kernel="triton")
    expected = reference_attention(q, k, v, name, keep=keep)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(out[:, :, 5], torch.zeros_like(out[:, :, 5]))
    for got, want in zip(_grads(out, (q, k, v)), _grads(expected, (q, k, v))):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_with_key_padding(dtype):
    q, k, v = make_qkv(B=2, H=1, Nq=20, Nk=24, d=16, dv=16, dtype=dtype)
    padding = torch.zeros(2, 24, dtype=torch.bool)
    padding[0, 10:] = True
    out = attention(q, k, v, "poly3", key_padding_mask=padding, kernel="triton")
    up = [x.detach().double() for x in (q, k, v)]
    expected = reference_attention(*up, "poly3", keep=~padding[:, None, None, :])
    assert out.dtype == dtype
    tol = 1e-2 if dtype == torch.float16 else 3e-2
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol * expected.abs().max().item())
    assert all(g.dtype == dtype and g.isfinite().all() for g in _grads(out, (q, k, v)))


def test_grids_put_batch_times_heads_on_axis_0(monkeypatch):
    """Regression: B*H was grid axis 1, which CUDA caps at 65535 (e.g. windowed attention, B x windows x heads)."""
    from polyattn_lightning.attention import triton_kernel

    grids, launch = {}, triton_kernel._launch

    def record(kernel, grid, *rest):
        grids[kernel.fn.__name__] = tuple(grid)
        return launch(kernel, grid, *rest)

    monkeypatch.setattr(triton_kernel, "_launch", record)
    q, k, v = make_qkv(B=3, H=2, Nq=70, Nk=130, d=8, dv=8, dtype=torch.float32)
    out = attention(q, k, v, "poly3", kernel="triton")
    torch.testing.assert_close(out, reference_attention(q, k, v, "poly3"), rtol=1e-4, atol=1e-4)
    out.sum().backward()
    forward, backward = (triton_kernel.launch_config(kind, torch.float32, 8, 8) for kind in ("forward", "backward"))
    assert grids == {
        "_forward": (6, -(-70 // forward.block_m)),
        "_backward_kv": (6, -(-130 // backward.block_n)),
        "_backward_q": (6, -(-70 // backward.block_m)),
    }


def _swin_inputs(dtype, windows=4, batch=2, heads=3, tokens=49, d=16):
    """Swin-shaped operands: (B * windows, H, 49, d), a 0/-100 shifted-window mask and a (1, H, 49, 49) bias."""
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(batch * windows, heads, tokens, d, generator=g).to(dtype).requires_grad_() for _ in range(3))
    bias = (torch.randn(1, heads, tokens, tokens, generator=g) * 0.5).requires_grad_()
    region = torch.randint(0, 3, (windows, tokens), generator=g)
    window_mask = (region[:, :, None] != region[:, None, :]).float() * -100.0  # (windows, N, N), 0 = same region
    mask = window_mask.repeat(batch, 1, 1).unsqueeze(1)  # as the switched Swin attention passes it
    return q, k, v, bias, mask


@pytest.mark.parametrize("name", ["poly3", "relu", "sigmoid"])
def test_swin_bias_and_shifted_window_mask_values_and_gradients(name):
    q, k, v, bias, mask = _swin_inputs(torch.float32)
    out = attention(q, k, v, name, attn_mask=mask, attn_bias=bias)  # auto: the Triton kernel takes the bias now
    keep = mask == 0
    expected = reference_attention(q, k, v, name, keep=keep, bias=bias)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    inputs = (q, k, v, bias)
    for got, want in zip(_grads(out, inputs), _grads(expected, inputs)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_bias_of_every_broadcast_shape_gets_its_gradient():
    q, k, v = make_qkv(B=2, H=3, Nq=20, Nk=24, d=16, dv=16, dtype=torch.float32)
    for shape in [(24,), (20, 24), (3, 1, 24), (2, 1, 20, 24), (2, 3, 20, 24)]:
        bias = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape))).requires_grad_()
        out = attention(q, k, v, "softplus", attn_bias=bias, kernel="triton")
        expected = reference_attention(q, k, v, "softplus", bias=bias)
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
        [got] = torch.autograd.grad(out.sum(), bias)
        [want] = torch.autograd.grad(expected.sum(), bias)
        assert got.shape == bias.shape
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_bias_in_half_precision():
    q, k, v, bias, mask = _swin_inputs(torch.bfloat16, windows=2, batch=1)
    out = attention(q, k, v, "poly3", attn_mask=mask, attn_bias=bias, kernel="triton")
    up = [x.detach().double() for x in (q, k, v, bias)]
    expected = reference_attention(*up[:3], "poly3", keep=mask == 0, bias=up[3])
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), expected, rtol=3e-2, atol=3e-2 * expected.abs().max().item())
    grads = _grads(out, (q, k, v, bias))
    assert grads[3].dtype == torch.float32 and all(g.isfinite().all() for g in grads)


@pytest.mark.parametrize("name", ["poly3", "sigmoid"])
def test_dropout_follows_the_documented_philox_scheme(name):
    q, k, v = make_qkv(B=2, H=2, Nq=40, Nk=37, d=16, dv=16, dtype=torch.float32)
    bias = torch.randn(1, 2, 40, 37, generator=torch.Generator().manual_seed(3)).requires_grad_()
    p = 0.3
    torch.manual_seed(11)
    out = attention(q, k, v, name, attn_bias=bias, dropout_p=p)  # auto: Triton with in-kernel dropout
    torch.manual_seed(11)
    seed = int(torch.randint(2**63 - 1, (1,), dtype=torch.int64))  # the draw attention() made
    keep = torch.stack([philox_keep(seed, bh, 40, 37, p) for bh in range(4)]).view(2, 2, 40, 37)
    assert abs(keep.float().mean().item() - (1 - p)) < 0.03
    s = q @ k.transpose(-2, -1) / 4.0 + bias
    n = torch.full((1, 1, 1, 1), 37.0)
    expected = (FORMULAS[name](s, n) * keep / (1 - p)) @ v
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    inputs = (q, k, v, bias)
    for got, want in zip(_grads(out, inputs), _grads(expected, inputs)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_compile_failure_warns_once_and_falls_back(monkeypatch):
    """A Triton error at the launch (what a GPU it cannot compile for raises) must not crash the run."""
    from polyattn_lightning.attention import triton_kernel

    def fail(*args, **kwargs):
        raise RuntimeError("injected: PTX assembly aborted due to errors")

    monkeypatch.setattr(triton_kernel, "_launch", fail)
    monkeypatch.setattr(triton_kernel, "_PROBED", {})
    q, k, v = make_qkv(B=1, H=2, Nq=30, Nk=30, d=16, dv=16, dtype=torch.float32)
    with pytest.warns(UserWarning, match="injected: PTX assembly aborted") as caught:
        out = attention(q, k, v, "relu")
    assert len([w for w in caught if "Triton attention kernel" in str(w.message)]) == 1
    torch.testing.assert_close(out, reference_attention(q, k, v, "relu"), rtol=1e-4, atol=1e-4)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # decided once: no second warning, no second try
        again = attention(q, k, v, "relu")
        again.sum().backward()
    assert _pick_kernel(q, get_activation("relu"), None, None, 0.0, None) != "triton"
    with pytest.raises(RuntimeError, match="injected"):  # asked for by name, it is not silently replaced
        attention(q, k, v, "relu", kernel="triton")



@pytest.mark.parametrize("shape", [(100, 130), (130, 40), (3, 150)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_causal_with_padding_and_bias_matches_reference(shape):
    """Causal tile-loop bounds across several 64-row / 32- and 64-key blocks; Nq > Nk leaves rows with no key
    (zeros); the bias gradient is zero above the diagonal although those tiles are never visited."""
    nq, nk = shape
    q, k, v = make_qkv(B=1, H=2, Nq=nq, Nk=nk, d=8, dv=12, dtype=torch.float32)
    bias = (0.1 * torch.randn(1, 2, nq, nk, generator=torch.Generator().manual_seed(3))).requires_grad_()
    padding = torch.zeros(1, nk, dtype=torch.bool)
    padding[0, nk // 2 : nk // 2 + 5] = True
    out = attention(q, k, v, "poly3", is_causal=True, key_padding_mask=padding, attn_bias=bias, kernel="triton")
    expected = causal_reference(q, k, v, "poly3", keep=~padding[:, None, None, :], bias=bias)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    got, want = _grads(out, (q, k, v, bias)), _grads(expected, (q, k, v, bias))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert torch.equal(got[3][..., ~bottom_right(nq, nk)], torch.zeros_like(got[3][..., ~bottom_right(nq, nk)]))
    assert _pick_kernel(q, get_activation("poly3"), None, None, 0.0, None, nk - nq) == "triton"  # probed causal


def test_causal_half_precision():
    q, k, v = make_qkv(B=2, H=1, Nq=40, Nk=72, d=16, dv=16, dtype=torch.float16)
    out = attention(q, k, v, "poly3", is_causal=True, kernel="triton")
    expected = causal_reference(*(x.detach().double() for x in (q, k, v)), "poly3")
    torch.testing.assert_close(out.double(), expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())
    assert all(g.dtype == torch.float16 and g.isfinite().all() for g in _grads(out, (q, k, v)))
