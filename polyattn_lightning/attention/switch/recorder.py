"""The softmax recorder: which modules still compute softmax (or call SDPA) in a forward, recorded, not guessed.

:func:`softmax_calls` runs a forward under a :class:`~torch.overrides.TorchFunctionMode` that records
every softmax-like call (``F.softmax``, ``Tensor.softmax``, ``torch.softmax``, ``log_softmax``,
``softmin``, SDPA, ``F.multi_head_attention_forward``) with the stack of modules whose forward was
running. Both switches (timm's and Hugging Face's) probe a model after switching it to a non-softmax
activation, so any call left is softmax outside a switched attention. A softmax written as
``exp() / sum()`` is not seen.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn
from torch.overrides import TorchFunctionMode

#: The function names that mean "softmax attention is still computed here".
RECORDED = frozenset(
    {
        "softmax",
        "log_softmax",
        "softmin",
        "_softmax",
        "_log_softmax",
        "scaled_dot_product_attention",
        "multi_head_attention_forward",
    }
)


@dataclass(frozen=True)
class SoftmaxCall:
    """One recorded call: the function and the modules that were running, outermost first."""

    function: str
    stack: tuple[tuple[str, nn.Module], ...]  # (path in the model, module)

    @property
    def path(self) -> str:
        return self.stack[-1][0] if self.stack else ""


class _Recorder(TorchFunctionMode):
    def __init__(self, stack: list[tuple[str, nn.Module]]):
        super().__init__()
        self.stack = stack
        self.calls: list[SoftmaxCall] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in RECORDED:
            self.calls.append(SoftmaxCall(name, tuple(self.stack)))
        return func(*args, **(kwargs or {}))


def softmax_calls(model: nn.Module, run: Callable[[], object]) -> list[SoftmaxCall]:
    """Run ``run()`` (a forward of ``model``) and return the softmax-like calls it made, in order."""
    stack: list[tuple[str, nn.Module]] = []
    handles = []

    def leave(module, args, output) -> None:  # a hook that returned the popped entry would replace the output
        stack.pop()

    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(lambda m, a, name=name: stack.append((name, m))))
        handles.append(module.register_forward_hook(leave, always_call=True))
    try:
        with _Recorder(stack) as recorder:
            run()
    finally:
        for handle in handles:
            handle.remove()
    return recorder.calls


__all__ = ["RECORDED", "SoftmaxCall", "softmax_calls"]
