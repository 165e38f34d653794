"""ONNX latency in onnxruntime: the poly3 model exported as ``polyattn export`` exports it, against the softmax model
exported the same way and against the PyTorch eager models, one thread.

``python -m polyattn_lightning.bench onnx [--parts vit,minilm] [--repeats 20]``: ``vit``, ViT-S/16 (timm's
``vit_small_patch16_224``, random init) on one 224 px image; ``minilm``, the quickstart's MiniLM shape (a BERT encoder
of 6 layers, width 384, 12 heads, random init: no download) on one sequence of 128 tokens. Each is switched to ``poly3``
(and kept on softmax), made a :class:`~polyattn_lightning.deploy.Source`, exported to ONNX through
:func:`~polyattn_lightning.deploy.write_source` (dynamic batch, and sequence for text; traced on the source's two-row
sample) and run in onnxruntime with one intra-op and one inter-op thread (``torch.set_num_threads(1)`` for the eager
models); each exported model's max abs difference from PyTorch is reported, and one beyond the exports' tolerance
(:data:`~polyattn_lightning.deploy.TOLERANCE`) is an exit status 1. The four cases of a model (``poly3-onnx``,
``softmax-onnx``, ``poly3-eager``, ``softmax-eager``) run round-robin on ``--instances`` copies (sessions and models of
the same weights); the ratios are the medians of the paired ratios of one copy and one round, with their
distribution-free 95% interval (``bench hf``'s :func:`~.hf.paired`). The issue's target: ``poly3-onnx / softmax-onnx``
of ViT-S at most 1.1.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

from ..attention.switch import set_attention
from ..deploy import TOLERANCE, Source, hf_source, write_source
from ..errors import ArgumentParser
from . import chosen_parts, quiet_loggers
from .hf import paired, pooled, summarise
from .timing import interleaved, machine, write_report

#: The quickstart MiniLM's shape (all-MiniLM-L6-v2).
MINILM = dict(vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536)
PARTS = ("vit", "minilm")
NAMES = {"vit": "ViT-S/16, one 224 px image", "minilm": "MiniLM-shaped encoder, one sequence of 128 tokens"}
#: The cases of each model, the first the one the ratios are of.
CASES = ("poly3-onnx", "softmax-onnx", "poly3-eager", "softmax-eager")
#: The target of the issue: poly3 ViT-S in onnxruntime at most this many times the softmax one.
TARGET = 1.1


def source(part: str, activation: str) -> Source:
    """The part's model switched to ``activation``, as ``polyattn export`` takes it (a :class:`Source`: tensors in,
    one tensor out), on one row of inputs."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    if part == "vit":
        import timm

        model = timm.create_model("vit_small_patch16_224", pretrained=False).eval()
        set_attention(model, activation)
        image = torch.randn(1, 3, 224, 224, generator=generator)
        return Source("timm", type(model).__name__, model, ("images",), (image,), "a random image")
    from transformers import BertConfig, BertModel

    model = BertModel(BertConfig(**MINILM)).eval()
    set_attention(model, activation)
    ids = torch.randint(1000, 30000, (1, 128), generator=generator)
    return hf_source(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, "random token ids")


def session(source: Source, path: Path) -> tuple[Callable[[int], object], float]:
    """The source exported to ONNX as ``polyattn export`` exports it (traced on its two-row sample: a batch of one
    would be fixed), in a one-thread onnxruntime session: a step running it on the source's inputs, and the max abs
    difference of its output from the PyTorch model's."""
    import onnxruntime

    with torch.no_grad():
        write_source(source, "onnx", path)
        expected = source.model(*source.inputs)
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    options.execution_mode = onnxruntime.ExecutionMode.ORT_SEQUENTIAL
    run = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    feeds = {given.name: t.numpy() for given, t in zip(run.get_inputs(), source.inputs)}
    error = (torch.from_numpy(run.run(None, feeds)[0]) - expected).abs().max().item()
    return (lambda _: run.run(None, feeds)), error


def eager(model: nn.Module, inputs: tuple[Tensor, ...]) -> Callable[[int], object]:
    def step(_: int) -> None:
        with torch.no_grad():
            model(*inputs)

    return step


def steps(part: str, instances: int, folder: Path) -> tuple[dict[str, Callable[[int], object]], dict[str, float]]:
    """``case#i -> step`` for every case of :data:`CASES` and copy ``i``, and ``onnx case#i -> the max abs
    difference of its output from the PyTorch model's``."""
    found, errors = {}, {}
    for i in range(instances):
        for activation in ("poly3", "softmax"):
            exported = source(part, activation)
            path = folder / f"{part}-{activation}-{i}.onnx"
            found[f"{activation}-onnx#{i}"], errors[f"{activation}-onnx#{i}"] = session(exported, path)
            found[f"{activation}-eager#{i}"] = eager(exported.model, exported.inputs)
    return {name: found[name] for i in range(instances) for name in (f"{case}#{i}" for case in CASES)}, errors


def text(name: str, result: dict) -> str:
    lines = [name, "| case | ms (median, all copies) | x softmax-onnx |", "|---|---|---|"]
    lines += [f"| {case} | {e['s'] * 1e3:.1f} | {e['ratio_time']:.3f} |" for case, e in result["cases"].items()]
    errors = ", ".join(f"{case} {error:.3g}" for case, error in result["onnx_max_abs_error"].items())
    lines.append(f"ONNX outputs, max abs difference from PyTorch: {errors}")
    for base in ("softmax-onnx", "poly3-eager"):
        pair = result[f"poly3-onnx / {base}"]
        low, high = pair["ci95"]
        lines.append(
            f"poly3-onnx / {base}: {pair['median']:.3f}x, 95% interval {low:.3f}-{high:.3f} "
            f"(median of {pair['pairs']} paired ratios)"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m polyattn_lightning.bench onnx", description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per case and copy")
    parser.add_argument("--instances", type=int, default=2, help="copies of each case (sessions and models)")
    parser.add_argument("--json", default=None, help="write the full results here")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    parts = chosen_parts(parser, args.parts, PARTS)
    for option in ("repeats", "instances"):
        if getattr(args, option) < 1:
            parser.error(f"--{option} {getattr(args, option)}: expected a whole number, at least 1")
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    report = {"command": " ".join(["python -m polyattn_lightning.bench onnx", *argv])}
    wrong = []
    with tempfile.TemporaryDirectory() as folder, quiet_loggers("polyattn_lightning", "transformers"):
        for part in parts:
            print(f"onnx bench: exporting and timing {NAMES[part]} ({len(CASES)} cases x {args.instances})", flush=True)
            timed, errors = steps(part, args.instances, Path(folder))
            times = interleaved(timed, args.repeats)
            result = {"cases": summarise(pooled(times), "softmax-onnx", 1, "calls"), "onnx_max_abs_error": errors}
            for base in ("softmax-onnx", "poly3-eager"):
                result[f"poly3-onnx / {base}"] = paired(times, "poly3-onnx", base)
            report[part] = result
            print(text(NAMES[part], result))
            wrong += [f"{part} {case} ({error:.3g})" for case, error in errors.items() if not error <= TOLERANCE]
    if "vit" in report:
        ratio = report["vit"]["poly3-onnx / softmax-onnx"]["median"]
        verdict = "MET" if ratio <= TARGET else "MISS"
        print(f"{verdict}: ONNX poly3 ViT-S {ratio:.3f}x the softmax ViT-S in onnxruntime (target <= {TARGET}x)")
    report["machine"] = machine(load_before)
    print(f"load average before {load_before}, after {report['machine']['load_average_after']}")
    write_report(report, args.json)
    if wrong:
        print(f"WRONG: the ONNX outputs differ from PyTorch's beyond {TOLERANCE:g}: {', '.join(wrong)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
