"""``.. api-module:: polyattn_lightning.attention``: a public package's reference page, written from its ``__all__``.

The module docstring, then each name of ``__all__`` (lazy ones included: autodoc's own ``:members:`` reads
``dir(module)``, which a lazy name is not in): classes, functions and constants documented in full where the name
is at home (``public_api.py``), and a one-line entry pointing there for a name the package re-exports.
"""

from __future__ import annotations

from docutils import nodes
from docutils.statemachine import StringList
from public_api import PublicName, data_docstring, home_path, public_names
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import nested_parse_with_titles

#: The page's sections, in order: (title, kinds).
SECTIONS = (("Classes", ("class",)), ("Exceptions", ("exception",)), ("Functions", ("function",)), ("Data", ("data",)))
ROLES = {"class": "class", "exception": "exc", "function": "func", "data": "data"}


def entry_lines(entry: PublicName) -> list[str]:
    """The reST of one name on its package's page."""
    if not entry.is_home:
        directive = "function" if entry.kind == "function" else entry.kind
        return [
            f".. py:{directive}:: {entry.name}",
            "   :no-contents-entry:",
            "",
            f"   Re-exported here; documented at :py:{ROLES[entry.kind]}:`{home_path(entry)}`.",
            "",
        ]
    if entry.kind in ("class", "exception"):
        return [f".. auto{entry.kind}:: {entry.path}", "   :members:", "   :show-inheritance:", ""]
    if entry.kind == "function":
        return [f".. autofunction:: {entry.path}", ""]
    doc = data_docstring(entry.module, entry.name) or ""
    return [f".. py:data:: {entry.name}", "", *("   " + line for line in doc.splitlines()), ""]


class APIModule(SphinxDirective):
    required_arguments = 1

    def run(self) -> list[nodes.Node]:
        module = self.arguments[0]
        entries = [e for e in public_names() if e.module == module]
        if not entries:
            raise self.error(f"api-module: {module} is not a public package with an __all__ (public_api.py)")
        lines = [f".. automodule:: {module}", "   :no-members:", "", f".. py:currentmodule:: {module}", ""]
        for title, kinds in SECTIONS:
            chosen = [e for e in entries if e.kind in kinds]
            if chosen:
                lines += [title, "-" * len(title), ""]
                for entry in chosen:
                    lines += entry_lines(entry)
        source = StringList(lines, source=self.get_source_info()[0])
        container = nodes.section()
        container.document = self.state.document
        nested_parse_with_titles(self.state, source, container)
        self.env.note_dependency(__file__)
        return container.children


def setup(app):
    app.add_directive("api-module", APIModule)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
