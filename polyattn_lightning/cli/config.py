"""Reading the config jsonargparse parsed: a ``class_path``/``init_args`` component's class and arguments, and the
best checkpoint's settings the task fills in. The other modules of the CLI read parsed configs through these."""

from __future__ import annotations

import importlib
from typing import Any

from ..callbacks.standard import resolve_checkpoint_monitor


def class_from_path(class_path: Any) -> type | None:
    """The class a resolved ``class_path`` names (None when it names none)."""
    module, _, name = str(class_path or "").rpartition(".")
    try:
        return getattr(importlib.import_module(module), name) if module else None
    except (ImportError, AttributeError):
        return None


def component_class(component) -> type | None:
    """The class a parsed ``class_path``/``init_args`` component names (None for None, a plain value or no class)."""
    return class_from_path(component.get("class_path") if hasattr(component, "get") else None)


def init_args(component) -> dict:
    """A parsed ``class_path``/``init_args`` component's arguments as a dict (empty for None or a plain value)."""
    args = component.get("init_args") if hasattr(component, "get") else None
    return args.as_dict() if hasattr(args, "as_dict") else dict(args or {})


def as_list(value) -> list:
    """A ``trainer.callbacks`` value as a list (None: empty; one callback: a list of it)."""
    return [] if value is None else list(value) if isinstance(value, list) else [value]


def resolve_task_defaults(config) -> None:
    """The best checkpoint's ``monitor``/``mode`` left unset take the task's (``--print_config`` and the saved
    ``config.yaml`` show the values used)."""
    model, checkpoint = config.get("model"), config.get("checkpoint")
    if checkpoint is None or not hasattr(checkpoint, "get"):
        return
    settings = {"monitor": checkpoint.get("monitor"), "mode": checkpoint.get("mode")}
    resolve_checkpoint_monitor(settings, component_class(model))
    checkpoint.monitor, checkpoint.mode = settings["monitor"], settings["mode"]
