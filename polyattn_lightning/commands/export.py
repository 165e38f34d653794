"""``polyattn export --ckpt RUN.ckpt --out FILE [--format pt2|onnx|state_dict]``: a run's model where it is deployed.

From a run's checkpoint (the config saved beside it, as ``polyattn maps`` finds it, gives the run's data) to

* ``pt2``: a ``torch.export`` program (``torch.export.save``; dynamic batch), which loads with
  ``torch.export.load`` in a process without this project;
* ``onnx``: ONNX through ``torch.onnx.export(..., dynamo=True)`` (dynamic batch), the attention as standard
  operators (while exporting, ``kernel="auto"`` takes a decomposable form: ``attention.kernels.pick``);
* ``state_dict``: for timm models, the model's state dict without Lightning's ``model.`` prefix, which loads with
  ``timm.create_model`` + ``set_attention`` + ``load_state_dict``.

Each export is checked at once: the written file, loaded back (onnxruntime for ONNX; for the state dict a model built
anew as above), runs a batch of the run's validation data, traced on two of its samples and checked on all of them,
and its max abs difference from the PyTorch model is printed beside the tolerance. Beyond it nothing is left: the file
is written under a temporary name and renamed only once it passed.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import yaml
from torch import Tensor, nn

from ..attention import set_attention
from ..cli import make_cli
from ..cli.runs import checkpoint_run_dir, newest_saved_config
from ..errors import ArgumentParser, ConfigError, MissingPathError
from .check_data import DataOnlyCLI
from .maps import load_module

#: The formats, with what each writes.
FORMATS = {
    "pt2": "a torch.export program (torch.export.save), dynamic batch",
    "onnx": "ONNX (torch.onnx.export, dynamo=True), dynamic batch",
    "state_dict": "a timm model's state dict without Lightning's 'model.' prefix",
}
#: The largest max abs difference an fp32 export may show against the PyTorch model.
TOLERANCE = 1e-4


def run_images(ckpt: Path) -> Tensor:
    """The inputs of the first validation batch of the run that wrote ``ckpt``, built from the config saved beside
    it."""
    config = newest_saved_config(checkpoint_run_dir(ckpt))
    if config is None:
        raise ConfigError(
            f"no config saved beside {ckpt} (its run folder's config.yaml): the export is checked on a batch of the "
            "run's data, which that config names"
        )
    sys.argv = sys.argv[:1]  # parsed here: LightningCLI would warn that its args and sys.argv both hold some
    saved = yaml.safe_load(config.read_text()) or {}
    pieces = {key: saved[key] for key in ("model", "data") if key in saved}  # the fit-only keys (ckpt_path) left out
    with tempfile.TemporaryDirectory() as folder:
        config_piece = Path(folder, "config.yaml")
        config_piece.write_text(yaml.safe_dump(pieces))
        datamodule = make_cli(["--config", str(config_piece)], run=False, cli_class=DataOnlyCLI).datamodule
    datamodule.prepare_data()
    datamodule.setup("validate")
    batch = next(iter(datamodule.val_dataloader()))
    images = batch[0] if isinstance(batch, (tuple, list)) else None
    if not isinstance(images, Tensor):
        raise ConfigError(f"{config}: the run's batches are not (images, labels); polyattn export takes image models")
    return images


def exportable(module) -> nn.Module:
    """The module's network, refused in one line (with the reason) where it is not a timm image model."""
    model = getattr(module, "model", None)
    if not (isinstance(model, nn.Module) and hasattr(model, "pretrained_cfg")):
        raise ConfigError(
            f"polyattn export takes timm image models; {type(module).__name__}'s "
            f"{type(model).__name__} is not one (a Hugging Face model: its save_pretrained folder, "
            "`polyattn consolidate`; a detector's post-processing is data-dependent and does not export)"
        )
    return model


def fresh_timm_model(module) -> nn.Module:
    """The module's timm model built anew as a user would: ``timm.create_model`` and ``set_attention``."""
    import timm

    hp = module.hparams
    kwargs = dict(hp.get("model_kwargs") or {})
    if hp.get("img_size") is not None:
        kwargs["img_size"] = hp.img_size
    model = timm.create_model(hp.model_name, num_classes=hp.num_classes, **kwargs)
    if hp.get("attention") is not None:
        set_attention(model, hp.attention)
    return model.eval()


def export_program(model: nn.Module, sample: Tensor) -> torch.export.ExportedProgram:
    """``torch.export`` of ``model`` traced on ``sample`` with a dynamic batch (dimension 0)."""
    batch = torch.export.Dim("batch", min=1, max=4096)
    return torch.export.export(model, (sample,), dynamic_shapes=({0: batch},))


def write_export(
    model: nn.Module,
    fmt: str,
    sample: Tensor,
    path: Path,
    rebuild: Callable[[], nn.Module] | None = None,
    program: torch.export.ExportedProgram | None = None,
) -> Callable[[Tensor], Tensor]:
    """Write ``model`` in ``fmt`` to ``path`` (``pt2`` and ``onnx`` from ``program``, else from
    :func:`export_program` on ``sample``); returns a function that runs the written file, loaded back, on images (a
    state dict: in the model ``rebuild`` builds anew)."""
    if fmt == "state_dict":
        torch.save(model.state_dict(), path)
        fresh = rebuild()
        fresh.load_state_dict(torch.load(path, weights_only=True))
        return fresh
    program = program or export_program(model, sample)
    if fmt == "pt2":
        torch.export.save(program, path)
        return torch.export.load(path).module()
    import onnxruntime

    torch.onnx.export(program, dynamo=True, verbose=False).save(str(path))
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return lambda x: torch.from_numpy(session.run(None, {name: x.numpy()})[0])


def export_checkpoint(
    ckpt: str | os.PathLike, out: str | os.PathLike, format: str = "pt2", tolerance: float = TOLERANCE
) -> Path:
    """Export the model of the run checkpoint ``ckpt`` to ``out`` in ``format`` (one of :data:`FORMATS`), checked
    on a batch of the run's data against the PyTorch model (max abs difference at most ``tolerance``, fp32); returns
    ``out``. Refuses, in one line, an existing ``out``, an unknown format, a missing checkpoint, a model that cannot
    export, and an export beyond the tolerance (nothing written)."""
    ckpt, out = Path(ckpt), Path(out)
    if format not in FORMATS:
        raise ConfigError(f"unknown export format {format!r}; expected one of {', '.join(FORMATS)}")
    if not tolerance >= 0:
        raise ConfigError(f"tolerance {tolerance} must be a number >= 0 (the max abs error an export may show)")
    if out.exists():
        raise ConfigError(f"{out} already exists; give a new path (an export never overwrites)")
    if not ckpt.exists():
        raise MissingPathError(f"checkpoint {ckpt} does not exist")
    module = load_module(ckpt, None)
    model = exportable(module).eval()
    images = run_images(ckpt).float()
    sample = images[:2] if len(images) > 2 else images.repeat(2, 1, 1, 1)[:2]  # traced at 2, checked at the batch
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.partial-{os.getpid()}.{format}")  # torch.export.save wants .pt2
    try:
        with torch.no_grad():
            run = write_export(model, format, sample, partial, lambda: fresh_timm_model(module))
            error = (run(images) - model(images)).abs().max().item()
        verdict = "within" if error <= tolerance else "beyond"
        line = f"{format} export checked on {len(images)} images of the run's data: max abs error {error:.3g} "
        line += f"({verdict} the tolerance {tolerance:g})"
        if error > tolerance:
            raise ConfigError(f"{line}; nothing written")
        partial.rename(out)
    finally:
        partial.unlink(missing_ok=True)
    print(line)
    print(f"wrote {out} ({FORMATS[format]})")
    return out


def parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="polyattn export",
        description=(
            "Export a run's model (pt2, onnx, or a timm state dict), checked at once on a batch of the run's data "
            f"against the PyTorch model (max abs error at most {TOLERANCE:g}, fp32)."
        ),
    )
    p.add_argument("--ckpt", type=Path, required=True, help="checkpoint of a run (its config.yaml beside it)")
    p.add_argument("--out", type=Path, required=True, help="file to write (never overwritten)")
    p.add_argument("--format", default="pt2", help=f"one of {', '.join(FORMATS)} (default: pt2)")
    p.add_argument("--tolerance", type=float, default=TOLERANCE, help=f"max abs error allowed (default {TOLERANCE:g})")
    return p


def main(argv: list[str] | None = None) -> Path:
    """Run the command; returns the file written."""
    args = parser().parse_args(argv)
    return export_checkpoint(args.ckpt, args.out, args.format, args.tolerance)
