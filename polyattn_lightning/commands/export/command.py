"""``polyattn export --ckpt RUN.ckpt|FOLDER --out PATH [--format pt2|onnx|state_dict|pretrained]``: a run's model
where it is deployed.

From a run's checkpoint (the config saved beside it, as ``polyattn maps`` finds it, gives the run's data) or a saved
switched Hugging Face folder (``save_pretrained``; checked on random inputs) to

* ``pt2``: a ``torch.export`` program (``torch.export.save``; dynamic batch and, for text models where the model
  allows it, dynamic sequence length), which loads with ``torch.export.load`` in a process without this project;
* ``onnx``: ONNX through ``torch.onnx.export(..., dynamo=True)`` (the same dynamic dimensions), the attention as
  standard operators (while exporting, ``kernel="auto"`` takes a decomposable form: ``attention.kernels.pick``);
* ``state_dict``: for timm models, the model's state dict without Lightning's ``model.`` prefix, which loads with
  ``timm.create_model`` + ``set_attention`` + ``load_state_dict``;
* ``pretrained``: for Hugging Face runs, the task's ``save_pretrained`` folder (``tasks.export.write_export``: the
  activation in its config, remote code where the model allows it), loaded back with ``load_pretrained``.

Each export is checked at once: the written file, loaded back (onnxruntime for ONNX), runs the run's inputs (a
batch of its validation data), traced on two of its rows and checked on all of them, and its max abs difference
from the PyTorch model is printed beside the tolerance. Beyond it, or where the model cannot export (a Hugging Face
model that takes more than token ids or images, a family the exporters fail on), the command refuses in one line and
nothing is left: the export is written under a temporary name and renamed only once it passed.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ...errors import ArgumentParser, ConfigError
from .formats import FORMATS, refusal, write_checked
from .source import ExportRefused, load_source

#: The largest max abs difference an fp32 export may show against the PyTorch model.
TOLERANCE = 1e-4


def export_checkpoint(
    ckpt: str | os.PathLike, out: str | os.PathLike, format: str = "pt2", tolerance: float = TOLERANCE
) -> Path:
    """Export the model of the run checkpoint, or saved Hugging Face folder, ``ckpt`` to ``out`` in ``format`` (one
    of :data:`FORMATS`), checked on the run's inputs against the PyTorch model (max abs difference at most
    ``tolerance``, fp32); returns ``out``. Refuses, in one line, an existing ``out``, an unknown format, a missing
    checkpoint, a model or format that cannot export, and an export beyond the tolerance (nothing written)."""
    ckpt, out = Path(ckpt), Path(out)
    if format not in FORMATS:
        raise ConfigError(f"unknown export format {format!r}; expected one of {', '.join(FORMATS)}")
    if not tolerance >= 0:
        raise ConfigError(f"tolerance {tolerance} must be a number >= 0 (the max abs error an export may show)")
    if out.exists():
        raise ConfigError(f"{out} already exists; give a new path (an export never overwrites)")
    source = load_source(ckpt)
    refused = refusal(source, format)
    if refused is not None:
        raise ExportRefused(refused)
    out.parent.mkdir(parents=True, exist_ok=True)
    suffix = "" if format == "pretrained" else f".{format}"  # torch.export.save wants .pt2
    partial = out.with_name(f".{out.name}.partial-{os.getpid()}{suffix}")
    rows = len(source.inputs[0])
    try:
        error, dynamic = write_checked(source, format, partial)
        verdict = "within" if error <= tolerance else "beyond"
        line = f"{format} export checked on {rows} {'images' if source.kind == 'timm' else 'rows'} of "
        line += f"{source.inputs_from}: max abs error {error:.3g} ({verdict} the tolerance {tolerance:g})"
        if error > tolerance:
            raise ConfigError(f"{line}; nothing written")
        partial.rename(out)
    finally:
        shutil.rmtree(partial) if partial.is_dir() else partial.unlink(missing_ok=True)
    print(line)
    print(f"wrote {out} ({FORMATS[format]}" + (f"; dynamic: {dynamic})" if dynamic else ")"))
    return out


def parser() -> ArgumentParser:
    """The command's options (``--ckpt``, ``--out``, ``--format``, ``--tolerance``)."""
    p = ArgumentParser(
        prog="polyattn export",
        description=(
            "Export a run's model, or a saved switched Hugging Face folder (pt2, onnx, a timm state dict, a "
            "Hugging Face run's save_pretrained folder), checked at once on the run's inputs against the PyTorch "
            f"model (max abs error at most {TOLERANCE:g}, fp32)."
        ),
    )
    p.add_argument(
        "--ckpt",
        type=Path,
        required=True,
        help="checkpoint of a run (its config.yaml beside it), or a saved switched Hugging Face folder",
    )
    p.add_argument("--out", type=Path, required=True, help="file (pretrained: folder) to write, never overwritten")
    p.add_argument("--format", default="pt2", help=f"one of {', '.join(FORMATS)} (default: pt2)")
    p.add_argument("--tolerance", type=float, default=TOLERANCE, help=f"max abs error allowed (default {TOLERANCE:g})")
    return p


def main(argv: list[str] | None = None) -> Path:
    """Run the command; returns what it wrote."""
    args = parser().parse_args(argv)
    return export_checkpoint(args.ckpt, args.out, args.format, args.tolerance)
