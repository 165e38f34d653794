"""What every backend builds on: the contract (``contract.py``: what a backend receives and declares, the kinds of
call), the cost model ``pick`` compares (``costs.py``), the operands' layout (``layout.py``), the recurrent state of
the linear forms (``state.py``) and the build of the C++ kernels (``cpp.py``, sources in ``kernels/csrc/``).

This face hands on the names of the module ``kernels/base.py`` this package replaced; the backends import from the
modules themselves.
"""

from .contract import Backend, KernelInputs, KernelNotSupported, elementwise_reasons, key_padding_reasons
from .costs import (
    CROSSOVER_TABLE,
    causal_pairs,
    cost_mode,
    cpu_model,
    crossover_length,
    crossover_table,
    device_entry,
    device_key,
    flop_crossover,
    linear_cost,
    measured_crossover,
    quadratic_cost,
    quadratic_seconds,
    reload_crossover_table,
)

__all__ = [
    "Backend",
    "CROSSOVER_TABLE",
    "KernelInputs",
    "KernelNotSupported",
    "causal_pairs",
    "cost_mode",
    "cpu_model",
    "crossover_length",
    "crossover_table",
    "device_entry",
    "device_key",
    "elementwise_reasons",
    "flop_crossover",
    "key_padding_reasons",
    "linear_cost",
    "measured_crossover",
    "quadratic_cost",
    "quadratic_seconds",
    "reload_crossover_table",
]
