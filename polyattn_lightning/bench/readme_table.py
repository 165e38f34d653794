"""A Markdown table between two markers, measured by a command: printed, written (``--write``) or checked
(``--check``, exit 1 when the file's table differs from the measurement). The timm and Hugging Face support
tables use it."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import ArgumentParser
from . import quiet_loggers


@dataclass(frozen=True)
class Markers:
    """The two comment lines a table sits between, and what the table is called in messages."""

    begin: str
    end: str
    name: str

    def replace(self, text: str, table: str) -> str:
        """``text`` with the table between the markers replaced by ``table``."""
        pattern = re.compile(re.escape(self.begin) + ".*?" + re.escape(self.end), re.S)
        if not pattern.search(text):
            raise ValueError(f"the file has no {self.name} markers ({self.begin} ... {self.end})")
        return pattern.sub(lambda _: f"{self.begin}\n{table}\n{self.end}", text)


def table_command(
    argv: list[str] | None,
    *,
    prog: str,
    description: str,
    markers: Markers,
    measure: Callable[[list[str]], str],
    subset_help: str,
) -> int:
    """The command line of a measured table: ``measure(names)`` makes it (all rows when ``names`` is empty)."""
    parser = ArgumentParser(prog=prog, description=description)
    parser.add_argument("--write", type=Path, help="rewrite the table in this Markdown file")
    parser.add_argument("--check", type=Path, help="exit 1 if this Markdown file's table differs")
    parser.add_argument("names", nargs="*", help=subset_help)
    args = parser.parse_args(argv)
    with quiet_loggers("polyattn_lightning"):  # the table says it all
        measured = measure(args.names)
    if args.write:
        args.write.write_text(markers.replace(args.write.read_text(), measured))
    elif args.check:
        text = args.check.read_text()
        if markers.replace(text, measured) != text:
            print(f"{args.check}: the {markers.name} differs from the measurement; rerun with --write")
            return 1
    else:
        print(measured)
    return 0


__all__ = ["Markers", "table_command"]
