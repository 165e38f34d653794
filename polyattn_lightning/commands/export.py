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
import sys
import tempfile
from pathlib import Path

import yaml
from torch import Tensor, nn

from ..attention import set_attention
from ..cli import make_cli
from ..cli.runs import checkpoint_run_dir, newest_saved_config
from ..deploy import FORMATS, TOLERANCE, ExportRefused, Source, hf_source, refusal, write_checked
from ..errors import ArgumentParser, ConfigError, MissingPathError
from .check_data import DataOnlyCLI
from .maps import load_module


def export_checkpoint(
    ckpt: str | os.PathLike, out: str | os.PathLike, format: str = "pt2", tolerance: float = TOLERANCE
) -> Path:
    """Export the model of the run checkpoint, or saved Hugging Face folder, ``ckpt`` to ``out`` in ``format`` (one
    of :data:`~polyattn_lightning.deploy.FORMATS`), checked on the run's inputs against the PyTorch model (max abs
    difference at most ``tolerance``, fp32); returns ``out``. Refuses, in one line, an existing ``out``, an unknown
    format, a missing checkpoint, a model or format that cannot export, and an export beyond the tolerance (nothing
    written)."""
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


def load_source(path: Path) -> Source:
    """The model of a run's checkpoint (file or sharded folder) or of a saved Hugging Face folder, with its inputs;
    refuses, in one line, what is neither a timm image model nor a Hugging Face model taking ids or images."""
    if not path.exists():
        raise MissingPathError(f"checkpoint {path} does not exist (a run's checkpoint, or a saved model folder)")
    if path.is_dir() and (path / "config.json").is_file():
        return _saved_folder(path)
    module = load_module(path, None)
    model = exportable(module).eval()
    datamodule = run_data(path)
    batch, inputs_from = next(iter(datamodule.val_dataloader())), "the run's data"
    if hasattr(model, "pretrained_cfg"):
        images = batch[0] if isinstance(batch, (tuple, list)) else None
        if not isinstance(images, Tensor):
            raise ConfigError(f"{inputs_from}: the run's batches are not (images, labels) as a timm model takes")
        return Source(
            "timm",
            type(model).__name__,
            model,
            ("images",),
            (images.float(),),
            inputs_from,
            rebuild=lambda: fresh_timm_model(module),
        )
    source = hf_source(model, batch, inputs_from)
    tokenizer = getattr(datamodule, "tokenizer", None)
    source.save_pretrained = lambda folder: _save_pretrained(module, tokenizer, folder)
    return source


def _save_pretrained(module, tokenizer, folder: Path) -> None:
    """The task's own ``save_pretrained`` export, with the run's tokenizer beside the model (as ``export_dir``)."""
    module.export(folder)
    if callable(getattr(tokenizer, "save_pretrained", None)):
        tokenizer.save_pretrained(folder)


def exportable(module) -> nn.Module:
    """The module's network, refused in one line (with the reason) where it is neither a timm image model nor a
    Hugging Face model."""
    model = getattr(module, "model", None)
    if isinstance(model, nn.Module) and (hasattr(model, "pretrained_cfg") or _is_hf(model)):
        return model
    raise ConfigError(
        f"polyattn export takes timm image models and Hugging Face models; {type(module).__name__}'s "
        f"{type(model).__name__} is neither (a detector's post-processing is data-dependent and does not export)"
    )


def run_data(ckpt: Path):
    """The validation data of the run that wrote ``ckpt`` (its data module, built from the config saved beside it
    and set up for validation)."""
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
    return datamodule


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


def _saved_folder(folder: Path) -> Source:
    import transformers

    from ..attention.switch.hf import load_pretrained

    config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    architectures = getattr(config, "architectures", None) or []
    cls = getattr(transformers, architectures[0], None) if architectures else None
    model = load_pretrained(folder, auto_class=cls)
    return hf_source(model, None, f"random inputs (a saved folder, {folder}, has no run to take a batch from)")


def _is_hf(model: nn.Module) -> bool:
    return hasattr(model, "config") and type(model).__module__.startswith("transformers.")


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
