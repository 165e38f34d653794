"""``polyattn sweep --config CFG --scales 0.01 0.1 1 --lengths 256 64 16 4 [--steps 150] --out sweep.png``

The polynomial-attention paper's figure 1: final validation accuracy against the
activation's scale factor (log axis), one line per sequence length. Each
(length, scale) pair is one short ``fit`` of CFG through this project's CLI with
the attention ``scale`` set and the patch size chosen so that the image holds
``length`` patches (``patch = img_size / sqrt(length)``; the digits quickstart's
16 px images give 256, 64, 16 and 4 tokens with patches of 1, 2, 4 and 8), then
one pass over the validation set. Runs keep nothing (no logger, no checkpoints;
each runs in a temporary directory). The numbers go to a CSV beside the PNG.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import tempfile
import time
import warnings
from pathlib import Path

from matplotlib.figure import Figure

from ..attention import describe, get_activation
from ..cli import make_cli
from ..errors import ArgumentParser, ConfigError, MissingPathError
from ..logs import quiet_loggers

#: Trainer settings of every sweep run: train ``--steps`` steps, validate once at the end, write nothing.
QUIET = {
    "--trainer.logger": "false",
    "--trainer.callbacks": "[]",
    "--callbacks_off": "[norms, predictions]",  # no logger to log norms to; nothing predicted
    "--trainer.enable_checkpointing": "false",
    "--trainer.enable_progress_bar": "false",
    "--trainer.enable_model_summary": "false",
    "--trainer.num_sanity_val_steps": "0",
    "--trainer.check_val_every_n_epoch": "1000000",
    "--trainer.max_epochs": "-1",
}
COLUMNS = ("tokens", "img_size", "patch_size", "activation", "scale", "steps", "val_top1", "val_loss", "seconds")


def patch_size(length: int, img_size: int) -> int:
    """The patch side cutting an ``img_size`` image into ``length`` patches; a ValueError lists the lengths that fit."""
    side = math.isqrt(length)
    if side * side == length and side and img_size % side == 0:
        return img_size // side
    fitting = [(img_size // p) ** 2 for p in range(1, img_size + 1) if img_size % p == 0]
    raise ConfigError(
        f"--lengths {length}: a {img_size}-px image cuts into a square number of equal patches only: "
        f"{', '.join(map(str, fitting))} (or change --img-size)"
    )


def _flags(overrides: dict[str, str]) -> list[str]:
    return [item for pair in overrides.items() for item in pair]


def base_settings(config: Path, extra: list[str]) -> tuple[dict, int, dict]:
    """The config's attention spec (as a dict), image size and ``model_kwargs``, as the CLI resolves them."""
    cli = make_cli(["--config", str(config), *extra, *_flags(QUIET)], run=False)
    model = cli.config.model.init_args
    spec = model.attention
    spec = dict(spec) if not isinstance(spec, str) else {"name": spec}
    data = cli.config.data.get("init_args") or {}
    img_size = model.get("img_size") or data.get("img_size")  # the model takes the data's when it gives none
    if img_size is None:
        raise ConfigError(
            f"{config}: model.init_args.img_size or data.init_args.img_size must be set for a sweep "
            "over sequence lengths"
        )
    return spec, int(img_size), dict(model.get("model_kwargs") or {})


def run_one(
    config: Path, extra: list[str], spec: dict, img_size: int, patch: int, kwargs: dict, steps: int, root: Path
) -> dict[str, float]:
    """Train one configuration ``steps`` steps and validate it: ``{"val_top1", "val_loss", "seconds"}``."""
    overrides = {
        **QUIET,
        "--model.init_args.attention": json.dumps(spec),
        "--model.init_args.img_size": str(img_size),
        "--data.init_args.img_size": str(img_size),
        "--model.init_args.model_kwargs": json.dumps({**kwargs, "patch_size": patch}),
        "--trainer.max_steps": str(steps),
        "--trainer.default_root_dir": str(root),
    }
    start = time.perf_counter()
    cli = make_cli(["--config", str(config), *extra, *_flags(overrides)], run=False)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    metrics = cli.trainer.validate(cli.model, datamodule=cli.datamodule, verbose=False)[0]
    return {"val_top1": metrics["val/top1"], "val_loss": metrics["val/loss"], "seconds": time.perf_counter() - start}


def sweep_figure(rows: list[dict], title: str) -> Figure:
    """Validation top-1 against the scale on a log axis, one line per length, the best scale of each starred."""
    fig = Figure(figsize=(7.5, 5.0), layout="constrained")
    ax = fig.subplots()
    for tokens in sorted({row["tokens"] for row in rows}, reverse=True):
        line = sorted((row for row in rows if row["tokens"] == tokens), key=lambda row: row["scale"])
        scales, accuracy = [row["scale"] for row in line], [100 * row["val_top1"] for row in line]
        (drawn,) = ax.plot(scales, accuracy, marker="o", label=f"N = {tokens} tokens (patch {line[0]['patch_size']})")
        best = max(range(len(line)), key=accuracy.__getitem__)
        ax.plot(scales[best], accuracy[best], marker="*", markersize=14, color=drawn.get_color())
    ax.set_xscale("log")
    ax.set_xlabel("scale factor c in phi(S) = c * f(S)")
    ax.set_ylabel("final validation top-1 (%)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(title="sequence length (best scale starred)", fontsize=8, title_fontsize=8)
    return fig


def parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="polyattn sweep",
        description=(
            "Train a config briefly for every attention scale and sequence length and plot the final validation "
            "top-1 against the scale (log axis), a line per length; writes the PNG and a CSV beside it."
        ),
    )
    p.add_argument("--config", type=Path, required=True, help="a classification config, e.g. the digits quickstart")
    p.add_argument("--scales", type=float, nargs="+", required=True, help="attention scale factors")
    p.add_argument("--lengths", type=int, nargs="+", required=True, help="sequence lengths (patches per image)")
    p.add_argument("--steps", type=int, default=150, help="training steps per run")
    p.add_argument("--img-size", type=int, help="image side (default: the config's)")
    p.add_argument("--out", type=Path, required=True, help="PNG to write; the CSV goes beside it")
    p.add_argument("--dpi", type=int, default=100)
    p.add_argument("extra", nargs=argparse.REMAINDER, help="after --: further CLI arguments for every run")
    return p


def main(argv: list[str] | None = None) -> tuple[Path, Path]:
    args = parser().parse_args(argv)
    extra = args.extra[1:] if args.extra[:1] == ["--"] else args.extra
    if not args.config.is_file():
        raise MissingPathError(f"--config {args.config} does not exist")
    if min(args.scales) <= 0 or args.steps < 1:
        raise ConfigError(f"--scales must be > 0 (log axis) and --steps >= 1; got {args.scales} and {args.steps}")
    with quiet_loggers("lightning.pytorch", level=logging.WARNING), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter")  # we pass args on purpose
        return _sweep(args, extra)  # one line per run instead of Lightning's banners


def _sweep(args: argparse.Namespace, extra: list[str]) -> tuple[Path, Path]:
    spec, img_size, kwargs = base_settings(args.config, extra)
    img_size = args.img_size or img_size
    patches = {length: patch_size(length, img_size) for length in args.lengths}  # check all before training
    rows = []
    for length, patch in patches.items():
        for scale in args.scales:
            run_spec = {**spec, "scale": scale}
            with tempfile.TemporaryDirectory(prefix="polyattn-sweep-") as root:  # the run's config.yaml only
                result = run_one(args.config, extra, run_spec, img_size, patch, kwargs, args.steps, Path(root))
            rows.append(
                dict(
                    tokens=length,
                    img_size=img_size,
                    patch_size=patch,
                    scale=scale,
                    steps=args.steps,
                    activation=describe(get_activation(run_spec)),
                    **result,
                )
            )
            print(
                f"N={length} scale={scale:g}: val top-1 {100 * result['val_top1']:.1f}% ({result['seconds']:.0f} s)",
                flush=True,
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    table = args.out.with_suffix(".csv")
    with table.open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    title = f"{args.config.stem}: {spec['name']} attention, {args.steps} training steps per run, {img_size}-px images"
    sweep_figure(rows, title).savefig(args.out, dpi=args.dpi)
    print(f"wrote {args.out} and {table}")
    return args.out, table
