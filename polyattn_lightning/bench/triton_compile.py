"""The Triton kernels compiled for a GPU that is not there: what a device would get, read from the compiler.

``triton.compile`` runs, for a target such as ``GPUTarget("cuda", 90, 32)``,
the pipeline the JIT runs at the first launch on that GPU. From its output:

* ``shared``: the shared memory a block needs (``metadata.shared``), what
  Triton compares with the device's limit before it raises ``OutOfResources``
  (``SHARED_LIMIT``: A100 166,912 B, H100/H200 232,448 B);
* the MMA kind of every product, from the TTGIR: ``wgmma`` (Hopper's
  ``warp_group_dot``), ``mma`` (``nvidia_mma`` version 2, A100's mma.sync) or
  ``fma`` (no tensor cores);
* registers, spills and stack per thread, from ``ptxas -v`` (the driver fills
  them in at load time, so they are not in the compile metadata; the ptxas
  shipped in the triton wheel reports them).

The launches are the ones ``triton_forward`` / ``triton_backward`` would make
(``forward_launches``, ``backward_launches``), built on meta tensors, so the
specialisation (alignment, ``== 1``) is the real one for those shapes.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import re
import subprocess
import tempfile
from typing import NamedTuple

import torch

from ..attention.registry import get_activation
from ..attention.kernels.triton import launch as tk

#: Shared memory per block a kernel may use (opt-in maximum), by compute capability.
SHARED_LIMIT = {80: 166_912, 90: 232_448}
#: The products of each kernel, in the order they appear in its code (the linear form's ``power_grad`` has one
#: one-hot scatter per coordinate of a monomial after ``y S^T``: :func:`products_of`).
PRODUCTS = {
    "forward": ("q k^T", "P V"),
    "backward_kv": ("q k^T", "P^T dO", "dO V^T", "dS^T q"),
    "backward_q": ("q k^T", "dO V^T", "dS k"),
    "power_state": ("m(x)^T y",),
    "power_apply": ("m(x) S",),
    "power_grad": ("y S^T", "scatter"),
}


def products_of(name: str, meta: dict) -> tuple[str, ...]:
    """The products of kernel ``name`` as launched with ``meta``."""
    if name == "power_grad":
        return ("y S^T", *(f"scatter {level + 1}" for level in range(meta["P"])))
    return PRODUCTS[name]


class Case(NamedTuple):
    """One configuration of the attention call: the three kernels are compiled for it."""

    form: str = "poly3"
    dtype: str = "bfloat16"
    d: int = 64
    n: int = 4096
    extras: bool = False  # mask + bias (with its gradient) + dropout
    causal: bool = False
    precision: str = "high"  # torch.get_float32_matmul_precision() while building the launches (fp32 inputs)
    table: str = "tuned"
    kernel: str = "quadratic"  # or "linear": the exact linear form's three programs (triton/power_op.py)


def _meta(*shape, dtype=torch.float32):
    return torch.empty(shape, dtype=dtype, device="meta")


def linear_launches(case: Case) -> list[tk.Launch]:
    """The linear form's programs on meta tensors (batch 2, 4 heads on 2 kv heads, ``d = dv``): the state of the
    keys, its reading by the queries and the gradient through the query features (dK's is the same program)."""
    from ..attention.kernels.base.state import device_monomials
    from ..attention.kernels.triton import power_op

    dtype = getattr(torch, case.dtype)
    p = int(case.form.removeprefix("poly"))
    heads, kv_heads, n, d = 8, 4, case.n, case.d
    D = math.comb(d + p - 1, p)
    tables = device_monomials(d, p, torch.device("meta"))
    q3, k3, v3 = _meta(heads, n, d, dtype=dtype), _meta(kv_heads, n, d, dtype=dtype), _meta(kv_heads, n, d, dtype=dtype)
    state, s = _meta(kv_heads, 1, D, d), _meta(heads, n)
    out, g, dq = _meta(heads, n, d), _meta(heads, n, d), _meta(heads, n, d)
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(case.precision)
    try:
        return [
            power_op.state_launch(k3, v3, state, tables, n, n, 1, True),
            power_op.apply_launch(q3, state, s, out, tables, n, n, 1, False, heads // kv_heads),
            power_op.grad_launch(q3, g, state, s, dq, tables, n, n, 1, False, heads // kv_heads),
        ]
    finally:
        torch.set_float32_matmul_precision(previous)


def case_launches(case: Case) -> list[tk.Launch]:
    """The three launches of ``case`` on meta tensors: batch 2, 4 heads, ``Nq = Nk = n``, ``d = dv``."""
    if case.kernel == "linear":
        return linear_launches(case)
    dtype = getattr(torch, case.dtype)
    batch, heads, n, d = 2, 4, case.n, case.d
    q3, k3, v3, out, do, dq, dk, dv = (_meta(batch * heads, n, d, dtype=dtype) for _ in range(8))
    c, shift = _meta(batch * heads, n), _meta(batch * heads, n)
    mask = _meta(batch, 1, n, n, dtype=torch.uint8) if case.extras else None
    bias = _meta(1, heads, n, n) if case.extras else None
    seed = _meta(1, dtype=torch.int64) if case.extras else None
    ds = _meta(batch * heads, n, n) if case.extras else dq
    p = 0.1 if case.extras else 0.0
    form, power = (int(x) for x in get_activation(case.form).fused_form)
    previous, table = torch.get_float32_matmul_precision(), os.environ.get("POLYATTN_TRITON_TABLE")
    torch.set_float32_matmul_precision(case.precision)
    os.environ["POLYATTN_TRITON_TABLE"] = case.table
    try:
        common = (c, shift, mask, bias, seed, heads, d**-0.5, form, power, p, 0 if case.causal else None)
        return tk.forward_launches(q3, k3, v3, out, *common) + tk.backward_launches(
            q3, k3, v3, do, dq, dk, dv, ds, *common, case.extras
        )
    finally:
        torch.set_float32_matmul_precision(previous)
        if table is None:
            del os.environ["POLYATTN_TRITON_TABLE"]
        else:
            os.environ["POLYATTN_TRITON_TABLE"] = table


def _source(launch: tk.Launch, backend):
    """The ``ASTSource`` and options the JIT would build for this launch (its own binder and packer)."""
    from triton.compiler import ASTSource
    from triton.runtime.jit import create_function_from_signature

    kernel = launch.kernel
    kwargs = {**launch.meta, "num_warps": launch.config.num_warps, "num_stages": launch.config.num_stages}
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return ASTSource(kernel, signature, constexprs, attrs), options


def mma_kinds(ttgir: str) -> list[str]:
    """The MMA kind of every product in a TTGIR module, in order: ``wgmma``, ``mma`` (v2) or ``fma``."""
    encodings = dict(re.findall(r"^(#mma\d*) = #ttg\.nvidia_mma<\{versionMajor = (\d+)", ttgir, re.M))
    kinds = []
    for line in ttgir.splitlines():
        if "ttng.warp_group_dot " in line:
            kinds.append("wgmma")
        elif re.search(r"= tt\.dot ", line):
            result = line.rsplit("->", 1)[-1]
            encoding = re.search(r"(#\w+)>", result)
            kinds.append("mma" if encoding and encodings.get(encoding.group(1)) == "2" else "fma")
    return kinds


_PTXAS = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads.*?Used (\d+) registers", re.S
)


def _ptxas_figures(log: str) -> dict:
    stack, stores, loads, registers = (int(x) for x in _PTXAS.search(log).groups())
    return {"registers": registers, "spill_stores": stores, "spill_loads": loads, "stack": stack}


def _run_ptxas(ptx: str, arch: int) -> str:
    import triton.backends.nvidia as nvidia

    ptxas = os.path.join(os.path.dirname(nvidia.__file__), "bin", "ptxas")
    with tempfile.TemporaryDirectory() as folder:
        source = os.path.join(folder, "k.ptx")
        with open(source, "w") as f:
            f.write(ptx)
        gpu = f"sm_{arch}a" if arch == 90 else f"sm_{arch}"
        result = subprocess.run(
            [ptxas, "-v", f"--gpu-name={gpu}", source, "-o", os.path.join(folder, "k.cubin")],
            capture_output=True,
            text=True,
            check=True,
        )
    return result.stdout + result.stderr


def compile_launch(launch: tk.Launch, arch: int) -> dict:
    """Compile one launch for ``sm_{arch}`` and read its figures."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    target = GPUTarget("cuda", arch, 32)
    source, options = _source(launch, make_backend(target))
    log = io.StringIO()
    previous = knobs.nvidia.dump_ptxas_log
    knobs.nvidia.dump_ptxas_log = True  # Triton runs ptxas -v anyway; this prints its log (on a cache miss)
    try:
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(source, target=target, options=options.__dict__)
    finally:
        knobs.nvidia.dump_ptxas_log = previous
    text = log.getvalue()
    if not _PTXAS.search(text):  # from Triton's cache: ptxas did not run
        text = _run_ptxas(compiled.asm["ptx"], arch)
    name = launch.kernel.fn.__name__.lstrip("_")
    kinds = mma_kinds(compiled.asm["ttgir"])
    products = products_of(name, launch.meta)
    per_product = len(kinds) // len(products) if kinds and len(kinds) % len(products) == 0 else None
    return {
        "kernel": name,
        "config": launch.config._asdict(),
        "shared": compiled.metadata.shared,
        "shared_limit": SHARED_LIMIT[arch],
        **_ptxas_figures(text),
        "mma": {product: kinds[i * per_product] for i, product in enumerate(products)} if per_product else kinds,
        "dots": kinds,
    }


def compile_case(case: Case, arch: int) -> list[dict]:
    """The three kernels of ``case`` compiled for ``sm_{arch}``."""
    return [compile_launch(launch, arch) for launch in case_launches(case)]
