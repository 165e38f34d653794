"""No docstring of the package quotes a measurement: a time, a speed ratio or a date goes stale with the next
change and belongs on a benchmark page (docs/benchmarks/), with its command, machine and date; a docstring says
what the code does and why.

Scanned: every module, class and function docstring under ``polyattn_lightning/`` and every ``#:`` comment (autodoc
shows those as the documentation of the name below them). Inline literals (````...````) are left out first: they
are examples of output (``fit finished: 150 steps, 40.2 s``), not quotations. What is left is matched against
``MEASUREMENT``; a match on a line that one of ``ALLOWED``'s phrases explains (a setting, a target, the name of a
published schedule) passes. A failure names file:line and the line.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "polyattn_lightning"

#: a ratio (``1.3x``, ``6x``), a time after a number (``12 s``, ``5-10 us``, ``0.7 ms``), a date (``2026-12-02``)
MEASUREMENT = re.compile(
    r"(?<![\w.])\d+(?:\.\d+)?x\b"
    r"|\d(?:\.\d+)?\s?(?:s|ms|us|µs|ns|min)\b"
    r"|\b20\d\d-\d\d-\d\d\b"
)
#: phrases that hold such a pattern without quoting a measurement, each with the reason
ALLOWED = {
    r"\b3x (?:recipe|schedule)|'s 3x\b|XCiT 3x|\b3x\)": "mmdet's and XCiT's '3x' schedule is a name (36 epochs)",
    r"[<>]=\s*\d+(?:\.\d+)?x?\b": "a benchmark's target (a threshold it checks), not a result",
    r"\d+x (?:the |full )?(?:full fine-tune|fine-tuning|lr)|at \d+x the": "a learning-rate setting",
    r"every \d+ s\b": "how often a wait says what it is doing (a setting)",
    r"``, \d+ s by default|`` \(\d+ s\) before the limit|\(\d+ s\) later": "SLURM's and this project's defaults",
    r"ms-crop-3x": "the name of mmdet's config",
    r"\d+(?:\.\d+)?x the floor|has been \d+(?:\.\d+)?x faster at two lengths": "a benchmark's target or stop rule",
}
LITERAL = re.compile(r"``.*?``")


def prose(docstring: str):
    """(offset, line) of a docstring's lines outside its literal blocks (the indented lines after a ``::``)."""
    literal_indent = None
    for offset, line in enumerate(docstring.splitlines()):
        indent = len(line) - len(line.lstrip())
        if literal_indent is not None and (not line.strip() or indent > literal_indent):
            continue
        literal_indent = indent if line.rstrip().endswith("::") else None
        yield offset, line


def doc_lines(path: Path):
    """(line number, text) of every docstring line outside literal blocks, and of every ``#:`` comment."""
    source = path.read_text()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(
                first.value.value, str
            ):
                for offset, line in prose(first.value.value):
                    yield first.lineno + offset, line
    for number, line in enumerate(source.splitlines(), 1):
        if line.strip().startswith("#:"):
            yield number, line.strip()


def measurements(path: Path) -> list[str]:
    found = []
    for number, line in doc_lines(path):
        text = LITERAL.sub("``", line)
        explained = [m.span() for pattern in ALLOWED for m in re.finditer(pattern, text)]
        for match in MEASUREMENT.finditer(text):
            if not any(start <= match.start() < end for start, end in explained):
                found.append(f"{path.relative_to(ROOT)}:{number}: {match.group(0)!r} in: {line.strip()}")
    return found


def test_no_docstring_quotes_a_measurement():
    found = [hit for path in sorted(PACKAGE.rglob("*.py")) for hit in measurements(path)]
    assert not found, "docstrings quoting a measurement (move it to docs/benchmarks/):\n" + "\n".join(found)


@pytest.mark.parametrize(
    "doc, caught",
    [
        ('"""The fused kernel is 0.79x SDPA."""', True),
        ('"""The build takes 12-16 s."""', True),
        ('"""Each call costs some 5-10 us."""', True),
        ('"""Measured on 2026-12-02."""', True),
        ('"""Prints ``fit finished: 40.2 s``."""', False),
        ('"""The XCiT 3x recipe."""', False),
        ('"""It prints::\n\n    train: step 121 running for 45 s\n\nthen 3.5x faster."""', True),
        ('"""It prints::\n\n    train: step 121 running for 45 s\n"""', False),
        ('"""Goal: poly1 >= 10x faster."""', False),
    ],
)
def test_the_scan_catches_measurements_and_passes_the_rest(tmp_path, doc, caught):
    """The scan on a module of one docstring (a fake package file under tmp_path, read as the real ones are)."""
    module = tmp_path / "polyattn_lightning" / "module.py"
    module.parent.mkdir()
    module.write_text(doc + "\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert bool(measurements(module)) is caught, measurements(module)
    finally:
        ROOT = saved
