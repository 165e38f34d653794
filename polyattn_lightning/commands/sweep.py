"""``polyattn sweep --config CFG --scales 0.01 0.1 1 --lengths 256 64 16 4 [--steps 150] --out DIR``

The polynomial-attention paper's figure 1 as a grid: final validation accuracy against the activation's scale
factor (log axis), one line per sequence length. The command writes ``DIR/grid.yaml``, a grid of two axes over CFG
(``length``: the patch size chosen so that the image holds ``length`` patches, ``patch = img_size / sqrt(length)``;
the digits quickstart's 16 px images give 256, 64, 16 and 4 tokens with patches of 1, 2, 4 and 8; ``scale``: the
config's attention with that scale), each cell a short ``fit`` of ``--steps`` steps validated once at its end, and
runs it with ``polyattn grid`` (``commands/grid.py``): the cells' run folders, resuming, ``--parallel``, and the
report's ``scale-sweep`` figure under ``DIR/report/``. Running the same command again completes what is missing.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from pathlib import Path

import yaml

from ..errors import ArgumentParser, ConfigError, MissingPathError
from ..grids.folder import GRID_FILE
from ..grids.spec import parsed, settings_args
from . import grid

#: Trainer settings of every sweep cell: train ``--steps`` steps counted across epochs, validate once at the end.
SHORT_FIT = {
    "trainer.max_epochs": -1,
    "trainer.check_val_every_n_epoch": None,
    "trainer.num_sanity_val_steps": 0,
    "trainer.enable_progress_bar": False,
}


def patch_size(length: int, img_size: int) -> int:
    """The patch side cutting an ``img_size`` image into ``length`` patches; a ConfigError lists the lengths that
    fit."""
    side = math.isqrt(length)
    if side * side == length and side and img_size % side == 0:
        return img_size // side
    fitting = [(img_size // p) ** 2 for p in range(1, img_size + 1) if img_size % p == 0]
    raise ConfigError(
        f"--lengths {length}: a {img_size}-px image cuts into a square number of equal patches only: "
        f"{', '.join(map(str, fitting))} (or change --img-size)"
    )


def extra_settings(extra: list[str]) -> dict[str, str]:
    """The CLI arguments given after ``--`` (``--key value`` or ``--key=value``) as grid settings."""
    settings, index = {}, 0
    while index < len(extra):
        arg = extra[index]
        if not arg.startswith("--"):
            raise ConfigError(f"after --: {arg!r} is not an option; expected --key value or --key=value pairs")
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
        elif index + 1 < len(extra) and not extra[index + 1].startswith("--"):
            key, value, index = arg[2:], extra[index + 1], index + 1
        else:
            raise ConfigError(f"after --: {arg} has no value; expected --key value or --key=value")
        settings[key] = value
        index += 1
    return settings


def base_settings(config: Path, extra: dict[str, str]) -> tuple[dict, int, dict]:
    """The config's attention spec (as a dict), image size and ``model_kwargs``, as the CLI resolves them."""
    parsed_config = parsed(["--config", str(config), *settings_args(extra)], f"--config {config}")
    model = parsed_config.model.init_args
    spec = model.attention
    spec = dict(spec) if not isinstance(spec, str) else {"name": spec}
    data = parsed_config.data.get("init_args") or {}
    img_size = model.get("img_size") or data.get("img_size")  # the model takes the data's when it gives none
    if img_size is None:
        raise ConfigError(
            f"{config}: model.init_args.img_size or data.init_args.img_size must be set for a sweep "
            "over sequence lengths"
        )
    return spec, int(img_size), dict(model.get("model_kwargs") or {})


def sweep_grid(args: argparse.Namespace, extra: dict[str, str]) -> dict:
    """The grid file of the sweep: ``length`` x ``scale`` over the config, the report's scale-sweep figure."""
    spec, img_size, kwargs = base_settings(args.config, extra)
    img_size = args.img_size or img_size
    patches = {length: patch_size(length, img_size) for length in args.lengths}  # all checked before writing
    return {
        "name": re.sub(r"[^\w.=+-]", "_", f"sweep-{args.config.stem}"),
        "base": os.path.relpath(args.config.resolve(), args.out.resolve()),
        "args": {
            **SHORT_FIT,
            "trainer.max_steps": args.steps,
            "trainer.val_check_interval": args.steps,
            "model.init_args.img_size": img_size,
            "data.init_args.img_size": img_size,
            **extra,
        },
        "axes": {
            "length": {
                "key": "model.init_args.model_kwargs",
                "values": {f"N{length}": {**kwargs, "patch_size": patch} for length, patch in patches.items()},
            },
            "scale": {
                "key": "model.init_args.attention",
                "values": {f"scale{scale:g}": {**spec, "scale": scale} for scale in args.scales},
            },
        },
        "report": {"metric": "val/top1", "use": "last", "figure": "scale-sweep", "x": "scale", "lines": "length"},
    }


def parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="polyattn sweep",
        description=(
            "Train a config briefly for every attention scale and sequence length, as a grid (DIR/grid.yaml, run by "
            "`polyattn grid`), and plot the final validation top-1 against the scale (log axis), a line per length."
        ),
    )
    p.add_argument("--config", type=Path, required=True, help="a classification config, e.g. the digits quickstart")
    p.add_argument("--scales", type=float, nargs="+", required=True, help="attention scale factors")
    p.add_argument("--lengths", type=int, nargs="+", required=True, help="sequence lengths (patches per image)")
    p.add_argument("--steps", type=int, default=150, help="training steps per run")
    p.add_argument("--img-size", type=int, help="image side (default: the config's)")
    p.add_argument("--out", type=Path, required=True, help="the sweep's grid folder: grid.yaml, cells/, report/")
    p.add_argument("--parallel", type=int, default=1, help="runs at a time (processes on this machine)")
    p.add_argument("--dry-run", action="store_true", help="write the grid file, list the runs; train nothing")
    p.add_argument("extra", nargs=argparse.REMAINDER, help="after --: further CLI arguments for every run")
    return p


def main(argv: list[str] | None = None) -> Path:
    """Write the sweep's grid file and run it with ``polyattn grid``; the grid file's path."""
    args = parser().parse_args(argv)
    extra = extra_settings(args.extra[1:] if args.extra[:1] == ["--"] else args.extra)
    if not args.config.is_file():
        raise MissingPathError(f"--config {args.config} does not exist")
    if min(args.scales) <= 0 or args.steps < 1:
        raise ConfigError(f"--scales must be > 0 (log axis) and --steps >= 1; got {args.scales} and {args.steps}")
    if args.out.suffix.lower() in (".png", ".pdf", ".svg"):
        raise ConfigError(f"--out {args.out}: the sweep's folder (its grid file, runs and report/), not a figure")
    text = yaml.safe_dump(sweep_grid(args, extra), sort_keys=False)
    path = args.out / GRID_FILE
    if path.is_file() and path.read_text() != text:
        raise ConfigError(
            f"{path} holds another sweep (other scales, lengths, steps or config): nothing was changed; give this "
            "sweep another --out folder"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {path}")
    grid.main([str(path), "--out", str(args.out), "--parallel", str(args.parallel), *(["--dry-run"] * args.dry_run)])
    return path
