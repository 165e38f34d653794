"""The Triton kernel under ``TRITON_INTERPRET=1``; run by ``test_attention_triton.py`` in a subprocess.

Not collected directly (no ``test_`` prefix): the interpreter must be switched
on before Triton decorates the kernels, i.e. before the package is imported.
"""
from __future__ import annotations

import os

import pytest
import torch
from attention_reference import (
    ELEMENTWISE, FORMULAS, bottom_right, causal_reference, make_qkv, philox_keep, reference_attention,
)

from auto_kernel import auto_kernel

from polyattn_lightning.attention import attention, get_activation
from polyattn_lightning.attention.kernels.triton import launch as tables
from polyattn_lightning.attention.kernels.triton import op
from polyattn_lightning.attention.kernels.triton import selfcheck as triton_selfcheck

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


def _grads(out, inputs):
    weight = torch.linspace(-1, 1, out.numel()).view(out.shape)
    return torch.autograd.grad((out.float() * weight).sum(), inputs)


def test_interpreter_is_active():
    import triton.runtime.interpreter  # noqa: F401  (the module the interpreted kernels run on)

    q = torch.zeros(1, 1, 1, 16)
    assert auto_kernel(q, get_activation("poly3")) == "triton" and auto_kernel(q.double(), get_activation("poly3")) != "triton"
    assert auto_kernel(q, get_activation("relu")) == "triton"
    assert auto_kernel(q, get_activation("relu"), dropout_p=0.1) == "triton"  # dropout in-kernel
    assert auto_kernel(q, get_activation("relu"), attn_bias=torch.zeros(1, 1, 1, 1)) == "triton"  # bias


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


def test_grids_are_one_dimensional_over_heads_and_blocks(monkeypatch):
    """B*H x blocks on one grid axis (CUDA caps axes 1 and 2 at 65535; windowed attention has more heads)."""

    grids, run = {}, op._run

    def record(launches):
        grids.update({launch.kernel.fn.__name__: (launch.grid, launch.config) for launch in launches})
        return run(launches)

    monkeypatch.setattr(op, "_run", record)
    q, k, v = make_qkv(B=3, H=2, Nq=70, Nk=130, d=8, dv=8, dtype=torch.float32)
    out = attention(q, k, v, "poly3", kernel="triton")
    torch.testing.assert_close(out, reference_attention(q, k, v, "poly3"), rtol=1e-4, atol=1e-4)
    out.sum().backward()
    config = {name: tables.launch_config(name, torch.float32, 8, 8, 70, 130) for name in tables.KERNELS}
    assert grids == {
        "_forward": ((6 * -(-70 // config["forward"].block_m),), config["forward"]),
        "_backward_kv": ((6 * -(-130 // config["backward_kv"].block_n),), config["backward_kv"]),
        "_backward_q": ((6 * -(-70 // config["backward_q"].block_m),), config["backward_q"]),
    }


@pytest.mark.parametrize("table, order", [("legacy", "heads"), ("tuned", "heads"), ("legacy", "blocks")])
def test_old_launch_table_and_grid_order_stay_selectable_and_right(monkeypatch, table, order):
    """POLYATTN_TRITON_TABLE / POLYATTN_TRITON_GRID pick the table and grid order from before the offline check."""

    monkeypatch.setenv("POLYATTN_TRITON_TABLE", table)
    monkeypatch.setenv("POLYATTN_TRITON_GRID", order)
    assert tables.launch_table() == table and tables.grid_order() == order
    q, k, v = make_qkv(B=2, H=3, Nq=70, Nk=90, d=8, dv=8, dtype=torch.float32)
    out = attention(q, k, v, "relu", kernel="triton")
    expected = reference_attention(q, k, v, "relu")
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    for got, want in zip(_grads(out, (q, k, v)), _grads(expected, (q, k, v))):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    monkeypatch.setenv("POLYATTN_TRITON_GRID", "sideways")
    with pytest.raises(ValueError, match="POLYATTN_TRITON_GRID='sideways'"):
        attention(q, k, v, "relu", kernel="triton")


def test_short_windows_get_the_small_tile():

    assert tables.launch_config("forward", torch.bfloat16, 32, 32, 49, 49) == tables._SHORT["forward"]
    assert tables.launch_config("forward", torch.bfloat16, 32, 32, 197, 197) != tables._SHORT["forward"]
    assert tables.launch_config("backward_q", torch.bfloat16, 128, 128, 49, 49) == tables._SHORT["backward_q"]


@pytest.mark.parametrize(
    "dtype, d", [(torch.float32, 64), (torch.float32, 128), (torch.float32, 256), (torch.float16, 128), (torch.float16, 256)]
)
def test_short_windows_too_wide_for_the_small_tile_take_the_tuned_one(dtype, d):
    """The 64 x 32 short tile spills past the goals in fp32 from d = 64 and in fp16 from d = 128, and needs more
    shared memory than A100 has in fp32 from d = 128 (more than Hopper at d = 256: an H200 refused it) and in fp16 at
    d = 256; such windows take their head dim's tuned tile."""
    for kernel in tables.KERNELS:
        assert tables.launch_config(kernel, dtype, d, d, 8, 8) == tables._TUNED[(kernel, dtype, d)]


def _swin_inputs(dtype, windows=4, batch=2, heads=3, tokens=49, d=16):
    """Swin-shaped operands: (B * windows, H, 49, d), a 0/-100 shifted-window mask and a (1, H, 49, 49) bias."""
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(batch * windows, heads, tokens, d, generator=g).to(dtype).requires_grad_() for _ in range(3))
    bias = (torch.randn(1, heads, tokens, tokens, generator=g) * 0.5).requires_grad_()
    region = torch.randint(0, 3, (windows, tokens), generator=g)
    window_mask = (region[:, :, None] != region[:, None, :]).float() * -100.0  # (windows, N, N), 0 = same region
    mask = window_mask.repeat(batch, 1, 1).unsqueeze(1)  # as the switched Swin attention passes it
    return q, k, v, bias, mask


@pytest.mark.parametrize("name", ["poly3", "relu", "sigmoid"])
def test_swin_bias_and_shifted_window_mask_values_and_gradients(name):
    q, k, v, bias, mask = _swin_inputs(torch.float32)
    out = attention(q, k, v, name, attn_mask=mask, attn_bias=bias)  # auto: the Triton kernel takes the bias now
    keep = mask == 0
    expected = reference_attention(q, k, v, name, keep=keep, bias=bias)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    inputs = (q, k, v, bias)
    for got, want in zip(_grads(out, inputs), _grads(expected, inputs)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_bias_of_every_broadcast_shape_gets_its_gradient():
    q, k, v = make_qkv(B=2, H=3, Nq=20, Nk=24, d=16, dv=16, dtype=torch.float32)
    for shape in [(24,), (20, 24), (3, 1, 24), (2, 1, 20, 24), (2, 3, 20, 24)]:
        bias = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape))).requires_grad_()
        out = attention(q, k, v, "softplus", attn_bias=bias, kernel="triton")
        expected = reference_attention(q, k, v, "softplus", bias=bias)
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
        [got] = torch.autograd.grad(out.sum(), bias)
        [want] = torch.autograd.grad(expected.sum(), bias)
        assert got.shape == bias.shape
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_bias_in_half_precision():
    q, k, v, bias, mask = _swin_inputs(torch.bfloat16, windows=2, batch=1)
    out = attention(q, k, v, "poly3", attn_mask=mask, attn_bias=bias, kernel="triton")
    up = [x.detach().double() for x in (q, k, v, bias)]
    expected = reference_attention(*up[:3], "poly3", keep=mask == 0, bias=up[3])
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), expected, rtol=3e-2, atol=3e-2 * expected.abs().max().item())
    grads = _grads(out, (q, k, v, bias))
    assert grads[3].dtype == torch.float32 and all(g.isfinite().all() for g in grads)


@pytest.mark.parametrize("name", ["poly3", "sigmoid"])
def test_dropout_follows_the_documented_philox_scheme(name):
    q, k, v = make_qkv(B=2, H=2, Nq=40, Nk=37, d=16, dv=16, dtype=torch.float32)
    bias = torch.randn(1, 2, 40, 37, generator=torch.Generator().manual_seed(3)).requires_grad_()
    p = 0.3
    torch.manual_seed(11)
    out = attention(q, k, v, name, attn_bias=bias, dropout_p=p)  # auto: Triton with in-kernel dropout
    torch.manual_seed(11)
    seed = int(torch.randint(2**63 - 1, (1,), dtype=torch.int64))  # the draw attention() made
    keep = torch.stack([philox_keep(seed, bh, 40, 37, p) for bh in range(4)]).view(2, 2, 40, 37)
    assert abs(keep.float().mean().item() - (1 - p)) < 0.03
    s = q @ k.transpose(-2, -1) / 4.0 + bias
    n = torch.full((1, 1, 1, 1), 37.0)
    expected = (FORMULAS[name](s, n) * keep / (1 - p)) @ v
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    inputs = (q, k, v, bias)
    for got, want in zip(_grads(out, inputs), _grads(expected, inputs)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_compile_failure_warns_once_and_falls_back(monkeypatch):
    """A Triton error at the launch (what a GPU it cannot compile for raises) must not crash the run."""

    def fail(*args, **kwargs):
        raise RuntimeError("injected: PTX assembly aborted due to errors")

    monkeypatch.setattr(op, "_run", fail)
    monkeypatch.setattr(triton_selfcheck, "_VERDICTS", {})
    q, k, v = make_qkv(B=1, H=2, Nq=30, Nk=30, d=16, dv=16, dtype=torch.float32)
    with pytest.warns(UserWarning, match="injected: PTX assembly aborted") as caught:
        out = attention(q, k, v, "relu")
    assert len([w for w in caught if "Triton attention kernel" in str(w.message)]) == 1
    torch.testing.assert_close(out, reference_attention(q, k, v, "relu"), rtol=1e-4, atol=1e-4)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # decided once: no second warning, no second try
        again = attention(q, k, v, "relu")
        again.sum().backward()
    assert auto_kernel(q, get_activation("relu")) != "triton"
    with pytest.raises(RuntimeError, match="injected"):  # asked for by name, it is not silently replaced
        attention(q, k, v, "relu", kernel="triton")


def _corrupt_forward(monkeypatch):
    """Inject a wrong result: the forward's output comes back 10 % too large."""

    run = op._run

    def wrong(launches):
        run(launches)
        if launches[0].kernel.fn.__name__ == "_forward":
            launches[0].args[3].mul_(1.1)

    monkeypatch.setattr(op, "_run", wrong)


@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_wrong_result_fails_the_self_check_and_falls_back(monkeypatch, dropout_p):

    monkeypatch.setattr(triton_selfcheck, "_VERDICTS", {})
    q, k, v, bias, mask = _swin_inputs(torch.float32, windows=2, batch=1)
    kwargs = dict(attn_mask=mask, attn_bias=bias, dropout_p=dropout_p)
    assert auto_kernel(q, get_activation("poly3"), attn_mask=mask == 0, attn_bias=bias, dropout_p=dropout_p) == "triton"  # a right kernel
    _corrupt_forward(monkeypatch)
    monkeypatch.setattr(triton_selfcheck, "_VERDICTS", {})
    with pytest.warns(UserWarning, match=r"failed its self-check for Config\(dtype='float32', d=16, dv=16, "
                      r"activation='poly3', mask=True, bias=True, bias_grad=True, dropout=" + str(dropout_p > 0)
                      + r".*output differs from the blocked kernel's by 0.1"):
        out = attention(q, k, v, "poly3", **kwargs)
    if not dropout_p:  # the fallback kernel ran: right values
        torch.testing.assert_close(out, reference_attention(q, k, v, "poly3", keep=mask == 0, bias=bias),
                                   rtol=1e-4, atol=1e-4)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per configuration
        attention(q, k, v, "poly3", **kwargs)
    assert auto_kernel(q, get_activation("poly3"), attn_mask=mask == 0, attn_bias=bias, dropout_p=dropout_p) != "triton"


def test_self_check_runs_once_per_compiled_configuration(monkeypatch):

    monkeypatch.setattr(triton_selfcheck, "_VERDICTS", {})
    checks, check = [], triton_selfcheck._self_check

    def counted(config, spec):
        checks.append(config)
        return check(config, spec)

    monkeypatch.setattr(triton_selfcheck, "_self_check", counted)
    relu = get_activation("relu")
    q = torch.zeros(2, 2, 160, 16)
    assert auto_kernel(q, relu) == "triton"
    assert auto_kernel(torch.zeros(2, 2, 176, 16), relu) == "triton"  # same kernels
    assert len(checks) == 1
    others = [
        (torch.zeros(2, 2, 161, 16), None, None),  # N not a multiple of 16
        (torch.zeros(2, 2, 40, 16), None, None),  # the short-window tile
        (torch.zeros(2, 1, 160, 16), None, None),  # one head
        (q, torch.zeros(2, 2, 160, 32), None),  # v's head dim
        (q, None, torch.zeros(1, 2, 160, 160)),  # a bias without gradient
        (q, None, torch.zeros(1, 2, 160, 160, requires_grad=True)),  # the bias gradient
    ]
    for query, value, bias in others:
        assert auto_kernel(query, relu, k=query, v=value, attn_bias=bias) == "triton"
    assert len(checks) == 7
    with torch.no_grad():  # no bias gradient: the kernels of the bias-without-gradient case
        auto_kernel(q, relu, attn_bias=torch.zeros(1, 2, 160, 160, requires_grad=True))
    assert len(checks) == 7
    monkeypatch.setenv("POLYATTN_TRITON_GRID", "heads")
    auto_kernel(q, relu)
    assert len(checks) == 8 and checks[-1].grid == "heads"
    monkeypatch.delenv("POLYATTN_TRITON_GRID")
    monkeypatch.setenv("POLYATTN_TRITON_SELFCHECK", "0")
    assert auto_kernel(torch.zeros(2, 2, 160, 24), relu) == "triton"
    assert len(checks) == 8
    monkeypatch.delenv("POLYATTN_TRITON_SELFCHECK")
    monkeypatch.setattr(triton_selfcheck, "MEASURED", frozenset({checks[0]._replace(d=24, dv=24)}))
    assert auto_kernel(torch.zeros(2, 2, 160, 24), relu) == "triton"
    assert len(checks) == 8  # measured on a GPU: no self-check


def test_self_check_problem_has_the_real_calls_specialisation(monkeypatch):
    """The small problem runs the very binaries of the real call: Triton's specialisation of every argument."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend


    seen = []
    run = op._run

    def record(launches):
        seen.append([(launch.kernel.fn.__name__, launch.config, tuple(
            native_specialize_impl(CUDABackend, a, False, True, True) for a in launch.args)) for launch in launches])
        return run(launches)

    monkeypatch.setattr(op, "_run", record)
    monkeypatch.setattr(triton_selfcheck, "_VERDICTS", {})
    q, k, v, bias, mask = _swin_inputs(torch.float32, windows=2, batch=1)
    g = torch.Generator().manual_seed(0)
    storage = torch.randn(2 * 3 * 49 * 16 + 1, generator=g)
    shifted_q = storage[1:].view(2, 3, 49, 16).requires_grad_()  # 4 bytes off 16-byte alignment
    cases = [dict(q=shifted_q, attn_mask=mask, attn_bias=bias, dropout_p=0.1),
             dict(q=make_qkv(B=2, H=1, Nq=100, Nk=100, d=16, dv=16, dtype=torch.float32)[0],
                  key_padding_mask=torch.zeros(2, 100, dtype=torch.bool))]
    for case in cases:
        query = case.pop("q")
        keys = torch.randn(query.shape, generator=g).requires_grad_()
        seen.clear()
        out = attention(query, keys, keys, "poly3", **case)
        out.sum().backward()
        check_forward, check_backward, real_forward, real_backward = seen
        assert check_forward == real_forward and check_backward == real_backward


def test_launches_run_under_the_device_guard_of_their_operands(monkeypatch):
    """Triton launches on the current CUDA device: the operators switch to the operands' device around them."""

    events, guard, run = [], op._device_guard, op._run

    class Recorded:
        def __init__(self, x):
            self.inner, self.device = guard(x), x.device

        def __enter__(self):
            events.append(("enter", self.device))
            return self.inner.__enter__()

        def __exit__(self, *exc):
            events.append(("exit", self.device))
            return self.inner.__exit__(*exc)

    monkeypatch.setattr(op, "_device_guard", Recorded)
    monkeypatch.setattr(op, "_run", lambda launches: (events.append(("run", len(launches))), run(launches)))
    q, k, v = make_qkv(B=1, H=2, Nq=20, Nk=20, d=8, dv=8, dtype=torch.float32)
    attention(q, k, v, "relu", kernel="triton").sum().backward()
    cpu = torch.device("cpu")
    assert events == [("enter", cpu), ("run", 1), ("exit", cpu), ("enter", cpu), ("run", 2), ("exit", cpu)]


@pytest.mark.parametrize("shape", [(100, 130), (130, 40), (3, 150)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_causal_with_padding_and_bias_matches_reference(shape):
    """Causal tile-loop bounds across several 64-row / 32- and 64-key blocks; Nq > Nk leaves rows with no key
    (zeros); the bias gradient is zero above the diagonal although those tiles are never visited."""
    nq, nk = shape
    q, k, v = make_qkv(B=1, H=2, Nq=nq, Nk=nk, d=8, dv=12, dtype=torch.float32)
    bias = (0.1 * torch.randn(1, 2, nq, nk, generator=torch.Generator().manual_seed(3))).requires_grad_()
    padding = torch.zeros(1, nk, dtype=torch.bool)
    padding[0, nk // 2 : nk // 2 + 5] = True
    out = attention(q, k, v, "poly3", is_causal=True, key_padding_mask=padding, attn_bias=bias, kernel="triton")
    expected = causal_reference(q, k, v, "poly3", keep=~padding[:, None, None, :], bias=bias)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    got, want = _grads(out, (q, k, v, bias)), _grads(expected, (q, k, v, bias))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert torch.equal(got[3][..., ~bottom_right(nq, nk)], torch.zeros_like(got[3][..., ~bottom_right(nq, nk)]))
    assert auto_kernel(q, get_activation("poly3"), k=k, v=v, is_causal=True) == "triton"  # probed causal


def test_causal_half_precision():
    q, k, v = make_qkv(B=2, H=1, Nq=40, Nk=72, d=16, dv=16, dtype=torch.float16)
    out = attention(q, k, v, "poly3", is_causal=True, kernel="triton")
    expected = causal_reference(*(x.detach().double() for x in (q, k, v)), "poly3")
    torch.testing.assert_close(out.double(), expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())
    assert all(g.dtype == torch.float16 and g.isfinite().all() for g in _grads(out, (q, k, v)))


def test_self_check_runs_outside_the_traced_region(monkeypatch):
    """Under torch.compile the check runs once while the call is traced (fullgraph: no graph break) and
    its verdict is a constant of the graph."""

    monkeypatch.setattr(triton_selfcheck, "_VERDICTS", {})
    calls, check = [], triton_selfcheck._self_check
    monkeypatch.setattr(triton_selfcheck, "_self_check", lambda config, spec: calls.append(config) or check(config, spec))
    relu = get_activation("relu")

    def step(q):
        return q * 2 if triton_selfcheck.triton_verified(q, q, q, relu, None, None, 0.0) else q * 3

    q = torch.randn(1, 2, 80, 16)
    compiled = torch.compile(step, backend="eager", fullgraph=True)
    assert torch.equal(compiled(q), q * 2) and torch.equal(compiled(q + 1), (q + 1) * 2)
    assert len(calls) == 1
