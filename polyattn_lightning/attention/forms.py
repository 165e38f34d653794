"""The activation forms the fused kernels implement: one named table that every kernel reads.

A built-in activation names its form in ``Activation.kernel`` (``("poly", 3)``, ``("relu",)``...);
:attr:`Activation.fused_form <polyattn_lightning.attention.registry.Activation.fused_form>` turns that into
``(FusedForm, power)``, the two integers the kernels take. Each kernel writes ``f`` and ``f'`` per form:

* C++: ``enum Form`` in ``kernels/csrc/fused_cpu.cpp`` (``tests/attention/test_forms.py`` checks it
  against :class:`FusedForm`);
* Triton: ``kernels/triton/jit.py`` compares ``FORM`` with the ``tl.constexpr`` constants made from
  :class:`FusedForm`;
* the blocked PyTorch kernel: its in-place fast paths (``kernels/blocked.py``), by :class:`FusedForm`.

To add a fused form: a member here, its ``f``/``f'`` in those three places, and the activation's factory in
``registry.py`` setting ``kernel=("<name>",)``; the fused-kernel tests then cover it by name.
"""

from __future__ import annotations

from enum import IntEnum


class FusedForm(IntEnum):
    """``f`` of ``phi(S) = c(n) * f(S + b(n))``, as the fused kernels know it."""

    POLY = 0  # S^p (the power is the kernel's second integer)
    RELU = 1
    SOFTPLUS = 2
    SIGMOID = 3


def form_of(kernel: tuple) -> tuple[FusedForm, int] | None:
    """``(form, power)`` of an ``Activation.kernel`` tuple, or None for a form no fused kernel knows."""
    if not kernel or kernel[0].upper() not in FusedForm.__members__:
        return None
    form = FusedForm[kernel[0].upper()]
    return form, (int(kernel[1]) if form is FusedForm.POLY else 1)
