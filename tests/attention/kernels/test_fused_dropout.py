"""Attention dropout inside the fused C++ kernel: the documented Philox scheme, the same mask in forward
and backward, values and gradients against a materialised computation with that very mask."""
from __future__ import annotations

import pytest
import torch
from attention_reference import ELEMENTWISE, FORMULAS, make_qkv
from test_attention_kernels import _grads, num_threads, small_tiles  # noqa: F401 (small_tiles is a fixture)

from polyattn_lightning.attention import attention
from polyattn_lightning.attention.kernels import fused_cpu
from polyattn_lightning.rng import capture_rng_state, restore_rng_state

# Random123's known-answer vectors for Philox4x32-10: (counter, key, output).
PHILOX_KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


def philox4x32_10(counter, key):
    """Philox4x32-10 written out from Salmon et al. (2011), in Python integers."""
    (c0, c1, c2, c3), (k0, k1) = counter, key
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & 0xFFFFFFFF, (p0 >> 32) ^ c3 ^ k1, p0 & 0xFFFFFFFF
        k0, k1 = (k0 + 0x9E3779B9) & 0xFFFFFFFF, (k1 + 0xBB67AE85) & 0xFFFFFFFF
    return c0, c1, c2, c3


def scheme_keep_mask(batch_heads, nq, nk, p, seed, offset=0):
    """The keep mask as fused_cpu.py's docstring defines it, entry by entry."""
    threshold = min(int(p * 2**32), 2**32 - 1)
    key = (seed & 0xFFFFFFFF, seed >> 32)
    keep = torch.zeros(batch_heads, nq, nk, dtype=torch.bool)
    for bh in range(batch_heads):
        for i in range(nq):
            for j in range(nk):
                keep[bh, i, j] = philox4x32_10((j // 4, i, bh, offset), key)[j % 4] >= threshold
    return keep


def masked_dropout_reference(q, k, v, name, allowed, keep, p, bias=None):
    """``(phi(S) * allowed * keep / (1 - p)) @ v`` with the whole score matrix; ``n`` counts ``allowed`` only."""
    s = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    if bias is not None:
        s = s + bias
    allowed = allowed.expand(s.shape)
    n = allowed.sum(-1, keepdim=True).clamp_min(1).to(s.dtype)
    return (FORMULAS[name](s, n) * allowed * keep.view(s.shape) / (1 - p)) @ v


def fused_dropout(q, k, v, name, seed, p, **kwargs):
    """``attention`` on the fused kernel after seeding torch, and the keep mask it must have drawn."""
    torch.manual_seed(seed)
    out = attention(q, k, v, name, dropout_p=p, kernel="fused_cpu", **kwargs)
    torch.manual_seed(seed)
    keep = fused_cpu.dropout_keep_mask(q.shape[0] * q.shape[1], q.shape[2], k.shape[2], p, fused_cpu.draw_seed())
    return out, keep


@pytest.mark.parametrize("counter, key, expected", PHILOX_KAT)
def test_reference_philox_matches_random123(counter, key, expected):
    assert philox4x32_10(counter, key) == expected


@pytest.mark.parametrize("seed", [0, 0x0123456789ABCDEF, 2**63 - 1])
def test_kernel_mask_is_the_documented_philox_scheme(seed):
    """Unaligned sizes (4 keys per Philox call), several heads, and the offset word."""
    for offset in (0, 5):
        expected = scheme_keep_mask(3, 5, 13, 0.3, seed, offset)
        assert torch.equal(fused_cpu.dropout_keep_mask(3, 5, 13, 0.3, seed, offset), expected)
    assert not torch.equal(fused_cpu.dropout_keep_mask(3, 5, 13, 0.3, seed, 1), expected)


def test_keep_rate_is_one_minus_p_and_masks_differ_across_seeds_and_heads():
    for p in (0.1, 0.5):
        keep = fused_cpu.dropout_keep_mask(4, 128, 1000, p, seed=7)
        assert keep.float().mean().item() == pytest.approx(1 - p, abs=0.005)
        # neighbouring keys (one Philox call), queries and heads are independent draws
        pairs = keep[..., 0::2].float() * keep[..., 1::2].float()
        assert pairs.mean().item() == pytest.approx((1 - p) ** 2, abs=0.01)
        assert not torch.equal(keep[0], keep[1])
    seed_1, seed_2 = (fused_cpu.dropout_keep_mask(2, 16, 64, 0.1, seed) for seed in (1, 2))
    assert not torch.equal(seed_1, seed_2)
    assert torch.equal(fused_cpu.dropout_keep_mask(2, 16, 64, 0.0, 1), torch.ones(2, 16, 64, dtype=torch.bool))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name", ELEMENTWISE)
def test_values_and_gradients_equal_the_materialized_computation_with_the_kernel_mask(name, threads, small_tiles):
    """Ragged tiles (4x3 forward, 5x3 backward: the mask is regenerated on other tile shapes), a padding mask
    with an empty row, a score bias; the gradients match only if the backward drops what the forward dropped."""
    q, k, v = make_qkv(B=2, H=3, Nq=13, Nk=10)
    allowed = torch.rand(2, 1, 13, 10, generator=torch.Generator().manual_seed(1)) > 0.3
    allowed[1, :, 4] = False
    bias = torch.randn(3, 13, 10, dtype=q.dtype, requires_grad=True)
    with num_threads(threads):
        out, keep = fused_dropout(q, k, v, name, seed=3, p=0.3, attn_mask=allowed, attn_bias=bias)
        grads = _grads(out, (q, k, v, bias))
    assert 0.5 < keep.float().mean().item() < 0.9
    expected = masked_dropout_reference(q, k, v, name, allowed, keep, 0.3, bias)
    torch.testing.assert_close(out, expected)
    for got, want in zip(grads, _grads(expected, (q, k, v, bias))):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("name", ["poly3", "poly1"])
def test_with_key_padding_only(name):
    """The key-length path: padded keys are never visited, the mask of the rest still applies."""
    q, k, v = make_qkv(B=3, H=2, Nq=9, Nk=11)
    padding = torch.arange(11) >= torch.tensor([11, 6, 0])[:, None]
    out, keep = fused_dropout(q, k, v, name, seed=5, p=0.2, key_padding_mask=padding)
    expected = masked_dropout_reference(q, k, v, name, ~padding[:, None, None, :], keep, 0.2)
    torch.testing.assert_close(out, expected)
    for got, want in zip(_grads(out, (q, k, v)), _grads(expected, (q, k, v))):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("name", ["poly3", "poly1", "softplus"])
def test_gradcheck_with_dropout(name, small_tiles):
    """With torch seeded the same way before each call the forward is a deterministic function."""
    q, k, v = make_qkv(B=1, H=2, Nq=7, Nk=6, d=3, dv=2)
    padding = torch.tensor([[False] * 4 + [True] * 2])

    def fn(q, k, v):
        torch.manual_seed(11)
        return attention(q, k, v, name, key_padding_mask=padding, dropout_p=0.3, kernel="fused_cpu")

    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_seeded_runs_repeat_and_a_restored_rng_state_continues_exactly():
    q, k, v = make_qkv(B=2, H=2, Nq=16, Nk=16, dtype=torch.float32)
    torch.manual_seed(0)
    first = attention(q, k, v, "poly3", dropout_p=0.1)
    state = capture_rng_state()  # what ExactResume saves in a checkpoint and restores on resume
    second = attention(q, k, v, "poly3", dropout_p=0.1)
    assert not torch.equal(first, second)  # each call draws a new seed
    restore_rng_state(state)
    assert torch.equal(attention(q, k, v, "poly3", dropout_p=0.1), second)
    torch.manual_seed(0)
    assert torch.equal(attention(q, k, v, "poly3", dropout_p=0.1), first)


def test_unbiased_and_picked_by_auto():
    q, k, v = make_qkv(B=2, H=2, Nq=64, Nk=256, dtype=torch.float32)
    v = torch.ones_like(v)  # every output is c(n) * sum of kept f / (1 - p)
    torch.manual_seed(0)
    auto = attention(q, k, v, "relu", dropout_p=0.4)
    torch.manual_seed(0)
    assert torch.equal(auto, attention(q, k, v, "relu", dropout_p=0.4, kernel="fused_cpu"))
    assert (auto.mean() / attention(q, k, v, "relu").mean()).item() == pytest.approx(1.0, abs=0.03)
