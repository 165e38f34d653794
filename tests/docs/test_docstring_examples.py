"""Every main entry point's docstring holds a short example, and each example runs as written (doctest)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from docstring_examples import ENTRY_POINTS, run

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    """The examples of every entry point, run in one fresh process (about half a minute: they build small models)."""
    out = tmp_path_factory.mktemp("examples") / "results.json"
    print("running the docstring examples of the entry points in a subprocess (about half a minute)", flush=True)
    done = subprocess.run([sys.executable, str(HERE / "docstring_examples.py"), str(out)], capture_output=True,
                          text=True, cwd=HERE.parents[1], env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_the_entry_point_has_an_example_that_runs(results, name):
    found = results[name]
    assert found["examples"] >= 2, f"{name}: its docstring has no example (>>> lines) to run"
    assert found["failed"] == 0, f"{name}: an example fails:\n{found['output']}"


def test_a_wrong_example_fails():
    def documented():
        """Doubles.

        >>> 2 * 2
        5
        """

    found = run(documented, "documented")
    assert (found["examples"], found["failed"]) == (1, 1)
    assert "Expected:\n    5\nGot:\n    4" in found["output"]
