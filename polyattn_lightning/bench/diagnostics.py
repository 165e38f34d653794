"""What the attention diagnostics cost a training run.

``python -m polyattn_lightning.bench diagnostics [--config configs/classification/quickstart.yaml]
[--every 50] [--epochs 1] [--repeats 3] [--json out.json]``

Norms: one training run of ``--epochs`` epochs of the config (no validation, a
TensorBoard logger in a temporary directory, no other callbacks) with and
without :class:`~polyattn_lightning.callbacks.AttentionNorms` every ``--every``
steps, alternating, ``--repeats`` times each. Each run starts from the same
seed, so both do the same work apart from the probes. The time added is
measured two ways: the time spent inside the callback's hook (all the work it
does; precise), and the difference of the median wall-clock times of whole
runs (includes any indirect cost, but noisy on a busy machine). Maps: the median time of one
:class:`~polyattn_lightning.callbacks.AttentionMaps` drawing (probe pass, both
figures, both PNGs) on the same model, i.e. what each validation adds.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

from ..errors import ArgumentParser
from ..diagnostics.figures import attention_pictures
from ..callbacks.attention_norms import AttentionNorms
from ..diagnostics.probe import probe_batch
from ..cli import make_cli
from . import CONFIGS, quiet_loggers
from .timing import machine, write_report

QUICKSTART = CONFIGS / "classification" / "quickstart.yaml"
#: The standard callbacks both runs leave out; the timed one keeps ``norms``.
OFF = ("checkpoint", "last_checkpoint", "lr_monitor", "resume", "nan_guard", "predictions")


def _fit(config: Path, epochs: int, every: int | None, root: str, hook_seconds: list[float]) -> tuple[float, object]:
    """Seconds of one ``fit``; ``every``: the norm callback's period, None: without it. The seconds spent in
    the callback's hook, one entry per training batch, go to ``hook_seconds``."""
    off = [*OFF, "norms"] if every is None else list(OFF)
    args = [
        "--config",
        str(config),
        "--trainer.callbacks=[]",
        "--trainer.max_epochs",
        str(epochs),
        "--trainer.limit_val_batches",
        "0",
        "--trainer.num_sanity_val_steps",
        "0",
        "--trainer.enable_checkpointing",
        "false",
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.enable_model_summary",
        "false",
        "--trainer.logger.init_args.save_dir",
        root,
        "--callbacks_off",
        f"[{', '.join(off)}]",
    ]
    if every is not None:
        args += ["--norms.every_n_steps", str(every)]
    cli = make_cli(args, run=False)
    for callback in cli.trainer.callbacks:
        if isinstance(callback, AttentionNorms):
            hook = callback.on_train_batch_start

            def timed(*hook_args, hook=hook):
                begin = time.perf_counter()
                hook(*hook_args)
                hook_seconds.append(time.perf_counter() - begin)

            callback.on_train_batch_start = timed  # Lightning looks hooks up on the instance
    start = time.perf_counter()
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    return time.perf_counter() - start, cli


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m polyattn_lightning.bench diagnostics", description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, default=QUICKSTART, help="training config (default: the quickstart)")
    parser.add_argument("--every", type=int, default=50, help="AttentionNorms every_n_steps (default 50)")
    parser.add_argument("--epochs", type=int, default=1, help="epochs per timed run")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs with and without (median reported)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    with quiet_loggers("lightning.pytorch", level=logging.WARNING), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
        return _measure(args)


def _measure(args: argparse.Namespace) -> int:
    load_before = os.getloadavg()
    times: dict[str, list[float]] = {"without": [], "with": []}
    hook_seconds: list[list[float]] = []
    with tempfile.TemporaryDirectory(prefix="polyattn-bench-") as root:
        _fit(args.config, 1, args.every, root, [])  # warm-up: kernel build, data set, allocator, first probe
        for _ in range(args.repeats):
            times["without"].append(_fit(args.config, args.epochs, None, root, [])[0])
            hook_seconds.append([])
            seconds, cli = _fit(args.config, args.epochs, args.every, root, hook_seconds[-1])
            times["with"].append(seconds)
        steps = cli.trainer.global_step
        probes = len(range(0, steps, args.every))
        module, datamodule = cli.model, cli.datamodule
        probe = probe_batch(module, next(iter(datamodule.val_dataloader())), 8)
        draws = []
        for i in range(args.repeats):
            start = time.perf_counter()
            for name, fig in attention_pictures(module, probe).items():
                fig.savefig(Path(root) / f"{i}_{name}.png", dpi=100)
            draws.append(time.perf_counter() - start)

    without, with_norms = statistics.median(times["without"]), statistics.median(times["with"])
    added = with_norms - without
    in_hook = statistics.median(sum(run) for run in hook_seconds)
    result = {
        "in_callback_per_epoch_s": in_hook / args.epochs,
        "in_callback_percent": 100 * in_hook / without,
        "in_callback_per_probe_ms": 1000 * in_hook / max(probes, 1),
        "in_callback_seconds": [sum(run) for run in hook_seconds],
        "config": str(args.config),
        "every_n_steps": args.every,
        "epochs": args.epochs,
        "steps": steps,
        "probes": probes,
        "repeats": args.repeats,
        "fit_seconds": times,
        "median_without_s": without,
        "median_with_s": with_norms,
        "added_per_epoch_s": added / args.epochs,
        "added_percent": 100 * added / without,
        "wall_per_probe_ms": 1000 * added / max(probes, 1),
        "maps_per_validation_s": statistics.median(draws),
        "maps_seconds": draws,
        "machine": machine(load_before),
    }
    print(
        f"{args.config.name}: {steps} steps in {args.epochs} epoch(s), AttentionNorms every {args.every} steps "
        f"({probes} probes)"
    )
    print(
        f"  inside the callback: {result['in_callback_per_epoch_s']:.3f} s per epoch "
        f"({result['in_callback_percent']:.2f}% of the training time), "
        f"{result['in_callback_per_probe_ms']:.0f} ms per probe"
    )
    print(
        f"  fit without {without:.2f} s, with {with_norms:.2f} s (medians of {args.repeats}): "
        f"{added / args.epochs:+.2f} s per epoch ({result['added_percent']:+.1f}%), "
        f"{result['wall_per_probe_ms']:.0f} ms per probe"
    )
    print(f"  AttentionMaps: {result['maps_per_validation_s']:.2f} s per validation (probe pass, two figures, PNGs)")
    print(f"  load average before {load_before[0]:.1f}, after {result['machine']['load_average_after'][0]:.1f}")
    write_report(result, args.json)
    return 0
