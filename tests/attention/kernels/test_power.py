"""The ``power`` kernel (exact linear-time poly2-poly4) against the materialised ``(q . k)^p`` in float64.

The reference is written here from the formula, independently of the kernels: scores ``S = q k^T t``,
``phi = S^p / sqrt(n)`` with ``n`` the keys a row may attend (bottom-right causal, key padding), kv heads
repeated for grouped-query attention. Chunks of 4 tokens (``small_chunks``) make every shape below span
several ragged chunks and cross the causal diagonal inside and between them.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from test_attention_kernels import _grads as grads
from test_attention_kernels import assert_matches_reference_attention as assert_matches
from test_attention_kernels import num_threads

from polyattn_lightning.attention import attention, kernel_choice
from polyattn_lightning.attention.functional import kernel_inputs
from polyattn_lightning.attention.kernels import KernelNotSupported, base
from polyattn_lightning.attention.kernels.base import cpp, state
from polyattn_lightning.attention.kernels.power import parallel
from polyattn_lightning.bench.timing import step_peak_bytes

pytestmark = pytest.mark.skipif(not cpp.load(), reason="the C++ kernels could not be built")

#: (Nq, Nk): square, a few queries over more keys (bottom-right), more queries than keys (rows with no key)
SHAPES = [(9, 9), (3, 17), (1, 13), (20, 7)]


def reference(q, k, v, p, keep=None, causal=False, t=None):
    """``c(n) (q k^T t)^p v`` with the whole score matrix (float64 in, float64 out)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    nq, nk = q.shape[-2], k.shape[-2]
    t = q.shape[-1] ** -0.5 if t is None else t
    allowed = torch.ones(nq, nk, dtype=torch.bool)
    if causal:
        allowed = torch.arange(nk)[None, :] <= torch.arange(nq)[:, None] + (nk - nq)
    allowed = allowed.expand(q.shape[0], q.shape[1], nq, nk)
    if keep is not None:
        allowed = allowed & keep[:, None, None, :]
    n = allowed.sum(-1, keepdim=True).clamp_min(1).to(q.dtype)
    return (((q @ k.transpose(-2, -1)) * t) ** p * allowed / n.sqrt()) @ v


def qkv(batch=2, heads=4, kv_heads=2, nq=9, nk=9, d=4, dv=5, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(batch, heads, nq, d), (batch, kv_heads, nk, d), (batch, kv_heads, nk, dv)]
    return [torch.randn(s, generator=g, dtype=dtype).requires_grad_() for s in shapes]


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(parallel, "chunk_size", lambda d, p: 4)


def padding(batch: int, nk: int) -> torch.Tensor:
    """True = padding: the last 3 keys of row 0, the first 2 of the last row (left padding)."""
    pad = torch.zeros(batch, nk, dtype=torch.bool)
    pad[0, -3:] = True
    pad[-1, :2] = True
    return pad


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("p", [2, 3, 4])
def test_matches_the_materialised_power_with_padding_and_grouped_heads(p, causal, shape, small_chunks):
    nq, nk = shape
    q, k, v = qkv(nq=nq, nk=nk)
    pad = padding(2, nk)
    out = attention(q, k, v, f"poly{p}", key_padding_mask=pad, is_causal=causal, kernel="power")
    assert_matches(out, reference(q, k, v, p, ~pad, causal), (q, k, v), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_a_float_scale_and_temperature_and_equal_heads(causal, small_chunks):
    q, k, v = qkv(heads=3, kv_heads=3, nq=10, nk=10)
    out = attention(q, k, v, {"name": "poly3", "scale": 0.25}, temperature=0.7, is_causal=causal, kernel="power")
    expected = reference(q, k, v, 3, causal=causal, t=0.7) * torch.sqrt(
        torch.arange(1, 11, dtype=torch.float64).view(10, 1) if causal else torch.tensor(10.0, dtype=torch.float64)
    ) * 0.25
    assert_matches(out, expected, (q, k, v), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_the_same_result_on_one_to_three_threads(threads, causal, small_chunks):
    """Non-causal splits a head's keys over threads when there are fewer heads than threads."""
    with num_threads(threads):
        q, k, v = qkv(batch=1, heads=2, kv_heads=1, nq=23, nk=23)
        out = attention(q, k, v, "poly2", is_causal=causal, kernel="power")
        assert_matches(out, reference(q, k, v, 2, causal=causal), (q, k, v), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("p", [2, 3])
def test_gradcheck(p, causal, small_chunks):
    q, k, v = qkv(batch=1, heads=2, kv_heads=1, nq=6, nk=7, d=3, dv=2)
    pad = torch.zeros(1, 7, dtype=torch.bool)
    pad[0, 1] = True
    fn = lambda q, k, v: attention(q, k, v, f"poly{p}", key_padding_mask=pad, is_causal=causal, kernel="power")  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_rows_without_keys_give_zeros_and_finite_gradients(causal, small_chunks):
    """A sequence whose keys are all padding (and, causal, the rows before the first key) outputs zeros; an inf
    in a padded key stays out."""
    q, k, v = qkv(nq=8, nk=6)
    pad = torch.zeros(2, 6, dtype=torch.bool)
    pad[1] = True
    pad[0, 0] = True
    with torch.no_grad():
        k[0, :, 0] = float("inf")
        v[0, :, 0] = float("nan")
    out = attention(q, k, v, "poly3", key_padding_mask=pad, is_causal=causal, kernel="power")
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    if causal:  # row i reaches keys j <= i - 2: rows 0, 1 none, row 2 only key 0, which is padding
        assert torch.equal(out[0, :, :3], torch.zeros_like(out[0, :, :3]))
        assert (out[0, :, 3].abs() > 0).all()
    assert all(torch.isfinite(g).all() for g in grads(out, (q, k, v)))
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_half_precision_inputs_keep_fp32_states(dtype, causal):
    q, k, v = qkv(batch=1, heads=2, kv_heads=2, nq=64, nk=64, d=8, dv=8, dtype=dtype)
    out = attention(q, k, v, "poly3", is_causal=causal, kernel="power")
    assert out.dtype == dtype
    exact = reference(*(x.detach().double() for x in (q, k, v)), 3, causal=causal)
    error = (out.double() - exact).norm() / exact.norm()
    assert error < (1e-2 if dtype == torch.bfloat16 else 2e-3)  # the output's own rounding: 2^-8, 2^-11
    assert all(g.dtype == dtype and torch.isfinite(g).all() for g in grads(out, (q, k, v)))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fp32_is_within_1e_5_of_float64(causal):
    """The goal's accuracy at d = 32, p = 3 on 2,048 tokens (5,984 features summed per output)."""
    q, k, v = qkv(batch=1, heads=1, kv_heads=1, nq=2048, nk=2048, d=32, dv=32, dtype=torch.float32)
    with torch.no_grad():
        out = attention(q, k, v, "poly3", is_causal=causal, kernel="power").double()
        exact = attention(*(x.double() for x in (q, k, v)), "poly3", is_causal=causal, kernel="fused_cpu")
    assert (out - exact).norm() / exact.norm() < 1e-5


def test_memory_does_not_grow_with_n_times_d():
    """d = 16, p = 3: D = 816 features. The features of 8,192 keys would be 26.7 MB; the step's extra memory
    (outputs, gradients, scratch) stays within a few copies of the inputs plus per-thread blocks."""
    d, p = 16, 3

    def peak(n):
        q, k, v = qkv(batch=1, heads=1, kv_heads=1, nq=n, nk=n, d=d, dv=d, dtype=torch.float32)
        return step_peak_bytes(lambda: attention(q, k, v, f"poly{p}", kernel="power").sum().backward(), q.device)

    small, large = peak(2048), peak(8192)
    features = 8192 * state.monomial_count(d, p) * 4
    inputs = 3 * 8192 * d * 4
    assert large < 12 * inputs + 4 * parallel.chunk_size(d, p) * state.monomial_count(d, p) * 4 * 4
    assert large < features / 4
    assert large - small < 12 * (inputs - inputs // 4)  # grows with N d, not with N D


def test_refuses_what_does_not_factor():
    q, k, v = qkv(nq=5, nk=5)
    choice = kernel_choice(q, k, v, "poly3", attn_mask=torch.ones(5, 5, dtype=torch.bool).tril(), attn_bias=None)
    assert "pairwise attn_mask" in " ".join(choice.passed_over["power"])
    for options, words in [
        ({"attn_bias": torch.zeros(1, 4, 5, 5, dtype=torch.float64)}, "score bias"),
        ({"dropout_p": 0.1}, "dropout"),
    ]:
        with pytest.raises(KernelNotSupported, match=words):
            attention(q, k, v, "poly3", kernel="power", **options)
    for name, words in [("poly1", "associative"), ("poly5", "poly2-poly4"), ("relu", "poly2-poly4")]:
        with pytest.raises(KernelNotSupported, match=words):
            attention(q, k, v, name, kernel="power")


def test_grouped_query_heads_reach_every_kernel():
    """k, v with fewer heads than q: the power kernel takes them as they are, every other gets them repeated."""
    q, k, v = qkv(nq=6, nk=6)
    expected = reference(q, k, v, 3)
    for kernel in ("power", "fused_cpu", "blocked", "materialized"):
        torch.testing.assert_close(attention(q, k, v, "poly3", kernel=kernel), expected)
    with pytest.raises(ValueError, match="Hkv dividing H"):
        attention(q, k[:, :1].repeat(1, 3, 1, 1), v[:, :1].repeat(1, 3, 1, 1), "poly3")


# --------------------------------------------------------------------------- auto and the crossover table


@pytest.fixture
def table(tmp_path, monkeypatch):
    """A crossover table of this machine's key: poly3 at d = 8 from 64 tokens (train, non-causal)."""

    def write(rows, alpha=1e-10):
        key = base.device_key(torch.device("cpu"))
        path = tmp_path / "crossover.json"
        path.write_text(json.dumps({"devices": {key: {"quadratic_seconds": alpha, "crossover": rows}}}))
        monkeypatch.setenv("POLYATTN_CROSSOVER", str(path))
        base.reload_crossover_table()

    yield write
    monkeypatch.delenv("POLYATTN_CROSSOVER")
    base.reload_crossover_table()


def row(p=3, d=8, causal=False, mode="train", n=64):
    return dict(p=p, d=d, causal=causal, mode=mode, n=n)


def test_auto_follows_the_table(table):
    table([row(), row(causal=True, n=200), row(mode="forward", n=500)])
    for n, kernel in [(48, "fused_cpu"), (80, "power")]:
        q, k, v = qkv(batch=1, heads=2, kv_heads=2, nq=n, nk=n, d=8, dv=8, dtype=torch.float32)
        assert kernel_choice(q, k, v, "poly3").kernel == kernel
    q, k, v = qkv(batch=1, heads=2, kv_heads=2, nq=150, nk=150, d=8, dv=8, dtype=torch.float32)
    assert kernel_choice(q, k, v, "poly3", is_causal=True).kernel == "fused_cpu"  # causal: from 200
    with torch.no_grad():  # no gradient: the forward crossover (500)
        assert kernel_choice(q, k, v, "poly3").kernel == "fused_cpu"
    assert kernel_choice(q, k, v, "poly3").kernel == "power"
    choice = kernel_choice(q, k, v, "poly3")
    assert "cost" in " ".join(choice.passed_over["fused_cpu"])


def test_auto_scales_the_crossover_to_other_head_dims_and_powers_it_lacks(table):
    """d = 16 is not in the table: its length is the FLOP crossover scaled by d = 8's measured ratio."""
    table([row(n=64)])
    expected = 64 / base.flop_crossover(8, 3, False) * base.flop_crossover(16, 3, False)
    q, k, v = qkv(batch=1, heads=1, kv_heads=1, nq=4, nk=4, d=16, dv=16, dtype=torch.float32)
    inputs = kernel_inputs(q, k, v, "poly3", None, None, None, None, None, 0.0, False)
    assert math.isclose(base.crossover_length(inputs, 16, 3), expected)
    assert math.isinf(base.crossover_length(inputs, 16, 2))  # no poly2 rows: never
    for n, kernel in [(int(expected * 0.9), "fused_cpu"), (int(expected * 1.1), "power")]:
        q, k, v = qkv(batch=1, heads=1, kv_heads=1, nq=n, nk=n, d=16, dv=16, dtype=torch.float32)
        assert kernel_choice(q, k, v, "poly3").kernel == kernel


def test_a_grouped_call_costs_less_on_the_linear_form(table):
    """Grouped-query heads share one kv state: a 4-to-1 call crosses over earlier than a 1-to-1 one."""
    table([row(n=64)])
    q, k, v = qkv(batch=1, heads=4, kv_heads=4, nq=56, nk=56, d=8, dv=8, dtype=torch.float32)
    assert kernel_choice(q, k, v, "poly3").kernel == "fused_cpu"
    assert kernel_choice(q, k[:, :1], v[:, :1], "poly3").kernel == "power"


def test_causal_pairs_count_the_bottom_right_triangle():
    for nq, nk in [(9, 9), (3, 17), (20, 7), (1, 5), (5, 1)]:
        dense = int((torch.arange(nk)[None, :] <= torch.arange(nq)[:, None] + nk - nq).sum())
        assert base.causal_pairs(nq, nk, nk - nq) == dense
        assert base.causal_pairs(nq, nk, None) == nq * nk


def test_the_shipped_table_covers_this_machine_kind_and_the_gpus():
    devices = base.crossover_table(str(base.CROSSOVER_TABLE))["devices"]
    assert any(key.startswith("cpu/") and entry["measured"] for key, entry in devices.items())
    gpus = [entry for key, entry in devices.items() if key.startswith("cuda/")]
    assert gpus and all(not entry["measured"] for entry in gpus)  # placeholders until measured on the GPU
    for entry in devices.values():
        keys = {(r["p"], r["d"], r["causal"], r["mode"]) for r in entry["crossover"]}
        assert {(3, 32, False, "train"), (2, 64, False, "train"), (3, 32, True, "train")} <= keys


def test_the_triton_kernels_under_the_interpreter():
    """``interpreted_power_cases.py`` in a subprocess with ``TRITON_INTERPRET=1`` (Triton's CPU interpreter)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    cases = Path(__file__).with_name("interpreted_power_cases.py")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(cases)],
        env=env, capture_output=True, text=True, timeout=1800, cwd=Path(__file__).parent,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout
