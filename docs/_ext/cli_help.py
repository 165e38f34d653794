"""``.. cli-help:: maps --help``: what ``polyattn maps --help`` prints, run at build time, so the CLI reference is
the parsers' own text and cannot drift from them.

Each command line runs in the build's process through ``polyattn_lightning.cli.main`` (the console script's entry
point), with the program named ``polyattn`` and the help wrapped at 100 columns (jsonargparse's backspace markers
dropped); a command that does not end with
status 0 is a build error naming it.
"""

from __future__ import annotations

import contextlib
import io
import os
import shlex
import sys
from functools import cache
from unittest import mock

from docutils import nodes
from sphinx.util.docutils import SphinxDirective

COLUMNS = "100"


@cache
def help_text(command: str) -> str:
    """What ``polyattn <command>`` prints (it must exit with status 0)."""
    from polyattn_lightning.cli import main

    out = io.StringIO()
    code = 0
    with (
        mock.patch.dict(os.environ, {"COLUMNS": COLUMNS}),
        mock.patch.object(sys, "argv", ["polyattn"]),
        contextlib.redirect_stdout(out),
    ):
        try:
            main(shlex.split(command))
        except SystemExit as stop:
            code = stop.code or 0
    if code != 0:
        raise RuntimeError(f"`polyattn {command}` exited with status {code}:\n{out.getvalue()}")
    return out.getvalue().replace("\b", "").rstrip() + "\n"  # jsonargparse marks some option names with a backspace


class CLIHelp(SphinxDirective):
    required_arguments = 1
    final_argument_whitespace = True

    def run(self) -> list[nodes.Node]:
        command = self.arguments[0]
        try:
            text = help_text(command)
        except Exception as error:
            raise self.error(f"cli-help: {error}") from error
        block = nodes.literal_block(text, text, language="text")
        caption = nodes.paragraph("", "", nodes.literal(f"polyattn {command}", f"polyattn {command}"))
        return [caption, block]


def setup(app):
    app.add_directive("cli-help", CLIHelp)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
