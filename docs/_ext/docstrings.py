"""How the package's docstrings are read: napoleon's Google-style sections (``Args:``, ``Returns:``) for modules,
classes and functions only.

napoleon reads an attribute's, property's or constant's docstring as ``type: description`` and turns whatever
precedes the first colon into a type (``#: hyperparameters the DataModule determines (...): None takes ...``
became a type named ``hyperparameters the DataModule determines``): the project writes those docstrings as prose
with colons, so they are left as written.
"""

from __future__ import annotations

from sphinx.ext.napoleon import _process_docstring

#: autodoc's kinds whose docstrings napoleon's inline ``type: description`` reading would rewrite
PROSE_KINDS = frozenset({"attribute", "data", "property"})


def google_sections(app, what, name, obj, options, lines) -> None:
    """napoleon's processing, except for :data:`PROSE_KINDS`."""
    if what not in PROSE_KINDS:
        _process_docstring(app, what, name, obj, options, lines)


def setup(app):
    app.setup_extension("sphinx.ext.napoleon")
    for listener in list(app.events.listeners["autodoc-process-docstring"]):
        if listener.handler is _process_docstring:
            app.disconnect(listener.id)
    app.connect("autodoc-process-docstring", google_sections)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
