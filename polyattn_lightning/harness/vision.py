"""Vision runs (classification, detection) evaluated as they already log it: ``lightning test`` of the run's
checkpoint with the run's saved config, through the project's CLI and Trainer, in this process; the test metrics
the task logged are the results (:func:`evaluate_vision`), in the shape of lm-eval's (``{"results": {"test":
...}}``) so that one table holds either."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .sources import Source


def test_metrics(source: Source) -> dict[str, float]:
    """The metrics ``lightning test --ckpt_path CKPT`` logs (the run's saved config is used; the test writes its
    own folder beside the run's, as any test of a checkpoint does)."""
    from ..cli.dispatch import make_cli

    cli = make_cli(["test", "--ckpt_path", str(source.path)])
    return {name: float(value) for name, value in cli.trainer.callback_metrics.items()}


def evaluate_vision(sources: list[Source], out: Path) -> dict[str, dict[str, Any]]:
    """``lightning test`` of every checkpoint; ``out/<label>.json`` holds each one's metrics."""
    results = {}
    for source in sources:
        result = {"results": {"test": test_metrics(source)}, "config": {"model": str(source.path), "task": source.task}}
        (out / f"{source.label}.json").write_text(json.dumps(result, indent=2), encoding="utf-8")
        results[source.label] = result
    return results
