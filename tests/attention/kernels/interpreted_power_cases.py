"""The Triton linear ``poly{p}`` kernels under ``TRITON_INTERPRET=1``; run by ``test_power.py`` in a subprocess.

Not collected directly (no ``test_`` prefix): the interpreter must be on before Triton decorates the kernels.
Against the materialised ``(q . k)^p`` in float64 (``test_power.reference``), through the same entry the CUDA
backend takes (``power_op.triton_power_attention`` on resolved arguments).
"""
from __future__ import annotations

import os

import pytest
import torch
from test_power import padding, qkv, reference

from polyattn_lightning.attention import get_activation
from polyattn_lightning.attention.kernels.base import state
from polyattn_lightning.attention.kernels.triton import power_op
from polyattn_lightning.attention.masks import keys_per_row

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


def run(q, k, v, p, pad=None, causal=False):
    act = get_activation(f"poly{p}")
    nq, nk = q.shape[-2], k.shape[-2]
    allowed = None if pad is None else ~pad[:, None, None, :]
    offset = nk - nq if causal else None
    n = keys_per_row(allowed, nk, q.device, offset)
    tables = state.device_monomials(q.shape[-1], p, q.device)
    return power_op.triton_power_attention(q, k, v, act, q.shape[-1] ** -0.5, allowed, n, offset, *tables)


def grads(out, inputs):
    weight = torch.linspace(-1, 1, out.numel()).view(out.shape)
    return torch.autograd.grad((out.float() * weight).sum(), inputs)


@pytest.fixture
def small_chunks(monkeypatch):
    """Causal chunks of 64 tokens (one row block): the shapes below span several."""
    monkeypatch.setattr(power_op, "MIN_CHUNK", 64)


@pytest.mark.parametrize("shape", [(70, 70), (20, 90), (100, 30)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("p", [2, 3, 4])
def test_matches_the_materialised_power(p, causal, shape, small_chunks):
    nq, nk = shape
    q, k, v = qkv(batch=2, heads=2, kv_heads=1, nq=nq, nk=nk, d=4, dv=5, dtype=torch.float32)
    pad = padding(2, nk)
    out = run(q, k, v, p, pad, causal)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    expected = reference(q64, k64, v64, p, ~pad, causal)
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-4)
    for got, want in zip(grads(out, (q, k, v)), grads(expected, (q64, k64, v64))):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


def test_bf16_loads_and_fp32_states(small_chunks):
    q, k, v = qkv(batch=1, heads=2, kv_heads=2, nq=80, nk=80, d=8, dv=8, dtype=torch.bfloat16)
    out = run(q, k, v, 2, causal=True)
    assert out.dtype == torch.bfloat16
    exact = reference(*(x.detach().double() for x in (q, k, v)), 2, causal=True)
    assert (out.double() - exact).norm() / exact.norm() < 1e-2
    assert all(g.dtype == torch.bfloat16 and torch.isfinite(g).all() for g in grads(out, (q, k, v)))


def test_an_inf_in_a_padded_key_stays_out():
    q, k, v = qkv(batch=2, heads=2, kv_heads=2, nq=9, nk=9, d=4, dv=4, dtype=torch.float32)
    pad = padding(2, 9)
    with torch.no_grad():
        k[0, :, -1] = float("inf")
        v[0, :, -1] = float("nan")
    out = run(q, k, v, 3, pad)
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads(out, (q, k, v)))


def test_the_chunk_grows_to_keep_the_states_within_budget():
    assert power_op.chunk_length(1000, 100, 16) == power_op.MIN_CHUNK
    rows, D, dv = 65536, 2080, 64
    chunk = power_op.chunk_length(rows, D, dv)
    assert chunk % 64 == 0 and rows / chunk * D * dv * 4 <= power_op.STATE_BUDGET
