"""Runs several ``polyattn`` command lines as separate processes that share one import of the CLI.

``python cli_driver.py CASES.json``: CASES is a list of ``{"argv": [...], "env": {...}}``; each case runs
in a child forked from this process (after the CLI's imports, some 5 s), with stdout and stderr going to
one file, exactly as ``polyattn ARGV`` would print them; an exception escaping ``cli.main`` is printed
the way the interpreter prints it. Writes ``[{"rc": int, "output": str}, ...]`` to CASES.json + ".out".
Cases run one after another, so a later case may use what an earlier one wrote (a checkpoint).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback

from polyattn_lightning import cli


def run_case(argv: list[str], env: dict[str, str]) -> dict:
    with tempfile.TemporaryFile("w+") as out:
        pid = os.fork()
        if pid == 0:  # the child: a fresh `polyattn ARGV` process in all but the imports
            os.dup2(out.fileno(), 1)
            os.dup2(out.fileno(), 2)
            os.environ.update(env)
            sys.argv = ["polyattn", *argv]
            code = 0
            try:
                cli.main()
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        out.seek(0)
        return {"rc": os.waitstatus_to_exitcode(status), "output": out.read()}


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        cases = json.load(f)
    results = [run_case(case["argv"], case.get("env", {})) for case in cases]
    with open(sys.argv[1] + ".out", "w") as f:
        json.dump(results, f)
