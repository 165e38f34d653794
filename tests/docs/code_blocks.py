"""The code blocks of the documentation pages (``docs/**/*.md``, and README.md): each is run, or marked as not run with a reason.

What runs, by the block's language:

* ``python``: executed; the blocks of one page share one namespace, in page order (a later block may use what an
  earlier one defined).
* ``bash``/``sh``/``shell``: every line must be a ``lightning``, ``polyattn`` or ``python -m polyattn_lightning``
  command (``\\`` continues a line, ``#`` starts a comment). Each is run in this process through the CLI's
  ``main``: ``fit``/``validate``/``test``/``predict`` with ``--print_config`` appended (the config is parsed and
  checked, nothing trains), ``grid`` with ``--dry-run`` (every cell's settings checked, nothing runs), any other
  verb with ``--help``.
* any other language (``yaml``, ``text``): only with a marker.

Markers are HTML comments on the lines just before the block (the site does not show them):

* ``<!-- not run: REASON -->``: not run; the reason is required, and no other marker goes with it.
* ``<!-- run: ARGS -->`` (shell blocks): each command runs for real with ARGS appended (a small size, e.g.
  ``--trainer.max_epochs 1``; none: as written) instead of the check above.
* ``<!-- setup: PYTHON -->`` (python and shell blocks, may span lines): run first, unseen by the reader, in the
  page's namespace: the inputs the example takes as given (tensors, a model, a saved folder, an image folder).
* ``<!-- file: NAME -->``: the block is written to NAME, for the blocks after it (e.g. a grid file).

All pages run in one process (the imports are paid once), in the order of their paths, each in a fresh folder of
its own that links ``configs/`` to the checkout's: a page's blocks see what its earlier blocks wrote (a run's
checkpoint), never another page's.

``python tests/docs/code_blocks.py WORKDIR RESULTS.json PAGE...`` runs the pages' blocks and writes each block's
outcome (``{"page:line": {"ok": ..., "detail": ..., "seconds": ...}}``); tests/docs/test_code_blocks.py reads it.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
SHELL = {"bash", "sh", "shell"}
MARKERS = ("not run", "run", "setup", "file")
FENCE = re.compile(r"^(`{3,}|~{3,})\s*([^`]*)$")  # the fence, its info string (language, or {directive} args)
MARKER = re.compile(r"<!--\s*(not run|run|setup|file):(.*?)-->", re.S)
#: how each verb is checked without running it (any other verb: --help)
CHECK = {"fit": "--print_config", "validate": "--print_config", "test": "--print_config",
         "predict": "--print_config", "grid": "--dry-run"}  # fmt: skip


@dataclass
class Block:
    page: str  # relative to the checkout, e.g. docs/howto/convert.md
    line: int  # of the opening fence, 1-based
    language: str
    text: str
    markers: dict[str, str] = field(default_factory=dict)  # MARKERS -> value, from the comments just before

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def runs(self) -> bool:
        return "not run" not in self.markers and self.problem() is None

    def problem(self) -> str | None:
        """Why the block is neither run nor properly marked (None: it is)."""
        marked, allowed = set(self.markers), {"python": {"setup"}, **dict.fromkeys(SHELL, {"setup", "run"})}
        if "not run" in marked:
            reason = self.markers["not run"]
            return None if reason and marked == {"not run"} else f"{self.id}: `not run:` needs a reason, and alone"
        if "file" in marked:
            name = self.markers["file"]
            return None if name and "/" not in name and marked == {"file"} else f"{self.id}: `file:` needs a NAME"
        if self.language not in allowed:
            return f"{self.id}: a {self.language or 'plain'} block is neither run nor marked `<!-- not run: REASON -->`"
        if marked - allowed[self.language]:
            return f"{self.id}: {', '.join(sorted(marked - allowed[self.language]))}: not for a {self.language} block"
        return None


def markers(lines: list[str]) -> dict[str, str]:
    """The markers of the HTML comments that end just before a block (``lines``: the page up to its fence)."""
    found, text = {}, "\n".join(lines).rstrip()
    while text.endswith("-->") and (start := text.rfind("<!--")) >= 0:
        if marked := MARKER.fullmatch(text[start:]):
            found[marked.group(1)] = marked.group(2).strip()
        text = text[:start].rstrip()
    return found


def page_blocks(path: Path) -> list[Block]:
    """The fenced code blocks of one Markdown page (MyST directives such as ```` ```{toctree} ```` excluded)."""
    lines = path.read_text().splitlines()
    page = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
    blocks, i = [], 0
    while i < len(lines):
        opened = FENCE.match(lines[i])
        if not opened:
            i += 1
            continue
        fence, info = opened.groups()
        language = info.split()[0] if info.split() else ""
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip().startswith(fence)
                    and set(lines[j].strip()) == {fence[0]}), len(lines))  # fmt: skip
        if not language.startswith("{"):
            text = "\n".join(lines[i + 1 : end]) + "\n"
            blocks.append(Block(page, i + 1, language, text, markers(lines[:i])))
        i = end + 1
    return blocks


def pages(docs: Path = DOCS) -> list[Path]:
    """The site's Markdown pages and, beside them, the README (its blocks are held to the same rule)."""
    return [*sorted(p for p in docs.rglob("*.md") if "_build" not in p.parts), docs.parent / "README.md"]


def commands(text: str) -> list[list[str]]:
    """The shell block's commands as argv lists without the program (``lightning``, ``polyattn``, ``python -m
    polyattn_lightning``); ValueError names a line that is none of these."""
    found = []
    for line in text.replace("\\\n", " ").splitlines():
        argv = shlex.split(line, comments=True)
        if not argv:
            continue
        if argv[0] in ("lightning", "polyattn"):
            found.append(argv[1:])
        elif argv[:3] == ["python", "-m", "polyattn_lightning"]:
            found.append(argv[3:])
        else:
            raise ValueError(f"`{line.strip()}` is not a lightning/polyattn command: mark the block not run")
    return found


def checked(argv: list[str], run_args: str | None) -> list[str]:
    """``argv`` as the runner runs it: with the marker's ARGS, or with its verb's check flag."""
    if run_args is not None:
        return argv + shlex.split(run_args)
    flag = CHECK.get(argv[0] if argv else "", "--help")
    if argv[:2] == ["grid", "report"]:
        flag = "--help"  # reads a grid's finished cells
    return argv if flag in argv else argv + [flag]


def run_cli(argv: list[str]) -> str:
    """The CLI's ``main`` in this process; returns its output, raises RuntimeError with it when it fails."""
    from polyattn_lightning.cli.dispatch import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            main(argv)
            status = 0
        except SystemExit as stop:
            status = stop.code or 0
    if status != 0:
        raise RuntimeError(f"`polyattn {shlex.join(argv)}` exited with {status}:\n{out.getvalue()[-3000:]}")
    return out.getvalue()


def run_block(block: Block, namespace: dict) -> str:
    """Run one block (working folder: the current one); returns what it printed, raises on failure."""
    if "file" in block.markers:
        Path(block.markers["file"]).write_text(block.text)
        return f"wrote {block.markers['file']}"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        if "setup" in block.markers:
            exec(compile(block.markers["setup"], f"{block.id} (setup)", "exec"), namespace)
        if block.language == "python":
            exec(compile(block.text, block.id, "exec"), namespace)
    if block.language in SHELL:
        return out.getvalue() + "".join(run_cli(checked(a, block.markers.get("run"))) for a in commands(block.text))
    return out.getvalue()


def run_pages(paths: list[Path], workdir: Path) -> dict[str, dict]:
    """Every block of ``paths`` that runs, page by page, each page in a folder of its own under ``workdir``."""
    results = {}
    for number, path in enumerate(paths):
        folder = workdir / f"{number:02d}-{path.stem}"
        folder.mkdir(parents=True)
        (folder / "configs").symlink_to(ROOT / "configs")
        os.chdir(folder)
        namespace = {"__name__": "__docs__"}
        for block in filter(lambda b: b.runs, page_blocks(path)):
            print(f"running {block.id} ({block.language})", file=sys.stderr, flush=True)
            start = time.perf_counter()
            try:
                detail, ok = run_block(block, namespace), True
            except Exception:
                detail, ok = traceback.format_exc(limit=-3), False
            results[block.id] = {"ok": ok, "detail": detail[-4000:], "seconds": round(time.perf_counter() - start, 2)}
    return results


if __name__ == "__main__":
    workdir, out, *names = sys.argv[1:]
    sys.path.insert(0, str(ROOT))  # the checkout's package
    found = run_pages([Path(n).resolve() for n in names], Path(workdir).resolve())
    Path(out).write_text(json.dumps(found, indent=1))
