"""The self-check's parts that need no Triton run: the PyTorch Philox reference, the specialisation rules,
the seed path (no host copy), the torch floor."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
import torch
from attention_reference import philox_keep

from polyattn_lightning.attention.kernels.triton import launch
from polyattn_lightning.attention.kernels.triton.selfcheck import _int_spec, check_lengths, dropout_keep

ROOT = Path(__file__).parents[3]


@pytest.mark.parametrize("seed", [0, 11, 2**40 + 12345, 2**63 - 2])
def test_pytorch_philox_keep_mask_matches_the_documented_scheme(seed):
    keep = dropout_keep(seed, 3, 9, 23, 0.3)
    assert keep.shape == (3, 9, 23)
    for bh in range(3):
        assert torch.equal(keep[bh], philox_keep(seed, bh, 9, 23, 0.3)), bh
    assert abs(dropout_keep(seed, 2, 64, 64, 0.1).float().mean().item() - 0.9) < 0.03


@pytest.mark.parametrize("nq, nk", [(39, 56), (32, 35), (56, 39), (64, 1), (1, 49), (197, 150), (100, 117), (300, 300)])
def test_the_self_check_runs_the_tiles_of_the_call_it_vouches_for(nq, nk):
    """The self-check's problem has the call's length and causal-offset specialisations and, whatever the dtype and
    head dim, the same tiles: a short causal window is checked on a short window (it was checked on 97 keys, off
    the short tile, when its offset's specialisation differed from the default lengths')."""
    short = max(nq, nk) <= launch.SHORT
    for causal in (False, True):
        cq, ck = check_lengths(_int_spec(nq), _int_spec(nk), _int_spec(nk - nq), short, causal)
        assert (_int_spec(cq), _int_spec(ck)) == (_int_spec(nq), _int_spec(nk))
        assert not causal or _int_spec(ck - cq) == _int_spec(nk - nq)
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for d in (32, 64, 128, 256):
                for kernel in launch.KERNELS:
                    call = launch.launch_config(kernel, dtype, d, d, nq, nk, table="tuned")
                    assert launch.launch_config(kernel, dtype, d, d, cq, ck, table="tuned") == call


def test_launch_key_specialisation_matches_triton():
    pytest.importorskip("triton")  # CPU-only torch builds have no Triton (and no Triton kernel)
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    for x in (0, 1, 2, 16, 48, 49, 197, 4096, 2**31 - 16, 2**31, 2**40 + 3, 2**63):
        kind, spec = native_specialize_impl(CUDABackend, x, False, True, True)
        assert _int_spec(x) == ("1" if kind == "constexpr" else kind + spec), x


def test_dropout_seed_is_drawn_on_the_device_without_a_host_copy():
    """Every op of a dropout forward on (fake) CUDA tensors stays on the device: no CPU tensor, no .item()."""
    pytest.importorskip("triton")
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from polyattn_lightning.attention import get_activation
    from polyattn_lightning.attention.kernels.triton.op import TritonAttention

    ops = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            devices = {str(a.device) for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)}
            ops.append((str(func), devices, str(kwargs.get("device"))))
            return func(*args, **kwargs)

    with FakeTensorMode():
        q = torch.randn(2, 2, 64, 32, device="cuda:1", dtype=torch.bfloat16, requires_grad=True)
        n = torch.full((1, 1, 1, 1), 64.0, device="cuda:1")
        with Record():
            out = TritonAttention.apply(q, q, q, None, get_activation("poly3"), 0.2, None, n, 0.1, None)
    assert out.device == torch.device("cuda:1")
    assert ("aten.randint.default", set(), "cuda:1") in ops
    assert "polyattn.triton_forward.default" in {name for name, _, _ in ops}
    assert all(devices <= {"cuda:1"} for _, devices, _ in ops), ops
    assert not any(name in ("aten._local_scalar_dense.default", "aten._to_copy.default") for name, _, _ in ops)


def test_torch_floor_has_triton_op():
    """``torch.library.triton_op`` (the Triton kernel's operators) came with torch 2.6."""
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    [floor] = [re.match(r"torch>=(\d+)\.(\d+)", d) for d in dependencies if re.match(r"torch\b", d)]
    assert floor and tuple(int(x) for x in floor.groups()) >= (2, 6)
    assert hasattr(torch.library, "triton_op") and hasattr(torch.library, "wrap_triton")
