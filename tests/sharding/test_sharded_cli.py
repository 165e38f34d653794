"""The sharded strategy through the CLI on one rank: ``--trainer configs/<family>/trainer/fsdp.yaml`` merged into a
config's trainer settings, the model built on the meta device, checkpoint folders, ``--ckpt_path`` taking a folder,
``polyattn consolidate`` to one file (which resumes without sharding) and to a ``save_pretrained`` folder (which
plain transformers loads, and ``load_pretrained`` runs with the trained activation), neither over an existing one,
and the one-line errors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from training_helpers import CONFIGS, QUICKSTART, built, fit, resolved_config

from polyattn_lightning import cli
from polyattn_lightning.attention.switch.hf import load_pretrained
from polyattn_lightning.callbacks import MemoryReport
from polyattn_lightning.commands import consolidate
from polyattn_lightning.errors import ConfigError
from polyattn_lightning.sharding import ShardedStrategy, is_sharded_checkpoint
from polyattn_lightning.tasks import HFCausalLM

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter is intended")
LLAMA = CONFIGS / "hf" / "tiny_llama_poly3.yaml"
HF_FSDP = CONFIGS / "hf" / "trainer" / "fsdp.yaml"
LORA = CONFIGS / "hf" / "convert" / "tiny_llama_poly3_lora.yaml"


@pytest.mark.parametrize(
    "config, fsdp, kept",
    [(LLAMA, HF_FSDP, ("max_epochs", 4)), (QUICKSTART, CONFIGS / "classification/trainer/fsdp.yaml", ("max_epochs", 10))],
)
def test_fsdp_trainer_config_merges_into_the_configs_trainer(capsys, config, fsdp, kept):
    trainer = resolved_config(capsys, config, "--trainer", str(fsdp))["trainer"]
    assert trainer["strategy"]["class_path"] == "polyattn_lightning.sharding.ShardedStrategy"
    assert trainer["precision"] == "32-true" and trainer[kept[0]] == kept[1]  # the config's own setting stays


def test_a_ckpt_path_folder_that_is_not_a_sharded_checkpoint_is_a_one_line_error(tmp_path, capsys):
    (tmp_path / "run.ckpt").mkdir()
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["fit", "--config", str(LLAMA), "--ckpt_path", str(tmp_path / "run.ckpt")])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.splitlines()[0]
    assert "run.ckpt is not a sharded checkpoint" in error and ".metadata" in error and "meta.pt" in error


ARGS = ["--trainer", str(HF_FSDP), "--trainer.accelerator", "cpu", "--trainer.devices", "1",
        "--trainer.limit_val_batches", "1", "--trainer.val_check_interval", "2", "--trainer.enable_progress_bar",
        "false", "--data.train_size", "200", "--data.val_size", "20", "--data.test_size", "20",
        "--model.init_args.test_after_fit", "false", "--data.batch_size", "8", "--memory.after_steps", "2"]


@pytest.mark.slow
def test_sharded_fit_resume_and_consolidation_through_the_cli(tmp_path, monkeypatch, one_rank):
    monkeypatch.chdir(tmp_path)
    data = ["--data.root", str(tmp_path / "stories")]
    run = fit("--config", str(LLAMA), *ARGS, *data, "--trainer.max_steps", "2", "--model.init_args.export_dir",
              str(tmp_path / "exported_by_fit"))  # every rank joins the gather, rank 0 writes
    strategy = run.trainer.strategy
    assert isinstance(strategy, ShardedStrategy) and strategy.built_on_meta  # no rank held the model whole
    [memory] = [c for c in run.trainer.callbacks if isinstance(c, MemoryReport)]
    assert "this run: FSDP2" in memory.lines[0] and "after 2 steps" in memory.lines[1]
    last = tmp_path / "runs" / "hf" / "tiny_llama_poly3" / "version_0" / "checkpoints" / "last.ckpt"
    assert is_sharded_checkpoint(last)

    resumed = fit("--config", str(LLAMA), *ARGS, *data, "--trainer.max_steps", "3", "--ckpt_path", str(last))
    assert resumed.trainer.global_step == 3
    ids = torch.randint(0, 384, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # export_dir came with the checkpoint's hyperparameters: the resumed run wrote it again
        by_fit = load_pretrained(tmp_path / "exported_by_fit", _causal_lm()).eval()(input_ids=ids).logits
        torch.testing.assert_close(by_fit, resumed.model.eval().model(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    config = json.loads((tmp_path / "exported_by_fit" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]  # not FSDP2's subclass FSDPLlamaForCausalLM

    whole = tmp_path / "last_full.ckpt"
    consolidate.main([str(last), "--out", str(whole)])
    exists = f"^--out {re.escape(str(whole))} exists; give a new file name, or move that one away$"
    with pytest.raises(ConfigError, match=exists):
        consolidate.main([str(last), "--out", str(whole)])  # nothing the user had is overwritten
    checkpoint = torch.load(whole, weights_only=True)
    assert checkpoint["global_step"] == 2 and "model.model.embed_tokens.weight" in checkpoint["state_dict"]
    one_process = ("--config", str(LLAMA), "--trainer.accelerator", "cpu", *ARGS[4:], *data, "--trainer.max_steps",
                   "3", "--ckpt_path", str(whole))  # no sharding, in a new run folder (the file is outside the run's)
    with pytest.raises(ConfigError, match="exported_by_fit holds the export of the run in .*version_0"):
        fit(*one_process)  # which would overwrite the export of the first run's folder
    plain = fit(*one_process, "--model.init_args.export_dir", str(tmp_path / "exported_by_plain"))
    assert plain.trainer.global_step == 3 and not isinstance(plain.trainer.strategy, ShardedStrategy)

    exported = tmp_path / "exported"
    consolidate.main([str(last), "--pretrained", str(exported)])
    with pytest.raises(ConfigError, match="^--pretrained .*exported holds an export written outside any run folder"):
        consolidate.main([str(last), "--pretrained", str(exported)])
    task = HFCausalLM.load_from_checkpoint(whole, weights_only=True).eval()
    with torch.no_grad():
        trained = task.model(input_ids=ids).logits
        switched = load_pretrained(exported, _causal_lm()).eval()(input_ids=ids).logits
    torch.testing.assert_close(switched, trained, rtol=1e-5, atol=1e-5)  # the trained activation, same outputs
    assert json.loads((exported / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    # plain transformers, without the project, refuses the poly3 model rather than run it as softmax
    probe = ("import sys; from transformers import AutoModelForCausalLM\n"
             "try:\n    AutoModelForCausalLM.from_pretrained(sys.argv[1])\nexcept ValueError as error:\n"
             "    print(str(error).splitlines()[0])\n"
             "assert not any(name.startswith('polyattn') for name in sys.modules), 'imported the project'")
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-c", probe, str(exported)], capture_output=True, text=True, env=env,
                            cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert 'Specified `attn_implementation="polyattn"` is not supported' in result.stdout, result.stdout


def _causal_lm():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM

def _causal_lm():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM


@pytest.mark.slow
def test_sharded_fit_converts_once_trains_lora_adapters_and_exports_merged(tmp_path, monkeypatch, one_rank):
    """Sharding with the conversion issue's features, on a pretrained (softmax) folder: the convert step runs on the
    plain model before it is sharded (once, saved in the checkpoint), only the LoRA adapters train under FSDP2, and
    ``export_dir`` writes the merged model, which ``load_pretrained`` runs with the in-run outputs. A model built on
    the meta device (from ``hf_config``) is sharded before it has weights: LoRA / convert there is a short error."""
    monkeypatch.chdir(tmp_path)
    data = ["--data.root", str(tmp_path / "stories")]
    teacher = built(CONFIGS / "hf" / "tiny_llama_softmax.yaml", *data, "--data.train_size", "200")
    teacher.model.model.save_pretrained(tmp_path / "teacher")
    teacher.datamodule.tokenizer.save_pretrained(tmp_path / "teacher")
    adapted = ["--model.init_args.model", str(tmp_path / "teacher"), "--model.init_args.convert.steps", "5",
               "--model.init_args.convert.samples", "8", "--model.init_args.export_dir", str(tmp_path / "exported")]
    run = fit("--config", str(LORA), *ARGS, *data, *adapted, "--trainer.max_steps", "2")
    assert isinstance(run.trainer.strategy, ShardedStrategy) and not run.trainer.strategy.built_on_meta
    trainable = {name for name, p in run.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable), sorted(trainable)[:5]
    last = tmp_path / "runs" / "hf" / "tiny_llama_poly3_lora" / "version_0" / "checkpoints" / "last.ckpt"
    whole = tmp_path / "last_full.ckpt"
    consolidate.main([str(last), "--out", str(whole)])
    assert torch.load(whole, weights_only=True)["polyattn_conversion"]["method"] == "transfer"
    ids = torch.randint(0, 384, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        in_run = run.model.eval().model(input_ids=ids).logits
        exported = load_pretrained(tmp_path / "exported", _causal_lm()).eval()(input_ids=ids).logits
    torch.testing.assert_close(exported, in_run, rtol=1e-5, atol=1e-5)
    assert not any("lora" in name for name in safetensors_keys(tmp_path / "exported"))

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["fit", "--config", str(LLAMA), *ARGS, *data, "--model.init_args.lora", "{r: 4}"])
    assert exit_info.value.code == 2


def safetensors_keys(folder: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(folder / "model.safetensors", framework="pt") as weights:
        return list(weights.keys())
