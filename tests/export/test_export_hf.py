"""``polyattn export`` of Hugging Face models: a tiny model of each exported family (BERT and DistilBERT encoders,
ViT, BEiT, the Llama causal LM) at poly3 to .pt2 and ONNX with a dynamic batch and sequence, run at other shapes against
PyTorch (onnxruntime for ONNX); the tiny Llama quickstart's run checkpoint through the CLI to .pt2, ONNX and its
save_pretrained folder, each checked on the run's data, and the saved folder exported in turn; the refusals (an
encoder-decoder, a format for the other kind of model), exit 2, nothing left."""
from __future__ import annotations

import re
from pathlib import Path

import onnx
import pytest
import torch
import transformers
from test_export import _refused  # the CLI's refusal: exit 2, one error line

from polyattn_lightning import cli, set_attention
from polyattn_lightning.attention.switch.hf import load_pretrained
from polyattn_lightning.deploy import ExportRefused, hf_source, write_source

pytestmark = pytest.mark.filterwarnings("ignore")

ROOT = Path(__file__).resolve().parents[2]
TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=64,
            max_position_embeddings=64)
FAMILIES = {
    "bert": ("BertModel", dict(TEXT, model_type="bert")),
    "distilbert": ("DistilBertModel", dict(model_type="distilbert", vocab_size=64, dim=32, n_layers=2, n_heads=4,
                                           hidden_dim=48, max_position_embeddings=64)),
    "vit": ("ViTModel", dict(model_type="vit", image_size=16, patch_size=4, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=4)),
    "llama": ("LlamaForCausalLM", dict(TEXT, model_type="llama", num_key_value_heads=2)),
    # its relative-position bias is added to the mask HF builds, which HF materialises while exporting
    "beit": ("BeitModel", dict(model_type="beit", image_size=16, patch_size=4, hidden_size=32, intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=4, use_relative_position_bias=True)),
}
CHECK = re.compile(r"(\w+) export checked on (\d+) rows of (.+?): max abs error (\S+) \(within the tolerance 0.0001\)")


def tiny(family: str):
    torch.manual_seed(0)
    name, config = FAMILIES[family]
    model = getattr(transformers, name)(transformers.AutoConfig.for_model(**config)).eval()
    set_attention(model, "poly3")
    return model


def other_shapes(inputs: tuple[torch.Tensor, ...], text: bool) -> tuple[torch.Tensor, ...]:
    """Five rows (traced on two), and for text ten tokens (the traced inputs hold sixteen), the last row padded."""
    if not text:
        return (torch.randn(5, *inputs[0].shape[1:], generator=torch.Generator().manual_seed(3)),)
    ids = torch.randint(3, 64, (5, 10), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[-1, 6:] = 0
    return ids, mask


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_exports_with_a_dynamic_batch_and_sequence(family, tmp_path):
    source = hf_source(tiny(family), None, "random inputs")
    text = source.sequence_dim is not None
    inputs = other_shapes(source.inputs, text)
    with torch.no_grad():
        expected = source.model(*inputs)
        assert expected.abs().max() > 1e-3
        for fmt in ("pt2", "onnx"):
            run, dynamic = write_source(source, fmt, tmp_path / f"model.{fmt}")
            assert dynamic == ("batch, sequence" if text else "batch"), fmt
            got = run(*inputs)
            assert got.shape == expected.shape
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=0, msg=fmt)
    assert "polyattn" not in torch.export.load(tmp_path / "model.pt2").graph_module.code  # standard operators
    graph = onnx.load(tmp_path / "model.onnx").graph  # the ONNX inputs named as the model takes them
    assert [given.name for given in graph.input] == list(source.names) and graph.output[0].name == "output"


def test_an_encoder_decoder_is_refused_in_one_line():
    config = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4)
    with pytest.raises(ExportRefused, match=r"^T5Model cannot be exported: an encoder-decoder takes decoder inputs"):
        hf_source(transformers.T5Model(config), None, "random inputs")


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory) -> Path:
    """``last.ckpt`` of the tiny Llama quickstart (poly3) trained two steps through the CLI, its config beside it (the
    data's root absolute: the export reads the run's config from the test's own working directory)."""
    folder = tmp_path_factory.mktemp("run")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        cli.main(["fit", "--config", str(ROOT / "configs" / "hf" / "tiny_llama_poly3.yaml"),
                  "--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1",
                  "--trainer.enable_progress_bar", "false", "--data.root", str(folder / "stories"), "--data.train_size", "64",
                  "--data.val_size", "16", "--data.test_size", "16", "--data.batch_size", "8",
                  "--model.init_args.test_after_fit", "false"])
    (path,) = folder.rglob("last.ckpt")
    return path


def test_a_hugging_face_run_exports_each_format_checked_on_its_data(llama_run, tmp_path, capsys):
    for fmt, name in (("pt2", "model.pt2"), ("onnx", "model.onnx"), ("pretrained", "saved")):
        cli.main(["export", "--ckpt", str(llama_run), "--out", str(tmp_path / name), "--format", fmt])
        out = capsys.readouterr().out
        (found,) = CHECK.findall(out)
        assert (found[0], found[2]) == (fmt, "the run's data") and float(found[3]) <= 1e-4, out
        assert int(found[1]) > 2  # more rows than the export was traced on: the dynamic batch is checked
        assert ("dynamic: batch, sequence" in out) == (fmt != "pretrained")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx", "model.pt2", "saved"]
    # the save_pretrained folder: the task's export (the marker, the remote code), loading switched as trained
    saved = tmp_path / "saved"
    assert (saved / "polyattn_export.json").is_file() and (saved / "modeling_polyattn.py").is_file()
    assert (saved / "tokenizer.json").is_file()  # the run's tokenizer beside the model, as export_dir writes it
    model = load_pretrained(saved, auto_class=transformers.LlamaForCausalLM).eval()
    ids = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(0))  # the run's batches: ids only
    program = torch.export.load(tmp_path / "model.pt2").module()
    with torch.no_grad():
        torch.testing.assert_close(program(ids), model(ids).logits, atol=1e-5, rtol=0)
    # the saved folder exported in turn: no run, random inputs, said
    cli.main(["export", "--ckpt", str(saved), "--out", str(tmp_path / "again.onnx"), "--format", "onnx"])
    (found,) = CHECK.findall(capsys.readouterr().out)
    assert found[0] == "onnx" and found[2].startswith("random inputs (a saved folder")


def test_a_format_for_the_other_kind_of_model_is_refused_and_nothing_is_left(llama_run, tmp_path, capsys):
    line = _refused(["--ckpt", str(llama_run), "--out", str(tmp_path / "model.pt"), "--format", "state_dict"], capsys)
    assert line.endswith("--format state_dict is for timm models; LlamaForCausalLM exports as pt2, onnx, pretrained")
    saved = tmp_path / "saved"
    model = tiny("llama")
    model.save_pretrained(saved)
    line = _refused(["--ckpt", str(saved), "--out", str(tmp_path / "again"), "--format", "pretrained"], capsys)
    assert "the source is a save_pretrained folder already" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["saved"]
