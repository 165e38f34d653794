"""The library code each switch that mirrors it was reviewed against: fingerprints of that code, per release.

An adapter keeps a library's steps and puts ``attention()`` where the softmax was (the Hugging Face families,
timm's families and its generic switch, PyTorch's ``nn.MultiheadAttention``); the mmcv stand-in
(``detection/mmcv_ops.py``) answers the calls mmcv's ops make. A release that changes those steps would make the
switch compute something else, or crash in the middle of a forward. So each records the code it was read for:

* a :class:`Mirror` names the library (its distribution: ``transformers``, ``timm``, ``torch``, ``mmcv-lite``),
  the class reviewed, and the library functions the switch mirrors or relies on: for an adapter
  (:func:`adapter_mirror`) every method of the library class it overrides, plus its ``relies_on`` (the helpers
  it calls and the callers whose conventions it takes, e.g. Falcon's model, which builds its ALiBi mask);
* the fingerprint is the SHA-256 of that code's normalised source (``ast.unparse`` without docstrings: comments,
  formatting and docstrings do not count), so code that two releases share has one fingerprint;
* ``reviewed.json`` records, per library and class, each reviewed fingerprint with the route it takes
  (``adapter``; ``interface`` for a Hugging Face class that calls ``AttentionInterface`` itself in that release,
  as ``FalconAttention`` does from transformers 5.25 on) and the releases it was read in.

At switch time :meth:`Mirror.route` looks the installed code's fingerprint up; code nobody reviewed is refused
in one line (:class:`UnreviewedCode`, a ``ConfigError``) naming the library, its installed release, the class
and what to do, before anything changes. Reviewing a new release is ``python -m polyattn_lightning.bench
fingerprints`` (docs/contributing.md, "Reviewing a new library release").
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import inspect
import json
import textwrap
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from torch import nn

from ...errors import ConfigError
from .base import SwitchedAttention

#: library -> class -> fingerprint -> {"route": ..., "releases": [...]}.
RECORDS = Path(__file__).with_name("reviewed.json")
#: The routes a reviewed fingerprint takes: the class's adapter, or (Hugging Face) transformers' AttentionInterface.
ADAPTER, INTERFACE = "adapter", "interface"
#: How a name missing from a release enters its fingerprint.
MISSING = "<missing>"


class UnreviewedCode(ConfigError):
    """The installed release of a library has code a switch mirrors that nobody reviewed: the switch refuses it."""


@dataclass(frozen=True)
class Mirror:
    """What one switch mirrors: ``code`` (qualified names of functions and methods) of ``library``, for ``name``."""

    library: str  # the distribution, as pip names it
    name: str  # the class reviewed (``module.qualified.Class``), the key of the records
    code: tuple[str, ...]

    def fingerprint(self) -> str:
        """SHA-256 (hex, first 16 digits) of the normalised sources of :attr:`code`, each under its name."""
        names = tuple(sorted(self.code))
        return _fingerprint(names, tuple(_function(_resolve(name)) for name in names))

    def installed(self) -> str:
        """The installed release of :attr:`library` (``unknown`` when pip does not know it)."""
        try:
            return version(self.library)
        except PackageNotFoundError:
            return "unknown"

    def route(self) -> str:
        """The recorded route of the installed code (:data:`ADAPTER` or :data:`INTERFACE`); code not recorded
        raises :class:`UnreviewedCode`."""
        recorded = records().get(self.library, {}).get(self.name, {})
        found = recorded.get(self.fingerprint())
        if found is not None:
            return found["route"]
        releases = sorted({r for entry in recorded.values() for r in entry["releases"]}, key=_release_key)
        pin = (
            f"pin a reviewed release ({self.library}=={releases[-1]}; reviewed: {', '.join(releases)}), or "
            if releases
            else ""
        )
        raise UnreviewedCode(
            f"{self.library} {self.installed()}'s {self.name} differs from the code polyattn_lightning was reviewed "
            f"against: {pin}upgrade polyattn_lightning"
        )


def adapter_mirror(library_class: type, adapter: type, library: str | None = None) -> Mirror:
    """The :class:`Mirror` of ``adapter``, the switch of ``library_class``: the library class's methods the adapter
    overrides or calls on ``self``, and the adapter's ``relies_on`` (names in the library class's module, or fully
    qualified names). ``library`` defaults to the top-level package of ``library_class``."""
    return _adapter_mirror(library_class, adapter, library or library_class.__module__.split(".")[0])


@functools.cache
def _adapter_mirror(library_class: type, adapter: type, library: str) -> Mirror:
    library_classes = [c for c in library_class.__mro__ if c not in (nn.Module, object)]
    own = [c for c in adapter.__mro__ if c not in library_class.__mro__ and c not in SwitchedAttention.__mro__]
    functions = [value for c in own for name, value in vars(c).items() if inspect.isfunction(value)]
    used = {value.__name__ for value in functions} | {name for f in functions for name in _called_on_self(f)}
    prefix = f"{library_class.__module__}.{library_class.__qualname__}"
    library_code = [f"{prefix}.{name}" for name in used if any(name in vars(c) for c in library_classes)]
    module = importlib.import_module(library_class.__module__)
    relied = [
        f"{library_class.__module__}.{name}" if _lookup(module, name.split(".")) is not None else name
        for name in getattr(adapter, "relies_on", ())
    ]
    return Mirror(library, prefix, tuple(sorted(set(library_code + relied))))


def _called_on_self(function) -> set[str]:
    """The names ``function`` calls as ``self.name(...)``."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    return {
        node.func.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "self"
    }


def adapter_route(library_class: type, adapter: type) -> str:
    """:meth:`Mirror.route` of ``adapter``'s mirror."""
    return adapter_mirror(library_class, adapter).route()


@functools.lru_cache(maxsize=1024)
def _fingerprint(names: tuple[str, ...], functions: tuple) -> str:
    """Cached by the function objects themselves: a function replaced at run time is fingerprinted again."""
    text = "\n".join(f"# {name}\n{normalised_source(function)}" for name, function in zip(names, functions))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _function(found):
    """The plain function behind a method, a classmethod or a decorated function (None stays None)."""
    return None if found is None else inspect.unwrap(getattr(found, "__func__", found))


def normalised_source(function) -> str:
    """``function``'s source as ``ast.unparse`` writes it without docstrings (:data:`MISSING` for None: a name the
    installed release does not have)."""
    if function is None:
        return MISSING
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]
    return ast.unparse(tree)


def _resolve(qualified: str):
    """The object ``qualified`` (``package.module.Class.method``) names, or None."""
    parts = qualified.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            module = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        return _lookup(module, parts[split:])
    return None


def _lookup(obj, names: list[str]):
    for name in names:
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    return obj


@functools.cache
def records() -> dict:
    """The recorded fingerprints (``reviewed.json``)."""
    return json.loads(RECORDS.read_text())


def record(mirrors: list[Mirror], interface: frozenset[str] = frozenset()) -> list[str]:
    """Record the installed code of ``mirrors`` as reviewed (a new fingerprint takes :data:`ADAPTER`, or
    :data:`INTERFACE` for a class named in ``interface``) and add the installed release to known fingerprints'
    releases; writes ``reviewed.json`` and returns one line per new fingerprint."""
    data = json.loads(RECORDS.read_text())
    added = []
    for mirror in mirrors:
        entries = data.setdefault(mirror.library, {}).setdefault(mirror.name, {})
        fingerprint, release = mirror.fingerprint(), mirror.installed()
        if fingerprint not in entries:
            route = INTERFACE if mirror.name in interface else ADAPTER
            entries[fingerprint] = {"route": route, "releases": []}
            added.append(f"{mirror.library} {release} {mirror.name} {fingerprint}: {route}")
        releases = entries[fingerprint]["releases"]
        if release not in releases:
            releases.append(release)
            releases.sort(key=_release_key)
    RECORDS.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    records.cache_clear()
    return added


def _release_key(release: str) -> tuple:
    return tuple(int(p) if p.isdigit() else 0 for p in release.split("+")[0].split("."))


__all__ = [
    "ADAPTER",
    "INTERFACE",
    "Mirror",
    "UnreviewedCode",
    "adapter_mirror",
    "adapter_route",
    "normalised_source",
    "record",
    "records",
]
