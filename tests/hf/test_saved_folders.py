"""A switched model's ``save_pretrained`` folder never loads as softmax without the project.

Its config names the project's attention implementation (``attn_implementation: polyattn``): a fresh process that
never imports the project gets transformers' refusal instead of a softmax model with weights trained for poly3, for
families switched through the interface (BERT, Llama), by adapters (DeBERTa-v2, GPT-Neo) and both (SigLIP). A folder
of a softmax model stays plain: it loads anywhere with HF's own outputs. ``load_pretrained`` loads every one switched,
with the saved model's outputs. In a fresh process that imported the project, a plain ``from_pretrained`` loads an
interface family switched (exactly the saved model's outputs), and refuses a family with adapter-switched modules in
one line naming ``load_pretrained`` (their code does not call the interface: a plain load would compute softmax).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import transformers

from polyattn_lightning.attention.switch import attention_modules, set_attention
from polyattn_lightning.attention.switch.hf import load_pretrained, probe_inputs
from polyattn_lightning.attention.switch.hf.saved import LOAD_PRETRAINED, write_remote_code
from polyattn_lightning.errors import ConfigError
from polyattn_lightning.bench.hf_support import build, family, model_class, run
from polyattn_lightning.tasks import HFCausalLM

FAMILIES = ["bert", "llama", "deberta-v2", "gpt-neo", "siglip"]
#: The families switched through the AttentionInterface alone; the others have adapter-switched modules.
INTERFACE = ("bert", "llama")


def fresh_process(script: str, saved: dict, keys, cwd, env: dict | None = None) -> dict:
    """Run ``script`` in a new interpreter with ``{key: [folder, model class name]}`` of ``keys`` as its argument;
    the JSON report it prints last."""
    folders = {key: [str(saved[key]["folder"]), saved[key]["class"]] for key in keys}
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(script), json.dumps(folders)], capture_output=True,
                            text=True, cwd=cwd, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def saved_implementation(key: str) -> str:
    return "polyattn" if key in INTERFACE else LOAD_PRETRAINED


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    """Per family: its folders switched to poly3 and to softmax, the probe inputs and each one's outputs."""
    root = tmp_path_factory.mktemp("saved")
    found = {}
    for key in FAMILIES:
        fam = family(key)
        model = build(fam)
        inputs = probe_inputs(model)
        hf_softmax = run(model, inputs)
        with torch.no_grad():
            first_output = model(**inputs).to_tuple()[0]  # HF's own softmax model, as the fresh process reads it
        softmax = build(fam)
        set_attention(softmax, "softmax")
        softmax.save_pretrained(root / key / "softmax")
        set_attention(model, "poly3")
        poly3 = run(model, inputs)
        assert (poly3 - hf_softmax).abs().max() > 1e-2  # what a silent softmax load would get wrong
        model.save_pretrained(root / key / "poly3")
        if key in INTERFACE:  # the trust_remote_code route: only for families switched through the interface alone
            write_remote_code(model, root / key / "poly3")
        else:
            with pytest.raises(ConfigError, match=f"cannot load through trust_remote_code: .*{LOAD_PRETRAINED}"):
                write_remote_code(model, root / key / "poly3")
        with torch.no_grad():
            first_poly3 = model(**inputs).to_tuple()[0]
        torch.save({"inputs": inputs, "softmax": first_output, "poly3": first_poly3}, root / key / "reference.pt")
        found[key] = {"folder": root / key, "inputs": inputs, "poly3": poly3, "class": fam.model}
    return found


def test_a_fresh_process_without_the_project_refuses_poly3_and_loads_softmax(saved, tmp_path):
    script = """
        import json, sys
        import torch, transformers

        report = {}
        for key, (folder, name) in json.loads(sys.argv[1]).items():
            cls = getattr(transformers, name)
            try:
                cls.from_pretrained(folder + "/poly3")
                refused = None
            except ValueError as error:
                refused = str(error).splitlines()[0]
            reference = torch.load(folder + "/reference.pt", weights_only=True)
            model = cls.from_pretrained(folder + "/softmax").eval()
            with torch.no_grad():
                first = model(**reference["inputs"]).to_tuple()[0]
            report[key] = {"refused": refused, "softmax_difference": (first - reference["softmax"]).abs().max().item()}
        report["imported"] = sorted(name for name in sys.modules if name.startswith("polyattn"))
        print(json.dumps(report))
    """
    report = fresh_process(script, saved, FAMILIES, tmp_path)
    assert report.pop("imported") == []
    for key, seen in report.items():
        refusal = f'attn_implementation="{saved_implementation(key)}"` is not supported'
        assert seen["refused"] is not None and refusal in seen["refused"], (key, seen["refused"])
        assert seen["softmax_difference"] < 1e-4, key


def test_trust_remote_code_loads_an_interface_family_switched_in_a_process_that_never_imports_the_project(saved,
                                                                                                          tmp_path):
    """Through an auto class (a model class named directly does not read ``auto_map``), the folder's
    modeling_polyattn.py attends as the project does (its own naive fp32 code, not the project's kernels: equal
    within 1e-5)."""
    script = """
        import json, sys
        import torch, transformers

        report = {}
        for key, (folder, name) in json.loads(sys.argv[1]).items():
            reference = torch.load(folder + "/reference.pt", weights_only=True)
            model = transformers.AutoModel.from_pretrained(folder + "/poly3", trust_remote_code=True).eval()
            assert type(model).__name__ == name, type(model)
            with torch.no_grad():
                first = model(**reference["inputs"]).to_tuple()[0]
            report[key] = {"difference": (first - reference["poly3"]).abs().max().item(),
                           "implementation": model.config._attn_implementation}
        report["imported"] = sorted(name for name in sys.modules if name.startswith("polyattn"))
        print(json.dumps(report))
    """
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)  # the project is not importable from the subprocess's working directory either
    report = fresh_process(script, saved, INTERFACE, tmp_path, env)
    assert report.pop("imported") == []
    for key, seen in report.items():
        assert seen["implementation"] == "polyattn" and seen["difference"] < 1e-5, (key, seen)


def test_load_pretrained_switches_every_family_back_with_the_saved_outputs(saved):
    for key, entry in saved.items():
        config = json.loads((entry["folder"] / "poly3" / "config.json").read_text())
        assert (config["attn_implementation"], config["polyattn_attention"]) == (saved_implementation(key), "poly3"), key
        assert "attn_implementation" not in json.loads((entry["folder"] / "softmax" / "config.json").read_text())
        loaded = load_pretrained(entry["folder"] / "poly3", model_class(family(key))).eval()
        assert {m.activation_spec for _, m in attention_modules(loaded)} == {"poly3"}, key
        torch.testing.assert_close(run(loaded, entry["inputs"]), entry["poly3"], rtol=0, atol=0, msg=key)


def test_a_plain_from_pretrained_in_a_process_that_imported_the_project_loads_switched_or_refuses(saved, tmp_path):
    script = """
        import json, sys
        import polyattn_lightning  # before transformers: the attention registers once transformers is imported
        import torch, transformers

        report = {}
        for key, (folder, name) in json.loads(sys.argv[1]).items():
            reference = torch.load(folder + "/reference.pt", weights_only=True)
            try:
                model = getattr(transformers, name).from_pretrained(folder + "/poly3").eval()
            except ValueError as error:
                report[key] = {"refused": str(error).splitlines()[0]}
                continue
            with torch.no_grad():
                first = model(**reference["inputs"]).to_tuple()[0]
            report[key] = {"refused": None, "difference": (first - reference["poly3"]).abs().max().item()}
        print(json.dumps(report))
    """
    report = fresh_process(script, saved, FAMILIES, tmp_path)
    for key, seen in report.items():
        if key in INTERFACE:
            assert seen == {"refused": None, "difference": 0.0}, (key, seen)
        else:
            assert f'attn_implementation="{LOAD_PRETRAINED}"` is not supported' in seen["refused"], (key, seen)


def test_a_folder_loaded_plainly_with_the_project_and_saved_again_keeps_its_mark(saved, tmp_path):
    """transformers pops ``attn_implementation`` when it reads a config: the attention's first call puts it back, so
    the re-saved folder still refuses to load without the project (an unmarked one would load as softmax)."""
    for key in INTERFACE:
        loaded = getattr(transformers, saved[key]["class"]).from_pretrained(saved[key]["folder"] / "poly3").eval()
        assert "attn_implementation" not in vars(loaded.config)  # what transformers does, which the fix answers
        first = run(loaded, saved[key]["inputs"])
        torch.testing.assert_close(first, saved[key]["poly3"], rtol=0, atol=0, msg=key)
        loaded.save_pretrained(tmp_path / key)
        config = json.loads((tmp_path / key / "config.json").read_text())
        assert (config["attn_implementation"], config["polyattn_attention"]) == ("polyattn", "poly3"), key


def test_a_folder_loaded_with_trust_remote_code_saves_again_marked_and_leaves_transformers_classes_alone(saved, tmp_path):
    """In a process that never imports the project: the re-saved folder carries modeling_polyattn.py, its auto_map
    and its mark (without which a process with neither would load it as softmax), and loads again to the same
    outputs; transformers' own class was not registered for the auto class (a BERT saved later in that process
    saves plainly)."""
    script = """
        import json, os, sys
        import torch, transformers

        report = {}
        for key, (folder, name) in json.loads(sys.argv[1]).items():
            reference = torch.load(folder + "/reference.pt", weights_only=True)
            model = transformers.AutoModel.from_pretrained(folder + "/poly3", trust_remote_code=True).eval()
            again = os.path.join(os.getcwd(), key + "-again")
            model.save_pretrained(again)
            config = json.load(open(again + "/config.json"))
            reloaded = transformers.AutoModel.from_pretrained(again, trust_remote_code=True).eval()
            with torch.no_grad():
                first = reloaded(**reference["inputs"]).to_tuple()[0]
            plain = getattr(transformers, name).from_pretrained(again).eval()  # the file registered the attention
            with torch.no_grad():
                plain_first = plain(**reference["inputs"]).to_tuple()[0]
            report[key] = {"mark": [config.get("attn_implementation"), config.get("polyattn_attention")],
                           "files": sorted(os.listdir(again)), "auto_model": config["auto_map"]["AutoModel"],
                           "difference": (first - reference["poly3"]).abs().max().item(),
                           "plain_difference": (plain_first - reference["poly3"]).abs().max().item(),
                           "hf_class_registered": getattr(transformers, name)._auto_class}
        report["imported"] = sorted(name for name in sys.modules if name.startswith("polyattn"))
        print(json.dumps(report))
    """
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    report = fresh_process(script, saved, INTERFACE, tmp_path, env)
    assert report.pop("imported") == []
    for key, seen in report.items():
        assert seen["mark"] == ["polyattn", "poly3"] and "modeling_polyattn.py" in seen["files"], (key, seen)
        assert seen["auto_model"] == f"modeling_polyattn.{saved[key]['class']}", (key, seen)
        assert seen["difference"] < 1e-5 and seen["hf_class_registered"] is None, (key, seen)
        assert seen["plain_difference"] < 1e-5, (key, seen)


def test_switching_back_to_softmax_leaves_a_plain_folder_and_the_export_carries_the_mark(tmp_path):
    model = build(family("bert"))
    set_attention(model, "poly3")
    set_attention(model, "softmax")
    model.save_pretrained(tmp_path / "back")
    assert "attn_implementation" not in json.loads((tmp_path / "back" / "config.json").read_text())
    llama = dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)
    for attention, mark in (("poly3", "polyattn"), ("softmax", None)):
        folder = HFCausalLM(hf_config=llama, vocab_size=64, attention=attention).export(tmp_path / attention)
        config = json.loads((folder / "config.json").read_text())
        assert config.get("attn_implementation") == mark
        # the export adds the trust_remote_code route where the model allows it
        assert (folder / "modeling_polyattn.py").is_file() == (mark is not None)
        if mark is not None:
            assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_polyattn.LlamaForCausalLM"
            assert config["auto_map"]["AutoModel"] == "modeling_polyattn.LlamaModel"


def test_the_auto_map_names_one_class_where_transformers_maps_a_config_to_several(tmp_path):
    """transformers maps DeiT's config to two image classifiers (with and without the distillation head): the
    folder's ``auto_map`` names the saved model's own class, which ``trust_remote_code`` then loads."""
    import transformers

    config = transformers.DeiTConfig(**family("deit").config)
    model = transformers.DeiTForImageClassificationWithTeacher(config).eval()
    set_attention(model, "poly3")
    model.save_pretrained(tmp_path)
    write_remote_code(model, tmp_path)
    auto_map = json.loads((tmp_path / "config.json").read_text())["auto_map"]
    assert auto_map["AutoModelForImageClassification"] == "modeling_polyattn.DeiTForImageClassificationWithTeacher"
    assert auto_map["AutoModel"] == "modeling_polyattn.DeiTModel"
