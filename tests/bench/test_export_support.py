"""The support tables' ``exports`` column: measured by exporting a row's tiny model (``bench export-support``), written
to a JSON file the tables read; a row the file does not hold says so; an encoder-decoder is refused with its reason."""
from __future__ import annotations

import json
import tempfile

import pytest
import timm

from polyattn_lightning.bench import export_support, export_table, hf_support, timm_support
from polyattn_lightning.errors import ConfigError

pytestmark = pytest.mark.filterwarnings("ignore")


def test_a_family_is_measured_by_exporting_it_and_an_encoder_decoder_is_refused(tmp_path):
    path = tmp_path / "export-support.json"
    path.write_text(json.dumps({"hf": {"GPT-2": {"formats": ["onnx"], "refused": {}}}}))  # an earlier run's row
    assert export_support.main(["--kind", "hf", "--write", str(path), "bert", "t5"]) == 0
    measured = json.loads(path.read_text())["hf"]
    assert measured["BERT"] == {"formats": ["pt2 (dynamic batch, sequence)", "onnx", "pretrained"], "refused": {}}
    assert measured["T5"]["formats"] == []
    assert measured["T5"]["refused"]["all"].startswith(
        "ExportRefused: T5Model cannot be exported: an encoder-decoder takes decoder inputs")
    assert measured["GPT-2"] == {"formats": ["onnx"], "refused": {}}  # kept: not measured by this run
    cell = export_table.export_cell("hf", "T5", path)
    assert cell.startswith("none<br>not all: ExportRefused: T5Model cannot be exported") and "|" not in cell
    assert export_table.export_cell("hf", "BERT", path) == "pt2 (dynamic batch, sequence), onnx, pretrained"
    assert export_table.export_cell("hf", "OPT", path) == export_table.NOT_MEASURED


def test_a_timm_row_exports_each_format_and_a_failing_one_is_refused_with_its_reason(monkeypatch):
    builds = []
    create_model = timm.create_model
    monkeypatch.setattr(timm, "create_model", lambda name, **kw: builds.append(name) or create_model(name, **kw))
    kwargs = dict(img_size=32, patch_size=8, depth=1, embed_dim=32, num_heads=2, num_classes=5)
    source = export_support.timm_source("vision_transformer", "vit_tiny_patch16_224", kwargs)
    assert builds == ["vit_tiny_patch16_224"]  # one build: the row's switching measured and the model exported
    assert export_support.formats_of(source) == {"formats": ["pt2 (dynamic batch)", "onnx", "state_dict"],
                                                 "refused": {}}
    assert len(builds) == 2  # the state dict loaded into the model built anew, as a user would
    # a state dict that does not load into the model rebuilt (another head): that format refused, in one line
    other = export_support.timm_source("vision_transformer", "vit_tiny_patch16_224", {**kwargs, "num_classes": 3})
    monkeypatch.setattr(source, "rebuild", lambda: other.model)
    found = export_support.formats_of(source)
    assert found["formats"] == ["pt2 (dynamic batch)", "onnx"]
    assert found["refused"]["state_dict"].startswith("RuntimeError: Error(s) in loading state_dict for VisionTransformer")


def test_the_tables_read_the_exports_column_from_the_shipped_file():
    shipped = export_table.export_support()
    row = hf_support.measure(hf_support.family("bert"))
    assert row.exports == export_table.export_cell("hf", "BERT") != export_table.NOT_MEASURED
    assert row.exports == ", ".join(shipped["hf"]["BERT"]["formats"])
    assert row.markdown().endswith(f"| {row.exports} |") and row.markdown().count("|") == 8
    assert hf_support.table([row]).splitlines()[0].endswith("| exports |")
    timm_row = timm_support.measure("vision_transformer", "test_vit")
    assert timm_row.exports == export_table.export_cell("timm", "test_vit") != export_table.NOT_MEASURED
    assert timm_support.table([timm_row]).splitlines()[0].endswith("| exports |")
    refused = timm_support.measure("resnest", "resnest14d")
    assert refused.verdict == "refused" and refused.exports == ""  # nothing switched: nothing exported


def test_a_timm_row_whose_attention_does_not_switch_has_nothing_to_export(capsys):
    todo = export_support.rows_to_measure("timm", ["resnest"])
    assert list(todo) == ["resnest14d"]
    assert export_support.measure_row(todo["resnest14d"]).startswith("refused (`timm.layers.split_attn.SplitAttn` x4")
    with pytest.raises(ConfigError, match=r"no timm row to measure among \['resnest'\]"):
        export_support.main(["--kind", "timm", "resnest"])
    assert "export-support: resnest14d: refused (" in capsys.readouterr().out


def test_a_refusal_names_the_file_written_without_its_temporary_folder():
    # Gemma 4's ViT (tiny) exports to ONNX a graph onnxruntime does not load; the error names the file it loaded
    kwargs = dict(img_size=64, depth=1, embed_dim=64, num_heads=2, head_dim=32, intermediate_size=128, num_classes=5,
                  pretrained_cfg_overlay=dict(input_size=(3, 64, 64)))
    found = export_support.formats_of(export_support.timm_source("gemma4_vit", "gemma4_vit_167m", kwargs))
    assert found["formats"] == ["pt2 (dynamic batch)", "state_dict"]
    refused = found["refused"]["onnx"]
    assert refused.startswith("InvalidArgument: [ONNXRuntimeError] : 2 : INVALID_ARGUMENT : Load model from model.onnx "
                              "failed:Invalid model.")
    assert tempfile.gettempdir() not in refused
    assert export_table.export_support()["timm"]["gemma4_vit_167m, depth=2"]["refused"]["onnx"] == refused  # shipped


@pytest.mark.parametrize(
    "kind, name, hint",
    [("hf", "bertt", "unknown Hugging Face family keys: 'bertt' (did you mean 'bert'?)"),
     ("timm", "vision_transformerr", "unknown timm model modules: 'vision_transformerr' (did you mean 'vision_transformer'?)")],
)
def test_an_unknown_name_exits_2_in_one_line_and_measures_nothing(tmp_path, kind, name, hint):
    """Through the benchmarks' entry point, as a user runs it: a misspelt name among good ones is never dropped
    silently; the file to write is not created."""
    import subprocess
    import sys

    out = tmp_path / "support.json"
    good = "bert" if kind == "hf" else "vision_transformer"
    result = subprocess.run([sys.executable, "-m", "polyattn_lightning.bench", "export-support", "--kind", kind,
                             "--write", str(out), good, name], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.startswith(f"error: {hint}") and "Traceback" not in result.stderr
    assert not out.exists() and "export-support:" not in result.stdout
