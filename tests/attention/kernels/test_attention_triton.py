"""Runs ``interpreted_triton_cases.py`` in a subprocess with ``TRITON_INTERPRET=1`` (Triton's CPU interpreter)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_triton_kernel_under_the_interpreter():
    cases = Path(__file__).with_name("interpreted_triton_cases.py")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(cases)],
        env=env, capture_output=True, text=True, timeout=1800,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout
