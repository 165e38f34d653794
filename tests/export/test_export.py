"""``polyattn export``: a tiny quickstart run to .pt2, ONNX and a timm state dict, each checked at once; the switched
timm families (ViT, Swin, XCiT at poly3) exported with a dynamic batch and run at another batch (onnxruntime for
ONNX); a .pt2 loaded where the project cannot be imported; the refusals, exit 2, nothing written."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import timm
import torch
from torch import nn

from polyattn_lightning import cli, export_checkpoint, set_attention
from polyattn_lightning.commands.export import exportable
from polyattn_lightning.deploy import export_program, write_export
from polyattn_lightning.errors import ConfigError

pytestmark = pytest.mark.filterwarnings("ignore")

QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "classification" / "quickstart.yaml"
CHECK = re.compile(r"(\w+) export checked on (\d+) images of the run's data: max abs error (\S+) \(within")

FAMILIES = {
    "vit": lambda: timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, embed_dim=32,
                                     num_heads=2, num_classes=5),
    "swin": lambda: timm.create_model("swin_tiny_patch4_window7_224", img_size=32, patch_size=4, window_size=4,
                                      embed_dim=16, depths=(1, 1), num_heads=(1, 2), num_classes=5),
    "xcit": lambda: timm.create_model("xcit_nano_12_p16_224", img_size=32, patch_size=8, depth=2, embed_dim=32,
                                      num_heads=2, num_classes=5, cls_attn_layers=1),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """``last.ckpt`` of a 2-layer poly3 digits ViT trained two steps through the CLI, its config.yaml beside it."""
    folder = tmp_path_factory.mktemp("run")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        cli.main(["fit", "--config", str(QUICKSTART),
                  "--model.init_args.model_kwargs", "{patch_size: 4, embed_dim: 32, depth: 2, num_heads: 2}",
                  "--trainer.max_steps", "2", "--trainer.val_check_interval", "2",
                  "--trainer.limit_val_batches", "1", "--trainer.enable_progress_bar", "false"])
    (path,) = folder.rglob("last.ckpt")
    return path


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_switched_family_exports_with_a_dynamic_batch(family, tmp_path):
    torch.manual_seed(0)
    model = FAMILIES[family]().eval()
    set_attention(model, "poly3")
    images = torch.randn(5, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(images)
        program = export_program(model, images[:2])  # traced at 2, run at 5
        assert "polyattn" not in program.graph_module.code  # standard operators only
        for fmt in ("pt2", "onnx"):
            got = write_export(model, fmt, images[:2], tmp_path / f"model.{fmt}", program=program)(images)
            assert got.shape == expected.shape and expected.abs().max() > 1e-3
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=0, msg=fmt)


def test_cli_exports_each_format_checked_and_loadable_without_the_project(checkpoint, tmp_path, capsys):
    state = torch.load(checkpoint, weights_only=True)["state_dict"]
    for fmt in ("pt2", "state_dict"):  # ONNX: the families' test, and the refusal below
        cli.main(["export", "--ckpt", str(checkpoint), "--out", str(tmp_path / f"model.{fmt}"), "--format", fmt])
        (found,) = CHECK.findall(capsys.readouterr().out)
        assert found[0] == fmt and int(found[1]) == 32 and float(found[2]) <= 1e-4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt2", "model.state_dict"]
    # the state dict: Lightning's "model." prefix gone, loads into timm's own model switched by set_attention
    plain = torch.load(tmp_path / "model.state_dict", weights_only=True)
    assert plain.keys() == {key.removeprefix("model.") for key in state if key.startswith("model.")}
    model = timm.create_model("vit_tiny_patch16_224", num_classes=10, img_size=16, patch_size=4, embed_dim=32, depth=2,
                              num_heads=2).eval()
    set_attention(model, "poly3")
    model.load_state_dict(plain)
    images = torch.randn(3, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model(images)
    torch.save(images, tmp_path / "images.pt")
    # the .pt2 in a process where polyattn_lightning cannot be imported
    code = (
        "import sys, torch; sys.modules['polyattn_lightning'] = None\n"
        f"program = torch.export.load({str(tmp_path / 'model.pt2')!r})\n"
        f"out = program.module()(torch.load({str(tmp_path / 'images.pt')!r}))\n"
        f"torch.save(out, {str(tmp_path / 'out.pt')!r})\n"
        "try:\n    import polyattn_lightning\nexcept ImportError:\n    print('project not importable')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "project not importable" in done.stdout
    torch.testing.assert_close(torch.load(tmp_path / "out.pt"), expected, atol=1e-5, rtol=0)


def _refused(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["export", *argv])
    assert exit_info.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1
    return lines[0]


def test_cli_refusals_exit_2_and_leave_nothing(checkpoint, tmp_path, capsys):
    out = tmp_path / "model.onnx"
    assert "unknown export format 'tflite'" in _refused(
        ["--ckpt", str(checkpoint), "--out", str(out), "--format", "tflite"], capsys)
    assert "does not exist" in _refused(["--ckpt", str(tmp_path / "none.ckpt"), "--out", str(out)], capsys)
    # beyond the tolerance (onnxruntime is never bit-exact here): one line with the figure, no file, no partial
    line = _refused(["--ckpt", str(checkpoint), "--out", str(out), "--format", "onnx", "--tolerance", "0"], capsys)
    assert re.search(r"max abs error \S+ \(beyond the tolerance 0\); nothing written", line)
    assert list(tmp_path.iterdir()) == []
    out.write_text("mine")
    assert "already exists" in _refused(["--ckpt", str(checkpoint), "--out", str(out)], capsys)
    assert out.read_text() == "mine"


def test_a_model_that_is_not_a_timm_model_is_refused_with_the_reason(tmp_path):
    with pytest.raises(ConfigError, match="takes timm image models and Hugging Face models; SimpleNamespace's Linear is"):
        exportable(SimpleNamespace(model=nn.Linear(2, 2)))
    with pytest.raises(ConfigError, match="unknown export format"):
        export_checkpoint(tmp_path / "x.ckpt", tmp_path / "x.bin", format="bin")
