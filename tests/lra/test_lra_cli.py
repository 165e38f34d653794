"""LRA through the CLI: every config composes to Xiong et al.'s recipe, `fit` runs on each task's official file
format, the quickstart learns, and 2-process DDP counts the test set once."""
from __future__ import annotations

import csv
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_lra_data import write_aan, write_cifar, write_imdb, write_pathfinder  # writers of the official formats

from polyattn_lightning import cli
from polyattn_lightning.attention import attention, get_activation
from polyattn_lightning.cli.runs import activation_label
from polyattn_lightning.data.lra import ListOpsSpec, PathfinderSpec
from polyattn_lightning.data.lra.listops import default_root, write_dataset
from polyattn_lightning.data.lra.snakes import write_dataset as write_pathfinder_set
from polyattn_lightning.grids.spec import settings_args
from polyattn_lightning.tasks import LRAModule
from training_helpers import GRIDS, built, experiment_configs, fit, grid_cells, named_pieces, runs_activation

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter is intended")

REPO = Path(__file__).resolve().parents[2]
LRA = REPO / "configs" / "lra"
QUICKSTART = LRA / "quickstart.yaml"
#: Xiong et al.: (DataModule, batch, steps, warmup)
RECIPE = {
    "listops": ("ListOpsDataModule", 32, 5000, 1000),
    "text": ("IMDbDataModule", 32, 20000, 8000),
    "retrieval": ("AANDataModule", 32, 30000, 800),
    "image": ("CIFAR10GrayDataModule", 256, 35000, 175),
    "pathfinder": ("PathfinderDataModule", 256, 62400, 312),
}
EXPERIMENTS = [LRA / f"{task}.yaml" for task in RECIPE]
#: Pathfinder at full length, on poly3 only: (resolution, batch, accumulated batches, validation every n batches)
FULL_LENGTH = {"pathx": (128, 32, 8, 2496), "path256": (256, 8, 32, 9984)}
FULL_LENGTH_EXPERIMENTS = [LRA / f"{task}.yaml" for task in FULL_LENGTH]
#: table 4's attention settings, each task's column a grid (configs/grids/lra_table4/<task>.yaml)
TABLE4 = {
    "softmax": "softmax",
    "poly3-14": {"name": "poly3", "scale": 0.0714},
    "poly3-scaled": {"name": "poly3", "scale": "inv_sqrt_n"},
    "poly1-14": {"name": "poly1", "scale": 0.0714},
    "relu": {"name": "relu", "scale": "inv_n"},
}
TINY_LISTOPS = ListOpsSpec(num_train=40, num_val=8, num_test=9, min_length=10, max_length=60, max_depth=3, max_args=4)


def make(*args: str):
    """The CLI with its classes built, not run."""
    return cli.make_cli(list(args), run=False)


def test_every_task_is_a_column_of_table_4():
    """Each task's grid runs its base config with every attention setting of table 4, 3 seeds each."""
    for task in RECIPE:
        base, _, cells = grid_cells(GRIDS / "lra_table4" / f"{task}.yaml")
        assert base == LRA / f"{task}.yaml"
        assert {labels["attention"]: settings["model.init_args.attention"] for _, labels, settings in cells} == TABLE4
        assert len(cells) == 3 * len(TABLE4)


@pytest.fixture(scope="module")
def tiny_roots(tmp_path_factory) -> dict[str, Path]:
    """Each task's tiny files in its official format."""
    return {task: tiny_release(tmp_path_factory.mktemp(task), task) for task in RECIPE}


@pytest.mark.parametrize("attention", TABLE4)
@pytest.mark.parametrize("task", RECIPE)
def test_config_composes_to_the_recipe_and_builds(tmp_path, monkeypatch, tiny_roots, task: str, attention: str):
    """Each table-4 cell (the task's base config with the attention its grid gives) through the CLI as ``fit``
    would, on the task's tiny files: the encoder built with what the data determines, running that attention."""
    monkeypatch.chdir(tmp_path)
    path, spec = LRA / f"{task}.yaml", TABLE4[attention]
    extra = ["--data.val_size", "6"] if task == "image" else []  # of 20 tiny training images, not 5000
    run = built(path, "--data.root", str(tiny_roots[task]), *settings_args({"model.init_args.attention": spec}), *extra)
    module, data, trainer = run.model, run.datamodule, run.trainer
    assert module.hparams.num_classes == data.num_classes and module.hparams.vocab_size == data.vocab_size
    data_class, batch, steps, warmup = RECIPE[task]
    assert type(data).__name__ == data_class and data.batch_size == batch
    assert trainer.max_steps == steps and module.optim.warmup_steps == warmup
    optim = module.optim
    assert (optim.lr, optim.weight_decay, optim.eps, optim.schedule) == (1e-4, 0, 1e-6, "linear")
    hp = module.hparams
    assert (hp.dim, hp.depth, hp.num_heads, hp.head_dim, hp.mlp_dim, hp.dropout) == (64, 2, 2, 32, 128, 0.1)
    assert hp.attn_dropout == 0.1
    assert get_activation(hp.attention) == get_activation(spec) and runs_activation(module.model, spec)


def test_x_without_attention_dropout_runs_linear_attention_from_the_command_line(tmp_path, monkeypatch, tiny_roots):
    """The removed ``*_poly1_attn_dropout0`` configs as the base config and two settings: x at 1/14 with no
    dropout on the attention map, which the associative (linear-time) form needs."""
    monkeypatch.chdir(tmp_path)
    run = built(LRA / "listops.yaml", "--data.root", str(tiny_roots["listops"]),
                "--model.init_args.attention", "{name: poly1, scale: 0.0714}", "--model.init_args.attn_dropout", "0.0")
    assert run.model.hparams.attn_dropout == 0.0 and get_activation(run.model.hparams.attention).associative


@pytest.mark.parametrize("path", FULL_LENGTH_EXPERIMENTS, ids=lambda p: p.stem)
def test_full_length_pathfinder_configs_build(tmp_path, monkeypatch, path: Path):
    """Path-X and Path-256 on tiny generated sets of their resolution: Pathfinder's recipe at an effective batch of
    256, the encoder at 16,384 / 65,536 positions, x^3 at 1/sqrt(N) without attention dropout (nothing that keeps
    the linear form out), the generator as the data when no root is given."""
    resolution, batch, accumulate, every = FULL_LENGTH[path.stem]
    root = write_pathfinder_set(PathfinderSpec(num_images=10), tmp_path / "data", resolution=resolution)
    monkeypatch.chdir(tmp_path)
    run = built(path, "--data.root", str(root))
    module, data, trainer = run.model, run.datamodule, run.trainer
    assert type(data).__name__ == "PathfinderDataModule" and data.resolution == resolution
    assert module.hparams.max_length == data.max_length == resolution**2
    assert data.generate == PathfinderSpec(num_images=200_000, images_per_folder=1000, seed=0)
    assert (data.batch_size, trainer.accumulate_grad_batches, trainer.val_check_interval) == (batch, accumulate, every)
    assert batch * accumulate == RECIPE["pathfinder"][1] and every == RECIPE["pathfinder"][3] * accumulate
    assert trainer.max_steps == RECIPE["pathfinder"][2] and module.optim.warmup_steps == RECIPE["pathfinder"][3]
    assert get_activation(module.hparams.attention) == get_activation("poly3") and module.hparams.attn_dropout == 0
    assert runs_activation(module.model, "poly3")


def test_quickstart_config_builds(tmp_path, monkeypatch, tiny_roots):
    monkeypatch.chdir(tmp_path)
    run = built(QUICKSTART, "--data.root", str(tiny_roots["listops"]))
    assert run.model.hparams.max_length == run.datamodule.max_length == 300  # the quickstart's, not the release's
    assert runs_activation(run.model.model, {"name": "poly3", "scale": 0.0714})


def test_every_lra_experiment_is_built_above():
    assert experiment_configs(LRA) == sorted([*EXPERIMENTS, *FULL_LENGTH_EXPERIMENTS, QUICKSTART])


def test_every_lra_config_piece_is_used():
    pieces = set(LRA.rglob("*.yaml")) - set(EXPERIMENTS) - set(FULL_LENGTH_EXPERIMENTS) - {QUICKSTART}
    assert {piece.resolve() for piece in pieces} <= named_pieces(LRA)


def tiny_release(root: Path, task: str) -> Path:
    """Tiny files in the task's official on-disk format."""
    if task == "listops":
        return write_dataset(TINY_LISTOPS, root)
    writer = {"text": write_imdb, "retrieval": write_aan, "image": write_cifar, "pathfinder": write_pathfinder}[task]
    return writer(root)


def scalars(log_dir: Path, tag: str) -> list[float]:
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return [event.value for event in events.Scalars(tag)]


@pytest.mark.parametrize(
    ("task", "attention"),
    [("listops", "softmax"), ("text", "poly3-scaled"), ("retrieval", "poly1-14"), ("image", "relu"),
     ("pathfinder", "poly3-14")],
)
def test_fit_a_few_steps_on_the_official_format(tmp_path, monkeypatch, caplog, task, attention):
    root = tiny_release(tmp_path / "data", task)
    monkeypatch.chdir(tmp_path)
    extra = ["--data.val_size", "6"] if task == "image" else []  # of 20 tiny training images, not 5000
    with caplog.at_level("INFO"):
        run = fit("--config", str(LRA / f"{task}.yaml"), "--data.root", str(root), "--data.batch_size", "2",
                  *settings_args({"model.init_args.attention": TABLE4[attention]}), "--trainer.max_steps", "2",
                  "--trainer.val_check_interval", "2", *extra)
    assert run.trainer.global_step == 2
    # the chance level the README's claims are measured against, counted here sample by sample
    test_set = run.datamodule.test_set
    label, count = Counter(test_set[i][1] for i in range(len(test_set))).most_common(1)[0]
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("majority-class rate")]
    assert f"test {count / len(test_set):.1%} (class {label})" in line and ": val " in line
    label = "softmax" if attention == "softmax" else activation_label(TABLE4[attention])
    log_dir = tmp_path / "runs" / "lra" / (task if attention == "softmax" else f"{task}_{label}") / "version_0"
    best = list((log_dir / "checkpoints").glob("best-*.ckpt"))
    assert len(best) == 1 and Path(run.trainer.ckpt_path).resolve() == best[0]  # tested with the best checkpoint
    assert len(scalars(log_dir, "test/top1")) == 1
    checkpoint = torch.load(best[0], weights_only=True)  # safe checkpoint IO
    assert checkpoint["hyper_parameters"]["two_tower"] is (task == "retrieval")


def test_quickstart_learns_above_the_majority_class(tmp_path, monkeypatch):
    """150 steps (of the quickstart's 600) on the set it generates on first use: test accuracy >= 1.5x the majority."""
    q = torch.randn(1, 1, 4, 8)
    attention(q, q, q, "poly3")  # loads the C++ kernels from their usual cache before the cache folder moves
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    run = fit("--config", str(QUICKSTART), "--trainer.max_steps", "150", "--trainer.val_check_interval", "50")
    spec = run.datamodule.generate
    test_file = default_root(spec) / "listops-1000" / "basic_test.tsv"
    assert test_file.is_file()  # generated on first use, under the cache
    labels = [row["Target"] for row in csv.DictReader(test_file.open(newline=""), delimiter="\t")]
    majority = Counter(labels).most_common(1)[0][1] / len(labels)
    assert run.trainer.callback_metrics["test/top1"].item() >= 1.5 * majority


@pytest.mark.slow
def test_two_process_ddp_tests_every_sample_once(tmp_path):
    """2 gloo ranks fit ListOps through the CLI; the test accuracy logged matches a one-process count over all
    9 test samples (odd: no sample repeated to even out the ranks)."""
    root = tiny_release(tmp_path / "data", "listops")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "polyattn_lightning", "fit", "--config", str(LRA / "listops.yaml"),
        "--model.init_args.attention", "poly3",
        "--data.root", str(root), "--data.batch_size", "4", "--trainer.accelerator", "cpu", "--trainer.devices", "2",
        "--trainer.strategy", "ddp", "--trainer.max_steps", "4", "--trainer.val_check_interval", "2",
        "--trainer.enable_progress_bar", "false",
    ]
    proc = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    log_dir = tmp_path / "runs" / "lra" / "listops_poly3" / "version_0"  # the base config's name and the attention
    (best,) = (log_dir / "checkpoints").glob("best-*.ckpt")
    module = LRAModule.load_from_checkpoint(best).eval()
    data = make("--config", str(LRA / "listops.yaml"), "--data.root", str(root)).datamodule
    data.setup("test")
    correct = 0
    with torch.no_grad():
        for batch in data.test_dataloader():
            correct += (module(batch["input_ids"], batch["mask"]).argmax(-1) == batch["label"]).sum().item()
    assert len(data.test_set) == 9
    assert scalars(log_dir, "test/top1") == [pytest.approx(correct / 9, abs=1e-6)]
