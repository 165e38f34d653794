"""``fused_cpu.decode``, the one-call C++ decoding step, against the plain-PyTorch reference: every built-in form,
one to eight query rows, causal rows (a short prompt's prefill), multi-head / grouped / multi-query caches,
Hugging Face's strided layouts, dtypes, threads, and what it refuses."""
from __future__ import annotations

import functools

import pytest
import torch
from attention_reference import ELEMENTWISE, causal_reference, reference_attention

from polyattn_lightning.attention import Activation, get_activation
from polyattn_lightning.attention.kernels import fused_cpu


def cache(batch=2, heads=4, kv_heads=2, rows=1, nk=13, d=8, dv=6, dtype=torch.float64, seed=0):
    """q in HF's layout (``(B, R, H, d)`` projected, viewed as ``(B, H, R, d)``), k/v ``(B, H_kv, Nk, d)``."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, rows, heads, d, generator=g, dtype=dtype).transpose(1, 2)
    k = torch.randn(batch, kv_heads, nk, d, generator=g, dtype=dtype)
    v = torch.randn(batch, kv_heads, nk, dv, generator=g, dtype=dtype)
    return q, k, v


def expected(q, k, v, name, causal=False):
    """The reference on the cache repeated per query head, in HF's ``(B, R, H, dv)`` layout."""
    groups = q.shape[1] // k.shape[1]
    k, v = (x.double().repeat_interleave(groups, dim=1) for x in (k, v))
    return (causal_reference if causal else reference_attention)(q.double(), k, v, name).transpose(1, 2)


def decode(q, k, v, name, causal=False, **options):
    return fused_cpu.decode(q, k, v, get_activation(name, **options), q.shape[-1] ** -0.5, causal)


@pytest.mark.parametrize("name", ELEMENTWISE)
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_each_form_matches_the_reference(name, heads, kv_heads, rows):
    q, k, v = cache(heads=heads, kv_heads=kv_heads, rows=rows)
    out = decode(q, k, v, name)
    assert out.shape == (2, rows, heads, 6) and out.is_contiguous()
    torch.testing.assert_close(out, expected(q, k, v, name), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ELEMENTWISE)
@pytest.mark.parametrize("rows, nk", [(8, 8), (5, 13), (1, 4), (6, 3)], ids=["prompt", "after-cache", "one", "fewer"])
def test_causal_rows_see_their_prefix_with_its_own_count(name, rows, nk):
    """Row r of R attends the first Nk - R + r + 1 keys and is scaled by that count (bottom-right causal, as
    ``attention(is_causal=True)``); rows before the first key (Nk < R) are zeros, as the reference's."""
    q, k, v = cache(heads=4, kv_heads=2, rows=rows, nk=nk)
    out = decode(q, k, v, name, causal=True)
    assert out.shape == (2, rows, 4, 6) and out.is_contiguous()
    torch.testing.assert_close(out, expected(q, k, v, name, causal=True), rtol=1e-10, atol=1e-12)
    if rows > 1 and nk >= rows:  # not the unmasked step: the last row attends every key, the first fewer
        torch.testing.assert_close(out[:, -1], decode(q, k, v, name)[:, -1], rtol=1e-12, atol=1e-14)
        assert not torch.allclose(out[:, 0], decode(q, k, v, name)[:, 0])


def test_fp32_and_a_fixed_scale():
    q, k, v = cache(dtype=torch.float32, nk=40)
    out = decode(q, k, v, "poly3", scale=0.25)
    want = expected(q, k, v, "poly3") * (0.25 * 40**0.5)  # the reference's 1/sqrt(N) replaced by 0.25
    torch.testing.assert_close(out, want.float(), rtol=1e-5, atol=1e-6)


def test_strided_caches_read_in_place_or_copied():
    """A slice of a preallocated (static) cache, a non-unit last stride, and a cache of one key."""
    q, k, v = cache(nk=20)
    big_k, big_v = torch.zeros(2, 2, 64, 8, dtype=k.dtype), torch.zeros(2, 2, 64, 6, dtype=v.dtype)
    big_k[:, :, :20], big_v[:, :, :20] = k, v
    torch.testing.assert_close(decode(q, big_k[:, :, :20], big_v[:, :, :20], "poly3"), expected(q, k, v, "poly3"))
    k_t = k.transpose(-1, -2).contiguous().transpose(-1, -2)  # the same values, last stride 20
    torch.testing.assert_close(decode(q, k_t, v, "poly3"), expected(q, k, v, "poly3"))
    q1, k1, v1 = cache(nk=1)
    torch.testing.assert_close(decode(q1, k1, v1, "sigmoid"), expected(q1, k1, v1, "sigmoid"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_types_compute_in_fp32_and_return_their_dtype(dtype):
    q, k, v = (x.to(dtype) for x in cache(nk=30))
    out = decode(q, k, v, "poly3")
    assert out.dtype == dtype
    want = expected(q.float(), k.float(), v.float(), "poly3")
    torch.testing.assert_close(out.double(), want, rtol=1e-2, atol=1e-2)


def test_a_long_cache_splits_over_threads_with_the_same_result():
    q, k, v = cache(batch=1, heads=8, kv_heads=2, nk=3000, d=16, dv=16, dtype=torch.float32)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = decode(q, k, v, "poly2")
        torch.set_num_threads(2)
        two = decode(q, k, v, "poly2")
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(two, one, rtol=0, atol=0)
    torch.testing.assert_close(one.double(), expected(q, k, v, "poly2"), rtol=1e-4, atol=1e-6)


def test_no_keys_give_zeros():
    q, k, v = cache(nk=0)
    assert torch.equal(decode(q, k, v, "poly3"), torch.zeros(2, 1, 4, 6, dtype=torch.float64))


def test_shapes_that_do_not_fit_are_refused():
    q, k, v = cache(heads=4, kv_heads=3)
    with pytest.raises(RuntimeError, match="4 query heads for 3 kv heads"):
        decode(q, k, v, "poly3")
    q, k, v = cache()
    with pytest.raises(RuntimeError, match="do not match"):
        decode(q, k[:, :, :5], v, "poly3")
    with pytest.raises(RuntimeError, match="share a dtype"):
        decode(q, k.float(), v, "poly3")
    op, form, power = fused_cpu.decode_plan(get_activation("poly3"))
    with pytest.raises(RuntimeError, match="1 row constant.*got 2 and 2"):
        op(q, k, v, form, power, 0.3, (1.0, 1.0), (0.0, 0.0), False)
    with pytest.raises(RuntimeError, match="2 row constant.*got 1 and 1"):
        op(*cache(rows=2), form, power, 0.3, (1.0,), (0.0,), True)


def test_what_it_cannot_run_is_left_to_the_caller(monkeypatch):
    """None (the caller's materialized path runs) for a custom activation and where the C++ build failed."""
    q, k, v = cache()
    custom = Activation("cube", fn=lambda s: s**3, grad=lambda s: 3 * s**2, scale="inv_sqrt_n")
    assert fused_cpu.decode(q, k, v, custom, 0.3) is None
    monkeypatch.setattr(fused_cpu, "load", lambda: False)
    # the plan is resolved once per activation (load() is decided once per process); a fresh one sees no build
    monkeypatch.setattr(fused_cpu, "decode_plan", functools.cache(fused_cpu.decode_plan.__wrapped__))
    assert fused_cpu.decode(q, k, v, get_activation("poly3"), 0.3) is None


@pytest.mark.parametrize("name", [*ELEMENTWISE, {"name": "poly3", "scale": 0.07}])
def test_row_constants_are_the_per_row_scale_and_shift(name):
    act = get_activation(name)
    for n in (0, 1, 7, 4096):
        counts = torch.tensor([float(n)], dtype=torch.float64)
        scale, shift = act.row_constants(n)
        assert scale == pytest.approx(act.row_scale(counts).item(), rel=1e-15)
        assert shift == pytest.approx(act.row_shift(counts).item(), abs=1e-15)


def test_compiles_in_one_graph():
    """The op's registered fake shape lets ``torch.compile`` (``fullgraph``: a break raises) trace through it."""
    q, k, v = cache(dtype=torch.float32)
    act = get_activation("poly3")
    compiled = torch.compile(lambda q, k, v: fused_cpu.decode(q, k, v, act, 0.3) * 2, backend="aot_eager",
                             fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(q, k, v), fused_cpu.decode(q, k, v, act, 0.3) * 2, rtol=0, atol=0)
