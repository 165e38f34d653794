"""The C++ kernels' build is keyed by content and environment: one build per source version, machine and
environment (torch install, interpreter), wherever the sources lie."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from polyattn_lightning.attention.kernels.base import cpp

CAPABILITY = "AVX2"


def _copy(tmp_path, name):
    target = tmp_path / name
    shutil.copytree(cpp.CSRC, target, ignore=shutil.ignore_patterns("__pycache__"))
    return target


def test_build_name_follows_content_not_location(tmp_path):
    a, b = _copy(tmp_path, "a"), _copy(tmp_path, "b")
    assert cpp.build_name(a, CAPABILITY) == cpp.build_name(b, CAPABILITY) == cpp.build_name(cpp.CSRC, CAPABILITY)
    assert cpp.build_name(a, CAPABILITY) != cpp.build_name(a, "AVX512")  # other flags, other build
    with open(b / "common.h", "a") as header:  # a header counts like a source
        header.write("// changed\n")
    assert cpp.build_name(b, CAPABILITY) != cpp.build_name(a, CAPABILITY)
    (a / "common.h").unlink()  # an install missing a file never names the complete build
    assert cpp.build_name(a, CAPABILITY) not in (cpp.build_name(b, CAPABILITY), cpp.build_name(cpp.CSRC, CAPABILITY))


def test_build_name_follows_the_environment():
    """Two virtual environments with the same torch version but their own install paths (include directories)
    or interpreter ABI get two builds; one environment's calls agree with each other and with the default."""
    venv_a = ["/venv_a/lib/python3.11/site-packages/torch/include", "/usr/include/python3.11"]
    venv_b = ["/venv_b/lib/python3.11/site-packages/torch/include", "/usr/include/python3.11"]
    abi = cpp.interpreter_abi()
    first, again = cpp.build_name(cpp.CSRC, CAPABILITY, venv_a, abi), cpp.build_name(cpp.CSRC, CAPABILITY, venv_a, abi)
    assert first == again
    assert cpp.build_name(cpp.CSRC, CAPABILITY, venv_b, abi) != first
    assert cpp.build_name(cpp.CSRC, CAPABILITY, venv_a, abi.replace("311", "312")) != first
    here = cpp.include_dirs()
    assert any(path.startswith(str(Path(torch.__file__).parent)) for path in here)  # torch's install path
    assert cpp.build_name(cpp.CSRC, CAPABILITY) == cpp.build_name(cpp.CSRC, CAPABILITY, here, abi)


def test_missing_source_raises_instead_of_loading_a_cached_build(tmp_path):
    broken = _copy(tmp_path, "broken")
    (broken / "associative_cpu.cpp").unlink()
    with pytest.raises(FileNotFoundError, match="associative_cpu.cpp"):
        cpp.build(broken)


def test_same_sources_in_two_locations_build_once(tmp_path):
    """The second location loads the first one's binary: same directory, the library not rewritten.

    In a subprocess: a process can load only one version of the ``polyattn_cpu`` ops. It compiles only
    when no test before it built the current sources (the build directory is shared).
    """
    a, b = _copy(tmp_path, "a"), _copy(tmp_path, "b")
    script = textwrap.dedent(f"""
        from pathlib import Path
        from polyattn_lightning.attention.kernels.base import cpp
        first = cpp.build(Path({str(a)!r}))
        [library] = first.glob("*.so")
        stamp = library.stat().st_mtime_ns
        second = cpp.build(Path({str(b)!r}))
        assert second == first, (first, second)
        assert library.stat().st_mtime_ns == stamp, "the second location recompiled"
        assert first.name.startswith("polyattn_cpu_"), first
        print("BUILT ONCE", first)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=900,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0 and "BUILT ONCE" in result.stdout, result.stdout[-2000:] + result.stderr[-3000:]
