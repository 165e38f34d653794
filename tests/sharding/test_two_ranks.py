"""FSDP2 on 2 gloo ranks through the sharded strategy, in one launch (``sharded_worker.py``), against DDP on the same
2 ranks and against one process with the same global batch, all from the same saved initial state dict.

Asserted: the weights after 4 steps equal DDP's and one process's (1e-5, fp32) for the tiny Llama and the tiny ViT,
poly3 and softmax, with the NaN guard skipping a step whose loss is NaN on one rank only (ViT) and attention norms
probed every 2 steps on every rank (their forward leaves training as it was); the tiny Llama's ``save_pretrained``
export holds DDP's tensors (its tied head written once); a sharded checkpoint written mid-epoch resumes on 2 ranks bit
for bit, sharded on 1 rank (DCP reshards) and, consolidated to one file, on one process within 1e-5; the decoder built
on the meta device is the same on 2 ranks as on 1 and has its own init; a preempted sharded job (SIGUSR1 on one rank
mid-step) requeues and continues bit for bit (weights, optimizer, lr schedule, every rank's RNG, batches, losses),
as the DDP path does; the memory lines are said, and FSDP2's estimate is about half DDP's; validation, test and
prediction on splits whose two shares make different numbers of batches finish under FSDP2 (and DDP), with the
metrics and predictions of one process on the same weights.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from sharding_harness import STEPS, TEST_SIZE, fit, save_initial_states, uneven, weights
from test_preemption import free_port, hpc_files, requeues, slurm_env
from test_resume import assert_identical
from training_helpers import cpu_trainer

from polyattn_lightning.callbacks import ExactResume, NonFiniteLossGuard, PredictionWriter
from polyattn_lightning.checkpoint import atomic_save
from polyattn_lightning.sharding import read_consolidated

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent
PYTHONPATH = os.pathsep.join(
    filter(None, [str(HERE), str(HERE.parent / "cluster"), str(HERE.parent), os.environ.get("PYTHONPATH")])
)


@pytest.fixture(scope="module")
def launch(tmp_path_factory) -> tuple[Path, Path]:
    """The 2-rank worker, run once; (initial state dicts folder, its output folder)."""
    folder = tmp_path_factory.mktemp("two_ranks")
    init, out = folder / "init", folder / "out"
    out.mkdir()
    save_initial_states(init)
    port = free_port()
    worker = HERE / "sharded_worker.py"
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), str(init), str(out)],
            env={**os.environ, **slurm_env(folder, 2, rank, port), "PYTHONPATH": PYTHONPATH, "OMP_NUM_THREADS": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        logs = [proc.communicate(timeout=900)[0] for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    codes = [proc.returncode for proc in procs]
    assert codes == [0, 0], f"exit codes {codes}:\n" + "\n".join(log[-4000:] for log in logs)
    return init, out


def load(out: Path, name: str):
    return torch.load(out / name, weights_only=True)


def single_process(kind: str, attention: str, init: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    callbacks = ()
    if kind == "vit":
        from ddp_worker import PoisonRank1Samples

        callbacks = (NonFiniteLossGuard(on_nonfinite="skip"), PoisonRank1Samples())
    _, model = fit(kind, attention, "single", 1, init / f"{kind}_init.pt", STEPS, callbacks,
                   default_root_dir=tmp_path)
    return weights(model)


def assert_close_weights(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.isfinite(value).all(), f"{name}: the NaN step was not skipped"
        torch.testing.assert_close(actual[name], value, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("kind", ["decoder", "vit"])
@pytest.mark.parametrize("attention", ["poly3", "softmax"])
def test_fsdp_trains_like_ddp_and_like_one_process(launch, tmp_path, kind, attention):
    init, out = launch
    fsdp = load(out, f"{kind}_{attention}_fsdp.pt")["weights"]
    ddp = load(out, f"{kind}_{attention}_ddp.pt")["weights"]
    initial = torch.load(init / f"{kind}_init.pt", weights_only=True)
    assert any(not torch.equal(fsdp[k], initial[k]) for k in initial)  # it trained
    assert_close_weights(fsdp, ddp)
    assert_close_weights(fsdp, single_process(kind, attention, init, tmp_path))


def test_sharded_export_writes_what_save_pretrained_writes_under_ddp(launch):
    """The tied head is written once, as plain transformers writes it, and the weights are DDP's."""
    from safetensors.torch import load_file

    _, out = launch
    ddp, fsdp = (load_file(out / f"export_{layout}" / "model.safetensors") for layout in ("ddp", "fsdp"))
    assert "lm_head.weight" not in ddp and "model.embed_tokens.weight" in ddp  # save_pretrained: tied weights once
    assert sorted(fsdp) == sorted(ddp)
    for name, value in ddp.items():
        torch.testing.assert_close(fsdp[name], value, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("kind", ["decoder", "vit"])
def test_each_rank_holds_half_the_parameters_and_optimizer_states(launch, kind):
    _, out = launch
    ddp, fsdp = (load(out, f"{kind}_poly3_{layout}.pt")["held"] for layout in ("ddp", "fsdp"))
    for part in ("parameters", "optimizer"):
        assert all(h[part] == ddp[0][part] for h in ddp)  # every DDP rank holds the whole
        assert all(h[part] <= 0.6 * ddp[0][part] for h in fsdp), (part, ddp, fsdp)  # half, padded shards


def test_attention_norms_are_probed_on_a_sharded_model(launch):
    _, out = launch
    assert load(out, "vit_poly3_fsdp.pt")["norm_steps"] == [0, 2]


def test_sharded_checkpoint_resumes_bit_for_bit_on_two_ranks(launch):
    _, out = launch
    folder = out / "decoder_ckpt" / "at2.ckpt"
    assert sorted(p.name for p in folder.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]  # no temporary folder left
    assert_identical(load(out, "decoder_resumed.pt"), load(out, "decoder_poly3_fsdp.pt")["weights"])


def test_consolidated_checkpoint_resumes_on_one_process(launch, tmp_path):
    init, out = launch
    checkpoint = read_consolidated(out / "decoder_ckpt" / "at2.ckpt")
    assert checkpoint["global_step"] == 2 and len(checkpoint["rng_states"]) == 2
    file = tmp_path / "at2_full.ckpt"
    atomic_save(checkpoint, file)
    with pytest.warns(UserWarning, match="RNG states for 2 ranks"):
        _, model = fit("decoder", "poly3", "single", 1, init / "decoder_init.pt", STEPS, (ExactResume(),),
                       str(file), default_root_dir=tmp_path)
    assert_close_weights(weights(model), load(out, "decoder_poly3_fsdp.pt")["weights"])


def test_sharded_checkpoint_of_two_ranks_resumes_sharded_on_one(launch, tmp_path, one_rank):
    """DCP reshards: the 2-rank folder loads into a 1-rank sharded run, which ends where the 2-rank run ended."""
    init, out = launch
    with pytest.warns(UserWarning, match="RNG states for 2 ranks"):
        _, model = fit("decoder", "poly3", "fsdp", 1, init / "decoder_init.pt", STEPS, (ExactResume(),),
                       str(out / "decoder_ckpt" / "at2.ckpt"), default_root_dir=tmp_path)
    assert_close_weights(weights(model), load(out, "decoder_poly3_fsdp.pt")["weights"])


def test_meta_device_build_is_the_same_on_two_ranks_as_on_one(launch, meta_built_decoder):
    _, out = launch
    assert_identical(load(out, "meta_init.pt"), meta_built_decoder["weights"])


def test_preempted_sharded_job_continues_exactly(launch):
    folder, out = launch[1].parent, launch[1]
    assert load(out, "preempted_mid_step.pt") is None
    assert hpc_files(out / "preempted") == ["hpc_ckpt_1.ckpt"]
    assert (out / "preempted" / "hpc_ckpt_1.ckpt" / ".metadata").is_file()
    assert requeues(folder) == ["requeue 4242"]
    reference, resumed = load(out, "preempted_reference.pt"), load(out, "preempted_resumed.pt")
    assert resumed["start_step"] == 6  # the signal came during step 5, which was completed and saved
    assert resumed["batches"] == reference["batches"][6:]
    assert resumed["loss"] == {step: v for step, v in reference["loss"].items() if step >= 6}
    for key in ("weights", "optimizer", "lr_schedule", "rng"):
        assert_identical(resumed[key], reference[key], key)


UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def sizes(line: str, layout: str) -> dict[str, float]:
    """The parts of one layout's estimate in bytes: ``{"total": ..., "parameters": ..., ...}``."""
    part = line.split(f"{layout} ", 1)[1].split(";")[0]
    found = re.findall(r"(?:(\w+) )?([\d.]+) (B|KiB|MiB|GiB)", part)
    return {(name or "total"): float(value) * UNITS[unit] for name, value, unit in found}


def test_memory_is_said_before_training_and_after_the_first_steps(launch):
    _, out = launch
    estimate, measured = load(out, "memory.pt")
    assert "this run: FSDP2" in estimate, estimate
    ddp, fsdp = sizes(estimate, "DDP"), sizes(estimate, "FSDP2 over 2 ranks")
    assert {"parameters", "gradients", "optimizer", "activations"} <= ddp.keys() & fsdp.keys(), estimate
    assert ddp["optimizer"] == pytest.approx(2 * ddp["parameters"], rel=0.01)  # AdamW: two moments
    assert fsdp["parameters"] == pytest.approx(ddp["parameters"] / 2, rel=0.05)  # half, padded shards
    assert fsdp["activations"] == ddp["activations"] > 0
    assert re.search(r"after 2 steps: rank 0 holds .*; rank 1 holds ", measured), measured


def test_attention_maps_of_a_sharded_checkpoint_folder(launch, tmp_path):
    """``polyattn maps`` reads a sharded folder (consolidated in memory): the diagnostics on a trained sharded run."""
    import numpy as np
    from PIL import Image

    from polyattn_lightning.commands import maps

    _, out = launch
    image = tmp_path / "digit.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(image)
    written = maps.main(["--ckpt", str(out / "preempted" / "hpc_ckpt_1.ckpt"), "--image", str(image),
                         "--out", str(tmp_path / "maps"), "--img-size", "8"])
    assert sorted(path.name for path in written) == ["heatmaps.png", "overlay.png"]
    assert all(path.stat().st_size > 1000 for path in written)


def one_process_evaluation(kind: str, state: dict[str, torch.Tensor], folder: Path) -> dict:
    """``validate``, ``test`` and ``predict`` of the ``kind`` task with weights ``state`` on one process."""
    model, data = uneven(kind)
    model.load_state_dict(state)
    trainer = cpu_trainer(default_root_dir=folder, callbacks=[PredictionWriter()])
    validated, tested = trainer.validate(model, data)[0], trainer.test(model, data)[0]
    trainer.predict(model, data, return_predictions=False)
    return {"val": validated, "test": tested, "predictions": merged_predictions(folder / "predictions")}


def merged_predictions(folder: Path) -> tuple[list[int], torch.Tensor]:
    """Every rank's prediction file merged: the data set indices in the order found, the rows in data set order."""
    files = [torch.load(path, weights_only=True) for path in sorted(folder.glob("rank*.pt"))]
    indices = torch.cat([f["indices"] for f in files])
    rows = torch.cat([f["predictions"] for f in files])
    return indices.tolist(), rows[indices.argsort()]


@pytest.mark.parametrize("kind, layout", [("vit", "ddp"), ("vit", "fsdp"), ("decoder", "fsdp")])
def test_uneven_evaluation_splits_finish_and_score_each_sample_once(launch, tmp_path, kind, layout):
    """Before the padding batch, FSDP2's rank with one batch more waited forever in its forward's all-gather."""
    _, out = launch
    run = load(out, f"uneven_{kind}_{layout}.pt")
    assert run["val_batches"] == ([2, 2] if layout == "fsdp" else [2, 1])  # the shares: 5 and 4 samples, batches of 4
    reference = one_process_evaluation(kind, run["weights"], tmp_path)
    for stage in ("val", "test"):
        assert run[stage].keys() == reference[stage].keys() and f"{stage}/loss" in run[stage]
        for name, value in reference[stage].items():
            assert run[stage][name] == pytest.approx(value, rel=1e-6, abs=1e-7), name
    assert run["fit_val"] == pytest.approx(reference["val"], rel=1e-6, abs=1e-7)  # the last validation of fit
    indices, rows = merged_predictions(out / f"uneven_{kind}_{layout}" / "predictions")
    assert sorted(indices) == list(range(TEST_SIZE))  # each sample once: the padding batch's prediction left out
    torch.testing.assert_close(rows, reference["predictions"][1], rtol=1e-5, atol=1e-6)
