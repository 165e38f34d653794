"""The formats ``polyattn export`` writes, each with how the written file is loaded back to be checked.

While exporting, ``kernel="auto"`` takes a decomposable form (``attention.kernels.pick``): the graphs hold standard
operators only, the attention as its ``N x N`` scores.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.export import Dim, ExportedProgram

from .model import ExportRefused, FirstOutput, Source

#: The formats, with what each writes.
FORMATS = {
    "pt2": "a torch.export program (torch.export.save), dynamic batch and, where the model allows, sequence",
    "onnx": "ONNX (torch.onnx.export, dynamo=True), dynamic batch and, where the model allows, sequence",
    "state_dict": "a timm model's state dict without Lightning's 'model.' prefix",
    "pretrained": "a Hugging Face run's save_pretrained folder (the task's own export)",
}
#: The largest max abs difference an fp32 export may show against the PyTorch model.
TOLERANCE = 1e-4
#: The formats each kind of model takes.
KIND_FORMATS = {"timm": ("pt2", "onnx", "state_dict"), "hf": ("pt2", "onnx", "pretrained")}
#: The largest batch, and the longest sequence where the model's config states none, a dynamic dimension declares.
MAX_BATCH, MAX_SEQUENCE = 4096, 1 << 16


def export_program(model: nn.Module, sample: Tensor | tuple[Tensor, ...], sequence_dim: int | None = None):
    """``torch.export`` of ``model`` traced on ``sample`` (a tensor, or one per input) with a dynamic batch
    (dimension 0) and, where ``sequence_dim`` is given and the model allows it, a dynamic sequence length (else
    fixed at the traced one). Refuses, in one line, a model that does not export."""
    inputs = sample if isinstance(sample, tuple) else (sample,)
    batch = Dim("batch", min=1, max=MAX_BATCH)
    tries = [{0: batch}]
    if sequence_dim is not None:
        config = getattr(getattr(model, "model", None), "config", None)
        longest = getattr(config, "max_position_embeddings", None) or MAX_SEQUENCE
        tries.insert(0, {0: batch, sequence_dim: Dim("sequence", min=2, max=int(longest))})
    error: Exception | None = None
    for spec in tries:
        shapes = tuple(spec for _ in inputs)
        shapes = (shapes,) if isinstance(model, FirstOutput) else shapes  # its forward takes them as *tensors
        try:
            return torch.export.export(model, inputs, dynamic_shapes=shapes)
        except Exception as err:  # noqa: BLE001 - a fixed sequence is the next try; the last error is said
            error = err
    raise ExportRefused(f"{_name(model)} cannot be exported (torch.export): {first_line(error)}")


def dynamic_dims(program: ExportedProgram) -> str:
    """The dynamic dimensions of the program's first input, in words (``batch, sequence``)."""
    first = next(
        node
        for node in program.graph.nodes
        if node.op == "placeholder" and node.name in program.graph_signature.user_inputs
    )
    words = ("batch", "sequence")
    shape = first.meta["val"].shape
    return ", ".join(words[i] if i < 2 else f"dim {i}" for i, size in enumerate(shape) if not isinstance(size, int))


def write_export(
    model: nn.Module,
    fmt: str,
    sample: Tensor | tuple[Tensor, ...],
    path: Path,
    rebuild: Callable[[], nn.Module] | None = None,
    program: ExportedProgram | None = None,
    names: tuple[str, ...] | None = None,
) -> Callable[..., Tensor]:
    """Write ``model`` in ``fmt`` (``pt2``, ``onnx``, ``state_dict``) to ``path`` (``pt2`` and ``onnx`` from
    ``program``, else from :func:`export_program` on ``sample``, dynamic batch; ``names``: the ONNX inputs' names,
    the output is ``output``); returns a function that runs the written file, loaded back, on inputs (a state dict:
    in the model ``rebuild`` builds anew)."""
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

    try:
        onnx_program = torch.onnx.export(
            program, input_names=list(names) if names else None, output_names=["output"], dynamo=True, verbose=False
        )
    except Exception as err:  # noqa: BLE001 - the exporter's failure is the model's refusal, in one line
        raise ExportRefused(f"{_name(model)} cannot be exported to ONNX: {first_line(err)}") from err
    onnx_program.save(str(path))
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [given.name for given in session.get_inputs()]
    return lambda *x: torch.from_numpy(session.run(None, {n: t.numpy() for n, t in zip(names, x)})[0])


def write_source(source: Source, fmt: str, path: Path) -> tuple[Callable[..., Tensor], str]:
    """Write ``source`` in ``fmt`` to ``path``; returns a function running what was written, loaded back as a user
    loads it, and the dynamic dimensions of an exported graph in words (empty: a PyTorch model, any shape)."""
    if fmt == "pretrained":
        return write_pretrained(source, path), ""
    if fmt == "state_dict":
        return write_export(source.model, fmt, source.sample, path, source.rebuild), ""
    program = export_program(source.model, source.sample, source.sequence_dim)
    run = write_export(source.model, fmt, source.sample, path, program=program, names=source.names)
    return run, dynamic_dims(program)


def write_checked(source: Source, fmt: str, path: Path) -> tuple[float, str]:
    """:func:`write_source`, then what was written run on the source's inputs: its max abs difference from the
    PyTorch model, and the dynamic dimensions in words."""
    with torch.no_grad():
        run, dynamic = write_source(source, fmt, path)
        return (run(*source.inputs) - source.model(*source.inputs)).abs().max().item(), dynamic


def write_pretrained(source: Source, folder: Path) -> Callable[..., Tensor]:
    """The run's ``save_pretrained`` folder (the task's export: ``tasks.export.write_export``), loaded back with
    ``load_pretrained``."""
    from ..attention.switch.hf import load_pretrained

    source.save_pretrained(folder)
    model = load_pretrained(folder, auto_class=type(source.model.model)).eval()
    return FirstOutput(model, source.names)


def refusal(source: Source, fmt: str) -> str | None:
    """Why ``source`` cannot be written in ``fmt`` (None: it can)."""
    if fmt not in KIND_FORMATS[source.kind]:
        takes = "timm models" if fmt == "state_dict" else "Hugging Face runs"
        return f"--format {fmt} is for {takes}; {source.family} exports as {', '.join(KIND_FORMATS[source.kind])}"
    if fmt == "pretrained" and source.save_pretrained is None:
        return f"{source.family}: the source is a save_pretrained folder already; export it as pt2 or onnx"
    return None


def first_line(error: BaseException | None) -> str:
    """An exception in one line of at most 300 characters, without terminal colour codes."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", f"{type(error).__name__}: {error}").strip()
    return text.splitlines()[0][:300]


def _name(model: nn.Module) -> str:
    return type(model.model).__name__ if isinstance(model, FirstOutput) else type(model).__name__
