"""The project's attention registers with transformers once both are imported, in either order.

A ``save_pretrained`` folder of a model switched through transformers' ``AttentionInterface`` names the project's
implementation (``attn_implementation: "polyattn"``) and its activation (``polyattn_attention``) in its config
(:mod:`polyattn_lightning.attention.switch.hf.saved`). For ``AutoModel.from_pretrained(folder)`` to load it switched
in a process that imported ``polyattn_lightning``, that name must be registered before transformers reads the config;
importing the package imports neither torch nor transformers, so :func:`install` registers at once where transformers
is already imported, and otherwise as soon as it is (a finder on ``sys.meta_path`` that runs after transformers'
own module code). Without the project the name is unknown and transformers refuses the folder in one line: never
softmax with the trained weights.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys


def register() -> None:
    """Register the attention and mask functions (``switch/hf/interface.py``)."""
    from .attention.switch.hf import interface

    interface.register()


class _RegisterAfter(importlib.abc.Loader):
    """transformers' own loader, then :func:`register`."""

    def __init__(self, loader: importlib.abc.Loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        register()


class TransformersFinder(importlib.abc.MetaPathFinder):
    """Finds ``transformers`` with the other finders and wraps its loader in :class:`_RegisterAfter` (once)."""

    def find_spec(self, name, path=None, target=None):
        if name != "transformers":
            return None
        sys.meta_path.remove(self)  # once: and so that the lookup below finds the real package
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _RegisterAfter(spec.loader)
        return spec


def install() -> None:
    """Register now where transformers is imported, else when it is; nothing where it is not installed."""
    if "transformers" in sys.modules:
        register()
    elif importlib.util.find_spec("transformers") is not None:
        if not any(isinstance(finder, TransformersFinder) for finder in sys.meta_path):
            sys.meta_path.insert(0, TransformersFinder())


__all__ = ["TransformersFinder", "install", "register"]
