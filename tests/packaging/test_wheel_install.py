"""Install the package as a user does (a built wheel, not the editable checkout) and run the C++ kernels from it.

The wheel goes into a fresh virtual environment that sees the test
environment's installed dependencies through a ``.pth`` file (``--no-deps``:
nothing is downloaded) but not its editable install of this checkout (that
finder is a ``.pth`` hook of the test environment's own site directory, which
a path listed in a ``.pth`` file does not run). The kernels then compile from
the installed ``csrc/`` into a private ``TORCH_EXTENSIONS_DIR`` and are checked
against the plain-PyTorch reference.
"""
from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
REFERENCE = ROOT / "tests" / "attention" / "attention_reference.py"

CHILD = r'''
import sys, warnings
from pathlib import Path
import torch
warnings.simplefilter("error")  # a kernel that fails to build warns and falls back: make that fail the test
import polyattn_lightning
from polyattn_lightning.attention import attention
from polyattn_lightning.attention.kernels.base import cpp
from attention_reference import make_qkv, reference_attention

venv_root = Path(sys.argv[1]).resolve()
installed = Path(polyattn_lightning.__file__).resolve()
assert venv_root in installed.parents, f"imported {installed}, not the wheel installed in {venv_root}"
assert all(venv_root in path.resolve().parents for path in cpp.SOURCES), cpp.SOURCES
assert cpp.load(), "the C++ kernels did not load"
q, k, v = make_qkv(B=2, H=2, Nq=37, Nk=29, d=8, dv=8, dtype=torch.float32)
keep = torch.rand(2, 1, 37, 29, generator=torch.Generator().manual_seed(1)) > 0.3
for name, mask in (("poly3", keep), ("relu", keep), ("poly1", None)):
    kernel = "associative" if name == "poly1" else "fused_cpu"
    out = attention(q, k, v, name, attn_mask=mask, kernel=kernel)
    expected = reference_attention(q, k, v, name, keep=mask)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    got = torch.autograd.grad(out.square().sum(), (q, k, v))
    want = torch.autograd.grad(expected.square().sum(), (q, k, v))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-3, atol=1e-3)
ops = [op for op in ("forward", "backward", "associative_forward") if hasattr(torch.ops.polyattn_cpu, op)]
print("KERNELS OK", installed, ops)
'''


def _run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, **kwargs)
    assert result.returncode == 0, f"{command}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def test_wheel_ships_every_kernel_source():
    """Fast part: what ``package-data`` must cover, read from the source tree (the slow test checks a real wheel)."""
    import tomllib

    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    patterns = data["polyattn_lightning.attention.kernels"]
    csrc = ROOT / "polyattn_lightning" / "attention" / "kernels" / "csrc"
    shipped = {path for pattern in patterns for path in csrc.parent.glob(pattern)}
    assert set(csrc.iterdir()) - {csrc / "__pycache__"} <= shipped


def test_wheel_ships_every_config():
    """The benches' defaults (and the experiments) come with a wheel: ``polyattn_lightning/configs`` is ``configs/``."""
    import tomllib

    from polyattn_lightning.bench import CONFIGS

    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["polyattn_lightning"]
    assert CONFIGS.resolve() == (ROOT / "configs").resolve()
    shipped = {path.resolve() for pattern in patterns for path in CONFIGS.parent.glob(pattern)}
    assert {path.resolve() for path in (ROOT / "configs").rglob("*") if path.is_file()} <= shipped


@pytest.mark.slow
def test_installed_wheel_builds_and_runs_the_cpp_kernels(tmp_path):
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.fail("no C++ compiler on this machine: the kernels cannot be built (install g++)")
    # 1. the wheel, built from a copy of the checkout (so no build/ or egg-info lands in the working tree)
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", "__pycache__", "*.egg-info", "build", "dist", "runs", "data", "tests", ".*"))
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
          "-w", str(tmp_path / "dist"), str(source)], cwd=tmp_path)
    [wheel] = (tmp_path / "dist").glob("polyattn_lightning-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    csrc = sorted(p.name for p in (ROOT / "polyattn_lightning" / "attention" / "kernels" / "csrc").iterdir() if p.is_file())
    missing = [name for name in csrc if f"polyattn_lightning/attention/kernels/csrc/{name}" not in names]
    assert not missing, f"the wheel lacks kernel sources {missing}"
    assert "polyattn_lightning/configs/detection/model/mask_rcnn_xcit_s12_p16_fpn.yaml" in names  # bench detection's
    assert "polyattn_lightning/configs/classification/quickstart.yaml" in names  # bench diagnostics' default
    assert "polyattn_lightning/attention/switch/reviewed.json" in names  # the switches' fingerprints

    # 2. a fresh venv that sees the test environment's dependencies but not its editable install
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    [env_site] = _run([str(python), "-c", "import site; print(site.getsitepackages()[0])"]).stdout.split()
    (Path(env_site) / "_test_dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)])

    # 3. compile and run the kernels from the installed copy, from a directory outside the checkout
    work = tmp_path / "run"
    work.mkdir()
    shutil.copy(REFERENCE, work)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "POLYATTN_FUSED_CPU")}
    env.update(TORCH_EXTENSIONS_DIR=str(tmp_path / "extensions"), OMP_NUM_THREADS="1")
    result = _run([str(python), "-c", CHILD, str(env_dir)], cwd=work, env=env)
    assert "KERNELS OK" in result.stdout
