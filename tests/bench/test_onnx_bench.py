"""``bench onnx`` end to end through ``python -m polyattn_lightning.bench``: both parts at one copy and one timed round,
each exported ONNX model checked against PyTorch, the report's four cases and ratios; a bad command line exits 2 in one
line, before anything runs; an ONNX model beyond the tolerance exits 1 with the report written."""
from __future__ import annotations

import json
import math

import pytest
import torch

from polyattn_lightning.bench import onnx
from polyattn_lightning.bench.__main__ import main as bench_main
from polyattn_lightning.deploy import TOLERANCE

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(autouse=True)
def threads():
    """The bench runs on one thread (torch.set_num_threads(1)): the other tests get theirs back."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_onnx_bench_times_the_four_cases_of_each_part_on_onnx_models_that_match_pytorch(tmp_path, capsys):
    out = tmp_path / "onnx.json"
    argv = ["--parts", "vit,minilm", "--repeats", "1", "--instances", "1", "--json", str(out)]
    assert bench_main(["onnx", *argv]) == 0
    report = json.loads(out.read_text())
    assert set(report) == {"command", "vit", "minilm", "machine"}
    assert report["command"] == " ".join(["python -m polyattn_lightning.bench onnx", *argv])
    assert report["machine"]["torch_threads"] == 1
    for part in ("vit", "minilm"):
        result = report[part]
        cases = result["cases"]
        assert list(cases) == list(onnx.CASES)
        for entry in cases.values():
            assert len(entry["samples_s"]) == 1 and entry["s"] == entry["samples_s"][0] > 0
            assert entry["ratio_time"] == pytest.approx(entry["s"] / cases["softmax-onnx"]["s"])
            assert math.isfinite(entry["ratio_time"]) and entry["ratio_time"] > 0
        assert cases["softmax-onnx"]["ratio_time"] == 1
        for base in ("softmax-onnx", "poly3-eager"):
            pair = result[f"poly3-onnx / {base}"]
            # one copy, one round: the one paired ratio is the ratio of the two cases' one sample each
            assert pair["pairs"] == 1 and pair["median"] == pytest.approx(cases["poly3-onnx"]["s"] / cases[base]["s"])
            assert math.isfinite(pair["median"]) and pair["median"] > 0 and pair["ci95"] == [pair["median"]] * 2
        errors = result["onnx_max_abs_error"]
        assert set(errors) == {"poly3-onnx#0", "softmax-onnx#0"}
        assert all(0 <= error <= TOLERANCE for error in errors.values()), errors
    printed = capsys.readouterr().out
    ratio = report["vit"]["poly3-onnx / softmax-onnx"]["median"]
    verdict = "MET" if ratio <= onnx.TARGET else "MISS"
    assert f"{verdict}: ONNX poly3 ViT-S {ratio:.3f}x the softmax ViT-S" in printed
    assert "WRONG" not in printed
    assert not list(tmp_path.glob("*.onnx"))  # the exports were written in a temporary folder, gone


@pytest.mark.parametrize(("option", "message"), [
    (["--repeats", "0"], "error: --repeats 0: expected a whole number, at least 1"),
    (["--instances", "-1"], "error: --instances -1: expected a whole number, at least 1"),
    (["--instances", "two"], "error: argument --instances: invalid int value: 'two'"),
    (["--parts", "vit,bert"], "error: --parts: unknown ['bert']; expected a comma list of vit, minilm"),
    (["--repeat", "1"], "error: unknown option --repeat (did you mean --repeats?)"),
])
def test_a_bad_command_line_exits_2_in_one_line_before_anything_runs(tmp_path, capsys, option, message):
    out = tmp_path / "onnx.json"
    with pytest.raises(SystemExit) as exit_:
        bench_main(["onnx", *option, "--json", str(out)])
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    error, hint = captured.err.splitlines()
    assert error == message and hint == "(`python -m polyattn_lightning.bench onnx --help` lists every option)"
    assert captured.out == "" and not out.exists()


def test_an_onnx_model_beyond_the_tolerance_exits_1_naming_it_with_the_report_written(tmp_path, capsys, monkeypatch):
    # a one-layer encoder of the MiniLM's vocabulary (quick to export), and a tolerance no difference is within
    monkeypatch.setitem(onnx.MINILM, "num_hidden_layers", 1)
    monkeypatch.setitem(onnx.MINILM, "hidden_size", 32)
    monkeypatch.setitem(onnx.MINILM, "num_attention_heads", 2)
    monkeypatch.setitem(onnx.MINILM, "intermediate_size", 64)
    monkeypatch.setattr(onnx, "TOLERANCE", -1.0)
    out = tmp_path / "onnx.json"
    assert bench_main(["onnx", "--parts", "minilm", "--repeats", "1", "--instances", "1", "--json", str(out)]) == 1
    errors = json.loads(out.read_text())["minilm"]["onnx_max_abs_error"]
    assert all(0 <= error <= TOLERANCE for error in errors.values()), errors  # the real tolerance holds them
    wrong = [line for line in capsys.readouterr().out.splitlines() if line.startswith("WRONG")]
    assert wrong == ["WRONG: the ONNX outputs differ from PyTorch's beyond -1: "
                     + ", ".join(f"minilm {case} ({error:.3g})" for case, error in errors.items())]
