"""Every import path that moved in the attention restructuring still works, for one release, with one deprecation line.

Checked in a fresh interpreter (an alias warns once, when first imported): each old module imports, names the new
module in a ``FutureWarning``, and hands out the names code used from it; the moved attributes of modules that still
exist resolve to the very objects of their new homes.
"""

from __future__ import annotations

import copy
import importlib
import json
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from polyattn_lightning import deprecated

#: Names old code imported from each old module path (what the tests, configs and docs of the last release used).
USED = {
    "polyattn_lightning.attention.timm_patch": [
        "set_attention",
        "attention_modules",
        "attention_map",
        "SwitchedAttention",
        "AttentionRefused",
        "ProbeInputError",
        "HAND_SOFTMAX",
        "SwinWindowAttention",
        "XCiTAttention",
        "ClassAttention",
        "_adapts",
    ],
    "polyattn_lightning.attention.timm_sdpa": ["GENERIC", "REVIEWED", "Reviewed", "Switched_attention_Attention"],
    "polyattn_lightning.attention.timm_probe": ["softmax_calls", "image_probe", "built_size"],
    "polyattn_lightning.attention.timm_adapters": ["cait"],
    "polyattn_lightning.attention.timm_adapters.swin_v2": ["SwinV2WindowAttention"],
    "polyattn_lightning.attention.switched": ["SwitchedAttention", "AttentionInputs", "_ADAPTERS", "_adapts"],
    "polyattn_lightning.attention.hf": [
        "set_attention",
        "load_pretrained",
        "split_mask",
        "decode_step",
        "IMPLEMENTATION",
        "Switched__transformers__models__bert__modeling_bert__BertSelfAttention",
    ],
    "polyattn_lightning.attention.hf_calibration": ["best_temperatures", "TEMPERATURES"],
    "polyattn_lightning.attention.diagnostics": [
        "attention_norms",
        "probe_attention",
        "select_layers",
        "captured_norms",
    ],
    "polyattn_lightning.attention.spline": ["polynomial_degree"],
    "polyattn_lightning.attention.blocked": ["blocked", "TILE_ELEMENTS"],
    "polyattn_lightning.attention.associative": ["associative", "CAUSAL_CHUNK"],
    "polyattn_lightning.attention.fused_cpu": ["key_lengths", "FusedCPUAttention"],
    "polyattn_lightning.attention.cpp": ["load", "build_name"],
    "polyattn_lightning.attention.kernels.cpp": ["load", "build_name", "SOURCES"],
    "polyattn_lightning.attention.triton_kernel": ["launch_config", "TritonAttention", "_SHORT"],
    "polyattn_lightning.attention.triton_selfcheck": ["dropout_keep", "triton_verified"],
    "polyattn_lightning.attention.triton_static": ["Case", "compile_case"],
    "polyattn_lightning.attention.timm_support": ["support_rows", "BEGIN"],
    "polyattn_lightning.tasks.models": ["create_timm_model", "resolve_pretrained_file"],
}

SCRIPT = textwrap.dedent("""
    import importlib, json, sys, warnings
    from polyattn_lightning import deprecated
    used, results = json.loads(sys.argv[1]), {}
    for old, names in used.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module = importlib.import_module(old)
            found = {name: type(getattr(module, name)).__name__ for name in names}
        results[old] = {"warnings": [str(w.message) for w in caught if w.category is FutureWarning], "found": found}
    same = {}
    for (module, name), (new_module, new_name) in deprecated.MOVED_ATTRIBUTES.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            owner = importlib.import_module(module)
            value = getattr(owner, name)
        new = getattr(importlib.import_module(new_module), new_name)
        lines = [str(w.message) for w in caught if w.category is FutureWarning]
        same[f"{module}.{name}"] = [value is new, lines, name in vars(owner) or isinstance(owner, deprecated.AliasModule)]
    print(json.dumps({"modules": results, "attributes": same}))
""")


def _run() -> dict:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(USED)], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_every_old_path_imports_warns_once_and_has_its_names():
    assert set(deprecated.MOVED_MODULES) <= set(USED) | {"polyattn_lightning.attention.timm_adapters"}
    report = _run()
    for old, seen in report["modules"].items():
        new = (deprecated._targets(old) or [None])[0]
        assert len(seen["warnings"]) == 1 and f"{old} moved to {new}" in seen["warnings"][0], (old, seen["warnings"])
        assert set(seen["found"]) == set(USED[old])
    for name, (identical, lines, kept) in report["attributes"].items():
        assert identical, f"{name} is not the object of its new home"
        if not kept:  # a name the module still imports for itself, or one of an alias module, needs no second line
            assert len(lines) == 1 and "moved to" in lines[0], (name, lines)


def test_a_removed_name_says_what_replaced_it():
    with warnings.catch_warnings():  # the alias's deprecation line (checked above, in a fresh interpreter)
        warnings.simplefilter("ignore", FutureWarning)
        from polyattn_lightning.attention import hf_calibration

    with pytest.raises(AttributeError, match=r"hf_calibration.fold_temperatures was removed; use .*convert\("):
        hf_calibration.fold_temperatures


@pytest.mark.parametrize(
    "module, name, replacement",
    [
        ("polyattn_lightning.attention.kernels.power", "fold", r"recurrent_state\(k, v, activation"),
        ("polyattn_lightning.attention.kernels.power", "step", r"attention\(q, k, v, activation, state=state"),
        ("polyattn_lightning.attention.kernels.fused_cpu", "decode_with", r"attention\(q, k, v, activation"),
        ("polyattn_lightning.attention.switch.hf.interface", "materialized_step", r"kernels.materialized"),
        ("polyattn_lightning.attention.switch.hf.interface", "probing", r"set_attention\(model, activation, probe="),
    ],
)
def test_a_decoding_name_that_went_says_what_replaced_it(module, name, replacement):
    """The recurrent form's functions took a state and its count apart and stepped outside ``pick()``; their
    replacements take a ``RecurrentState`` through ``attention()``."""
    with pytest.raises(AttributeError, match=rf"{module}.{name} was removed; use .*{replacement}"):
        getattr(importlib.import_module(module), name)


#: The old doors: every old module path whose ``set_attention`` code switched models with.
OLD_DOORS = [old for old, names in USED.items() if "set_attention" in names]


def _old_module(old: str):
    with warnings.catch_warnings():  # its deprecation line (checked above, in a fresh interpreter)
        warnings.simplefilter("ignore", FutureWarning)
        return importlib.import_module(old)


def test_every_name_an_old_module_shares_with_the_one_door_is_the_door():
    from polyattn_lightning.attention import switch

    shared = [(old, name) for old, names in USED.items() for name in names if name in switch.__all__]
    assert ("polyattn_lightning.attention.timm_patch", "set_attention") in shared
    for old, name in shared:
        assert getattr(_old_module(old), name) is getattr(switch, name), f"{old}.{name}"


@pytest.mark.parametrize("old", OLD_DOORS)
def test_an_old_door_switches_an_hf_and_a_timm_model_as_the_one_door_does(old):
    """``from polyattn_lightning.attention.timm_patch import set_attention`` took HF models too; both old doors now
    switch either kind exactly as ``polyattn_lightning.attention.set_attention`` does."""
    import timm
    from transformers import BertConfig, BertModel

    from polyattn_lightning.attention import set_attention

    old_door = _old_module(old).set_attention
    torch.manual_seed(0)
    bert = BertModel(BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                intermediate_size=32, max_position_embeddings=16)).eval()
    vit = timm.create_model("vit_tiny_patch16_224", img_size=16, patch_size=8, depth=2, embed_dim=16, num_heads=2,
                            num_classes=3).eval()
    ids, images = torch.randint(0, 32, (2, 6)), torch.randn(2, 3, 16, 16)
    for model, inputs in ((bert, {"input_ids": ids}), (vit, {"x": images})):
        through_old, through_door = copy.deepcopy(model), copy.deepcopy(model)
        assert old_door(through_old, "poly3") == set_attention(through_door, "poly3") == 2
        with torch.no_grad():
            old_out, door_out, softmax_out = (m(**inputs) for m in (through_old, through_door, model))
        if not isinstance(old_out, torch.Tensor):
            old_out, door_out, softmax_out = (o.last_hidden_state for o in (old_out, door_out, softmax_out))
        torch.testing.assert_close(old_out, door_out, rtol=0, atol=0)
        assert (old_out - softmax_out).abs().max() > 1e-3  # switched: no longer the softmax model's output
