"""The Triton kernel checks itself, once per compiled configuration, until a GPU run has measured it.

The kernel has been compiled for A100 and Hopper offline (``bench triton-static``)
and checked under Triton's CPU interpreter, but a real GPU compiles it through
passes the interpreter never runs. So the first time ``attention()`` would run
Triton for a launch configuration, ``triton_verified`` runs a small random
problem of that configuration through it and through the blocked PyTorch
kernel, forward and backward; for dropout the reference rebuilds the keep mask
with ``dropout_keep`` (the documented Philox scheme in PyTorch ops). Beyond the
dtype's tolerance (``TOLERANCE``), or on any error, it warns once, naming the
configuration and the error, and ``attention()`` uses the blocked kernel for
that configuration from then on.

* The configuration (``launch_key``) is every value that changes the compiled
  kernels: device, dtype, head dims, form, mask / bias / bias-gradient /
  dropout flags, the products' precision (``torch.get_float32_matmul_precision``),
  causal flag, the launch table and grid order, the three tile configs, and Triton's
  specialisation of each runtime argument (``== 1``, divisible by 16, 32/64
  bit, pointer alignment). The small problem is built from the key alone, with
  lengths, strides and pointer offsets of the same specialisation, so it runs
  the very binaries the real call will run.
* Verdicts are cached per process. Configurations in ``MEASURED`` (filled from
  ``scripts/gpu_check.py`` results) skip the check; ``POLYATTN_TRITON_SELFCHECK=0``
  turns it off.
* Under ``torch.compile`` the check runs when the call is traced, outside the
  traced region (``assume_constant_result``); pointers count as aligned there.
* A device fault (an illegal memory access) poisons the CUDA context: nothing
  can be recovered after one, so the check cannot fall back from it; it only
  catches wrong values and Python-level errors (compile errors, out of resources).
"""

from __future__ import annotations

import os
import warnings
from typing import NamedTuple

import torch
from torch import Tensor

from ...forms import FusedForm
from ...masks import keys_per_row
from ...registry import get_activation
from ..blocked import blocked
from . import launch
from .op import TritonAttention, kernel_operands

#: Largest error allowed, relative to the reference's largest value, by dtype (and fp32 precision).
TOLERANCE = {
    "bfloat16": 5e-2,
    "float16": 2e-2,
    ("float32", "ieee"): 1e-4,
    ("float32", "tf32x3"): 1e-3,
    ("float32", "tf32"): 2e-2,
}
#: Coarse configurations measured on a GPU by scripts/gpu_check.py (``Config`` tuples;
#: docs/benchmarks/kernels-cuda.md lists the runs).
MEASURED: frozenset = frozenset()
#: ``launch_key`` -> verdict, per process.
_VERDICTS: dict = {}


class Config(NamedTuple):
    """A launch configuration as a person names it (what ``MEASURED`` lists and a warning says)."""

    dtype: str
    d: int
    dv: int
    activation: str
    mask: bool
    bias: bool
    bias_grad: bool
    dropout: bool
    causal: bool
    precision: str
    table: str
    grid: str


def _int_spec(x: int) -> str:
    """Triton's specialisation of an integer argument (``native_specialize_impl``, written out)."""
    if x == 1:
        return "1"
    kind = "i32" if -(2**31) <= x < 2**31 else "u64" if x >= 2**63 else "i64"
    return kind + ("D" if x % 16 == 0 else "")


def _ptr_spec(x: Tensor | None) -> str:
    if x is None or torch.compiler.is_compiling():
        return "D"
    return "D" if x.data_ptr() % 16 == 0 else ""


def launch_key(q, k, v, act, allowed, bias, dropout_p: float, causal: int | None = None) -> tuple:
    """``(Config, specialisation)``: every value that changes the compiled kernels for this call."""
    q3, k3, v3, mask, bias4 = kernel_operands(q, k, v, allowed, bias)
    bh, nq, d = q3.shape
    nk, dv = k3.shape[1], v3.shape[2]
    form, power = (int(x) for x in act.fused_form)
    name = f"poly{power}" if form == FusedForm.POLY else FusedForm(form).name.lower()
    config = Config(
        str(q.dtype).removeprefix("torch."),
        d,
        dv,
        name,
        mask is not None,
        bias4 is not None,
        bias4 is not None and bias4.requires_grad and torch.is_grad_enabled(),
        dropout_p > 0,
        causal is not None,
        launch.fp32_precision() if q.dtype == torch.float32 else "-",
        launch.launch_table(),
        launch.grid_order(),
    )
    threshold = min(int(dropout_p * 2**32), 2**32 - 1)
    tiles = tuple(tuple(launch.launch_config(kernel, q.dtype, d, dv, nq, nk)) for kernel in launch.KERNELS)
    strides = tuple(_int_spec(s) for x in (mask, bias4) for s in launch._broadcast_strides(x))
    spec = (
        str(q.device),
        form,
        power,
        float(dropout_p),
        _int_spec(threshold),
        max(nq, nk) <= launch.SHORT,
        tiles,
        tuple(_int_spec(x) for x in (nq, nk, q.shape[1], d, dv, 0 if causal is None else causal)),
        strides,
        tuple(_ptr_spec(x) for x in (q3, k3, v3, mask, bias4)),
    )
    return config, spec


def triton_verified(q, k, v, act, allowed, bias, dropout_p: float, causal: int | None = None) -> bool:
    """Whether ``attention()`` may run Triton for this call's configuration (checked once per process);
    ``causal``: the causal diagonal offset or None."""
    if os.environ.get("POLYATTN_TRITON_SELFCHECK", "1") == "0":
        return True
    return _verdict(launch_key(q, k, v, act, allowed, bias, dropout_p, causal))


@torch.compiler.assume_constant_result
def _verdict(key: tuple) -> bool:
    if key not in _VERDICTS:
        config, spec = key
        _VERDICTS[key] = config in MEASURED or _self_check(config, spec)
    return _VERDICTS[key]


def _length(spec: str, short: bool) -> int:
    """A length of the same specialisation; short keeps the short-window tile."""
    if spec == "1":
        return 1
    return (48 if short else 80) if spec.endswith("D") else (49 if short else 81)


def check_lengths(nq_spec: str, nk_spec: str, offset_spec: str, short: bool, causal: bool) -> tuple[int, int]:
    """``(nq, nk)`` of the self-check's problem: the call's specialisations of both lengths (and, causal, of the
    offset ``nk - nq``), both within the short window when the call's are (so it runs the call's tiles)."""
    nq, nk = _length(nq_spec, short), _length(nk_spec, short)
    if not causal or _int_spec(nk - nq) == offset_spec:
        return nq, nk
    widest = launch.SHORT if short else 160
    pairs = sorted(
        ((a, b) for a in range(1, widest + 1) for b in range(1, widest + 1)),
        key=lambda pair: abs(pair[0] - nq) + abs(pair[1] - nk),  # nearest the lengths the other checks use
    )
    for nq, nk in pairs:
        if (max(nq, nk) <= launch.SHORT) == short and (_int_spec(nq), _int_spec(nk), _int_spec(nk - nq)) == (
            nq_spec,
            nk_spec,
            offset_spec,
        ):
            return nq, nk
    raise ValueError(f"no lengths of specialisations {nq_spec}, {nk_spec}, offset {offset_spec} (short: {short})")


def _stride(spec: str) -> int:
    return 1 if spec == "1" else 16 if spec.endswith("D") else 3


def _placed(shape, dtype, device, aligned: bool, generator, strides=None) -> Tensor:
    """A random tensor of ``shape`` (``strides``: any, overlapping allowed), at a 16-byte-aligned address or not."""
    strides = strides or torch.empty(shape, device="meta").stride()
    extent = 1 + sum((size - 1) * stride for size, stride in zip(shape, strides))
    offset = 0 if aligned else 1
    if dtype == torch.bool:
        flat = torch.rand(extent + offset, generator=generator) > 0.3
    else:
        flat = torch.randn(extent + offset, generator=generator)
    return flat.to(device, dtype)[offset:].as_strided(shape, strides)


def _operand(shape4, stride_specs, dtype, device, aligned, generator) -> Tensor:
    """A 4-D mask or bias with the given broadcast-stride specialisation (``16`` = broadcast, passed as 0)."""
    shape = [1 if spec.endswith("D") else size for size, spec in zip(shape4, stride_specs)]
    strides = [0 if size == 1 else _stride(spec) for size, spec in zip(shape, stride_specs)]
    return _placed(shape, dtype, device, aligned, generator, strides)


def _self_check(config: Config, spec: tuple) -> bool:
    device, form, power, p, _, short, _, lengths, strides, pointers = spec
    nq_spec, nk_spec, heads_spec, _, _, offset_spec = lengths
    dtype = getattr(torch, config.dtype)
    nq, nk = check_lengths(nq_spec, nk_spec, offset_spec, short, config.causal)
    causal = nk - nq if config.causal else None
    heads = _stride(heads_spec)
    batch = 2
    g = torch.Generator().manual_seed(0)  # the default generators are left alone: seeded runs stay repeatable
    aligned = [ptr == "D" for ptr in pointers]
    q, k, v = (
        _placed(shape, dtype, device, ok, g)
        for shape, ok in zip(
            [(batch, heads, nq, config.d), (batch, heads, nk, config.d), (batch, heads, nk, config.dv)], aligned
        )
    )
    allowed = _operand((batch, heads, nq, nk), strides[:4], torch.bool, device, aligned[3], g) if config.mask else None
    bias = _operand((batch, heads, nq, nk), strides[4:], torch.float32, device, aligned[4], g) if config.bias else None
    act = get_activation(config.activation)
    t = config.d**-0.5
    try:
        with torch.enable_grad(), torch.autocast(torch.device(device).type, enabled=False):
            leaves = [x.detach().requires_grad_() for x in (q, k, v)]
            bias_leaf = None if bias is None else bias.detach().requires_grad_(config.bias_grad)
            n = keys_per_row(allowed, nk, q.device, causal)
            seed = torch.tensor([0x5EED_2026_0001], dtype=torch.int64, device=device)
            out = TritonAttention.apply(*leaves, bias_leaf, act, t, allowed, n, p, causal, seed if p else None)
            kept = allowed
            if p:
                keep = dropout_keep(int(seed), batch * heads, nq, nk, p).view(batch, heads, nq, nk).to(device)
                kept = keep if allowed is None else keep & allowed
            expected = blocked(*leaves, act, t, kept, bias_leaf, n, 0.0, causal=causal).float() / (1.0 - p)
            wanted = leaves + ([bias_leaf] if config.bias_grad else [])
            weight = torch.randn(out.shape, generator=g).to(device)
            got = torch.autograd.grad((out.float() * weight).sum(), wanted)
            want = torch.autograd.grad((expected.float() * weight).sum(), wanted)
            if q.is_cuda:
                torch.cuda.synchronize(q.device)
        tolerance = TOLERANCE.get(config.dtype, TOLERANCE.get((config.dtype, config.precision)))
        for label, a, b in zip(("output", "dq", "dk", "dv", "dbias"), (out, *got), (expected, *want)):
            error = _relative_error(a, b)
            if not error <= tolerance:
                raise ArithmeticError(
                    f"{label} differs from the blocked kernel's by {error:.3g} of its largest "
                    f"value (tolerance {tolerance:g})"
                )
    except Exception as error:  # wrong values, a Triton compile error, out of resources...
        warnings.warn(
            f"the Triton attention kernel failed its self-check for {config} ({type(error).__name__}: {error}); "
            "attention uses the blocked PyTorch kernel for this configuration from now on (slower)",
            stacklevel=5,
        )
        return False
    return True


def _relative_error(got: Tensor, want: Tensor) -> float:
    scale = want.detach().abs().max().item() or 1.0
    return ((got.detach().double() - want.detach().double()).abs().max() / scale).item()


def _mulhilo(a: Tensor, b: int) -> tuple[Tensor, Tensor]:
    """High and low 32 bits of ``a * b`` (``a`` int64 < 2**32, ``b`` < 2**32) without leaving int64."""
    low_part, high_part = (a & 0xFFFF) * b, (a >> 16) * b  # each < 2**48
    low = low_part + ((high_part & 0xFFFF) << 16)
    return ((high_part >> 16) + (low >> 32)) & 0xFFFFFFFF, low & 0xFFFFFFFF


def dropout_keep(seed: int, batch_heads: int, nq: int, nk: int, p: float) -> Tensor:
    """The kernels' keep mask ``(batch_heads, nq, nk)``: pair (i, j) of head bh is kept iff word ``j % 4`` of
    Philox4x32-10(key = seed's low/high 32 bits, counter = (j // 4, i, bh, 0)) >= ``floor(p * 2**32)``."""
    bh, i, j = torch.meshgrid(torch.arange(batch_heads), torch.arange(nq), torch.arange(nk), indexing="ij")
    c = [j // 4, i, bh, torch.zeros_like(i)]
    k0, k1 = seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF
    for _ in range(10):
        hi0, lo0 = _mulhilo(c[0], 0xD2511F53)
        hi1, lo1 = _mulhilo(c[2], 0xCD9E8D57)
        c = [hi1 ^ c[1] ^ k0, lo1, hi0 ^ c[3] ^ k1, lo0]
        k0, k1 = (k0 + 0x9E3779B9) & 0xFFFFFFFF, (k1 + 0xBB67AE85) & 0xFFFFFFFF
    words = torch.stack(c).gather(0, (j % 4)[None]).squeeze(0)
    return words >= min(int(p * 2**32), 2**32 - 1)
