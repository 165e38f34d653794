"""The spline check: relu attention is piecewise cubic, x^3 attention a degree-7 polynomial, softmax neither."""
from __future__ import annotations

import pytest
import torch
from timm.layers import Attention

from polyattn_lightning.diagnostics.spline import polynomial_degree
from polyattn_lightning.attention import set_attention


def block(activation: str, **kwargs) -> Attention:
    torch.manual_seed(0)
    module = Attention(8, num_heads=2, **kwargs)
    set_attention(module, activation)
    return module


def test_relu_attention_is_piecewise_cubic():
    report = polynomial_degree(block("relu"))
    assert report.degree == 3
    assert report.relative_differences[4] < 1e-8 < report.relative_differences[3]
    assert report.windows > 20  # most windows fit inside one piece


def test_poly3_attention_has_degree_seven():
    report = polynomial_degree(block("poly3"))
    assert report.degree == 7
    assert report.relative_differences[8] < 1e-8 < report.relative_differences[7]


def test_softmax_attention_is_no_polynomial():
    report = polynomial_degree(block("softmax"))
    assert report.degree is None
    assert report.relative_differences[4] > 1e-3


def test_layernorm_is_refused():
    with pytest.raises(ValueError, match=r"q_norm is a LayerNorm: normalisation is not polynomial"):
        polynomial_degree(block("relu", qk_norm=True, norm_layer=torch.nn.LayerNorm))
