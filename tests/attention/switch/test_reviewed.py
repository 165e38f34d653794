"""The fingerprints of the library code the switches mirror (``switch/reviewed.py``): every installed release's
code is recorded, and code that changed is refused in one line, the model left as it was."""
from __future__ import annotations

import json

import pytest
import timm
import torch
import transformers
from torch import nn
from transformers import MPNetConfig, MPNetModel

from polyattn_lightning.attention import set_attention
from polyattn_lightning.attention.switch import AttentionRefused, SwitchedAttention
from polyattn_lightning.attention.switch import reviewed
from polyattn_lightning.attention.switch.reviewed import Mirror, UnreviewedCode, normalised_source
from polyattn_lightning.bench import fingerprints
from polyattn_lightning.errors import ConfigError


def test_every_installed_release_is_recorded():
    """CI against a release nobody reviewed fails here, naming what to review and how."""
    missing = [f"{m.library} {m.installed()} {m.name}" for m in fingerprints.installed_mirrors()
               if fingerprints.status(m) == "NOT REVIEWED"]
    assert not missing, (
        f"code the switches mirror, not reviewed: {missing}; review it and record it with "
        "python -m polyattn_lightning.bench fingerprints --write (configs/README.md, Contributing)"
    )


def _altered(forward):
    """A copy of ``forward`` with one more step: what a new release that changed a forward looks like."""

    def forward_changed(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        return out

    return forward_changed


def test_a_changed_hf_forward_is_refused_in_one_line_and_the_model_is_unchanged(monkeypatch):
    from transformers.models.mpnet import modeling_mpnet

    torch.manual_seed(0)
    model = MPNetModel(MPNetConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=48, initializer_range=0.2)).eval()
    ids = torch.randint(1, 64, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(input_ids=ids).last_hidden_state
    classes = [type(m) for m in model.modules()]
    monkeypatch.setattr(modeling_mpnet.MPNetSelfAttention, "forward",
                        _altered(modeling_mpnet.MPNetSelfAttention.forward))
    with pytest.raises(ConfigError) as refused:
        set_attention(model, "poly3")
    version = transformers.__version__
    assert str(refused.value) == (
        f"MPNetModel cannot be switched: encoder.layer.0.attention.attn: transformers {version}'s "
        "transformers.models.mpnet.modeling_mpnet.MPNetSelfAttention differs from the code polyattn_lightning was "
        "reviewed against: pin a reviewed release (transformers==5.25.0; reviewed: 5.24.0, 5.25.0), or upgrade "
        "polyattn_lightning"
    )
    assert [type(m) for m in model.modules()] == classes
    assert not hasattr(model.config, "polyattn_attention")
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).last_hidden_state, before)
    monkeypatch.undo()
    assert set_attention(model, "poly3") == 2  # the reviewed code switches


def test_a_changed_timm_forward_is_refused_in_one_line_and_strict_false_switches_the_rest(monkeypatch):
    from timm.models import swin_transformer

    model = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, img_size=56, window_size=7,
                              embed_dim=16, depths=(1, 1), num_heads=(1, 2), num_classes=3).eval()
    monkeypatch.setattr(swin_transformer.WindowAttention, "forward", _altered(swin_transformer.WindowAttention.forward))
    classes = [type(m) for m in model.modules()]
    with pytest.raises(AttentionRefused) as refused:
        set_attention(model, "poly3")
    message = str(refused.value)
    assert "\n" not in message
    assert (f"layers.0.blocks.0.attn, layers.1.blocks.0.attn (timm.models.swin_transformer.WindowAttention): timm "
            f"{timm.__version__}'s timm.models.swin_transformer.WindowAttention differs from the code "
            "polyattn_lightning was reviewed against: pin a reviewed release (timm==1.0.31; reviewed: 1.0.31), or "
            "upgrade polyattn_lightning") in message
    assert [type(m) for m in model.modules()] == classes
    with pytest.raises(AttentionRefused, match="no attention module set_attention can switch"):
        set_attention(model, "poly3", strict=False)  # the only attention class is the changed one


def test_a_changed_torch_multihead_attention_is_refused(monkeypatch):
    from importlib.metadata import version

    model = nn.Sequential(nn.MultiheadAttention(8, 2, batch_first=True))
    monkeypatch.setattr(nn.MultiheadAttention, "forward", _altered(nn.MultiheadAttention.forward))
    with pytest.raises(AttentionRefused) as refused:
        set_attention(model, "poly3", probe=False)
    assert str(refused.value) == (
        "Sequential has no attention module set_attention can switch: 0 (torch.nn.modules.activation."
        f"MultiheadAttention): torch {version('torch')}'s torch.nn.modules.activation.MultiheadAttention differs from "
        "the code polyattn_lightning was reviewed against: pin a reviewed release (torch==2.14.1; reviewed: 2.13.0, "
        "2.14.1), or upgrade polyattn_lightning (the support table in docs/reference/timm-models.md lists what switches)"
    )
    assert not isinstance(model[0], SwitchedAttention)


def test_the_fingerprint_is_of_the_code_not_its_layout():
    def f(x):
        """A docstring."""
        # a comment
        return x + 1

    def g(x):
        return (x
                + 1)

    def h(x):
        return x + 2

    assert normalised_source(f) == normalised_source(g).replace("def g", "def f")
    assert normalised_source(f) != normalised_source(h).replace("def h", "def f")
    missing = Mirror("torch", "x", ("torch.nn.functional.no_such_function",))
    assert reviewed.normalised_source(None) == reviewed.MISSING and missing.fingerprint() != Mirror(
        "torch", "x", ("torch.nn.functional.softmax",)).fingerprint()


def test_an_unrecorded_library_says_to_upgrade():
    with pytest.raises(UnreviewedCode, match=r"^torch \S+'s x differs from the code polyattn_lightning was reviewed "
                       r"against: upgrade polyattn_lightning$"):
        Mirror("torch", "x", ("torch.nn.functional.softmax",)).route()


def test_record_adds_new_code_and_releases(tmp_path, monkeypatch):
    records = tmp_path / "reviewed.json"
    records.write_text("{}")
    monkeypatch.setattr(reviewed, "RECORDS", records)
    reviewed.records.cache_clear()
    mirror = Mirror("torch", "torch.x", ("torch.nn.functional.softmax",))
    try:
        added = reviewed.record([mirror], interface=frozenset({"torch.x"}))
        assert added == [f"torch {mirror.installed()} torch.x {mirror.fingerprint()}: interface"]
        assert mirror.route() == "interface"
        assert reviewed.record([mirror]) == []  # known code: nothing new
        data = json.loads(records.read_text())
        assert data == {"torch": {"torch.x": {mirror.fingerprint(): {"releases": [mirror.installed()],
                                                                     "route": "interface"}}}}
    finally:
        reviewed.records.cache_clear()


def test_the_fingerprints_command_lists_and_exits_1_on_unreviewed_code(capsys, monkeypatch):
    assert fingerprints.main([]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.split()[:2] == ["transformers", transformers.__version__] and line.endswith("FalconAttention")
               for line in lines)
    monkeypatch.setattr(nn.MultiheadAttention, "forward", _altered(nn.MultiheadAttention.forward))
    assert fingerprints.main([]) == 1
    captured = capsys.readouterr()
    assert [line for line in captured.out.splitlines() if "NOT REVIEWED" in line] == [
        line for line in captured.out.splitlines() if line.endswith("activation.MultiheadAttention")]
    assert "1 not reviewed" in captured.err
    with pytest.raises(SystemExit) as usage:
        fingerprints.main(["--interface", "x"])
    assert usage.value.code == 2 and "--interface is for --write" in capsys.readouterr().err
