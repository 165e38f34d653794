"""The kernel interface: each backend names what it refuses, a named kernel refuses in one error listing the reasons,
and ``kernel_choice`` says what ``auto`` picks and why it passed the others over."""

from __future__ import annotations

import pytest
import torch
from attention_reference import make_qkv

from polyattn_lightning.attention import KERNELS, Activation, attention, kernel_choice
from polyattn_lightning.attention.kernels import BACKENDS, PRIORITY, KernelNotSupported, pick
from polyattn_lightning.attention.functional import kernel_inputs

CUSTOM = Activation("sign", torch.sign, torch.zeros_like, scale="inv_n")


def _inputs(
    activation="poly3",
    *,
    q=None,
    k=None,
    v=None,
    dropout_p=0.0,
    bias=None,
    attn_mask=None,
    key_padding_mask=None,
    is_causal=False,
):
    q0, k0, v0 = make_qkv(dtype=torch.float32)
    q, k, v = (q0 if q is None else q), (k0 if k is None else k), (v0 if v is None else v)
    return kernel_inputs(q, k, v, activation, None, None, key_padding_mask, attn_mask, bias, dropout_p, is_causal)


def reasons(name, **kwargs) -> str:
    return "; ".join(BACKENDS[name].not_supported_reasons(_inputs(**kwargs)))


def test_kernel_names_are_the_backends():
    assert KERNELS == ("auto", *BACKENDS)
    assert set(PRIORITY) == set(BACKENDS) - {"materialized"}  # the reference runs only by name


def test_each_backend_names_the_inputs_it_refuses():
    q, k, v = make_qkv(dtype=torch.float32)
    pairwise = torch.ones(2, 1, 9, 11, dtype=torch.bool)
    assert "is not softmax" in reasons("sdpa")
    assert reasons("sdpa", activation="softmax") == ""
    assert "not linear" in reasons("associative")
    assert "pairwise attn_mask" in reasons("associative", activation="poly1", attn_mask=pairwise)
    assert "attn_bias" in reasons("associative", activation="poly1", bias=torch.zeros(1, 3, 9, 11))
    assert "dropout" in reasons("associative", activation="poly1", dropout_p=0.1)
    assert (
        reasons(
            "associative", activation="poly1", key_padding_mask=torch.zeros(2, 11, dtype=torch.bool), is_causal=True
        )
        == ""
    )
    assert "does not know activation 'sign'" in reasons("fused_cpu", activation=CUSTOM)
    assert "softmax runs on the 'sdpa' kernel only" in reasons("fused_cpu", activation="softmax")
    assert "runs on CUDA tensors" in reasons("triton")  # this machine's tensors are on the CPU
    assert "dtype torch.float64" in reasons("triton", q=q.double(), k=k.double(), v=v.double())
    wide = torch.zeros(2, 3, 9, 300)
    assert "head dim 300 > 256" in reasons("triton", q=wide, k=torch.zeros(2, 3, 11, 300), v=v)
    assert "does not know activation 'sign'" in reasons("triton", activation=CUSTOM)
    for name in ("blocked", "materialized"):
        assert (
            reasons(name, activation=CUSTOM, dropout_p=0.2, bias=torch.zeros(1), attn_mask=pairwise, is_causal=True)
            == ""
        )
        assert "softmax" in reasons(name, activation="softmax")


def test_a_named_kernel_refuses_in_one_error_listing_its_reasons_and_who_can():
    q, k, v = make_qkv(dtype=torch.float32)
    with pytest.raises(KernelNotSupported) as error:
        attention(q, k, v, "poly3", attn_bias=torch.zeros(1), dropout_p=0.1, kernel="associative")
    message = str(error.value)
    assert "attention kernel 'associative' cannot take these inputs" in message
    assert "not linear" in message and "attn_bias" in message and "dropout" in message
    assert message.endswith("(kernels that can: fused_cpu, blocked, materialized)")
    with pytest.raises(ValueError, match="unknown attention kernel 'fast'"):
        attention(q, k, v, "poly3", kernel="fast")


def test_kernel_choice_says_what_auto_picks_and_why_not_the_others():
    q, k, v = make_qkv(dtype=torch.float32)
    choice = kernel_choice(q, k, v, "poly3", key_padding_mask=torch.zeros(2, 11, dtype=torch.bool))
    assert choice.kernel == "fused_cpu"
    assert set(choice.passed_over) == set(BACKENDS) - {"fused_cpu"}
    assert "not linear" in choice.passed_over["associative"][0]
    assert choice.passed_over["blocked"][0].startswith("'fused_cpu' is preferred (cost ")  # equal costs: priority
    text = str(choice)
    assert text.splitlines()[0] == "auto picks 'fused_cpu'" and "  sdpa: activation 'poly3' is not softmax" in text
    assert kernel_choice(q, k, v, "poly1").kernel == "associative"
    assert kernel_choice(q, k, v, CUSTOM).kernel == "blocked"
    assert kernel_choice(q, k, v).kernel == "sdpa"
    with pytest.raises(TypeError, match="unknown options \\['kernel'\\]"):
        kernel_choice(q, k, v, "poly3", kernel="blocked")


def test_auto_runs_what_kernel_choice_names(monkeypatch):
    q, k, v = make_qkv(dtype=torch.float32)
    called = []
    for name, backend in BACKENDS.items():
        monkeypatch.setattr(
            backend, "forward", lambda inputs, name=name, run=backend.forward: called.append(name) or run(inputs)
        )
    for activation in ("poly3", "poly1", CUSTOM, "softmax"):
        attention(q, k, v, activation)
    assert called == ["fused_cpu", "associative", "blocked", "sdpa"]


class _Costly:
    """A backend that states a cost, to check pick() compares the costs of the able backends that state one."""

    def __init__(self, backend, cost):
        self.backend, self.price = backend, cost

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def cost(self, inputs):
        return self.price


def test_costs_decide_between_backends_that_state_one(monkeypatch):
    inputs = _inputs("poly3")
    assert pick(inputs).kernel == "fused_cpu"
    able = [name for name in PRIORITY if not BACKENDS[name].not_supported_reasons(inputs)]
    assert {"fused_cpu", "blocked"} <= set(able)
    for name, cost in {**dict.fromkeys(able, 3.0), "blocked": 1.0, "fused_cpu": 2.0}.items():
        monkeypatch.setitem(BACKENDS, name, _Costly(BACKENDS[name], cost))
    choice = pick(inputs)
    assert choice.kernel == "blocked"
    assert choice.passed_over["fused_cpu"] == ["'blocked' is preferred (cost 2 s against 1 s)"]
    first = able[0]
    monkeypatch.setitem(BACKENDS, first, _Costly(BACKENDS[first], None))
    choice = pick(inputs)  # the first able backend states no cost: priority decides, no costs compared
    assert choice.kernel == first and choice.passed_over["blocked"] == [f"{first!r} is preferred"]
