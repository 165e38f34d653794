"""The activation registry: names, families, options, custom activations."""
from __future__ import annotations

import pytest
import torch
from attention_reference import make_qkv

from polyattn_lightning.attention import (
    Activation,
    attention,
    describe,
    get_activation,
    register_activation,
    registered_activations,
)
from polyattn_lightning.attention import registry
from polyattn_lightning.errors import ConfigError


@pytest.fixture
def clean_registry(monkeypatch):
    """Registrations made by a test disappear after it."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_FAMILIES", dict(registry._FAMILIES))
    monkeypatch.setattr(registry, "_RESOLVED", {})


def test_unknown_name_lists_registered_names():
    with pytest.raises(KeyError) as err:
        get_activation("cubic")
    for name in ("softmax", "poly{p}", "relu", "softplus", "sigmoid"):
        assert name in str(err.value)


def test_builtins_resolve_with_their_paper_scales():
    assert get_activation("poly3").scale == "inv_sqrt_n" and get_activation("poly3").kernel == ("poly", 3)
    assert get_activation("poly1").associative and not get_activation("poly2").associative
    assert get_activation("relu").scale == "inv_n" and get_activation("softplus").scale == "inv_n"
    assert get_activation("sigmoid").shift == "neg_log_n"
    assert get_activation("softmax").is_softmax


@pytest.mark.parametrize("name", ["poly0", "poly9", "poly33"])
def test_poly_powers_beyond_1_to_8_are_an_error_naming_the_power_and_range(name):
    assert get_activation("poly8").kernel == ("poly", 8)
    with pytest.raises(ConfigError, match=rf"{name}: the power must be an integer from 1 to 8, got {name[4:]}"):
        get_activation(name)


def test_yaml_style_spec_with_scale():
    act = get_activation({"name": "poly3", "scale": 1 / 14})
    assert act.scale == pytest.approx(1 / 14) and describe(act) == "poly3[scale=0.07143]"
    n = torch.tensor([[[[196.0]]]])
    assert torch.equal(act.row_scale(n), torch.full_like(n, 1 / 14))
    assert get_activation("poly3", scale="none").row_scale(n).item() == 1.0
    with pytest.raises(ValueError, match="bad options"):
        get_activation({"name": "poly3", "power": 2})
    with pytest.raises(ValueError, match="unknown scale"):
        get_activation("relu", scale="inv_cube_n")


def test_custom_activation_by_decorator_runs_on_the_blocked_kernel(clean_registry):
    @register_activation("square_relu")
    def square_relu(scale="inv_n"):
        return Activation("square_relu", lambda s: torch.relu(s) ** 2, lambda s: 2 * torch.relu(s), scale=scale)

    assert "square_relu" in registered_activations()
    q, k, v = make_qkv()
    out = attention(q, k, v, "square_relu", kernel="auto")
    s = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    torch.testing.assert_close(out, torch.relu(s) ** 2 / k.shape[-2] @ v)
    small = make_qkv(B=1, H=1, Nq=3, Nk=4, d=2, dv=2)
    assert torch.autograd.gradcheck(lambda q, k, v: attention(q, k, v, "square_relu"), small)


def test_register_by_call_and_duplicates(clean_registry):
    register_activation("halfpoly{p}", lambda p: get_activation(f"poly{p}", scale=0.5))
    assert get_activation("halfpoly2").scale == 0.5
    with pytest.raises(ValueError, match="already registered"):
        register_activation("relu", lambda: None)


@pytest.mark.parametrize("bad", [True, False, 0, -0.5, float("nan"), [1.0]])
def test_scale_must_be_a_positive_number_not_a_bool(bad):
    """Regression: ``scale=True``/``False`` passed validation (and False made every output zero)."""
    with pytest.raises(ValueError, match="scale must be"):
        get_activation("poly3", scale=bad)


def test_a_name_may_not_shadow_a_family_member_or_the_reverse(clean_registry):
    """Regression: registering ``poly3`` silently replaced the ``poly{p}`` family's poly3 everywhere."""
    with pytest.raises(ValueError, match=r"clashes with the registered poly\{p\}"):
        register_activation("poly3", lambda: get_activation("relu"))
    assert get_activation("poly3").kernel == ("poly", 3)
    register_activation("gate7", lambda: get_activation("relu"))
    with pytest.raises(ValueError, match="clashes with the registered gate7"):
        register_activation("gate{p}", lambda p: get_activation("relu"))


def test_an_error_inside_a_factory_is_not_reported_as_bad_options(clean_registry):
    """Regression: any TypeError raised inside a factory was reported as 'bad options {}'."""

    @register_activation("broken")
    def broken():
        return Activation("broken", torch.tanh, None + 1)

    with pytest.raises(TypeError, match="NoneType"):
        get_activation("broken")
    with pytest.raises(ValueError, match="bad options"):
        get_activation({"name": "relu", "power": 2})
