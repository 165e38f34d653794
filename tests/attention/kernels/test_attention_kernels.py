"""The non-softmax kernels against the plain-PyTorch reference: values, gradients, masks, dtypes, dropout."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
import torch
from attention_reference import ELEMENTWISE, make_qkv, reference_attention

from polyattn_lightning.attention import Activation, attention, get_activation
from polyattn_lightning.attention.kernels import associative, blocked, fused_cpu
from auto_kernel import auto_kernel

QUADRATIC = ["materialized", "blocked", "fused_cpu"]


def _grads(out, inputs):
    """Gradients of a fixed, non-trivial function of ``out`` (not just its sum)."""
    weight = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)
    return torch.autograd.grad((out * weight).sum(), inputs)


def assert_matches_reference_attention(out, expected, inputs, **tol):
    torch.testing.assert_close(out, expected, **tol)
    for got, want in zip(_grads(out, inputs), _grads(expected, inputs)):
        torch.testing.assert_close(got, want, **tol)


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles of 3 keys and a few queries, causal prefix sums in chunks of 4 keys, so shapes below span several
    ragged blocks (and cross the causal diagonal in many)."""
    monkeypatch.setattr(blocked, "MAX_KEY_BLOCK", 3)
    monkeypatch.setattr(blocked, "TILE_ELEMENTS", 64)
    monkeypatch.setattr(fused_cpu, "FORWARD_BLOCK", (4, 3))
    monkeypatch.setattr(fused_cpu, "BACKWARD_BLOCK", (5, 3))
    monkeypatch.setattr(associative, "CAUSAL_CHUNK", 4)


@contextlib.contextmanager
def num_threads(count: int):
    """PyTorch's intra-op thread count set to ``count`` for the block."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield count
    finally:
        torch.set_num_threads(before)


@pytest.fixture(params=[1, 2, 3], ids=["1thread", "2threads", "3threads"])
def threads(request):
    """Run with one to three intra-op threads (the fused kernel splits work differently)."""
    with num_threads(request.param):
        yield request.param


@pytest.mark.parametrize("kernel", QUADRATIC)
@pytest.mark.parametrize("name", ELEMENTWISE)
def test_each_activation_matches_reference(name, kernel):
    q, k, v = make_qkv()
    assert_matches_reference_attention(attention(q, k, v, name, kernel=kernel), reference_attention(q, k, v, name), (q, k, v))


@pytest.mark.parametrize("name", ELEMENTWISE)
def test_blocked_with_ragged_blocks_and_nq_ne_nk(name, small_tiles):
    q, k, v = make_qkv(B=2, H=2, Nq=37, Nk=10)  # 37 = 2 x 16 + 5 queries, 10 = 3 x 3 + 1 keys per tile
    assert blocked.block_sizes((2, 2, 37, 10), blocked.TILE_ELEMENTS) == (1, 16, 3)
    keep = torch.rand(2, 1, 37, 10, generator=torch.Generator().manual_seed(1)) > 0.3
    bias = torch.randn(2, 37, 10, dtype=q.dtype, requires_grad=True)
    out = attention(q, k, v, name, attn_mask=keep, attn_bias=bias, kernel="blocked")
    assert_matches_reference_attention(out, reference_attention(q, k, v, name, keep=keep, bias=bias), (q, k, v, bias))


@pytest.mark.parametrize("bias_shape", [(3, 37, 10), (2, 3, 37, 10), (2, 3, 37, 1)], ids=["shared", "own", "key-bcast"])
@pytest.mark.parametrize("heads", [1, 3])
@pytest.mark.parametrize("name", ELEMENTWISE)
def test_fused_cpu_with_ragged_blocks_and_nq_ne_nk(name, heads, bias_shape, small_tiles, threads):
    """Fewer heads than twice the threads spreads each head's key blocks over chunks that sum dQ (and a
    bias gradient shared by heads or broadcast along keys) in buffers of their own; a bias of every head's
    own goes straight into its gradient."""
    q, k, v = make_qkv(B=2, H=heads, Nq=37, Nk=10)  # 37 = 9 x 4 + 1 queries, 10 = 3 x 3 + 1 keys per tile
    keep = torch.rand(1, 1, 37, 10, generator=torch.Generator().manual_seed(1)) > 0.3
    keep[..., 5, :] = False  # a row with no attendable key
    bias_shape = tuple(heads if size == 3 else size for size in bias_shape)
    bias = torch.randn(bias_shape, dtype=q.dtype, requires_grad=True)
    out = attention(q, k, v, name, attn_mask=keep, attn_bias=bias, kernel="fused_cpu")
    expected = reference_attention(q, k, v, name, keep=keep, bias=bias)
    assert_matches_reference_attention(out, expected, (q, k, v, bias))


@pytest.mark.parametrize("name", ELEMENTWISE)
def test_gradcheck_fused_cpu(name, small_tiles, threads):
    q, k, v = make_qkv(B=1, H=1, Nq=17, Nk=5, d=3, dv=2)
    keep = torch.tensor([True, True, False, True, True])
    bias = torch.randn(17, 5, dtype=torch.float64, requires_grad=True)

    def fn(q, k, v, bias):
        return attention(q, k, v, name, attn_mask=keep, attn_bias=bias, kernel="fused_cpu")

    assert torch.autograd.gradcheck(fn, (q, k, v, bias))


@pytest.mark.parametrize("name", ELEMENTWISE)
def test_gradcheck_blocked(name, small_tiles):
    q, k, v = make_qkv(B=1, H=2, Nq=17, Nk=5, d=3, dv=2)
    keep = torch.tensor([True, True, False, True, True])
    bias = torch.randn(2, 17, 5, dtype=torch.float64, requires_grad=True)

    def fn(q, k, v, bias):
        return attention(q, k, v, name, attn_mask=keep, attn_bias=bias, kernel="blocked")

    assert torch.autograd.gradcheck(fn, (q, k, v, bias))


@pytest.fixture(params=["cpp", "torch"])
def associative_path(request, monkeypatch):
    """The associative kernel's C++ path (CPU default) and its PyTorch path (other devices)."""
    if request.param == "torch":
        monkeypatch.setattr(associative, "load", lambda: False)
    return request.param


@pytest.mark.parametrize("kernel", ["associative", *QUADRATIC])
def test_poly1_with_key_padding_on_every_kernel(kernel, associative_path):
    q, k, v = make_qkv(Nq=6, Nk=8)
    padding = torch.zeros(2, 8, dtype=torch.bool)
    padding[0, 5:] = True
    out = attention(q, k, v, "poly1", key_padding_mask=padding, kernel=kernel)
    keep = ~padding[:, None, None, :]
    assert_matches_reference_attention(out, reference_attention(q, k, v, "poly1", keep=keep), (q, k, v))


def test_gradcheck_associative(associative_path):
    q, k, v = make_qkv(B=2, H=2, Nq=6, Nk=7, d=3, dv=2)
    padding = torch.zeros(2, 7, dtype=torch.bool)
    padding[1, 4:] = True
    fn = lambda q, k, v: attention(q, k, v, "poly1", key_padding_mask=padding, kernel="associative")  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v))


@pytest.mark.parametrize("kernel", ["blocked", "fused_cpu", "associative"])
def test_double_backward_raises_instead_of_a_wrong_answer(kernel):
    """A gradient penalty differentiates the backward; without the guard, d/dq of it would be silently lost."""
    q, k, v = make_qkv()
    out = attention(q, k, v, "poly1", kernel=kernel)
    weight = torch.ones_like(out, requires_grad=True)
    (grad_q,) = torch.autograd.grad(out, q, grad_outputs=weight, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        grad_q.square().sum().backward()


def test_inf_in_a_padded_key_stays_out(associative_path):
    q, k, v = make_qkv(Nq=6, Nk=8)
    padding = torch.zeros(2, 8, dtype=torch.bool)
    padding[:, 6:] = True
    k = k.detach().clone()
    k[..., 6:, :] = float("inf")
    for kernel in ("associative", "fused_cpu", "materialized"):
        out = attention(q, k, v, "poly1", key_padding_mask=padding, kernel=kernel)
        assert out.isfinite().all(), kernel
        torch.testing.assert_close(out, reference_attention(q, k[..., :6, :], v[..., :6, :], "poly1"))


@pytest.mark.parametrize("name", ["poly1", "poly3"])
@pytest.mark.parametrize("sizes", [(0, 9, 11), (2, 0, 11), (2, 9, 0)], ids=["no-batch", "no-queries", "no-keys"])
def test_empty_inputs_give_empty_or_zero_outputs(name, sizes):
    batch, nq, nk = sizes
    q, k, v = make_qkv(B=batch, Nq=nq, Nk=nk)
    out = attention(q, k, v, name)
    assert out.shape == (batch, 3, nq, 5) and not out.any()
    assert all(g.shape == x.shape and not g.any() for g, x in zip(torch.autograd.grad(out.sum(), (q, k, v)), (q, k, v)))


def test_fused_backward_scratch_does_not_grow_with_a_copy_of_dq_per_thread():
    """Regression: with fewer heads than 2x the threads, every thread summed dQ for *all* heads in its own
    buffer (threads x dQ of extra memory); now a chunk of work holds dQ only for the heads it touches."""
    from polyattn_lightning.bench.attention import Case, peak_bytes

    q, k, v = (x.detach().float().requires_grad_() for x in make_qkv(B=1, H=24, Nq=512, Nk=512, d=16, dv=16))
    case = Case("poly3/fused_cpu", lambda q, k, v: attention(q, k, v, "poly3", kernel="fused_cpu"))
    tiles = 16 * 3 * fused_cpu.BACKWARD_BLOCK[0] * fused_cpu.BACKWARD_BLOCK[1] * 4
    dq = q.numel() * 4
    with num_threads(16):  # 24 heads < 2 x 16 threads: the key blocks of a head are spread over chunks
        extra = peak_bytes(case, (q, k, v, torch.ones_like(q))) - tiles
    assert extra < 16 * dq  # q, k, v grads, out and saved operands are a few dQ; the old buffers were 16


def test_associative_rejects_what_it_cannot_do():
    q, k, v = make_qkv()
    with pytest.raises(ValueError, match="attn_mask"):
        attention(q, k, v, "poly1", attn_mask=torch.ones(9, 11, dtype=torch.bool), kernel="associative")
    with pytest.raises(ValueError, match="linear"):
        attention(q, k, v, "poly3", kernel="associative")


def test_auto_picks_associative_only_where_exact():
    q, k, v = make_qkv()
    poly1, poly3 = get_activation("poly1"), get_activation("poly3")
    key_only = torch.ones(2, 1, 1, 11, dtype=torch.bool)
    assert auto_kernel(q, poly1, k=k, v=v) == "associative"
    assert auto_kernel(q, poly1, k=k, v=v, key_padding_mask=torch.zeros(2, 11, dtype=torch.bool)) == "associative"
    assert auto_kernel(q, poly1, k=k, v=v, attn_mask=key_only) == "associative"  # a mask of the key alone
    assert auto_kernel(q, poly1, k=k, v=v, attn_mask=torch.ones(2, 1, 9, 11, dtype=torch.bool)) == "fused_cpu"  # pairwise
    assert auto_kernel(q, poly1, k=k, v=v, attn_bias=torch.zeros(1)) == "fused_cpu"  # score bias
    assert auto_kernel(q, poly3, k=k, v=v) == "fused_cpu"  # CPU: no Triton


def test_auto_picks_fused_cpu_only_where_it_applies():
    q, k, v = make_qkv()
    poly3 = get_activation("poly3")
    assert auto_kernel(q, poly3, k=k, v=v, attn_mask=torch.ones(1, 1, 9, 11, dtype=torch.bool)) == "fused_cpu"
    assert auto_kernel(q, poly3, k=k, v=v, attn_bias=torch.zeros(1)) == "fused_cpu"  # score bias
    assert auto_kernel(q, poly3, k=k, v=v, dropout_p=0.1) == "fused_cpu"  # in-kernel dropout
    custom = Activation("sign", torch.sign, torch.zeros_like, scale="inv_n")
    assert auto_kernel(q, custom, k=k, v=v) == "blocked"  # a form the fused kernels do not know


def test_fused_cpu_rejects_what_it_cannot_do():
    q, k, v = make_qkv()
    custom = Activation("sign", torch.sign, torch.zeros_like, scale="inv_n")
    with pytest.raises(ValueError, match="does not know activation 'sign'"):
        attention(q, k, v, custom, kernel="fused_cpu")


def test_auto_poly1_with_key_padding_and_attn_mask_matches_reference():
    """Regression: a key-padding mask together with a pairwise attn_mask sent poly1 to the associative
    kernel, which then refused the merged (pairwise) mask with a ValueError."""
    q, k, v = make_qkv()
    padding = torch.zeros(2, 11, dtype=torch.bool)
    padding[0, 8:] = True
    pairwise = torch.rand(9, 11, generator=torch.Generator().manual_seed(1)) > 0.3
    pairwise[2] = False  # a row with no attendable key
    out = attention(q, k, v, "poly1", key_padding_mask=padding, attn_mask=pairwise)
    keep = pairwise & ~padding[:, None, None, :]
    assert_matches_reference_attention(out, reference_attention(q, k, v, "poly1", keep=keep), (q, k, v))
    swin = torch.where(pairwise, 0.0, -100.0).double()
    out = attention(q, k, v, "poly1", key_padding_mask=padding, attn_mask=swin)
    torch.testing.assert_close(out, reference_attention(q, k, v, "poly1", keep=keep))


# --------------------------------------------------------------------------- masks


@pytest.mark.parametrize("kernel", QUADRATIC)
@pytest.mark.parametrize("name", ["poly3", "sigmoid"])
def test_masked_keys_contribute_nothing_and_n_counts_the_rest(name, kernel):
    q, k, v = make_qkv()
    swin = torch.zeros(9, 11)
    swin[:, 7:] = -100.0  # Swin's shifted-window mask: 0 keep, -100 masked
    padding = torch.zeros(2, 11, dtype=torch.bool)
    padding[1, :2] = True
    out_additive = attention(q, k, v, name, attn_mask=swin, key_padding_mask=padding, kernel=kernel)
    out_bool = attention(q, k, v, name, attn_mask=swin == 0, key_padding_mask=padding, kernel=kernel)
    torch.testing.assert_close(out_additive, out_bool)

    keep = (swin == 0) & ~padding[:, None, None, :]
    assert_matches_reference_attention(out_bool, reference_attention(q, k, v, name, keep=keep), (q, k, v))
    # changing what is behind the mask changes nothing
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[..., 7:, :], v2[..., 7:, :] = 1e3, -1e3
    torch.testing.assert_close(attention(q, k2, v2, name, attn_mask=swin, key_padding_mask=padding, kernel=kernel), out_bool)


@pytest.mark.parametrize("kernel", QUADRATIC)
@pytest.mark.parametrize("name", ELEMENTWISE)
def test_rows_with_no_attendable_key_give_zeros_and_finite_grads(name, kernel):
    q, k, v = make_qkv()
    keep = torch.ones(9, 11, dtype=torch.bool)
    keep[4] = False
    out = attention(q, k, v, name, attn_mask=keep, kernel=kernel)
    assert torch.equal(out[:, :, 4], torch.zeros_like(out[:, :, 4])) and out.isfinite().all()
    assert all(g.isfinite().all() for g in _grads(out, (q, k, v)))


def test_bad_masks_are_rejected():
    q, k, v = make_qkv()
    with pytest.raises(ValueError, match="attn_bias"):
        attention(q, k, v, "poly3", attn_mask=torch.ones(9, 11))  # positive additive values: a bias
    with pytest.raises(ValueError, match="key_padding_mask"):
        attention(q, k, v, "poly3", key_padding_mask=torch.zeros(2, 9, dtype=torch.bool))


@pytest.mark.parametrize("name", ["softmax", "poly3", "poly1"])
@pytest.mark.parametrize("what", ["attn_mask", "attn_bias"])
def test_masks_and_bias_that_would_enlarge_the_batch_are_rejected(name, what):
    """Regression: a mask or bias that broadcasts to a *larger* (B, H, Nq, Nk), e.g. batch 3 for B = 1, was
    accepted: non-softmax outputs came back with batch 3 (mask) or used part of the bias, softmax raised deep in SDPA."""
    q, k, v = make_qkv(B=1)
    extra = torch.ones(3, 1, 9, 11, dtype=torch.bool) if what == "attn_mask" else torch.zeros(3, 1, 9, 11)
    with pytest.raises(ValueError, match=f"{what} of shape"):
        attention(q, k, v, name, **{what: extra})
    fits = extra[:1].expand(1, 3, 9, 11)
    assert attention(q, k, v, name, **{what: fits}).shape == (1, 3, 9, 5)


# --------------------------------------------------------------------------- dropout


def _dropout_attention(q, k, v, seed=0, p=0.4, kernel="blocked"):
    torch.manual_seed(seed)
    return attention(q, k, v, "relu", dropout_p=p, kernel=kernel)


def test_dropout_is_seeded_and_unbiased():
    q, k, v = make_qkv(B=2, H=2, Nq=64, Nk=256, dtype=torch.float32)
    v = torch.ones_like(v)  # every output is c * sum of kept phi / (1 - p)
    first, again, other = _dropout_attention(q, k, v, 0), _dropout_attention(q, k, v, 0), _dropout_attention(q, k, v, 1)
    assert torch.equal(first, again) and not torch.equal(first, other)
    plain = attention(q, k, v, "relu")
    assert (first.mean() / plain.mean()).item() == pytest.approx(1.0, abs=0.03)
    materialized = _dropout_attention(q, k, v, 0, kernel="materialized")
    assert (materialized.mean() / plain.mean()).item() == pytest.approx(1.0, abs=0.03)


def test_dropout_backward_replays_the_forward_mask(small_tiles):
    """With the seed fixed, the forward is a deterministic function, so gradcheck applies."""
    q, k, v = make_qkv(B=1, H=2, Nq=17, Nk=7, d=3, dv=2)
    assert torch.autograd.gradcheck(lambda q, k, v: _dropout_attention(q, k, v, seed=3), (q, k, v))


# --------------------------------------------------------------------------- precision


@pytest.mark.parametrize("kernel", ["blocked", "fused_cpu", "materialized", "associative", "power"])
def test_bf16_under_autocast_returns_bf16_close_to_fp32(kernel):
    q, k, v = make_qkv(B=2, H=2, Nq=40, Nk=40, d=16, dv=16, dtype=torch.float32)
    name = "poly1" if kernel == "associative" else "poly3"
    expected = attention(q, k, v, name, kernel=kernel)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        unchanged = attention(q, k, v, name, kernel=kernel)  # fp32 inputs: scores stay fp32 under autocast
        low = [x.detach().bfloat16().requires_grad_() for x in (q, k, v)]
        out = attention(*low, name, kernel=kernel)
    assert unchanged.dtype == torch.float32
    torch.testing.assert_close(unchanged, expected)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, rtol=3e-2, atol=3e-2 * expected.abs().max().item())
    assert all(g.dtype == torch.bfloat16 for g in torch.autograd.grad(out.float().sum(), low))


@pytest.mark.parametrize("kernel", QUADRATIC)
def test_fp16_large_scores_do_not_overflow(kernel):
    """|S| ~ 64: naive fp16 ``S**3`` (~2.6e5) overflows fp16's 65504; the kernels compute it in fp32."""
    g = torch.Generator().manual_seed(0)
    q = (8 + torch.rand(1, 2, 8, 16, generator=g)).half()
    k = (8 + torch.rand(1, 2, 16, 16, generator=g)).half()
    v = (1e-3 * torch.randn(1, 2, 16, 8, generator=g)).half()
    naive = ((q @ k.transpose(-2, -1)) * 16**-0.5) ** 3
    assert torch.isinf(naive).any()
    out = attention(q, k, v, "poly3", kernel=kernel)
    assert out.dtype == torch.float16 and out.isfinite().all()
    expected = reference_attention(q.double(), k.double(), v.double(), "poly3")
    torch.testing.assert_close(out.double(), expected, rtol=2e-3, atol=1e-3 * expected.abs().max().item())


# --------------------------------------------------------------------------- the fused kernel's build

_PICK_AND_RUN = """
import warnings, torch
from polyattn_lightning.attention import attention, kernel_choice
q = torch.randn(1, 2, 5, 4, dtype=torch.float64)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    print(kernel_choice(q, q, q, "poly3").kernel)
    out = attention(q, q, q, "poly3")
torch.testing.assert_close(out, attention(q, q, q, "poly3", kernel="materialized"))
print(" / ".join(str(w.message) for w in caught))
"""


def _pick_in_fresh_process(tmp_path, **env) -> tuple[str, str]:
    """``(kernel auto picks for poly3, warnings)`` in a process with an empty extension cache."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions"), **env}
    result = subprocess.run([sys.executable, "-c", _PICK_AND_RUN], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    kernel, _, warned = result.stdout.partition("\n")
    return kernel, warned.strip()


def test_without_a_compiler_the_blocked_kernel_runs_after_a_warning(tmp_path):
    kernel, warned = _pick_in_fresh_process(tmp_path, CXX=str(tmp_path / "no-such-c++"))
    assert kernel == "blocked"
    assert "fused_cpu.cpp" in warned and "falls back" in warned


def test_the_fused_kernel_can_be_switched_off(tmp_path):
    assert _pick_in_fresh_process(tmp_path, POLYATTN_FUSED_CPU="0") == ("blocked", "")
