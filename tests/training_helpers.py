"""Test helpers every task family's tests share: a quiet CPU trainer, a simulated preemption, the CLI's resolved
config, ``fit`` and a config's model and data built, command lines run as processes, and the configs' paths.

On ``sys.path`` through ``pythonpath = ["tests"]`` in pyproject.toml (and ``PYTHONPATH`` for the
torchrun workers), so any test directory imports it as ``training_helpers``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import yaml
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.cli import LightningCLI
from PIL import Image
from torch import nn

from polyattn_lightning import cli
from polyattn_lightning.cli.prechecks import yaml_references
from polyattn_lightning.attention import get_activation
from polyattn_lightning.attention import attention_modules
from polyattn_lightning.checkpoint import SafeCheckpointIO
from polyattn_lightning.grids.spec import cells, parsed, read_grid

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
#: the classification quickstart, the config most tests run shrunk
QUICKSTART = CONFIGS / "classification" / "quickstart.yaml"
#: the grid files (one per paper table, and each one's small variant)
GRIDS = CONFIGS / "grids"


def grid_cells(path: Path) -> tuple[Path, dict[str, Any], list[tuple[str, dict[str, str], dict[str, Any]]]]:
    """The base config, the fixed settings and the cells ``(name, labels, settings)`` of the grid file ``path``, read
    and checked by the grid command's own reader."""
    spec = read_grid(path)
    return spec.base, spec.args, [(cell.name, cell.labels, cell.settings) for cell in cells(spec)]


def parsed_config(*args: str):
    """The config ``fit`` would run with ``args``: parsed and pre-checked as the grid command checks a cell, nothing
    built."""
    return parsed(list(args), "the test's command line")


def run_commands(cwd: Path, *argvs: list[str], timeout: int = 900) -> list[dict]:
    """Run each ``argv`` as ``polyattn ARGV`` in ``cwd``, one process each (``tests/cli/cli_driver.py``, which imports
    the CLI once and forks per command); their ``{"rc": exit status, "output": stdout and stderr}``."""
    cases = cwd / "cases.json"
    cases.write_text(json.dumps([{"argv": argv} for argv in argvs]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "POLYATTN_DEBUG": "0"}
    driver = Path(__file__).with_name("cli") / "cli_driver.py"
    subprocess.run([sys.executable, str(driver), str(cases)], cwd=cwd, env=env, check=True, timeout=timeout)
    return json.loads(Path(f"{cases}.out").read_text())


def error_lines(output: str) -> list[str]:
    """The ``error: ...`` lines of a command's output."""
    return [line for line in output.splitlines() if line.startswith("error: ")]


def resolved_config(capsys, path: Path, *args: str) -> dict:
    """The full config the CLI would run ``path`` with, parsed and type-checked but not instantiated."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["fit", "--config", str(path), *args, "--print_config"])
    assert exit_info.value.code in (0, None)
    return yaml.safe_load(capsys.readouterr().out)


def experiment_configs(folder: Path) -> list[Path]:
    """Every config under ``folder`` that ``fit --config`` takes (a mapping with a top-level ``model``), sorted: the
    tests that build them find a new one without being told."""
    return sorted(path for path in folder.rglob("*.yaml")
                  if isinstance(config := yaml.safe_load(path.read_text()), dict) and "model" in config)


def config_piece(path: Path, key: str) -> dict:
    """The mapping under ``key`` of the config file ``path``, read from the piece file it names when it names one."""
    value = yaml.safe_load(path.read_text())[key]
    return yaml.safe_load((path.parent / value).read_text()) if isinstance(value, str) else value


def built(path: Path, *args: str) -> LightningCLI:
    """The CLI's trainer, model and data for ``path`` and ``args``, instantiated, not run; then what ``fit`` does
    before its first step: the data prepared and set up, the values it determines given to the model, the model
    built (``configure_model``: layers, heads, metrics, attention switched)."""
    run = cli.make_cli(["--config", str(path), *args], run=False)
    run.datamodule.prepare_data()
    run.datamodule.setup("fit")
    run.model.check_data(run.datamodule)
    run.model.configure_model()
    assert run.model.built
    return run


def runs_activation(module: nn.Module, spec) -> bool:
    """Whether ``module`` has switched attention and all of it runs the activation ``spec`` names."""
    switched = attention_modules(module)
    return bool(switched) and all(get_activation(m.activation_spec) == get_activation(spec) for _, m in switched)


def named_pieces(folder: Path) -> set[Path]:
    """Every YAML file a YAML file under ``folder`` names (resolved), each checked to exist. A piece is parsed only
    through the files that name them, so a test asserts that its pieces are all among these."""
    named = set()
    for path in folder.rglob("*.yaml"):
        named |= {(path.parent / name).resolve() for name in yaml_references(yaml.safe_load(path.read_text()))}
    missing = sorted(str(ref) for ref in named if not ref.is_file())
    assert not missing, f"named but missing: {missing}"
    return named


def fit(*args: str):
    """Run ``fit`` through the CLI without a progress bar; returns it for its trainer, model and data."""
    return cli.make_cli(["fit", *args, "--trainer.enable_progress_bar", "false"])


def cpu_trainer(**overrides: Any) -> pl.Trainer:
    """A quiet, deterministic CPU trainer with the project's checkpoint IO; ``overrides`` win."""
    settings: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        deterministic=True,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        plugins=[SafeCheckpointIO()],
    )
    settings.update(overrides)
    return pl.Trainer(**settings)


class Killed(Exception):
    """Stands for the job being preempted."""


class KillAt(Callback):
    """Raises :class:`Killed` before optimizer step ``step`` (None: never), as a preemption would stop the run."""

    def __init__(self, step: int | None):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            raise Killed


class SlowStep(Callback):
    """Sleeps ``seconds`` in the backward of optimizer step ``step`` (1-based): one step that runs long, inside the
    step's hooks (so a heartbeat has a step to report)."""

    def __init__(self, step: int, seconds: float):
        self.step, self.seconds = step, seconds

    def on_after_backward(self, trainer, pl_module) -> None:
        if trainer.global_step + 1 == self.step:
            time.sleep(self.seconds)


def write_jpeg(path: Path, seed: int, size: int = 24) -> Path:
    """A random-noise RGB JPEG; its mean colour depends on ``seed`` so files differ."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path, format="JPEG")
    return path
