"""Cross-references the Python domain does not find, resolved by import instead of dropped or warned about.

The docstrings name internal modules and classes (``:class:`~.transfer.TransferOptions```), and autodoc writes
annotations as references (``torch.Tensor``, ``pathlib.Path``); only the public packages have pages. A reference
the domain cannot resolve is looked up by import (dotted from ``polyattn_lightning``, or relative to the page's
module and each module of the package, as a leading ``.`` asks):

* an object the site documents under another path (a public name's home, ``public_api.py``): a link there;
* any other object that imports (an internal helper, a class of torch or Lightning): its name as code, no link;
* nothing by that name: left alone, so the nitpicky build reports it (a stale or misspelt reference).

A reference the domain finds several times over (``SwitchedAttention`` from a page whose module does not export it:
its home, a package re-exporting it and the canonical path it was defined at) is pointed at the one page that
documents the object in full, when every match is that object.
"""

from __future__ import annotations

import importlib
import sys

from public_api import PACKAGE, public_names
from sphinx import addnodes
from sphinx.transforms.post_transforms import SphinxPostTransform

#: Roles whose targets are Python objects
PY_ROLES = frozenset({"class", "exc", "func", "meth", "attr", "data", "obj", "mod", "const", "type"})


def lookup(path: str):
    """The object at dotted ``path`` (a module, or attributes of the longest module prefix that imports)."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        name = ".".join(parts[:cut])
        try:
            obj = sys.modules.get(name) or importlib.import_module(name)
        except Exception:  # noqa: BLE001 - not a module: try a shorter prefix
            continue
        try:
            for attribute in parts[cut:]:
                obj = getattr(obj, attribute)
        except AttributeError:
            return None
        return obj
    return None


def candidates(target: str, module: str | None):
    """Dotted paths ``target`` may mean: itself, then under the page's module and its parents, then under every
    module of the package already imported."""
    target = target.lstrip(".~")
    yield target
    scopes = []
    if module:
        parts = module.split(".")
        scopes += [".".join(parts[:cut]) for cut in range(len(parts), 0, -1)]
    scopes += sorted(name for name in sys.modules if name == PACKAGE or name.startswith(PACKAGE + "."))
    for scope in scopes:
        yield f"{scope}.{target}"


def documented_home(obj) -> str | None:
    """The path the site documents ``obj`` at in full, if it is a public class or function."""
    key = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    for entry in public_names():
        if entry.is_home and entry.kind != "data":
            home = getattr(importlib.import_module(entry.module), entry.name)
            if (getattr(home, "__module__", None), getattr(home, "__qualname__", None)) == key and None not in key:
                return entry.path
    return None


def resolve(app, env, node, contnode):
    if node.get("refdomain") != "py" or node.get("reftype") not in PY_ROLES:
        return None
    target = node["reftarget"]
    if " " in target.strip():
        return None  # prose in a role: a docstring mistake, reported
    for path in candidates(target, node.get("py:module")):
        obj = lookup(path)
        if obj is None:
            continue
        home = documented_home(obj)
        if home is not None:
            domain = env.domains["py"]
            found = domain.resolve_xref(env, node["refdoc"], app.builder, "obj", home, node, contnode)
            if found is not None:
                return found
        return contnode
    return None


class OneHome(SphinxPostTransform):
    """Before the domain resolves them: a fuzzy reference with several matches that are one documented object
    is written as the path of its home."""

    default_priority = 5  # before sphinx's ReferencesResolver (10)

    def run(self, **kwargs) -> None:
        domain = self.env.domains["py"]
        for node in self.document.findall(addnodes.pending_xref):
            if node.get("refdomain") != "py" or node.get("reftype") not in PY_ROLES:
                continue
            module, cls = node.get("py:module"), node.get("py:class")
            matches = domain.find_obj(self.env, module, cls, node["reftarget"], node["reftype"], searchmode=1)
            if len(matches) < 2:
                continue
            homes = {documented_home(lookup(name)) for name, _ in matches}
            if len(homes) == 1 and None not in homes:
                node["reftarget"] = homes.pop()
                node["refspecific"] = False


def setup(app):
    app.connect("missing-reference", resolve)
    app.add_post_transform(OneHome)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
