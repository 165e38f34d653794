"""Sphinx configuration of the polyattn_lightning documentation.

Build: ``sphinx-build -W --keep-going -n docs docs/_build/html`` (warnings are errors, nitpicky: every
cross-reference must resolve). The API pages are written from the public packages' ``__all__``
(``_ext/api_pages.py``), the CLI reference from the parsers (``_ext/cli_help.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS / "_ext"))
sys.path.insert(0, str(DOCS.parent))  # the checkout's package, before an installed one

project = "polyattn_lightning"
author = "the polyattn_lightning authors"
copyright = "the polyattn_lightning authors, Apache-2.0"
release = version = "0.1.0"

extensions = [
    "sphinx.ext.autodoc",
    "docstrings",  # napoleon, for functions and classes only
    "myst_parser",
    "api_pages",
    "cli_help",
    "references",
    "bench_figures",  # the benchmark pages' figures, drawn from benchmarks/*.json
    "config_catalogue",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
# docs/ also holds the files README.md shows (figures, benchmark JSON) and grid reports, which are not pages
exclude_patterns = ["_build", "grids/**"]
templates_path: list[str] = []

html_theme = "furo"
html_title = "polyattn_lightning"
html_static_path: list[str] = []

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_class_signature = "mixed"
autodoc_inherit_docstrings = False  # a method without its own docstring is not documented with its base's
napoleon_google_docstring = True
napoleon_numpy_docstring = False

nitpicky = True
nitpick_ignore_regex: list[tuple[str, str]] = []
