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


_BY_NAME = {form.name: form for form in FusedForm}


def form_of(kernel: tuple) -> tuple[FusedForm, int] | None:
    """``(form, power)`` of an ``Activation.kernel`` tuple, or None for a form no fused kernel knows.

    Asked on every attention call (a decoding step's whole budget is a few microseconds): one dict lookup."""
    form = _BY_NAME.get(kernel[0].upper()) if kernel else None
    if form is None:
        return None
    return form, (int(kernel[1]) if form is FusedForm.POLY else 1)
