"""The private SLURM of ``slurm_cluster.py`` as a test sees it through the ``slurm`` fixture: client commands run
without arguments of their own reach it, and a job it starts runs this interpreter on this checkout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from slurm_cluster import NODE, PARTITION, ROOT

pytestmark = pytest.mark.slow

PROBE = (
    "import importlib.util, os, sys; "
    "print(sys.executable, sys.prefix, importlib.util.find_spec('polyattn_lightning').origin, "
    "os.environ['SLURM_JOB_ID'])"
)


def test_client_commands_and_jobs_use_the_private_cluster_and_this_environment(slurm, tmp_path):
    assert os.environ["SLURM_CONF"] == str(slurm.conf)
    node = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %P %c"], capture_output=True, text=True, check=True)
    assert node.stdout.split() == [NODE, f"{PARTITION}*", str(slurm.cpus)]

    # run outside the checkout, whose folder python -c would put first on sys.path
    job = subprocess.run(
        ["srun", "--ntasks", "1", "python", "-c", PROBE],
        check=False,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert job.returncode == 0, job.stderr
    executable, prefix, package, job_id = job.stdout.split()
    # this environment's interpreter: ``python`` from its scripts folder (the test may run as ``python3``)
    assert Path(executable).parent == Path(sys.executable).parent and prefix == sys.prefix
    assert package == str(ROOT / "polyattn_lightning" / "__init__.py")
    assert slurm.wait_for_job(job_id)["JobState"] == "COMPLETED"
