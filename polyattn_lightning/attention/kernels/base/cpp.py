"""Build and load the C++ CPU kernels in ``csrc/`` (``torch.ops.polyattn_cpu``).

The sources are compiled by ``torch.utils.cpp_extension`` (gcc and ninja) into
``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``) the first
time a process needs them, then loaded from there. The build takes seconds on an idle machine and a minute or
more on a busy one (docs/benchmarks/kernels-cpu.md, "Building the C++ kernels"). It talks
(:class:`~polyattn_lightning.waits.Wait`): a line when it starts saying why it takes time, the elapsed time in
place on a terminal, a line every 10 s in the run's log, and the
time it took.

The build is keyed by content and environment: its name holds the CPU's vector
extensions (so nodes of different CPU generations sharing a home directory
never load each other's binaries) and a hash of every file in ``csrc/``
(sources and headers), the compiler flags, the torch version, the include
directories (torch's install path and the interpreter's headers) and the
interpreter's ABI. torch's build step compares its ``build.ninja`` (which
names those paths) with the last one in the folder and recompiles when they
differ, so two virtual environments sharing one folder would rebuild each
other's kernels at every alternation: each environment gets a folder of its
own. The files are copied into the build directory and compiled from there, so
two checkouts of the same sources in one environment share one build, a changed
file gets a new build, and an install missing a file can never be satisfied
from the cache. Where the build fails (no compiler), a warning says why and the
PyTorch implementations run instead; ``POLYATTN_FUSED_CPU=0`` turns the C++
kernels off.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import os
import re
import shutil
import sys
import sysconfig
import warnings
from pathlib import Path

import torch

from ....waits import Wait

CSRC = Path(__file__).parents[1] / "csrc"
#: The translation units; every ``*.cpp`` / ``*.h`` in ``csrc/`` also goes into the build key.
SOURCE_NAMES = ("fused_cpu.cpp", "associative_cpu.cpp", "power_cpu.cpp")
SOURCES = [CSRC / name for name in SOURCE_NAMES]
#: Compiler flags per ``torch.backends.cpu.get_cpu_capability()``: the instruction set, and the
#: macros that select the matching ``at::vec::Vectorized`` (SIMD exp and log1p for softplus/sigmoid).
_VECTOR_FLAGS = {
    "AVX512": [
        "-mavx512f",
        "-mavx512dq",
        "-mavx512vl",
        "-mavx512bw",
        "-mfma",
        "-DCPU_CAPABILITY=AVX512",
        "-DCPU_CAPABILITY_AVX512",
    ],
    "AVX2": ["-mavx2", "-mfma", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
}
_PORTABLE_FLAGS = ["-DCPU_CAPABILITY=DEFAULT"]


def cflags(capability: str) -> list[str]:
    return ["-O3", "-fopenmp", *_VECTOR_FLAGS.get(capability, _PORTABLE_FLAGS)]


def kernel_files(csrc: Path) -> list[Path]:
    """Every file a build reads: the sources and the headers they include."""
    return sorted(path for path in csrc.iterdir() if path.suffix in (".cpp", ".h"))


def include_dirs() -> list[str]:
    """The header folders a build compiles against: torch's (its install path) and the interpreter's."""
    return [*_import_cpp_extension().include_paths(), sysconfig.get_paths()["include"]]


def interpreter_abi() -> str:
    """What makes a compiled module of one interpreter unloadable by another: its extension suffix
    (implementation, version, platform), ABI flags and torch's C++ ABI."""
    return f"{sysconfig.get_config_var('EXT_SUFFIX')} {sys.abiflags} cxx11abi={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"


def build_name(csrc: Path, capability: str, includes: list[str] | None = None, abi: str | None = None) -> str:
    """``polyattn_cpu_<isa>_<hash>``: the hash covers every kernel file's name and bytes, the flags, torch's
    version, the include directories (:func:`include_dirs` when None) and the ABI (:func:`interpreter_abi`)."""
    digest = hashlib.sha256()
    for path in kernel_files(csrc):
        digest.update(f"{path.name}\0{path.stat().st_size}\0".encode())
        digest.update(path.read_bytes())
    includes = include_dirs() if includes is None else includes
    abi = interpreter_abi() if abi is None else abi
    digest.update("\0".join([*cflags(capability), torch.__version__, *includes, abi]).encode())
    isa = re.sub(r"\W", "_", capability.lower())
    return f"polyattn_cpu_{isa}_{digest.hexdigest()[:16]}"


_loaded: dict[str, str] = {}  # the build this process loaded


def build(csrc: Path = CSRC) -> Path:
    """Compile (unless a build of the same content exists) and load the kernels in ``csrc``; the build directory.

    Raises whatever the compiler or loader raises.
    """
    cpp_extension = _import_cpp_extension()
    missing = [name for name in SOURCE_NAMES if not (csrc / name).exists()]
    if missing:
        raise FileNotFoundError(f"kernel sources {missing} are missing from {csrc}")
    _put_ninja_on_path()
    capability = torch.backends.cpu.get_cpu_capability()
    name = build_name(csrc, capability)
    if _loaded.get("name", name) != name:  # a second TORCH_LIBRARY polyattn_cpu would abort the process
        raise RuntimeError(
            f"kernel build {_loaded['name']} is loaded in this process; {name} (other sources) cannot be"
        )
    directory = Path(cpp_extension._get_build_directory(name, verbose=False))
    source_dir = directory / "src"
    source_dir.mkdir(parents=True, exist_ok=True)
    for path in kernel_files(csrc):  # compile from the build's own copy: the same paths for every checkout
        target = source_dir / path.name
        if not target.exists() or target.read_bytes() != path.read_bytes():
            partial = target.with_suffix(f"{target.suffix}.{os.getpid()}.tmp")
            shutil.copyfile(path, partial)
            os.replace(partial, target)
    built = (directory / f"{name}.so").exists()
    wait = Wait(  # the one pause a user would otherwise wonder about
        "compiling the C++ attention kernels for this CPU",
        f"gcc compiles {len(SOURCE_NAMES)} sources against torch's headers: about 15 s, minutes when the CPU is "
        f"busy (once per environment; cached in {directory})",
    )
    with contextlib.nullcontext() if built else wait:
        cpp_extension.load(
            name=name,
            sources=[str(source_dir / source) for source in SOURCE_NAMES],
            extra_cflags=cflags(capability),
            build_directory=str(directory),
            is_python_module=False,
        )
    if not _loaded:
        _register_fakes()
    _loaded["name"] = name
    return directory


def _register_fakes() -> None:
    """Output shapes of the C++ ops for ``torch.compile``'s fake tensors, so a compiled model traces through
    them without a graph break (the autograd Functions around them keep their once-differentiable backward)."""

    def forward(q, k, v, *args):
        return q.new_empty(q.shape[0], q.shape[1], v.shape[2])

    def backward(q, k, v, dout, row_shift, bias, allowed, key_lengths, bias_grad, *args):
        # dbias is laid out like the bias's storage: the span of its (broadcast, stride-0) view
        span = 1 + sum((size - 1) * stride for size, stride in zip(bias.shape, bias.stride())) if bias_grad else 0
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), q.new_empty(span)

    def decode(q, k, v, *args):  # (B, H, R, dv) over (B, R, H, dv) memory, as the op returns it
        return v.new_empty(q.shape[0], q.shape[2], q.shape[1], v.shape[3]).transpose(1, 2)

    def associative_forward(q, k, v, keep, s):
        return q.new_empty(q.shape[0], q.shape[1], v.shape[2]), q.new_empty(q.shape[0], q.shape[2], v.shape[2])

    def associative_backward(q, k, v, *args):  # also the causal one's: (dq, dk, dv)
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def power_forward(q, k, v, keep, s, power, groups, *args):
        features = math.comb(q.shape[2] + power - 1, power)
        return q.new_empty(q.shape[0], q.shape[1], v.shape[2]), q.new_empty(k.shape[0], features, v.shape[2])

    def power_causal_forward(q, k, v, keep, s, power, groups, offset, chunk, initial, final_state):
        out, state = power_forward(q, k, v, keep, s, power, groups)
        return out, state if final_state else q.new_empty(0)

    def power_decode(q, k, v, *args):
        return q.new_empty(q.shape[0], 1, v.shape[2])

    for name, fake in [
        ("forward", forward),
        ("backward", backward),
        ("decode", decode),
        ("associative_forward", associative_forward),
        ("associative_backward", associative_backward),
        ("associative_causal_forward", forward),
        ("associative_causal_backward", associative_backward),
        ("power_forward", power_forward),
        ("power_backward", associative_backward),
        ("power_causal_forward", power_causal_forward),
        ("power_causal_backward", associative_backward),
        ("power_decode", power_decode),
    ]:
        torch.library.register_fake(f"polyattn_cpu::{name}", fake)


@torch.compiler.assume_constant_result
def load() -> bool:
    """Build (once per machine and source version) and load the kernels; False where that is impossible.

    A constant for ``torch.compile``: decided once, when first traced or called, never inside a graph.
    """
    return _load()


@functools.cache
def _load() -> bool:
    if os.environ.get("POLYATTN_FUSED_CPU", "1") == "0":
        return False
    try:
        build()
    except Exception as error:  # no compiler, no BLAS symbols, ...: the PyTorch kernels still work
        warnings.warn(
            f"the C++ attention kernels ({', '.join(SOURCE_NAMES)}) could not be built or loaded "
            f"({type(error).__name__}: {error}); non-softmax attention on CPU falls back to the slower "
            "PyTorch kernels. Set POLYATTN_FUSED_CPU=0 to silence this.",
            stacklevel=3,
        )
        return False
    return True


def _import_cpp_extension():
    """``torch.utils.cpp_extension`` without the ``No CUDA runtime is found, using CUDA_HOME=...`` warning it logs
    when imported on a machine with a CUDA toolkit but no GPU: these kernels are CPU code and never use CUDA_HOME."""
    import logging

    log = logging.getLogger("torch.utils.cpp_extension")
    disabled, log.disabled = log.disabled, True
    try:
        from torch.utils import cpp_extension
    finally:
        log.disabled = disabled
    return cpp_extension


def _put_ninja_on_path() -> None:
    """``cpp_extension`` runs ``ninja`` from PATH; the PyPI package's binary may sit in an unactivated venv."""
    if shutil.which("ninja") is None:
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
