"""Models switched and saved before the attention package moved still load and run (tests/fixtures/old_switched).

The fixtures were written by the flat ``attention/`` package (their classes are named by the old module paths,
``attention.timm_sdpa.Switched_*``, ``attention.timm_patch.SwinWindowAttention``, ``attention.hf.Switched__...``);
each must load with today's code, give the output it gave then, and equal a fresh switch of the same weights.
"""

from __future__ import annotations

import copy
import io
import pickle
import warnings
from pathlib import Path

import pytest
import timm
import torch
from transformers import BertConfig, BertModel

from polyattn_lightning.attention import set_attention
from polyattn_lightning.models.lra_encoder import LRAClassifier

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "old_switched"


def _fresh(name: str):
    """The model the fixture was made from, built and switched by today's code (make_fixture.py's recipe)."""
    if name == "vit_poly3":
        model = timm.create_model(
            "vit_tiny_patch16_224", img_size=32, patch_size=8, depth=1, embed_dim=16, num_heads=2, num_classes=3
        )
        spec = "poly3"
    elif name == "swin_poly3":
        model = timm.create_model(
            "swin_tiny_patch4_window7_224",
            img_size=32,
            patch_size=4,
            window_size=4,
            embed_dim=8,
            depths=(2,),
            num_heads=(2,),
            num_classes=3,
        )
        spec = "poly3"
    elif name == "xcit_poly3":
        model = timm.create_model(
            "xcit_nano_12_p16_224", img_size=32, depth=1, embed_dim=16, num_heads=2, num_classes=3
        )
        spec = {"name": "poly3", "scale": 1 / 14}
    elif name == "lra_poly1":
        return LRAClassifier(
            vocab_size=12,
            max_length=16,
            num_classes=3,
            dim=16,
            mlp_dim=16,
            num_heads=2,
            head_dim=8,
            depth=1,
            attention="poly1",
        )
    else:
        model = BertModel(
            BertConfig(
                vocab_size=32,
                hidden_size=16,
                num_hidden_layers=1,
                num_attention_heads=2,
                intermediate_size=16,
                max_position_embeddings=16,
            )
        )
        spec = "poly3"
    set_attention(model, spec)
    return model


def _run(model, x):
    model.eval()
    with torch.no_grad():
        y = model(**x) if isinstance(x, dict) else model(x)
    return y.last_hidden_state if hasattr(y, "last_hidden_state") else y


def _load(name: str) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the old module paths' deprecation line (test_old_paths.py)
        return torch.load(FIXTURES / f"{name}.pt", weights_only=False)  # our own fixture: whole pickled models


@pytest.mark.parametrize("name", ["vit_poly3", "swin_poly3", "xcit_poly3", "lra_poly1", "hf_bert"])
def test_old_pickles_load_run_as_saved_and_equal_a_fresh_switch(name):
    saved = _load(name)
    old = saved["model"]
    torch.testing.assert_close(_run(old, saved["input"]), saved["output"], rtol=1e-6, atol=1e-6)
    fresh = _fresh(name)
    fresh.load_state_dict(old.state_dict())
    torch.testing.assert_close(_run(fresh, saved["input"]), saved["output"], rtol=1e-6, atol=1e-6)
    for before, after in zip(old.modules(), fresh.modules()):
        assert type(before) is type(after)  # the old pickle's classes are today's classes


@pytest.mark.parametrize("name", ["vit_poly3", "swin_poly3", "xcit_poly3", "hf_bert"])
def test_new_pickles_name_only_new_paths(name):
    old = _load(name)["model"]
    buffer = io.BytesIO()
    torch.save(copy.deepcopy(old), buffer)
    text = buffer.getvalue()
    for stale in (b"attention.timm_sdpa", b"attention.timm_patch", b"attention.switched", b"attention.hf\n"):
        assert stale not in text
    assert b"polyattn_lightning.attention.switch." in text
    pickle.loads(pickle.dumps(old))  # and the new names resolve


def test_load_pretrained_round_trips_under_both_import_paths(tmp_path):
    from polyattn_lightning.attention.switch.hf import load_pretrained

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        from polyattn_lightning.attention.hf import load_pretrained as old_load_pretrained

    saved = _load("hf_bert")
    expected = saved["output"]
    for load in (load_pretrained, old_load_pretrained):
        model = load(FIXTURES / "hf_bert")
        assert model.config.polyattn_attention == "poly3"
        torch.testing.assert_close(_run(model, saved["input"]), expected, rtol=1e-6, atol=1e-6)
        model.save_pretrained(tmp_path / load.__module__)
        again = load(tmp_path / load.__module__)
        torch.testing.assert_close(_run(again, saved["input"]), expected, rtol=1e-6, atol=1e-6)
