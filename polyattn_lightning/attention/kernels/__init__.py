"""The attention kernels, one module (or folder) per backend, and the one ``pick()`` that chooses among them.

``dispatch.py`` lists the backends (its docstring: which does what, how ``auto`` chooses, how to add one) and runs
them; ``base/`` is what they build on (the contract, the cost model, the operands' layout, the recurrent state, the
C++ build). A backend says what it takes in every kind of call: a parallel call, a KV-cache step, a step from a
recurrent state (``base/contract.py``).
"""

from .base.contract import Backend, KernelInputs, KernelNotSupported
from .dispatch import BACKENDS, KERNELS, PRIORITY, KernelChoice, pick, run

__all__ = [
    "BACKENDS",
    "KERNELS",
    "PRIORITY",
    "Backend",
    "KernelChoice",
    "KernelInputs",
    "KernelNotSupported",
    "pick",
    "run",
]
