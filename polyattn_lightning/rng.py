"""Every random number generator a run draws from, captured and put back: for exact resume and for side passes
(the diagnostics' probe forward) that must leave training as it would have been."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture_rng_state() -> dict[str, Any]:
    """This process's torch (CPU and every CUDA device's: the Triton kernel draws its dropout seed on the
    tensors' device), numpy and python RNG states, as weights_only-loadable values."""
    kind, key, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": (kind, key.tolist(), pos, has_gauss, gauss),  # a list, not an ndarray: weights_only refuses arrays
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state`."""
    torch.set_rng_state(state["torch"])
    kind, key, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.asarray(key, dtype=np.uint32), pos, has_gauss, gauss))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        if isinstance(state["cuda"], torch.Tensor):  # checkpoints before per-device states: the current device's
            torch.cuda.set_rng_state(state["cuda"])
        else:
            for device, device_state in enumerate(state["cuda"][: torch.cuda.device_count()]):
                torch.cuda.set_rng_state(device_state, device)
