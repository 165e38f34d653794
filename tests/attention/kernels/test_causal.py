"""``attention(..., is_causal=True)`` on every kernel against a dense bottom-right mask of the tests' own.

Query i attends keys j <= i + Nk - Nq. The reference (``attention_reference.causal_reference``) builds
that mask densely from index comparisons; the kernels never see a mask tensor. The Triton kernel's
causal cases are in ``interpreted_triton_cases.py``.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from attention_reference import ELEMENTWISE, bottom_right, causal_reference, make_qkv
from test_attention_kernels import _grads, num_threads, small_tiles  # noqa: F401 (small_tiles is a fixture)
from test_attention_kernels import assert_matches_reference_attention as assert_close_with_grads
from torch.utils._python_dispatch import TorchDispatchMode

from polyattn_lightning.attention.kernels import associative
from polyattn_lightning.attention import attention, get_activation
from auto_kernel import auto_kernel
from polyattn_lightning.attention.masks import keys_per_row

QUADRATIC = ["materialized", "blocked", "fused_cpu"]
#: (Nq, Nk): square, a few queries over a cache (Nq < Nk), and more queries than keys (rows with no key)
SHAPES = [(9, 9), (3, 17), (1, 17), (20, 7)]


@pytest.fixture(params=["cpp", "torch"])
def associative_path(request, monkeypatch):
    """The causal associative kernel's C++ sweep (CPU default) and its batched PyTorch form (other devices)."""
    if request.param == "torch":
        monkeypatch.setattr(associative, "load", lambda: False)
    return request.param


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("kernel", QUADRATIC)
@pytest.mark.parametrize("name", ELEMENTWISE)
def test_causal_matches_reference(name, kernel, shape, small_tiles):
    nq, nk = shape
    q, k, v = make_qkv(B=2, H=2, Nq=nq, Nk=nk, d=4, dv=5)
    out = attention(q, k, v, name, is_causal=True, kernel=kernel)
    assert_close_with_grads(out, causal_reference(q, k, v, name), (q, k, v))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_fused_cpu_causal_splits_work_over_threads(threads, small_tiles):
    """The fused kernel orders causal query blocks first/last/... and splits key blocks by tile area."""
    with num_threads(threads):
        q, k, v = make_qkv(B=1, H=1, Nq=23, Nk=31, d=4, dv=3)
        out = attention(q, k, v, "poly3", is_causal=True, kernel="fused_cpu")
        assert_close_with_grads(out, causal_reference(q, k, v, "poly3"), (q, k, v))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("kernel", ["associative", *QUADRATIC])
def test_causal_with_key_padding_and_n_counting_only_reachable_keys(kernel, shape, small_tiles, associative_path):
    """Padding + causal; N is the number of unpadded keys within reach, so a row whose reachable keys are
    all padding outputs zeros."""
    nq, nk = shape
    name = "poly1" if kernel == "associative" else "poly3"
    q, k, v = make_qkv(B=2, H=2, Nq=nq, Nk=nk, d=4, dv=5)
    padding = torch.zeros(2, nk, dtype=torch.bool)
    padding[0, -3:] = True  # at the end
    padding[1, : max(2, nk - nq + 2)] = True  # the first keys: the first rows of batch 1 have none left
    out = attention(q, k, v, name, is_causal=True, key_padding_mask=padding, kernel=kernel)
    keep = ~padding[:, None, None, :]
    assert_close_with_grads(out, causal_reference(q, k, v, name, keep), (q, k, v))
    reachable = (keep & bottom_right(nq, nk)).sum(-1).expand(2, 2, nq)
    assert torch.equal(out[reachable == 0], torch.zeros_like(out[reachable == 0]))


@pytest.mark.parametrize("kernel", QUADRATIC)
def test_causal_with_attn_mask_and_key_padding(kernel, small_tiles):
    q, k, v = make_qkv(B=2, H=3, Nq=10, Nk=13, d=4, dv=5)
    attn_mask = torch.rand(2, 1, 10, 13, generator=torch.Generator().manual_seed(1)) > 0.3
    padding = torch.zeros(2, 13, dtype=torch.bool)
    padding[1, 9:] = True
    out = attention(q, k, v, "relu", is_causal=True, attn_mask=attn_mask, key_padding_mask=padding, kernel=kernel)
    keep = attn_mask & ~padding[:, None, None, :]
    assert_close_with_grads(out, causal_reference(q, k, v, "relu", keep), (q, k, v))


def test_keys_per_row_counts_reachable_unpadded_keys():
    padding = torch.tensor([[False, True, False, False, True, False, False], [True] * 3 + [False] * 4])
    allowed = ~padding[:, None, None, :]
    for nq in (1, 4, 7, 10):
        expected = (allowed & bottom_right(nq, 7)).sum(-1, keepdim=True).float()
        got = keys_per_row(allowed, 7, torch.device("cpu"), causal=7 - nq)
        assert torch.equal(got.expand_as(expected), expected)
        alone = keys_per_row(None, 7, torch.device("cpu"), causal=7 - nq)
        assert torch.equal(alone.flatten(), bottom_right(nq, 7).sum(-1).float())


@pytest.mark.parametrize("kernel", QUADRATIC)
def test_rows_with_no_key_give_zeros_and_finite_grads(kernel):
    q, k, v = make_qkv(B=1, H=2, Nq=8, Nk=3, d=4, dv=4)
    out = attention(q, k, v, "sigmoid", is_causal=True, kernel=kernel)
    assert torch.equal(out[:, :, :5], torch.zeros_like(out[:, :, :5]))  # rows 0..4 reach no key
    assert out[:, :, 5:].abs().sum() > 0
    assert all(g.isfinite().all() for g in _grads(out, (q, k, v)))


@pytest.mark.parametrize("kernel", ["sdpa", "associative", *QUADRATIC])
def test_changing_future_tokens_changes_nothing_before_them(kernel, associative_path):
    name = {"sdpa": "softmax", "associative": "poly1"}.get(kernel, "poly3")
    q, k, v = (x.detach() for x in make_qkv(B=1, H=2, Nq=40, Nk=40, d=8, dv=8, dtype=torch.float32))
    out = attention(q, k, v, name, is_causal=True, kernel=kernel)
    changed = [x.clone() for x in (q, k, v)]
    for x in changed:
        x[:, :, 25:] = 100 * torch.randn_like(x[:, :, 25:])
    again = attention(*changed, name, is_causal=True, kernel=kernel)
    torch.testing.assert_close(again[:, :, :25], out[:, :, :25], rtol=0, atol=0)
    assert not torch.allclose(again[:, :, 25:], out[:, :, 25:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kernel", ["associative", *QUADRATIC])
def test_low_precision_inputs(kernel, dtype, associative_path):
    name = "poly1" if kernel == "associative" else "poly3"
    q, k, v = make_qkv(B=2, H=2, Nq=24, Nk=40, d=16, dv=8, dtype=dtype)
    padding = torch.zeros(2, 40, dtype=torch.bool)
    padding[1, 30:] = True
    out = attention(q, k, v, name, is_causal=True, key_padding_mask=padding, kernel=kernel)
    expected = causal_reference(*(x.detach().double() for x in (q, k, v)), name, ~padding[:, None, None, :])
    tol = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 3e-3}[dtype]
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol * expected.abs().max().item())
    grads = _grads(out.float(), (q, k, v))
    assert all(g.dtype == dtype and g.isfinite().all() for g in grads)


@pytest.mark.parametrize("kernel", QUADRATIC)
def test_fp16_large_scores_do_not_overflow(kernel):
    """|S| ~ 300: fp16 ``S**3`` overflows 65504; the causal kernels compute it in fp32 as the others do
    (v is small enough that the true output, from as few as 9 keys, fits in fp16)."""
    g = torch.Generator().manual_seed(0)
    q = (8 + torch.rand(1, 2, 8, 16, generator=g)).half()
    k = (8 + torch.rand(1, 2, 16, 16, generator=g)).half()
    v = (1e-4 * torch.randn(1, 2, 16, 8, generator=g)).half()
    assert torch.isinf(((q @ k.transpose(-2, -1)) * 16**-0.5) ** 3).any()
    out = attention(q, k, v, "poly3", is_causal=True, kernel=kernel)
    assert out.dtype == torch.float16 and out.isfinite().all()
    expected = causal_reference(q.double(), k.double(), v.double(), "poly3")
    torch.testing.assert_close(out.double(), expected, rtol=2e-3, atol=1e-3 * expected.abs().max().item())


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_softmax_matches_sdpa_with_the_lower_right_mask(shape):
    nq, nk = shape
    q, k, v = make_qkv(B=2, H=2, Nq=nq, Nk=nk, d=4, dv=5)
    mask = bottom_right(nq, nk)
    empty = ~mask.any(-1)[:, None]  # rows with no key: SDPA gives NaN there, attention() zeros
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | empty).masked_fill(empty, 0.0)
    assert_close_with_grads(attention(q, k, v, "softmax", is_causal=True), expected, (q, k, v))
    padding = torch.zeros(2, nk, dtype=torch.bool)
    padding[1, -2:] = True
    both = mask & ~padding[:, None, None, :]
    empty = ~both.any(-1, keepdim=True)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=both | empty).masked_fill(empty, 0.0)
    out = attention(q, k, v, "softmax", is_causal=True, key_padding_mask=padding)
    assert_close_with_grads(out, expected, (q, k, v))


def test_softmax_causal_with_an_additive_mask():
    q, k, v = make_qkv(B=1, H=2, Nq=5, Nk=8, d=4, dv=4)
    additive = torch.zeros(5, 8, dtype=torch.float64)
    additive[:, 1] = -100.0
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=additive.masked_fill(~bottom_right(5, 8), -torch.inf))
    assert_close_with_grads(attention(q, k, v, "softmax", is_causal=True, attn_mask=additive), expected, (q, k, v))


# --------------------------------------------------------------------------- linear-time causal poly1


@pytest.mark.parametrize("shape", [(64, 64), (150, 150), (37, 200), (200, 37)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_linear_causal_poly1_equals_the_quadratic_one(shape, associative_path):
    """The chunked prefix-sum form (ragged against its 64-query chunks) against poly1 on the whole matrix."""
    nq, nk = shape
    q, k, v = make_qkv(B=2, H=2, Nq=nq, Nk=nk, d=8, dv=6)
    padding = torch.zeros(2, nk, dtype=torch.bool)
    padding[1, nk // 3 : nk // 2] = True
    for mask in (None, padding):
        out = attention(q, k, v, "poly1", is_causal=True, key_padding_mask=mask, kernel="associative")
        quadratic = attention(q, k, v, "poly1", is_causal=True, key_padding_mask=mask, kernel="materialized")
        assert_close_with_grads(out, quadratic, (q, k, v))


def test_the_dispatcher_picks_the_linear_form_for_causal_poly1():
    q, longer = torch.zeros(1, 1, 4, 8), torch.zeros(1, 1, 7, 8)  # keys: as many as queries, 3 more
    poly1, poly3 = get_activation("poly1"), get_activation("poly3")
    padding_only = torch.zeros(1, 7, dtype=torch.bool)
    assert auto_kernel(q, poly1, is_causal=True) == "associative"
    assert auto_kernel(q, poly1, k=longer, key_padding_mask=padding_only, is_causal=True) == "associative"
    assert auto_kernel(q, poly1, attn_mask=torch.ones(1, 1, 4, 4, dtype=torch.bool), is_causal=True) == "fused_cpu"
    assert auto_kernel(q, poly3, is_causal=True) == "fused_cpu"


class LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an aten op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(x, torch.Tensor):
                self.largest = max(self.largest, x.numel())
        return out


def test_linear_causal_poly1_allocates_no_n_by_n_tensor(associative_path):
    n, d = 2048, 8
    q, k, v = make_qkv(B=1, H=1, Nq=n, Nk=n, d=d, dv=d, dtype=torch.float32)
    padding = torch.zeros(1, n, dtype=torch.bool)
    padding[0, -100:] = True
    recorder = LargestTensor()
    with recorder:
        out = attention(q, k, v, "poly1", is_causal=True, key_padding_mask=padding)
        out.sum().backward()
    assert recorder.largest <= n * associative.CAUSAL_CHUNK < n * n // 16
    expected = attention(*(x.detach()[:, :, :256] for x in (q, k, v)), "poly1", is_causal=True,
                         key_padding_mask=padding[:, :256], kernel="materialized")
    torch.testing.assert_close(out[:, :, :256].detach(), expected)  # a causal prefix is its own problem


def test_norm_diagnostics_see_the_causal_scores():
    from polyattn_lightning.diagnostics.norms import attention_norms

    q, k, _ = (x.detach() for x in make_qkv(B=2, H=3, Nq=6, Nk=10, d=4, dv=4))
    mask = bottom_right(6, 10)
    s = q @ k.transpose(-2, -1) / 2.0
    n = mask.sum(-1, keepdim=True).double()
    phi, grad = (s**3 / n.sqrt()) * mask, (3 * s**2 / n.sqrt()) * mask
    norms = attention_norms(q, k, "poly3", is_causal=True)
    torch.testing.assert_close(norms.phi, phi.square().sum((-2, -1)).sqrt().mean(0).float())
    torch.testing.assert_close(norms.jacobian, grad.square().sum((-2, -1)).sqrt().mean(0).float())


@pytest.mark.parametrize("kernel", ["blocked", "fused_cpu"])
def test_gradcheck_causal_with_dropout_and_bias(kernel, small_tiles):
    """The backward replays the forward's dropout draws over the same causal tiles (re-seeded per call)."""
    q, k, v = make_qkv(B=1, H=2, Nq=7, Nk=10, d=3, dv=2)
    bias = (0.1 * torch.randn(1, 2, 7, 10, dtype=torch.float64)).requires_grad_()

    def fn(q, k, v, bias):
        torch.manual_seed(0)
        return attention(q, k, v, "poly3", is_causal=True, attn_bias=bias, dropout_p=0.3, kernel=kernel)

    undropped = attention(q, k, v, "poly3", is_causal=True, attn_bias=bias, kernel=kernel)
    assert not torch.allclose(fn(q, k, v, bias), undropped)  # dropout is on
    assert torch.autograd.gradcheck(fn, (q, k, v, bias))


@pytest.mark.parametrize("activation, shape", [("poly3", (12, 12)), ("poly1", (5, 12)), ("softmax", (5, 12))])
def test_causal_call_compiles_in_one_graph(activation, shape):
    """torch.compile traces a causal call with key padding without a graph break (fullgraph raises on one)."""
    nq, nk = shape
    q, k, v = make_qkv(B=2, H=2, Nq=nq, Nk=nk, d=8, dv=8, dtype=torch.float32)
    padding = torch.zeros(2, nk, dtype=torch.bool)
    padding[1, 9:] = True

    def call(q, k, v):
        return attention(q, k, v, activation, is_causal=True, key_padding_mask=padding)

    eager = call(q, k, v)
    torch._dynamo.reset()
    compiled = torch.compile(call, backend="aot_eager", fullgraph=True)(q, k, v)
    assert_close_with_grads(compiled, eager, (q, k, v))
