"""Norm diagnostics against explicit autograd Jacobians."""
from __future__ import annotations

from functools import partial

import pytest
import torch
from attention_reference import make_qkv

from polyattn_lightning.diagnostics import norms
from polyattn_lightning.attention import get_activation
from polyattn_lightning.diagnostics.norms import attention_norms


def _explicit_norms(q, k, keep, rows_of):
    """Per-head norms from the full Jacobian of ``phi`` applied to one score row at a time."""
    s = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    B, H, nq, _ = s.shape
    phi_sq, jac_sq = torch.zeros(B, H, dtype=s.dtype), torch.zeros(B, H, dtype=s.dtype)
    for b in range(B):
        for h in range(H):
            for i in range(nq):
                f = partial(rows_of, row_keep=keep[b, 0, i])
                phi_sq[b, h] += f(s[b, h, i]).square().sum()
                jac_sq[b, h] += torch.autograd.functional.jacobian(f, s[b, h, i]).square().sum()
    return phi_sq.sqrt().mean(0), jac_sq.sqrt().mean(0)


@pytest.mark.parametrize("name", ["poly3", "relu", "sigmoid", "softmax"])
def test_norms_match_explicit_jacobians(name, monkeypatch):
    monkeypatch.setattr(norms, "BLOCK_ELEMENTS", 40)  # several query blocks
    q, k, _ = make_qkv(B=2, H=2, Nq=5, Nk=6)
    padding = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])
    keep = ~padding[:, None, None, :].expand(2, 1, 5, 6)
    act = get_activation(name)

    def rows_of(row, row_keep):
        if act.is_softmax:
            return torch.where(row_keep, row, float("-inf")).softmax(-1)
        return torch.where(row_keep, act(row, row_keep.sum().double()), 0.0)

    phi, jac = attention_norms(q.detach(), k.detach(), name, key_padding_mask=padding)
    expected_phi, expected_jac = _explicit_norms(q.detach(), k.detach(), keep, rows_of)
    assert phi.shape == jac.shape == (2,)
    torch.testing.assert_close(phi, expected_phi.float())
    torch.testing.assert_close(jac, expected_jac.float())


def test_softmax_norms_respect_the_paper_bounds():
    q, k, _ = make_qkv(B=1, H=2, Nq=16, Nk=16, dtype=torch.float32)
    phi, jac = attention_norms(q, k, "softmax")
    assert (phi <= 16**0.5).all() and (jac <= 2 * 16**0.5).all()


@pytest.mark.parametrize("name", ["softmax", "poly3"])
def test_norms_take_masks_and_bias_without_a_query_dimension(name):
    """Regression: a 1-D ``(Nk,)`` additive mask or bias (it broadcasts to (B, H, Nq, Nk), so
    ``attention()`` takes it) raised IndexError in ``attention_norms``."""
    q, k, _ = make_qkv()
    mask_1d = torch.zeros(11, dtype=torch.float64)
    mask_1d[7:] = float("-inf") if name == "softmax" else -100.0
    bias_1d = torch.linspace(-1, 1, 11, dtype=torch.float64)
    got = attention_norms(q, k, name, attn_mask=mask_1d, attn_bias=bias_1d)
    want = attention_norms(q, k, name, attn_mask=mask_1d.expand(9, 11), attn_bias=bias_1d.expand(9, 11))
    torch.testing.assert_close(got.phi, want.phi)
    torch.testing.assert_close(got.jacobian, want.jacobian)
