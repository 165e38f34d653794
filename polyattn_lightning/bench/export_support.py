"""Which ``polyattn export`` formats work per row of the timm and Hugging Face support tables, measured by exporting
each row's tiny model: what their ``exports`` column reads (:data:`~.export_table.EXPORT_SUPPORT`).

``python -m polyattn_lightning.bench export-support --kind timm|hf [--write FILE] [names...]`` builds the model
each support table measures, switched to ``poly3`` (timm: the row's model as :mod:`.timm_support` builds and
switches it, for the rows whose attention switches; Hugging Face: the family's tiny model, :mod:`.hf_support`), and
writes every format of its kind as ``polyattn export`` does (:func:`~polyattn_lightning.deploy.write_checked`): ``pt2``
and ``onnx`` traced on two rows and checked on three (``pt2`` named with its dynamic dimensions); timm
``state_dict`` through ``timm.create_model`` + ``set_attention`` + ``load_state_dict``; Hugging Face ``pretrained``
through the task's ``save_pretrained`` export (``tasks.export.write_export``) and
``load_pretrained``. A format works when its max abs difference from PyTorch is within the fp32 tolerance; one that
fails is refused with the error's first line (the temporary folder it was written in left out of it).
``--write`` merges each row into the file as soon as it is measured (the rows not measured keep theirs).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ..attention.switch import set_attention
from ..deploy import KIND_FORMATS, TOLERANCE, Source, hf_source, write_checked
from ..deploy.formats import first_line
from ..errors import ArgumentParser, ConfigError, closest_option
from ..tasks.export import write_export
from . import hf_support, quiet_loggers, timm_support
from .export_table import EXPORT_SUPPORT


def formats_of(source: Source) -> dict:
    """``{"formats": [...], "refused": {format: reason}}``: each format of the source's kind written and checked in
    a temporary folder (``pt2`` named with its dynamic dimensions)."""
    works, refused = [], {}
    for fmt in KIND_FORMATS[source.kind]:
        with tempfile.TemporaryDirectory() as folder:
            try:
                error, dynamic = write_checked(source, fmt, Path(folder) / f"model.{fmt}")
            except Exception as err:  # noqa: BLE001 - a format that fails is the row's cell, said in one line
                refused[fmt] = first_line(err).replace(folder + os.sep, "")[:200]  # no machine's path
                continue
        if error <= TOLERANCE:
            works.append(fmt + (f" (dynamic {dynamic})" if fmt == "pt2" else ""))
        elif error != error:  # NaN: the PyTorch model's own outputs are not finite on the random inputs
            refused[fmt] = "not checked: the PyTorch model's outputs on random inputs are not finite"
        else:
            refused[fmt] = f"max abs error {error:.3g} beyond the tolerance {TOLERANCE:g}"
    return {"formats": works, "refused": refused}


def timm_source(family: str, name: str, kwargs: dict) -> Source | str:
    """The timm model of a table row as the table measures it (:func:`.timm_support.measure_model`: built, switched
    to poly3 non-strictly; one build for the row's verdict and its export), on random images at its input size; its
    state dict loaded into the model built anew the same way. Where the row's attention is not switched (not built,
    refused, no attention...), its verdict and why: it has nothing to export."""

    def rebuild() -> nn.Module:
        again, model = timm_support.measure_model(family, name, kwargs)
        if model is None:
            raise RuntimeError(f"building {name} again failed: {again.verdict}: {again.softmax}")
        return model.eval()

    row, model = timm_support.measure_model(family, name, kwargs)
    if row.verdict not in timm_support.EXPORTED_VERDICTS:
        return row.verdict + (f" ({row.softmax})" if row.softmax else "")
    model.eval()
    size = getattr(getattr(model, "patch_embed", None), "img_size", None) or model.pretrained_cfg["input_size"][1:]
    size = (size, size) if isinstance(size, int) else tuple(size)
    images = torch.randn(3, model.pretrained_cfg["input_size"][0], *size, generator=torch.Generator().manual_seed(0))
    return Source("timm", name, model, ("images",), (images,), "random images", rebuild=rebuild)


def hf_family_source(key: str) -> Source:
    """The family's tiny model switched to poly3, on random inputs; its ``pretrained`` folder written by the tasks'
    export (:func:`~polyattn_lightning.tasks.export.write_export`)."""
    model = hf_support.build(hf_support.family(key))
    set_attention(model, "poly3")
    source = hf_source(model, None, "random inputs")
    source.save_pretrained = lambda folder: write_export(model, model.state_dict(), folder, None, None, None)
    return source


def measure_row(build: Callable[[], Source | str]) -> dict | str:
    """The formats of the source ``build`` makes; a model that cannot be exported at all is its row's reason. Where
    ``build`` makes none (a timm row whose attention is not switched), why not."""
    try:
        source = build()
    except Exception as err:  # noqa: BLE001 - a model that takes other inputs, or does not build, is a row
        return {"formats": [], "refused": {"all": first_line(err)[:200]}}
    return source if isinstance(source, str) else formats_of(source)


def rows_to_measure(kind: str, names: list[str]) -> dict[str, Callable[[], Source | str]]:
    """``row -> what builds its source``: the Hugging Face families (keys ``names``: only those), or the timm
    support table's rows (modules ``names``: only those; instead of a source, why not where the row's attention is
    not switched), keyed as the tables show them."""
    modules = timm_support.model_modules() if kind == "timm" else {}
    known = [fam.key for fam in hf_support.FAMILIES] if kind == "hf" else sorted(modules)
    unknown = [name for name in names if name not in known]
    if unknown:
        hints = [
            f"{name!r} (did you mean {near!r}?)" if (near := closest_option(name, known)) else repr(name)
            for name in unknown
        ]
        what = "Hugging Face family keys" if kind == "hf" else "timm model modules"
        listed = ", ".join(known) if len(known) <= 12 else f"{', '.join(known[:12])}, ... ({len(known)} in all)"
        raise ConfigError(f"unknown {what}: {', '.join(hints)}; expected some of {listed}")
    if kind == "hf":
        return {
            fam.name: (lambda key=fam.key: hf_family_source(key))
            for fam in hf_support.FAMILIES
            if not names or fam.key in names
        }
    rows = {}
    for family in names or known:
        candidates = [(timm_support.smallest(modules[family]), {})]
        candidates += [(name, kwargs) for module, name, kwargs in timm_support.VARIANTS if module == family]
        for name, kwargs in candidates:
            label = timm_support.model_label(name, kwargs)
            rows[label] = lambda family=family, name=name, kwargs=kwargs: timm_source(family, name, kwargs)
    return rows


def write(path: Path, kind: str, rows: dict[str, dict]) -> None:
    """Merge ``rows`` into the JSON file at ``path`` (the rows of other runs keep theirs)."""
    data = json.loads(path.read_text()) if path.exists() else {}
    data[kind] = dict(sorted({**data.get(kind, {}), **rows}.items()))
    data["measured_by"] = f"python -m polyattn_lightning.bench export-support (torch {torch.__version__})"
    path.write_text(json.dumps(data, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(
        prog="python -m polyattn_lightning.bench export-support", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--kind", choices=list(KIND_FORMATS), required=True, help="timm table rows or HF families")
    parser.add_argument(
        "--write", type=Path, help=f"merge the rows into this JSON file (the tables': {EXPORT_SUPPORT})"
    )
    parser.add_argument("names", nargs="*", help="only these timm model modules or HF family keys")
    args = parser.parse_args(argv)
    measured = {}
    with quiet_loggers("polyattn_lightning"), quiet_loggers("transformers"):
        todo = rows_to_measure(args.kind, args.names)
        for i, (row, build) in enumerate(todo.items()):
            print(f"export-support: {row} ({i + 1}/{len(todo)})", flush=True)
            entry = measure_row(build)
            if isinstance(entry, str):
                print(f"export-support: {row}: {entry}: nothing to export", flush=True)
                continue
            measured[row] = entry
            if args.write:  # each row as it is measured: a long run stopped keeps what it measured
                write(args.write, args.kind, {row: entry})
    if not measured:
        raise ConfigError(f"no {args.kind} row to measure among {args.names}")
    print(json.dumps(measured, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
