"""The Triton kernel compiled for a real GPU, against the reference: run by ``scripts/gpu_check.py``.

CUDA only (``-m cuda``); on a machine without a GPU every test here skips with
that reason. The interpreter tests (``interpreted_triton_cases.py``) cover the
same logic on CPU but not what only a compiler for a device checks: tensor-core
shape rules, shared memory and registers per block size, bf16/fp16 products,
grid limits. Each test asks for ``kernel="triton"`` by name, so a kernel that
fails to compile fails the test instead of falling back.
"""
from __future__ import annotations

import warnings

import pytest
import torch
from attention_reference import FORMULAS, make_qkv, philox_keep, reference_attention

from polyattn_lightning.attention import attention, get_activation
from auto_kernel import auto_kernel

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu_check.py runs these)"),
]
#: Relative tolerance per dtype, against an fp64 reference of the same (rounded) inputs.
TOLERANCE = {torch.float32: 2e-3, torch.float16: 1e-2, torch.bfloat16: 4e-2}


def _cuda(tensors, dtype):
    return [x.detach().to("cuda", dtype).requires_grad_() for x in tensors]


def _check(out, expected, dtype):
    scale = expected.abs().max().item() or 1.0
    torch.testing.assert_close(out.double().cpu(), expected.double().cpu(), rtol=TOLERANCE[dtype],
                               atol=TOLERANCE[dtype] * scale)


def _values_and_grads(name, dtype, q, k, v, keep=None, bias=None, **kwargs):
    """Triton on the GPU vs the fp64 reference on CPU, for the output and the gradients of q, k, v (and bias)."""
    inputs = _cuda((q, k, v), dtype)
    gpu_bias = None if bias is None else bias.detach().cuda().requires_grad_()
    out = attention(*inputs, name, attn_bias=gpu_bias, kernel="triton", **kwargs)
    assert out.dtype == dtype and out.is_cuda
    ref_inputs = [x.detach().double().cpu().requires_grad_() for x in inputs]
    ref_bias = None if bias is None else bias.detach().double().requires_grad_()
    expected = reference_attention(*ref_inputs, name, keep=None if keep is None else keep.cpu(), bias=ref_bias)
    _check(out, expected, dtype)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = torch.autograd.grad((out.double() * weight.cuda()).sum(), [*inputs, *([gpu_bias] if bias is not None else [])])
    want = torch.autograd.grad((expected * weight).sum(), [*ref_inputs, *([ref_bias] if bias is not None else [])])
    for g, w in zip(got, want):
        _check(g, w, dtype)


@pytest.mark.parametrize("name", ["poly1", "poly3", "relu", "softplus", "sigmoid"])
def test_every_form_bf16_ragged_with_pairwise_mask(name):
    q, k, v = make_qkv(B=2, H=3, Nq=197, Nk=150, d=64, dv=64, dtype=torch.float32)
    keep = torch.rand(2, 1, 197, 150, generator=torch.Generator().manual_seed(0)) > 0.3
    keep[:, :, 7] = False  # a query with no key
    _values_and_grads(name, torch.bfloat16, q, k, v, keep=keep, attn_mask=keep.cuda())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [16, 32, 64, 128])
def test_dtypes_and_head_dims(dtype, d):
    q, k, v = make_qkv(B=2, H=2, Nq=300, Nk=300, d=d, dv=d, dtype=torch.float32)
    _values_and_grads("poly3", dtype, q, k, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_key_padding_and_unequal_lengths(dtype):
    q, k, v = make_qkv(B=3, H=2, Nq=33, Nk=1000, d=64, dv=32, dtype=torch.float32)
    padding = torch.zeros(3, 1000, dtype=torch.bool)
    padding[1, 600:] = True
    padding[2, 1:] = True
    keep = ~padding[:, None, None, :]
    _values_and_grads("relu", dtype, q, k, v, keep=keep, key_padding_mask=padding.cuda())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_swin_bias_with_shifted_window_mask(dtype):
    """Swin: (B * windows, H, 49, 32) with a (1, H, 49, 49) relative-position bias and a 0/-100 window mask."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(8 * 16, 3, 49, 32, generator=g) for _ in range(3))
    bias = torch.randn(1, 3, 49, 49, generator=g)
    region = torch.randint(0, 4, (16, 49), generator=g)
    mask = ((region[:, :, None] != region[:, None, :]).float() * -100.0).repeat(8, 1, 1).unsqueeze(1)
    _values_and_grads("poly3", dtype, q, k, v, keep=mask == 0, bias=bias, attn_mask=mask.cuda())


def test_large_scores_in_fp16_do_not_overflow():
    """|S| ~ 45 makes S^3 ~ 9e4 > 65504 (fp16's max): phi(S) must stay fp32 inside the kernel."""
    q, k, v = make_qkv(B=1, H=2, Nq=128, Nk=128, d=64, dv=64, dtype=torch.float32)
    q = q / q.norm(dim=-1, keepdim=True) * 45.0 * 8.0 ** 0.5  # t = 1/8: |S| up to ~45 (|k| ~ 8)
    k = k / k.norm(dim=-1, keepdim=True) * 8.0
    v = v * 1e-3
    inputs = _cuda((q, k, v), torch.float16)
    out = attention(*inputs, "poly3", kernel="triton")
    assert out.isfinite().all()
    expected = reference_attention(*[x.detach().double().cpu() for x in inputs], "poly3")
    assert expected.abs().max() < 6e4  # the output itself fits in fp16
    _check(out, expected, torch.float16)


def test_dropout_mask_is_the_documented_philox_scheme():
    q, k, v = make_qkv(B=2, H=2, Nq=100, Nk=90, d=64, dv=64, dtype=torch.float32)
    inputs = _cuda((q, k, v), torch.float32)
    p = 0.2
    torch.manual_seed(5)
    out = attention(*inputs, "sigmoid", dropout_p=p, kernel="triton")
    torch.manual_seed(5)
    seed = int(torch.randint(2**63 - 1, (1,), dtype=torch.int64, device="cuda"))  # drawn on the device
    keep = torch.stack([philox_keep(seed, bh, 100, 90, p) for bh in range(4)]).view(2, 2, 100, 90)
    ref = [x.detach().double().cpu() for x in inputs]
    s = ref[0] @ ref[1].transpose(-2, -1) / 8.0
    expected = (FORMULAS["sigmoid"](s, torch.full((1, 1, 1, 1), 90.0, dtype=torch.float64)) * keep / (1 - p)) @ ref[2]
    _check(out, expected, torch.float32)


def test_more_than_65535_batch_heads():
    """Grid axis 0 carries B*H: windowed attention easily has B x windows x heads > 65535."""
    q, k, v = make_qkv(B=35000, H=2, Nq=16, Nk=16, d=16, dv=16, dtype=torch.float32)
    _values_and_grads("relu", torch.bfloat16, q, k, v)


def test_auto_picks_triton_without_warnings_for_every_configuration():
    """``attention()`` self-checks each configuration once and would fall back with a warning: none may fail here
    (fp32 at the default 'highest': IEEE products, and at 'high': tf32x3; short windows of 8 tokens, whose tile
    depends on dtype and head dim)."""
    previous = torch.get_float32_matmul_precision()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for dtype, precision in ((torch.float32, "highest"), (torch.float32, "high"), (torch.float16, "high"),
                                     (torch.bfloat16, "high")):
                torch.set_float32_matmul_precision(precision)
                for d, n in ((d, n) for d in (16, 64, 128, 256) for n in (8, 300)):
                    for mask, bias, dropout in ((None, None, 0.0), (torch.ones(1, 1, 1, n, dtype=torch.bool, device="cuda"),
                                                                      torch.zeros(1, 1, n, n, device="cuda"), 0.1)):
                        q = torch.zeros(1, 1, n, d, device="cuda", dtype=dtype)
                        picked = auto_kernel(q, get_activation("poly3"), attn_mask=mask, attn_bias=bias, dropout_p=dropout)
                        assert picked == "triton", (dtype, precision, d, n, mask is not None)
    finally:
        torch.set_float32_matmul_precision(previous)


def test_dropout_call_does_not_synchronise_the_host():
    q, k, v = _cuda(make_qkv(B=2, H=2, Nq=128, Nk=128, d=64, dv=64, dtype=torch.float32), torch.bfloat16)
    attention(q, k, v, "poly3", dropout_p=0.1).sum().backward()  # the self-check and the compiles happen here
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = attention(q, k, v, "poly3", dropout_p=0.1)
        torch.autograd.grad(out.sum(), (q, k, v))
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_launches_follow_the_operands_device_not_the_current_one():
    q, k, v = (x.detach().to("cuda:1").requires_grad_() for x in make_qkv(B=1, H=2, Nq=100, Nk=100, d=32, dv=32,
                                                                         dtype=torch.float32))
    with torch.cuda.device(0):
        out = attention(q, k, v, "relu", kernel="triton")
    expected = reference_attention(*[x.detach().double().cpu() for x in (q, k, v)], "relu")
    _check(out, expected, torch.float32)


def test_compiled_attention_matches_eager():
    """torch.compile (inductor) through the triton_op operators, with bias and mask, no graph break."""
    q, k, v = _cuda(make_qkv(B=2, H=4, Nq=64, Nk=64, d=32, dv=32, dtype=torch.float32), torch.bfloat16)
    bias = torch.randn(1, 4, 64, 64, device="cuda", requires_grad=True)
    keep = torch.rand(2, 1, 64, 64, device="cuda") > 0.2

    def step(q, k, v, bias):
        return attention(q, k, v, "poly3", attn_mask=keep, attn_bias=bias)

    eager = step(q, k, v, bias)
    eager_grads = torch.autograd.grad(eager.float().sum(), (q, k, v, bias))
    compiled = torch.compile(step, fullgraph=True)(q, k, v, bias)
    compiled_grads = torch.autograd.grad(compiled.float().sum(), (q, k, v, bias))
    _check(compiled, eager.detach(), torch.bfloat16)
    for got, want in zip(compiled_grads, eager_grads):
        _check(got, want, torch.bfloat16)
