"""The package's public API as the documentation sees it: every name of the ``__all__`` of each public package.

A public package is ``polyattn_lightning`` or one of its subpackages without a ``_`` in its path that sets
``__all__`` (the project's ``__init__.py`` files hand names on). Names are resolved by import, lazy ones (a
package's ``__getattr__``) included, since ``getattr`` asks for them. A name exported by several packages is one
object: it is documented in full at its **home**, the shallowest package that exports it (``set_attention`` at
``polyattn_lightning``), and each other path gets a short entry pointing there, so that every public path is in
the site's ``objects.inv``. The API pages (``api_pages.py``) and the coverage test (``tests/docs``) both read this.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import pkgutil
from dataclasses import dataclass
from functools import cache
from types import ModuleType

from sphinx.pycode import ModuleAnalyzer

PACKAGE = "polyattn_lightning"


@dataclass(frozen=True)
class PublicName:
    """One ``module.name`` of a public ``__all__``, with what it is and where it is documented in full."""

    module: str
    name: str
    kind: str  # "class", "exception", "function" or "data"
    key: str  # the same for every path of one object
    home: str  # the module whose page documents it in full

    @property
    def path(self) -> str:
        return f"{self.module}.{self.name}"

    @property
    def is_home(self) -> bool:
        return self.module == self.home


@cache
def public_modules() -> tuple[str, ...]:
    """The public packages, shallowest first (each imported)."""
    root = importlib.import_module(PACKAGE)
    found = [PACKAGE]
    for info in pkgutil.walk_packages(root.__path__, f"{PACKAGE}."):
        if info.ispkg and not any(part.startswith("_") for part in info.name.split(".")):
            if hasattr(importlib.import_module(info.name), "__all__"):
                found.append(info.name)
    return tuple(sorted(found, key=lambda m: (m.count("."), m)))


def kind_of(obj) -> str:
    """How a public name is documented; a type alias (``Callable[...]``, a ``Union``) is data, as it is assigned."""
    if inspect.isclass(obj):
        return "exception" if issubclass(obj, BaseException) else "class"
    if inspect.isroutine(obj):
        return "function"
    return "data"


def defining_module(module: str, name: str) -> str:
    """The module whose source assigns ``name``: followed through ``from .x import name`` and a package's lazy
    ``_LAZY`` table (``name -> module``) from ``module``."""
    mod = importlib.import_module(module)
    lazy = getattr(mod, "_LAZY", {})
    if name in lazy:
        return defining_module(lazy[name], name)
    source = inspect.getsource(mod)
    for node in ast.parse(source).body:
        if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == name for a in node.names):
            if node.level:
                base = importlib.util.resolve_name("." * node.level + (node.module or ""), mod.__package__ or module)
            else:
                base = node.module or ""
            target = f"{base}.{name}"
            if importlib.util.find_spec(base) is not None and name not in _submodules(base):
                return defining_module(base, name)
            return target
    return module


def _submodules(package: str) -> set[str]:
    mod = importlib.import_module(package)
    return {info.name for info in pkgutil.iter_modules(getattr(mod, "__path__", []))}


def data_docstring(module: str, name: str) -> str | None:
    """The ``#:`` comment (or the string after the assignment) that documents a constant, where it is assigned."""
    where = defining_module(module, name)
    docs = ModuleAnalyzer.for_module(where).find_attr_docs()
    lines = docs.get(("", name))
    return "\n".join(lines).strip() or None if lines else None


def docstring(entry: PublicName) -> str | None:
    """The object's own docstring (a class's, not one it inherits; a constant's ``#:`` comment), or None."""
    if entry.kind == "data":
        return data_docstring(entry.module, entry.name)
    obj = getattr(importlib.import_module(entry.module), entry.name)
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else getattr(obj, "__doc__", None)
    return doc.strip() or None if isinstance(doc, str) else None


@cache
def public_names() -> tuple[PublicName, ...]:
    """Every ``module.name`` of the public packages' ``__all__``s, in ``__all__`` order per package."""
    raw: list[tuple[str, str, str, str]] = []
    for module in public_modules():
        mod: ModuleType = importlib.import_module(module)
        for name in mod.__all__:
            obj = getattr(mod, name)  # a lazy name is imported here
            kind = kind_of(obj)
            if kind == "data":
                key = f"data:{defining_module(module, name)}.{name}"
            else:
                key = f"{kind}:{obj.__module__}.{obj.__qualname__}"
            raw.append((module, name, kind, key))
    homes: dict[str, str] = {}
    for module, _, _, key in raw:  # shallowest first: the first module seen is the home
        homes.setdefault(key, module)
    return tuple(PublicName(module, name, kind, key, homes[key]) for module, name, kind, key in raw)


def home_path(entry: PublicName) -> str:
    """Where ``entry`` is documented in full."""
    for other in public_names():
        if other.key == entry.key and other.is_home:
            return other.path
    raise LookupError(entry.path)


def py_names(inventory_bytes: bytes) -> set[str]:
    """The Python object names of a built site's ``objects.inv``."""
    from sphinx.util.inventory import InventoryFile

    inventory = InventoryFile.loads(inventory_bytes, uri="")
    return {name for kind, items in inventory.data.items() if kind.startswith("py:") for name in items}


def undocumented(site_names: set[str]) -> dict[str, str]:
    """Each public path the site does not document, with why: missing from the site's inventory, or (at its
    home) without a docstring of its own. Empty: every public name is documented."""
    missing = {}
    for entry in public_names():
        if entry.path not in site_names:
            missing[entry.path] = "not in the site's objects.inv"
        elif docstring(next(e for e in public_names() if e.key == entry.key and e.is_home)) is None:
            missing[entry.path] = f"no docstring (documented at {home_path(entry)})"
    return missing
