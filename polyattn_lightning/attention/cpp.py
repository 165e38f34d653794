"""Build and load the C++ CPU kernels in ``csrc/`` (``torch.ops.polyattn_cpu``).

The sources are compiled by ``torch.utils.cpp_extension`` (gcc and ninja) into
``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``) the first
time a process needs them, some 15 s, then loaded from there. The build is
named after the CPU's vector extensions, so nodes of different CPU generations
that share a home directory never load each other's binaries. Where the build
fails (no compiler), a warning says why and the PyTorch implementations run
instead; ``POLYATTN_FUSED_CPU=0`` turns the C++ kernels off.
"""
from __future__ import annotations

import functools
import os
import re
import shutil
import warnings
from pathlib import Path

import torch

SOURCES = [Path(__file__).parent / "csrc" / name for name in ("fused_cpu.cpp", "associative_cpu.cpp")]
#: Compiler flags per ``torch.backends.cpu.get_cpu_capability()``: the instruction set, and the
#: macros that select the matching ``at::vec::Vectorized`` (SIMD exp and log1p for softplus/sigmoid).
_VECTOR_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bw", "-mfma",
               "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"],
    "AVX2": ["-mavx2", "-mfma", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
}
_PORTABLE_FLAGS = ["-DCPU_CAPABILITY=DEFAULT"]


@functools.cache
def load() -> bool:
    """Compile (once per machine and source version) and load the kernels; False where that is impossible."""
    if os.environ.get("POLYATTN_FUSED_CPU", "1") == "0":
        return False
    capability = torch.backends.cpu.get_cpu_capability()
    try:
        _put_ninja_on_path()
        from torch.utils import cpp_extension

        cpp_extension.load(
            name="polyattn_cpu_" + re.sub(r"\W", "_", capability.lower()),
            sources=[str(path) for path in SOURCES],
            extra_cflags=["-O3", "-fopenmp", *_VECTOR_FLAGS.get(capability, _PORTABLE_FLAGS)],
            is_python_module=False,
        )
    except Exception as error:  # no compiler, no BLAS symbols, ...: the PyTorch kernels still work
        warnings.warn(
            f"the C++ attention kernels ({', '.join(path.name for path in SOURCES)}) could not be built or "
            f"loaded ({type(error).__name__}: {error}); non-softmax attention on CPU falls back to the slower "
            "PyTorch kernels. Set POLYATTN_FUSED_CPU=0 to silence this.",
            stacklevel=3,
        )
        return False
    return True


def _put_ninja_on_path() -> None:
    """``cpp_extension`` runs ``ninja`` from PATH; the PyPI package's binary may sit in an unactivated venv."""
    if shutil.which("ninja") is None:
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
