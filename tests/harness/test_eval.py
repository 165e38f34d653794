"""``polyattn eval`` on tiny random-init Llamas (a softmax teacher and its x^3 switch) and the local tasks, checked
against the models' log-likelihoods computed here directly, without lm-eval."""

from __future__ import annotations

import json
import math
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from polyattn_lightning.attention import set_attention
from polyattn_lightning.attention.switch.hf import load_pretrained
from polyattn_lightning.cli import main as cli_main
from polyattn_lightning.conversion import ConvertRecipe
from polyattn_lightning.data.generated_text import story, train_tokenizer
from polyattn_lightning.harness import CHOICE, PERPLEXITY, choice_items
from polyattn_lightning.harness.sources import Source, teacher_of
from polyattn_lightning.harness.table import format_value

pytest.importorskip("lm_eval")  # the [eval] extra; [test] installs it

ROOT = Path(__file__).resolve().parents[2]


def stories(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [story(rng)[0] for _ in range(count)]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A softmax teacher and its x^3 switch (the same random weights) saved with a stories tokenizer, and held-out
    stories the tokenizer was not trained on."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("eval")
    tokenizer = train_tokenizer(stories(300, seed=1), 300)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=128, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    for name, attention in (("teacher", None), ("student", "poly3")):
        if attention:
            set_attention(model, attention)
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    text = root / "held_out.txt"
    text.write_text("\n".join(stories(16, seed=2)) + "\n")
    return root, text, tokenizer


def log_likelihood(model, context: list[int], continuation: list[int]) -> float:
    """sum of log p(continuation | context), token by token."""
    ids = torch.tensor([context + continuation])
    with torch.no_grad():
        logprobs = model(ids).logits[0, len(context) - 1 : -1].double().log_softmax(-1)
    return logprobs.gather(-1, torch.tensor(continuation)[:, None]).sum().item()


def word_perplexity(model, tokenizer, lines: list[str]) -> float:
    """exp(-sum of each line's token log-likelihoods (after the end-of-sequence token) / whitespace words)."""
    total = sum(log_likelihood(model, [tokenizer.eos_token_id], tokenizer(line)["input_ids"]) for line in lines)
    return math.exp(-total / sum(len(re.split(r"\s+", line)) for line in lines))


def choice_accuracy(model, tokenizer, items: list[dict]) -> float:
    """How often the right choice has the highest summed log-likelihood after its context."""
    right = 0
    for item in items:
        context = tokenizer(item["context"])["input_ids"]
        scores = [
            log_likelihood(model, context, tokenizer(item["context"] + " " + choice)["input_ids"][len(context) :])
            for choice in item["choices"]
        ]
        right += max(range(len(scores)), key=scores.__getitem__) == item["label"]
    return right / len(items)


def test_teacher_and_student_side_by_side_match_their_hand_computed_numbers(folders, tmp_path, capsys, caplog):
    import datasets.config
    from transformers import AutoModelForCausalLM

    root, text, tokenizer = folders
    out = tmp_path / "out"
    online = datasets.config.HF_DATASETS_OFFLINE
    cli_main(["eval", f"teacher={root / 'teacher'}", f"student={root / 'student'}", "--out", str(out),
                        "--text", str(text), "--batch-size", "4"])  # fmt: skip
    assert datasets.config.HF_DATASETS_OFFLINE == online  # offline while the local tasks ran, as it was after
    assert "already-initialized model" not in caplog.text  # lm-eval's notes on a model object: not shown
    lines = text.read_text().splitlines()
    items = choice_items(lines)
    assert len(items) == len(lines)  # every story ends with its sum
    for label in ("teacher", "student"):
        saved = json.loads((out / f"{label}.json").read_text())  # lm-eval's format
        assert {"results", "configs", "versions", "n-samples", "higher_is_better"} <= set(saved)
        model = load_pretrained(root / label, AutoModelForCausalLM).eval()
        assert (getattr(model.config, "polyattn_attention", None) is not None) == (label == "student")
        perplexity, choice = saved["results"][PERPLEXITY], saved["results"][CHOICE]
        assert perplexity["word_perplexity,none"] == pytest.approx(word_perplexity(model, tokenizer, lines), rel=1e-5)
        assert choice["acc,none"] == pytest.approx(choice_accuracy(model, tokenizer, items))
        assert saved["n-samples"][CHOICE]["effective"] == len(items)
    teacher, student = (json.loads((out / f"{label}.json").read_text())["results"] for label in ("teacher", "student"))
    assert teacher[PERPLEXITY]["word_perplexity,none"] != student[PERPLEXITY]["word_perplexity,none"]  # x^3 differs
    table = (out / "table.md").read_text()
    assert table.splitlines()[0] == "| task | metric | teacher | student |"
    row = next(line for line in table.splitlines() if f"| {PERPLEXITY} | word_perplexity |" in line)
    assert row.endswith(" | ".join(format_value(r[PERPLEXITY]["word_perplexity,none"]) for r in (teacher, student)) + " |")
    assert table in capsys.readouterr().out
    assert sorted(path.name for path in out.iterdir()) == ["student.json", "table.md", "tasks", "teacher.json"]


def error_lines(stderr: str) -> list[str]:
    """The refusal: the ``error:`` line and every line after it but the hint on how to see the traceback (progress
    lines of long waits come before it)."""
    lines = stderr.strip().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("error:")]
    assert len(starts) == 1, stderr
    return [line for line in lines[starts[0] :] if "POLYATTN_DEBUG" not in line]


def run_cli(*args: str, setup: str = "") -> subprocess.CompletedProcess:
    code = f"import sys\n{setup}\nfrom polyattn_lightning.cli import main\nmain(sys.argv[1:])"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT)


def test_a_missing_lm_eval_is_said_in_one_line_naming_the_extra(folders, tmp_path):
    root, text, _ = folders
    done = run_cli("eval", str(root / "teacher"), "--out", str(tmp_path / "out"), "--text", str(text),
                   setup="sys.modules['lm_eval'] = None")  # fmt: skip
    assert done.returncode == 2
    [line] = error_lines(done.stderr)
    assert 'pip install -e ".[eval]"' in line
    assert not (tmp_path / "out").exists()  # refused before anything is written


def test_bad_path_unknown_task_non_causal_model_and_a_used_out_folder_are_refused(folders, tmp_path, capsys):
    from transformers import BertConfig, BertModel

    root, text, _ = folders
    BertModel(BertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                         vocab_size=50)).save_pretrained(tmp_path / "bert")  # fmt: skip
    capsys.readouterr()  # the progress bar of save_pretrained
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "mine.txt").write_text("kept")
    cases = {
        (str(tmp_path / "nowhere"), "--out", str(tmp_path / "o1")): "does not exist",
        (str(root / "teacher"), "--out", str(tmp_path / "o2"), "--tasks", "no_such_task"): "no_such_task",
        (str(tmp_path / "bert"), "--out", str(tmp_path / "o3")): "not a causal LM",
        (str(root / "teacher"), "--out", str(tmp_path / "used")): "not an empty folder",
        (str(root / "teacher"), "--out", str(tmp_path / "o4"), "--text", str(tmp_path / "no.txt")): "no.txt does not",
    }
    for args, message in cases.items():
        with pytest.raises(SystemExit) as exit_info:
            cli_main(["eval", "--text", str(text), *args])  # a --text in args wins
        [line] = error_lines(capsys.readouterr().err)
        assert exit_info.value.code == 2 and message in line, (args, line)
        assert not Path(args[2]).exists() or args[2].endswith("used"), args  # refused before anything is written
    assert (tmp_path / "used" / "mine.txt").read_text() == "kept"


def test_a_conversion_run_names_its_teacher(folders, tmp_path):
    root, _, _ = folders
    hparams = {"model": str(root / "teacher"), "attention": "poly3", "convert": ConvertRecipe(method="transfer")}
    student = Source("student", tmp_path / "last.ckpt", "checkpoint", "HFCausalLM", hparams)
    assert teacher_of(student).path == root / "teacher"
    assert teacher_of(Source("s", tmp_path, "checkpoint", "HFCausalLM", {**hparams, "attention": "softmax"})) is None
    assert teacher_of(Source("s", tmp_path, "checkpoint", "HFCausalLM", {**hparams, "convert": None})) is None



def test_a_runs_checkpoint_gives_the_numbers_of_its_export(tmp_path, monkeypatch):
    """A run folder (its checkpoint rebuilt, the tokenizer from its saved config's data) and the folder the same run
    exported evaluate alike."""
    from training_helpers import fit

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    run = fit("--config", str(ROOT / "configs" / "hf" / "tiny_llama_poly3.yaml"), "--data.train_size", "120",
              "--data.val_size", "16", "--data.test_size", "16", "--trainer.max_steps", "2",
              "--model.init_args.export_dir", "exported")  # fmt: skip
    text = run.datamodule.files()["test"]
    cli_main(["eval", f"run={run.trainer.log_dir}", "exported", "--out", "out", "--text", text])
    from_run, exported = (json.loads(Path(f"out/{label}.json").read_text())["results"] for label in ("run", "exported"))
    assert from_run[PERPLEXITY]["word_perplexity,none"] == pytest.approx(exported[PERPLEXITY]["word_perplexity,none"])
    assert from_run[CHOICE]["acc,none"] == exported[CHOICE]["acc,none"]
