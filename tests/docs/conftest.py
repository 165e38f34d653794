"""The documentation site, built once per test session with the strict build the README gives."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
sys.path.insert(0, str(DOCS / "_ext"))  # public_api: the public names the site and these tests read


@dataclass
class Site:
    html: Path
    returncode: int
    output: str

    def warnings(self) -> list[str]:
        return [line for line in self.output.splitlines() if "WARNING" in line or "ERROR" in line]


@pytest.fixture(scope="session")
def site(tmp_path_factory) -> Site:
    """``sphinx-build -W --keep-going -n`` of ``docs/`` into a fresh folder (about a minute on 2 cores)."""
    out = tmp_path_factory.mktemp("docs")
    html, doctrees = out / "html", out / "doctrees"
    print(f"building the documentation site into {html} (about a minute)", flush=True)
    done = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-n", "-q", "-b", "html", "-d", str(doctrees),
         str(DOCS), str(html)],
        capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    return Site(html, done.returncode, done.stdout + done.stderr)
