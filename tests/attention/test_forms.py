"""One table of fused activation forms (attention/forms.py), read by every fused kernel in its own language."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from polyattn_lightning.attention import get_activation
from polyattn_lightning.attention.forms import FusedForm, form_of

KERNELS = Path(__file__).resolve().parents[2] / "polyattn_lightning" / "attention" / "kernels"


def test_the_cpp_enum_matches_the_table():
    source = (KERNELS / "csrc" / "fused_cpu.cpp").read_text()
    body = re.search(r"enum Form : int64_t \{([^}]*)\}", source).group(1)
    cpp = {name.strip(): int(value) for name, value in (item.split("=") for item in body.split(","))}
    assert cpp == {form.name: form.value for form in FusedForm}


def test_the_triton_constants_come_from_the_table():
    source = (KERNELS / "triton" / "jit.py").read_text()
    named = set(re.findall(r"^(\w+): tl\.constexpr = tl\.constexpr\(int\(FusedForm\.(\w+)\)\)", source, re.M))
    assert named == {(form.name, form.name) for form in FusedForm if form is not FusedForm.SIGMOID}
    assert not re.search(r"FORM == \d", source)  # no integer code written out


@pytest.mark.parametrize(
    "name, expected",
    [
        ("poly3", (FusedForm.POLY, 3)),
        ("poly1", (FusedForm.POLY, 1)),
        ("relu", (FusedForm.RELU, 1)),
        ("softplus", (FusedForm.SOFTPLUS, 1)),
        ("sigmoid", (FusedForm.SIGMOID, 1)),
        ("softmax", None),
    ],
)
def test_each_builtin_activation_names_its_form(name, expected):
    assert get_activation(name).fused_form == expected


def test_a_custom_form_is_none():
    assert form_of(()) is None and form_of(("gelu",)) is None
    assert form_of(("poly", 5)) == (FusedForm.POLY, 5)
    assert torch.tensor(int(FusedForm.SIGMOID)).item() == 3  # the integers the kernels take
