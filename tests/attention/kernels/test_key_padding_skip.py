"""Key padding on the fused C++ kernel: a key-only mask becomes per-sequence key lengths, the key loops stop
there, and values and gradients still equal the reference (padded queries keep attending to real keys)."""
from __future__ import annotations

import pytest
import torch
from attention_reference import ELEMENTWISE, make_qkv, reference_attention
from test_attention_kernels import _grads, assert_matches_reference_attention, num_threads, small_tiles  # noqa: F401

from polyattn_lightning.attention import attention
from polyattn_lightning.attention.kernels.fused_cpu import key_lengths


def _padding(lengths, nk):
    """``key_padding_mask`` (True = padding) for sequences of the given true lengths."""
    return torch.arange(nk) >= torch.tensor(lengths)[:, None]


def test_key_only_masks_become_lengths_and_a_prefix_mask_is_dropped():
    padding = _padding([11, 0, 4, 1], 11)
    lengths, mask = key_lengths(~padding[:, None, None, :], 4, 11)
    assert lengths.tolist() == [11, 0, 4, 1] and mask is None
    holes = ~padding[:, None, None, :]
    holes[2, ..., 1] = False  # sequence 2 attends to keys 0, 2, 3: not a prefix
    lengths, mask = key_lengths(holes, 4, 11)
    assert lengths.tolist() == [11, 0, 4, 1] and mask is holes
    shared = torch.tensor([True, False, True, False, False]).view(1, 1, 1, 5)  # one mask for the whole batch
    lengths, mask = key_lengths(shared, 3, 5)
    assert lengths.tolist() == [3, 3, 3] and mask is shared
    pairwise = torch.ones(2, 1, 6, 5, dtype=torch.bool)  # varies over queries: no lengths
    assert key_lengths(pairwise, 2, 5) == (None, pairwise)
    assert key_lengths(None, 2, 5) == (None, None)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name", ELEMENTWISE)
def test_ragged_lengths_match_the_reference(name, threads, small_tiles):
    """Lengths 0 (every key padded), full, 1, and tails ending inside and at the edge of a 3-key tile;
    padded query rows still attend to the real keys, as in the reference."""
    q, k, v = make_qkv(B=5, H=2, Nq=10, Nk=13)
    padding = _padding([0, 13, 1, 7, 9], 13)
    with num_threads(threads):
        out = attention(q, k, v, name, key_padding_mask=padding, kernel="fused_cpu")
        grads = _grads(out, (q, k, v))
    expected = reference_attention(q, k, v, name, keep=~padding[:, None, None, :])
    torch.testing.assert_close(out, expected)
    for got, want in zip(grads, _grads(expected, (q, k, v))):
        torch.testing.assert_close(got, want)
    assert torch.equal(out[0], torch.zeros_like(out[0]))  # no attendable key: zeros


@pytest.mark.parametrize("threads", [1, 2])
def test_non_prefix_key_masks_keep_their_holes(threads, small_tiles):
    q, k, v = make_qkv(B=3, H=2, Nq=8, Nk=12)
    keep = ~_padding([12, 9, 5], 12)
    keep[0, 3] = keep[1, 7] = keep[2, 0] = False
    with num_threads(threads):
        out = attention(q, k, v, "poly3", attn_mask=keep[:, None, None, :], kernel="fused_cpu")
        expected = reference_attention(q, k, v, "poly3", keep=keep[:, None, None, :])
        assert_matches_reference_attention(out, expected, (q, k, v))


def test_keys_beyond_the_length_are_never_read(small_tiles):
    """NaN in padded keys and values: a kernel that visited them would get NaN in dQ (0 * NaN), even masked."""
    q, k, v = make_qkv(B=2, H=2, Nq=7, Nk=9)
    padding = _padding([5, 9], 9)
    behind = padding[:, None, :, None]
    k_nan, v_nan = (x.detach().masked_fill(behind, float("nan")).requires_grad_() for x in (k, v))
    out = attention(q, k_nan, v_nan, "poly3", key_padding_mask=padding, kernel="fused_cpu")
    dq, dk, dv = _grads(out, (q, k_nan, v_nan))
    assert out.isfinite().all() and dq.isfinite().all()
    assert not dk[0, :, 5:].any() and not dv[0, :, 5:].any()  # padded keys get zero gradients
    expected = attention(q, k, v, "poly3", key_padding_mask=padding, kernel="materialized")
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(dq, _grads(expected, (q, k, v))[0])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name", ["poly3", "sigmoid"])
def test_gradcheck_with_key_padding(name, threads, small_tiles):
    q, k, v = make_qkv(B=3, H=1, Nq=6, Nk=7, d=3, dv=2)
    padding = _padding([7, 2, 0], 7)
    with num_threads(threads):
        assert torch.autograd.gradcheck(
            lambda q, k, v: attention(q, k, v, name, key_padding_mask=padding, kernel="fused_cpu"), (q, k, v)
        )
