"""The Docker image, SLURM script and torchrun script agree with the project they launch.

No Docker engine runs in CI, so the Dockerfile is read and checked against
pyproject.toml and the CLI; so is the sbatch script, in seconds and for the
GPU nodes it asks for (its real runs on SLURM: test_slurm_jobs.py); the torchrun
script really runs (2 CPU processes).
"""
from __future__ import annotations

import os
import re
import shlex
import socket
import sys
import subprocess
import tomllib
from datetime import timedelta
from pathlib import Path
from string import Template

import pytest
from lightning.pytorch.strategies import DDPStrategy
from packaging.requirements import Requirement

from polyattn_lightning.cli import make_cli

ROOT = Path(__file__).parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
QUICKSTART = ROOT / "configs" / "classification" / "quickstart.yaml"


def logical_lines(path: Path) -> list[str]:
    """The file's lines with comments dropped and backslash-continued lines joined."""
    lines = [line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")]
    return [line.strip() for line in re.sub(r"\\\n", " ", "\n".join(lines)).splitlines() if line.strip()]


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs."""
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in logical_lines(ROOT / "docker" / "Dockerfile")]


def instructions(name: str) -> list[str]:
    return [args for instruction, args in dockerfile() if instruction == name]


def test_docker_base_is_a_cuda_runtime_with_a_torch_pyproject_accepts():
    [default_base] = [args.split("=", 1)[1] for args in instructions("ARG") if args.startswith("BASE_IMAGE=")]
    assert instructions("FROM") == ["${BASE_IMAGE}"]
    match = re.fullmatch(r"pytorch/pytorch:(?P<torch>[\d.]+)-cuda[\d.]+-cudnn\d+-runtime", default_base)
    assert match, default_base
    [torch_requirement] = [Requirement(r) for r in PYPROJECT["dependencies"] if Requirement(r).name == "torch"]
    assert torch_requirement.specifier.contains(match["torch"])


def test_docker_installs_this_package_with_extras_pyproject_defines():
    labels = dict(re.findall(r'([\w.]+)="([^"]*)"', " ".join(instructions("LABEL"))))
    assert labels["org.opencontainers.image.title"] == PYPROJECT["name"]
    assert labels["org.opencontainers.image.version"] == PYPROJECT["version"]
    install = " ".join(instructions("RUN"))
    [extras] = re.findall(r'"/opt/polyattn_lightning\[([\w,-]+)\]"', install)
    assert set(extras.split(",")) == {"detection", "lra"} <= set(PYPROJECT["optional-dependencies"])
    assert f"pip show {PYPROJECT['name']}" in install


def test_docker_runs_the_lightning_entry_point_as_a_non_root_user():
    assert instructions("ENTRYPOINT") == ['["lightning"]']
    assert "lightning" in PYPROJECT["scripts"]
    [user] = instructions("USER")
    assert user not in ("root", "0")
    assert instructions("WORKDIR") == ["/workspace"]


def test_docker_copies_only_code_and_configs():
    copied = set()
    for args in instructions("COPY"):
        *sources, _destination = [token for token in shlex.split(args) if not token.startswith("--")]
        copied.update(sources)
    assert copied == {"pyproject.toml", "README.md", "polyattn_lightning", "configs", "docker/ca-certificates/"}
    assert all((ROOT / name).exists() for name in copied)
    assert not instructions("ADD")
    # the build context excludes everything but what is copied: no data, checkpoints or .git can slip in
    rules = [line for line in (ROOT / ".dockerignore").read_text().splitlines() if line and not line.startswith("#")]
    assert rules[0] == "**"
    assert {rule[1:].rstrip("/") for rule in rules if rule.startswith("!")} == {name.rstrip("/") for name in copied}


def test_extra_ca_certificates_come_from_a_folder_git_ignores():
    """The build trusts docker/ca-certificates/*.crt (a proxy's CA), and the repository holds none of them."""
    folder = ROOT / "docker" / "ca-certificates"
    ignore = (folder / ".gitignore").read_text().split()
    assert "*" in ignore and {"!.gitignore", "!README.md"} <= set(ignore)
    tracked = subprocess.run(["git", "ls-files", str(folder)], cwd=ROOT, capture_output=True, text=True, check=True)
    assert sorted(Path(line).name for line in tracked.stdout.split()) in ([], [".gitignore", "README.md"])
    install = " ".join(instructions("RUN"))
    assert "update-ca-certificates" in install and "PIP_CERT=/etc/ssl/certs/ca-certificates.crt pip install" in install


def test_docker_copies_everything_the_package_install_reads():
    """``pip install /opt/polyattn_lightning`` reads pyproject's readme, the packages and their package data
    (the kernels' csrc/*.cpp and *.h): each must lie under a path a COPY brings into /opt/polyattn_lightning."""
    copied = {}
    for args in instructions("COPY"):
        *sources, destination = [token for token in shlex.split(args) if not token.startswith("--")]
        copied.update({source: destination for source in sources})
    into_opt = {source for source, destination in copied.items() if destination.startswith("/opt/polyattn_lightning")}
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    needed = {PYPROJECT["readme"], "pyproject.toml"}
    for package, patterns in setuptools["package-data"].items():
        folder = ROOT.joinpath(*package.split("."))
        files = [path for pattern in patterns for path in folder.glob(pattern)]
        assert files, f"package-data {package}: {patterns} match no file"
        needed.update(str(path.relative_to(ROOT)) for path in files)
    for include in setuptools["packages"]["find"]["include"]:
        needed.update(path.name for path in ROOT.glob(include) if (path / "__init__.py").exists())
    uncovered = [path for path in needed if not any(path == s or path.startswith(s.rstrip("/") + "/") for s in into_opt)]
    assert not uncovered, f"the image's pip install needs {uncovered}, which no COPY brings in"


def test_slurm_script_asks_for_one_task_per_device_and_requeue_signal():
    script = (ROOT / "scripts" / "slurm" / "train.sbatch").read_text()
    sbatch = dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?", script, re.MULTILINE))
    assert sbatch["ntasks-per-node"] == sbatch["gpus-per-node"]
    assert sbatch["signal"] == "SIGUSR1@90" and "requeue" in sbatch
    # the srun line, with SLURM's variables as this script sets them, is a command line the CLI accepts
    [launch] = [line for line in logical_lines(ROOT / "scripts" / "slurm" / "train.sbatch") if line.startswith("srun ")]
    slurm = {"config": str(QUICKSTART), "SLURM_NTASKS_PER_NODE": sbatch["ntasks-per-node"],
             "SLURM_JOB_NUM_NODES": sbatch["nodes"], "SLURM_JOB_ID": "42", "run_dir": "runs/slurm-42"}
    command = [Template(token).substitute(slurm) for token in shlex.split(launch) if token not in ("$@", "${resume[@]}")]
    # a task that dies ends the others at once (srun's default lets them wait in a collective)
    assert command[:4] == ["srun", "--kill-on-bad-exit=1", "lightning", "fit"] and "lightning" in PYPROJECT["scripts"]
    trainer = make_cli([*command[4:], "--trainer.accelerator", "cpu"], run=False).trainer
    assert (trainer.num_devices, trainer.num_nodes) == (8, 2)
    assert isinstance(trainer.strategy, DDPStrategy) and trainer.strategy._timeout == timedelta(minutes=5)
    assert any(type(callback).__name__ == "StopOnSignal" for callback in trainer.callbacks)
    assert trainer.logger.log_dir == "runs/classification/quickstart/slurm-42"  # where the resume below looks


@pytest.mark.slow
def test_torchrun_script_trains_with_two_processes(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "GPUS": "2", "MASTER_PORT": str(port), "PYTHON": sys.executable}  # no activated venv needed
    proc = subprocess.run(
        [ROOT / "scripts" / "torchrun.sh", QUICKSTART, "--trainer.accelerator", "cpu", "--trainer.max_epochs", "1",
         "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "2", "--trainer.enable_progress_bar", "false"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Starting with 2 processes" in proc.stdout + proc.stderr
    assert list(tmp_path.rglob("last.ckpt"))


def test_slurm_script_resumes_from_the_newest_complete_checkpoint(tmp_path):
    """A requeued job (same id) passes --ckpt_path: the newer of its hpc checkpoint and last.ckpt, none at first."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')  # stand-in: prints the command it would run
    (bin_dir / "srun").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "42",
           "SLURM_NTASKS_PER_NODE": "8", "SLURM_JOB_NUM_NODES": "2"}

    def resumed_from() -> str | None:
        proc = subprocess.run(["bash", ROOT / "scripts" / "slurm" / "train.sbatch", QUICKSTART], cwd=tmp_path, env=env,
                              capture_output=True, text=True, check=True)
        args = proc.stdout.splitlines()
        return args[args.index("--ckpt_path") + 1] if "--ckpt_path" in args else None

    assert resumed_from() is None
    hpc = tmp_path / "runs" / "slurm-42" / "hpc_ckpt_3.ckpt"
    last = tmp_path / "runs" / "classification" / "quickstart" / "slurm-42" / "checkpoints" / "last.ckpt"
    for path, mtime in ((hpc, 1_000), (last, 2_000)):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"")
        os.utime(path, (mtime, mtime))
    assert resumed_from() == "runs/classification/quickstart/slurm-42/checkpoints/last.ckpt"  # killed after the last preemption
    os.utime(hpc, (3_000, 3_000))
    assert resumed_from() == "runs/slurm-42/hpc_ckpt_3.ckpt"
