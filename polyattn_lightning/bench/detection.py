"""Detection benchmark: one training step of XCiT-S12 Mask R-CNN + FPN, softmax against poly3, same run.

``python -m polyattn_lightning.bench detection [--size 256x256] [--batch 1] [--repeats 3]
[--attention '{name: poly3, scale: 0.0714}'] [--config configs/detection/model/...yaml] [--json out.json]``

One step = the detector's data preprocessor, ``mode='loss'``, backward and an AdamW step, on CPU,
for a fixed synthetic batch (``--batch`` images of ``--size`` with three boxes and masks each, no
resizing). The two detectors share their initial weights and differ only in the backbone's attention.
After one warm-up step each, the steps run interleaved (softmax, poly3, softmax, ...) ``--repeats``
times, each from the same RNG seed so both sample the same way, and each reports its median. The
backbone alone (forward and backward of its four maps) is timed the same way, so that a slow step
can be traced to the backbone's attention or cleared of it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import numpy as np
import torch
import yaml
from torch import nn

from ..errors import ArgumentParser
from ..attention import get_activation
from . import CONFIGS
from .timing import interleaved, machine, write_report

#: The detector benchmarked when ``--config`` is not given (shipped with the package).
DEFAULT_CONFIG = CONFIGS / "detection/model/mask_rcnn_xcit_s12_p16_fpn.yaml"
DEFAULT_POLY3 = "{name: poly3, scale: 0.0714}"


def synthetic_batch(batch: int, height: int, width: int, seed: int = 0) -> dict:
    """``batch`` random images with three boxes and their masks each, packed by mmdet's PackDetInputs."""
    from mmcv.transforms import Compose
    from mmdet.structures.mask import BitmapMasks
    from mmengine.dataset import pseudo_collate

    pack = Compose([dict(type="PackDetInputs")])
    rng = np.random.default_rng(seed)
    samples = []
    for index in range(batch):
        corners = np.array([[0.1, 0.1, 0.5, 0.6], [0.4, 0.3, 0.9, 0.8], [0.05, 0.55, 0.35, 0.95]])
        boxes = corners * [width, height, width, height]
        masks = np.zeros((len(boxes), height, width), np.uint8)
        for mask, (x1, y1, x2, y2) in zip(masks, boxes.astype(int)):
            mask[y1:y2, x1:x2] = 1
        samples.append(
            pack(
                dict(
                    img=rng.integers(0, 256, (height, width, 3), dtype=np.uint8),
                    img_shape=(height, width),
                    ori_shape=(height, width),
                    img_id=index,
                    img_path=f"{index}.jpg",
                    scale_factor=(1.0, 1.0),
                    gt_bboxes=boxes.astype(np.float32),
                    gt_bboxes_labels=np.arange(len(boxes)) % 80,
                    gt_ignore_flags=np.zeros(len(boxes), bool),
                    gt_masks=BitmapMasks(masks, height, width),
                )
            )
        )
    return pseudo_collate(samples)


def build_detector(config: Path, attention) -> nn.Module:
    """The mmdet detector of ``config`` (a YAML model mapping) with the backbone's attention set."""
    from ..detection import XCiTBackbone  # noqa: F401  (installs the mmcv ops, fills mmdet's registries)
    from mmdet.registry import MODELS
    from mmengine.config import ConfigDict

    cfg = yaml.safe_load(config.read_text())
    cfg["backbone"]["attention"] = attention
    return MODELS.build(ConfigDict(cfg)).train()


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict, seed: int) -> float:
    """Preprocess, loss, backward, optimizer step; returns the loss."""
    torch.manual_seed(seed)  # the RPN and RoI samplers draw the same way for every model
    optimizer.zero_grad(set_to_none=True)
    losses = model(**model.data_preprocessor(batch, True), mode="loss")
    loss, _ = model.parse_losses(losses)
    loss.backward()
    optimizer.step()
    return loss.item()


def backbone_step(model: nn.Module, images: torch.Tensor) -> None:
    """Forward and backward of the backbone's four maps."""
    model.zero_grad(set_to_none=True)
    sum(m.float().pow(2).mean() for m in model.backbone(images)).backward()


def _size(text: str) -> tuple[int, int]:
    try:
        height, width = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"size {text!r}: expected HxW, e.g. 256x256") from None
    if height < 32 or width < 32:
        raise argparse.ArgumentTypeError(f"size {text!r}: each side must be at least 32")
    return height, width


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m polyattn_lightning.bench detection", description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="mmdet model mapping (YAML)")
    parser.add_argument("--size", type=_size, default=(256, 256), help="image height x width (default 256x256)")
    parser.add_argument("--batch", type=int, default=1, help="images per step (default 1)")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per model (median reported)")
    parser.add_argument(
        "--attention", default=DEFAULT_POLY3, help=f"the attention against softmax (default {DEFAULT_POLY3})"
    )
    parser.add_argument("--json", default=None, help="write the full results here")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if not args.config.is_file():
        parser.error(f"--config {args.config}: no such file")
    attention = yaml.safe_load(args.attention)
    try:
        label = get_activation(attention).name
    except (TypeError, ValueError, KeyError) as err:
        parser.error(f"--attention {args.attention}: {err}")
    if label == "softmax":
        parser.error("--attention: give the activation to compare with softmax, e.g. poly3")

    load_before = os.getloadavg()
    torch.manual_seed(0)
    softmax = build_detector(args.config, "softmax")
    other = build_detector(args.config, attention)
    other.load_state_dict(softmax.state_dict())
    models = {"softmax": softmax, label: other}
    batch = synthetic_batch(args.batch, *args.size)
    images = softmax.data_preprocessor(batch, True)["inputs"]
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-4, weight_decay=0.05) for name, m in models.items()}

    steps = {
        f"{name}/train_step": (lambda seed, m=m, o=optimizers[name]: train_step(m, o, batch, seed))
        for name, m in models.items()
    }
    steps |= {f"{name}/backbone_fwd_bwd": (lambda seed, m=m: backbone_step(m, images)) for name, m in models.items()}
    print(
        f"running {len(steps)} cases x {args.repeats} at {args.batch}x{args.size[0]}x{args.size[1]} ...",
        file=sys.stderr,
        flush=True,
    )
    times = interleaved(steps, args.repeats)
    medians = {name: statistics.median(t) for name, t in times.items()}
    (base, other_name) = list(models)
    parts = ("train_step", "backbone_fwd_bwd")
    ratios = {part: medians[f"{other_name}/{part}"] / medians[f"{base}/{part}"] for part in parts}

    print(f"| case | {base} (s) | {other_name} (s) | ratio |")
    print("|---|---|---|---|")
    for part, ratio in ratios.items():
        print(f"| {part} | {medians[f'{base}/{part}']:.3f} | {medians[f'{other_name}/{part}']:.3f} | {ratio:.3f} |")
    met = ratios["train_step"] <= 1.05
    print(f"{'MET ' if met else 'MISS'} {other_name} train step / softmax <= 1.05: {ratios['train_step']:.3f}")
    if args.json:
        report = {
            "command": " ".join(["python -m polyattn_lightning.bench detection", *argv]),
            "machine": machine(load_before),
            "input": {"batch": args.batch, "height": args.size[0], "width": args.size[1], "config": str(args.config)},
            "attention": attention,
            "samples_s": times,
            "median_s": medians,
            "ratio": ratios,
            "target": {"target": "train step ratio <= 1.05", "value": ratios["train_step"], "met": met},
        }
        write_report(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
