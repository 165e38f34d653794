"""timm-model benchmark: one training step of timm's own model against the switched softmax and poly3 ones.

``python -m polyattn_lightning.bench timm [--models eva02_small_patch14_224 beit_base_patch16_224]
[--img-size 224] [--batch 8] [--repeats 5] [--poly3 '{name: poly3, scale: inv_sqrt_n}'] [--json out.json]``

One step = forward, cross-entropy on fixed labels, backward and an AdamW step, on CPU, for a fixed
random batch. Per model three copies with the same initial weights: timm's own (``fused_attn`` on:
SDPA), the same switched to ``softmax`` by ``set_attention`` (the generic switch's overhead) and
switched to poly3. After one warm-up step each the steps run interleaved ``--repeats`` times; each
reports its median and spread (max - min), and the ratios switched-softmax / timm and poly3 /
switched-softmax come from medians of the same run.
"""

from __future__ import annotations

import copy
import os
import statistics
import sys
from pathlib import Path

import timm
import torch
import yaml

from ..errors import ArgumentParser
from ..attention import set_attention
from .timing import interleaved, machine, write_report

DEFAULT_MODELS = ("eva02_small_patch14_224", "beit_base_patch16_224")
DEFAULT_POLY3 = "{name: poly3, scale: inv_sqrt_n}"


def training_step(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model.train()

    def step(_: int) -> None:
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()

    return step


def bench_model(name: str, img_size: int, batch: int, repeats: int, poly3) -> dict:
    torch.manual_seed(0)
    timm_model = timm.create_model(name, pretrained=False, num_classes=1000, img_size=img_size)
    for module in timm_model.modules():
        if hasattr(module, "fused_attn"):
            module.fused_attn = True
    images = torch.randn(batch, 3, img_size, img_size, generator=torch.Generator().manual_seed(1))
    labels = torch.arange(batch) % 1000
    softmax, poly = copy.deepcopy(timm_model), copy.deepcopy(timm_model)
    set_attention(softmax, "softmax")
    set_attention(poly, poly3)
    steps = {
        "timm": training_step(timm_model, images, labels),
        "softmax": training_step(softmax, images, labels),
        "poly3": training_step(poly, images, labels),
    }
    times = interleaved(steps, repeats)
    medians = {k: statistics.median(v) for k, v in times.items()}
    return {
        "model": name,
        "img_size": img_size,
        "batch": batch,
        "repeats": repeats,
        "poly3": poly3,
        "seconds": times,
        "median_s": medians,
        "spread_s": {k: max(v) - min(v) for k, v in times.items()},
        "switched_softmax_over_timm": medians["softmax"] / medians["timm"],
        "poly3_over_switched_softmax": medians["poly3"] / medians["softmax"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m polyattn_lightning.bench timm", description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS))
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--poly3", default=DEFAULT_POLY3, help="the non-softmax activation (YAML)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    load = os.getloadavg()
    poly3 = yaml.safe_load(args.poly3)
    report = {"command": "timm", "results": [], "machine": machine(load)}
    for name in args.models:  # each model's line (and the JSON so far) as soon as it is measured
        r = bench_model(name, args.img_size, args.batch, args.repeats, poly3)
        report["results"].append(r)
        report["machine"] = machine(load)
        med, spread = r["median_s"], r["spread_s"]
        print(
            f"{r['model']} {r['img_size']}px batch {r['batch']}: "
            f"timm {med['timm']:.3f} s (spread {spread['timm']:.3f}), "
            f"switched softmax {med['softmax']:.3f} s ({spread['softmax']:.3f}), poly3 {med['poly3']:.3f} s "
            f"({spread['poly3']:.3f}); softmax/timm {r['switched_softmax_over_timm']:.3f}x, "
            f"poly3/softmax {r['poly3_over_switched_softmax']:.3f}x; load average now {os.getloadavg()}",
            flush=True,
        )
        write_report(report, args.json)
    print(f"load average before {load}, after {report['machine']['load_average_after']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
