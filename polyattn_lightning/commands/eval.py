"""``polyattn eval MODEL [MODEL ...] --out DIR [--tasks polyattn_heldout,polyattn_sums] [--text FILE] [--limit N]``

Evaluates trained or converted models side by side (:func:`polyattn_lightning.harness.evaluate`): a causal LM (a
``save_pretrained`` folder, a run's checkpoint or run folder) through lm-evaluation-harness with the project's
attention (``pip install -e ".[eval]"``), on the local tasks (held-out text for perplexity, a multiple-choice set
generated from it: no download) or any task lm-eval knows (with network); a vision run through ``lightning test``
of its checkpoint. A MODEL is ``LABEL=PATH`` or ``PATH``; a conversion run given alone brings its teacher.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import ArgumentParser
from ..harness import LOCAL_TASKS, evaluate


def parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="polyattn eval",
        description="Evaluate models side by side: causal LMs through lm-evaluation-harness (local tasks, no "
        "download; or any lm-eval task, with network), vision runs through `lightning test`.",
    )
    p.add_argument(
        "models", nargs="+", metavar="[LABEL=]PATH", help="a save_pretrained folder, a .ckpt or a run folder"
    )
    p.add_argument("--out", type=Path, required=True, help="a new or empty folder for the results and the table")
    p.add_argument(
        "--tasks",
        default=",".join(LOCAL_TASKS),
        help=f"comma-separated lm-eval tasks (default: the local {', '.join(LOCAL_TASKS)})",
    )
    p.add_argument("--text", type=Path, help="held-out text of the local tasks, a document a line (default: the "
                   "tiny Llama quickstart's test split)")  # fmt: skip
    p.add_argument("--limit", type=int, help="at most this many documents per task")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0, help="lm-eval's seeds and the multiple-choice set's")
    return p


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """Run the command; returns each model's results by label (:func:`polyattn_lightning.harness.evaluate`)."""
    args = parser().parse_args(argv)
    tasks = [task.strip() for task in args.tasks.split(",") if task.strip()]
    return evaluate(args.models, args.out, tasks, args.text, args.limit, args.batch_size, args.seed)
