"""The conversion benchmark runs end to end on a tiny teacher (the Llama quickstart's model, barely trained) and a
tiny ViT, and reports every conversion and fine-tune it was asked for, with its figure."""
from __future__ import annotations

import json

import torch

from polyattn_lightning.attention import attention
from polyattn_lightning.bench.__main__ import main as bench_main
from polyattn_lightning.data import GeneratedStoriesData
from polyattn_lightning.tasks import ClassificationModule, HFCausalLM

DATA = {"train_size": 64, "val_size": 16, "test_size": 16}


def test_llama_recovery_is_reported_per_method_budget_and_mode(tmp_path, monkeypatch):
    attention(*[torch.randn(1, 1, 4, 8)] * 3, "poly3")  # the C++ kernels load from their cache before it moves
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    data = GeneratedStoriesData(**DATA)
    data.prepare_data()
    data.setup("fit")
    teacher = HFCausalLM(hf_config={"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
                                    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                    "max_position_embeddings": 64}, vocab_size=len(data.tokenizer))
    teacher.model.save_pretrained(tmp_path / "teacher")
    data.tokenizer.save_pretrained(tmp_path / "teacher")
    out, figure = tmp_path / "llama.json", tmp_path / "llama.png"
    assert bench_main(["convert", "llama", "--teacher", str(tmp_path / "teacher"), "--activations", "poly3",
                       "--inits", "transfer", "--budgets", "1", "--seeds", "1", "--samples", "16",
                       "--transfer", '{"steps": 2}', "--data", json.dumps(DATA), "--json", str(out),
                       "--figure", str(figure)]) == 0
    report = json.loads(out.read_text())
    assert set(report["switch"]) == {f"poly3/{m}" for m in ("none", "calibrate", "transfer", "transfer (factor only)")}
    assert set(report["finetune"]) == {"poly3/transfer/full", "poly3/transfer/lora", "softmax/teacher/full"}
    assert 0 < report["finetune"]["poly3/transfer/lora"]["adapter_fraction"] < 0.1
    assert report["conversion"]["poly3/transfer"]["transfer"]["steps"] == 2
    assert figure.read_bytes()[:4] == b"\x89PNG" and "load_average_before" in report["machine"]


def test_vit_recovery_runs_the_tasks_convert_step(tmp_path):
    teacher = ClassificationModule("vit_tiny_patch16_224", num_classes=10, img_size=16, attention="softmax",
                                   model_kwargs={"patch_size": 4, "embed_dim": 16, "depth": 1, "num_heads": 2})
    torch.save({"state_dict": teacher.state_dict(), "hyper_parameters": dict(teacher.hparams)}, tmp_path / "t.ckpt")
    out = tmp_path / "vit.json"
    assert bench_main(["convert", "vit", "--teacher", str(tmp_path / "t.ckpt"), "--budgets", "1", "--seeds", "1",
                       "--samples", "8", "--transfer", '{"steps": 2}', "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["switch"]) == {"none", "calibrate", "transfer"} and 0 <= report["teacher_top1"] <= 1
    assert set(report["finetune"]["poly3/transfer/lora"]) == {"1"}
