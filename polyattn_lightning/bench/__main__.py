"""``python -m polyattn_lightning.bench <name> [options]``: run one benchmark by name."""

from __future__ import annotations

import importlib
import sys

from ..errors import reported

BENCHMARKS = {
    "attention": "attention",
    "convert": "convert",
    "crossover": "crossover",
    "decode": "decode",
    "detection": "detection",
    "diagnostics": "diagnostics",
    "export-support": "export_support",
    "fingerprints": "fingerprints",
    "fsdp": "fsdp",
    "hf": "hf",
    "hf-support": "hf_support",
    "hf-sweep": "hf_sweep",
    "long-context": "long_context",
    "lra": "lra",
    "onnx": "onnx",
    "timm": "timm_models",
    "timm-support": "timm_support",
    "triton-static": "triton_static",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in BENCHMARKS:
        print(f"usage: python -m polyattn_lightning.bench {{{','.join(BENCHMARKS)}}} [options]", file=sys.stderr)
        return 2
    benchmark = importlib.import_module(
        f".{BENCHMARKS[argv[0]]}", __package__
    )  # imported on use: detection needs mmdet
    return reported(benchmark.main)(argv[1:])  # bad input: one line and exit 2, as from the CLI


if __name__ == "__main__":
    sys.exit(main())
