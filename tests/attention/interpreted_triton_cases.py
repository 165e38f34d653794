"""The Triton kernel under ``TRITON_INTERPRET=1``; run by ``test_attention_triton.py`` in a subprocess.

Not collected directly (no ``test_`` prefix): the interpreter must be switched
on before Triton decorates the kernels, i.e. before the package is imported.
"""
from __future__ import annotations

import os

import pytest
import torch
from attention_reference import ELEMENTWISE, make_qkv, reference_attention

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
    assert _pick_kernel(q, get_activation("relu"), None, None, 0.1, None) == "blocked"  # no dropout in Triton


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

    grids = {}

    class Recorder:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            grids[self.name] = tuple(grid)
            return self.kernel[grid]

    for name in ("_forward", "_backward_kv", "_backward_q"):
        monkeypatch.setattr(triton_kernel, name, Recorder(name, getattr(triton_kernel, name)))
    q, k, v = make_qkv(B=3, H=2, Nq=70, Nk=130, d=8, dv=8, dtype=torch.float32)
    out = attention(q, k, v, "poly3", kernel="triton")
    torch.testing.assert_close(out, reference_attention(q, k, v, "poly3"), rtol=1e-4, atol=1e-4)
    out.sum().backward()
    assert grids == {"_forward": (6, 2), "_backward_kv": (6, 3), "_backward_q": (6, 2)}
