"""The conversion benchmark runs end to end on a tiny teacher (the Llama quickstart's model, barely trained) and a
tiny ViT, and reports every conversion and fine-tune it was asked for, with its figure."""

from __future__ import annotations

import json
import logging

import pytest
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
    teacher = HFCausalLM(
        hf_config={
            "model_type": "llama",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 64,
        },
        vocab_size=len(data.tokenizer),
    )
    teacher.model.save_pretrained(tmp_path / "teacher")
    data.tokenizer.save_pretrained(tmp_path / "teacher")
    out, figure = tmp_path / "llama.json", tmp_path / "llama.png"
    args = "convert llama --activations poly3 --inits transfer --budgets 1 --seeds 1 --samples 16".split()
    args += ["--teacher", str(tmp_path / "teacher"), "--transfer", '{"steps": 2}', "--data", json.dumps(DATA)]
    assert bench_main([*args, "--json", str(out), "--figure", str(figure)]) == 0
    report = json.loads(out.read_text())
    assert set(report["switch"]) == {f"poly3/{m}" for m in ("none", "calibrate", "transfer", "transfer (factor only)")}
    assert set(report["finetune"]) == {"poly3/transfer/full", "poly3/transfer/lora", "softmax/teacher/full"}
    assert 0 < report["finetune"]["poly3/transfer/lora"]["adapter_fraction"] < 0.1
    assert report["conversion"]["poly3/transfer"]["transfer"]["steps"] == 2
    assert figure.read_bytes()[:4] == b"\x89PNG" and "load_average_before" in report["machine"]


def test_vit_recovery_runs_the_tasks_convert_step_once_per_method(tmp_path, caplog):
    teacher = ClassificationModule(
        "vit_tiny_patch16_224",
        num_classes=10,
        img_size=16,
        attention="softmax",
        model_kwargs={"patch_size": 4, "embed_dim": 16, "depth": 1, "num_heads": 2},
    )
    torch.save({"state_dict": teacher.state_dict(), "hyper_parameters": dict(teacher.hparams)}, tmp_path / "t.ckpt")
    out = tmp_path / "vit.json"
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
        args = "convert vit --budgets 1,2 --seeds 2 --samples 8".split()
        args += ["--teacher", str(tmp_path / "t.ckpt"), "--transfer", '{"steps": 2}', "--json", str(out)]
        assert bench_main(args) == 0
    report = json.loads(out.read_text())
    # 2 budgets x 2 seeds x full and LoRA fine-tune what one convert step wrote
    summaries = [r.getMessage().split(":")[0] for r in caplog.records if " to poly3: " in r.getMessage()]
    assert summaries == ["convert calibrate to poly3", "convert transfer to poly3"]
    assert set(report["switch"]) == {"none", "calibrate", "transfer"} and 0 <= report["teacher_top1"] <= 1
    conversions = report["conversion"]  # the task's own convert step: none converts nothing
    assert conversions["none"] is None and conversions["calibrate"]["method"] == "calibrate"
    assert conversions["transfer"]["held_out"] == 2 and conversions["transfer"]["transfer"]["steps"] == 2
    assert set(report["finetune"]["poly3/transfer/lora"]) == set(report["finetune"]["poly3/none/full"]) == {"1", "2"}
    assert len(report["finetune"]["poly3/transfer/full"]["2"]["seeds"]) == 2


def test_minilm_is_judged_on_held_out_sentences_of_its_samples_style_and_of_another(tmp_path):
    out = tmp_path / "minilm.json"
    args = "convert minilm --samples 16 --sentences 12 --other-style 9 --activations poly3 --methods none,transfer"
    assert bench_main([*args.split(), "--transfer", '{"steps": 2}', "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert (report["samples"], report["held_out"], report["other_style"]) == (16, 12, 9)
    assert set(report["results"]) == {"poly3/none", "poly3/transfer"}
    transfer = report["results"]["poly3/transfer"]
    assert transfer["conversion"]["held_out"] == 4 and len(transfer["conversion"]["error_held_out"]) == 6
    for style in ("held_out", "other_style"):
        assert -1 <= transfer[style]["min_cosine"] <= transfer[style]["mean_cosine"] <= 1
        assert transfer[style]["mean_cosine"] > report["results"]["poly3/none"][style]["mean_cosine"]


def test_agreement_is_the_mean_cosine_and_the_spearman_of_the_pairwise_similarities():
    from scipy.stats import spearmanr

    from polyattn_lightning.bench.convert import agreement

    g = torch.Generator().manual_seed(0)
    reference = torch.nn.functional.normalize(torch.randn(12, 8, generator=g), dim=-1)
    got = torch.nn.functional.normalize(reference + 0.5 * torch.randn(12, 8, generator=g), dim=-1)
    result = agreement(got, reference)
    pairs = torch.triu_indices(12, 12, offset=1)
    expected = spearmanr((got @ got.T)[pairs[0], pairs[1]], (reference @ reference.T)[pairs[0], pairs[1]])
    assert result["spearman"] == pytest.approx(expected.statistic, abs=1e-12)
    assert result["mean_cosine"] == pytest.approx(float(torch.nn.functional.cosine_similarity(got, reference).mean()))
    assert result["min_cosine"] == pytest.approx(float(torch.nn.functional.cosine_similarity(got, reference).min()))


def test_the_everyday_sentences_are_distinct_unlike_the_samples_and_interleave_their_kinds():
    from polyattn_lightning.bench.sentences import HEADLINES, QUESTIONS, REMARKS, everyday_sentences, varied_sentences

    every = everyday_sentences()
    assert len(every) == len(set(every)) == 96 and not set(every) & set(varied_sentences(700))
    assert every[:3] == [QUESTIONS[0], HEADLINES[0], REMARKS[0]] and everyday_sentences(5) == every[:5]
    assert all(s.endswith("?") for s in QUESTIONS) and not any(s[-1] in ".?!" for s in HEADLINES)
