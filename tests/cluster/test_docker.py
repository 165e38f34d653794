"""docker/check.sh where a Docker engine runs: opt-in (``pytest -m docker``), never in the default run.

The script builds the image (GBs) and runs the quickstart, a 2-process DDP job and a 2-node job killed
and resumed in fresh containers, comparing the final checkpoints bit for bit. ``POLYATTN_DOCKER_BASE``
names the base image (default: the Dockerfile's, the official PyTorch image; without a registry build one
with docker/make_base.sh), ``POLYATTN_DOCKER_CA_CERTS`` a folder of extra CA certificates for the build.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.docker, pytest.mark.slow]
CHECK = Path(__file__).parents[2] / "docker" / "check.sh"


def test_docker_check_builds_and_runs_the_image(tmp_path):
    if shutil.which("docker") is None or subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        pytest.fail("pytest -m docker needs a running Docker engine (docker info failed)")
    options = []
    for option, variable in (("--base", "POLYATTN_DOCKER_BASE"), ("--ca-certs", "POLYATTN_DOCKER_CA_CERTS")):
        if variable in os.environ:
            options += [option, os.environ[variable]]
    proc = subprocess.run([CHECK, *options, "--work", tmp_path], capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "bitwise equal" in proc.stdout and "all checks passed" in proc.stdout
