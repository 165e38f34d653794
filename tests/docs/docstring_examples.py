"""The examples (``>>>``) in the docstrings of the main entry points, run with :mod:`doctest`.

``ENTRY_POINTS`` names the objects whose docstrings must hold an example: the functions a user calls first and the
task modules. ``python tests/docs/docstring_examples.py RESULTS.json [DOTTED.NAME...]`` runs their examples (all of
``ENTRY_POINTS`` without names) in this process, in one namespace per object, and writes per object
``{"examples": <count>, "failed": <count>, "output": <doctest's report of the failures>}``;
tests/docs/test_docstring_examples.py reads it. A separate process: an example registers an activation, which
would stay registered for every later test of a pytest session.
"""

from __future__ import annotations

import doctest
import importlib
import io
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENTRY_POINTS = (
    "polyattn_lightning.set_attention",
    "polyattn_lightning.attention.attention",
    "polyattn_lightning.convert",
    "polyattn_lightning.register_activation",
    "polyattn_lightning.kernel_choice",
    "polyattn_lightning.tasks.ClassificationModule",
    "polyattn_lightning.tasks.DetectionModule",
    "polyattn_lightning.tasks.LRAModule",
    "polyattn_lightning.tasks.HFSequenceClassification",
    "polyattn_lightning.tasks.HFCausalLM",
)
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def resolve(dotted: str):
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def run(obj, name: str) -> dict:
    """Run the examples of ``obj``'s own docstring (not its members'); count them and the failures."""
    tests = [t for t in doctest.DocTestFinder(recurse=False).find(obj, name, globs={}) if t.examples]
    out = io.StringIO()
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    for test in tests:
        runner.run(test, out=out.write)
    return {"examples": sum(len(t.examples) for t in tests), "failed": runner.failures, "output": out.getvalue()}


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # the checkout's package
    results_path, *names = sys.argv[1:]
    results = {name: run(resolve(name), name) for name in names or ENTRY_POINTS}
    Path(results_path).write_text(json.dumps(results, indent=1))
