"""Decoding from a recurrent state against a KV cache: one attention layer's step, and a tiny Llama generating.

    python -m polyattn_lightning.bench decode [--configs poly1/64,poly2/64,poly3/32]
        [--lengths 128,256,...,32768] [--heads 8] [--repeats 5] [--steps 20] [--model] [--write] [--json out.json]

Per layer (batch 1, ``--heads`` heads, one token, fp32), at each context length N, interleaved (median of
``--repeats`` samples of ``--steps`` steps each):

* ``sdpa``: ``F.scaled_dot_product_attention`` of the new query over a preallocated K/V of N tokens (softmax;
  what HF's ``sdpa`` runs per token, without the cache's append);
* ``kv``: this project's KV-cache step (``attention()`` on one row, no mask, no gradient) over the same K/V;
* ``state``: the step from a recurrent state (``attention(..., state=...)``: fold the token's key into ``S``, read
  it with its query).

The state step does not depend on N (its time should be flat from 1k to 32k); the goals are at 32k: poly1 >= 10x, poly2
(d = 64) >= 5x, poly3 (d = 32) >= 3x faster than ``sdpa``. ``--write`` records, per power and head dim, the
length from which the state step beats the ``kv`` step as the crossover table's ``decode`` row (what
``RecurrentCache`` switches at). ``--model``: the bench's tiny Llama (random weights, head dim 16) generating
``--new-tokens`` tokens greedily after prompts of ``--prompts`` tokens: HF ``sdpa``, ``poly3`` with the KV cache,
``poly3`` with ``RecurrentCache`` (the table's threshold) and with a state from the first token.
"""

from __future__ import annotations

import os
import statistics
import sys

import torch
import torch.nn.functional as F

from ..attention import attention, get_activation
from ..attention.functional import recurrent_state
from ..attention.kernels import base
from ..errors import ArgumentParser
from .hf import LLAMA
from .timing import crossing, interleaved, machine, write_report, write_table_rows

DEFAULT_LENGTHS = tuple(2**i for i in range(7, 16))  # 128 .. 32,768 (the goals: 1k .. 32k)
GOALS = {1: 10.0, 2: 5.0, 3: 3.0}  # state step x faster than sdpa at 32k (poly2 at d = 64, poly3 at d = 32)


def layer_steps(p: int, d: int, n: int, heads: int, steps: int) -> dict:
    """The three per-layer steps at context ``n``, each running ``steps`` tokens."""
    g = torch.Generator().manual_seed(n)
    keys, values = torch.randn(1, heads, n, d, generator=g), torch.randn(1, heads, n, d, generator=g)
    q, k, v = (torch.randn(1, heads, 1, d, generator=g) for _ in range(3))
    act, t = get_activation(f"poly{p}"), d**-0.5
    state = recurrent_state(keys, values, act)

    def repeat(fn):
        def run(_):
            with torch.no_grad():
                for _ in range(steps):
                    fn()

        return run

    return {
        "sdpa": repeat(lambda: F.scaled_dot_product_attention(q, keys, values)),
        "kv": repeat(lambda: attention(q, keys, values, act, temperature=t)),
        "state": repeat(lambda: attention(q, k, v, act, temperature=t, state=state)),
    }


def layer_curves(configs, lengths, heads, repeats, steps) -> list[dict]:
    rows = []
    for p, d in configs:
        points = []
        for n in lengths:
            times = interleaved(layer_steps(p, d, n, heads, steps), repeats)
            point = {"n": n, **{name: statistics.median(t) / steps for name, t in times.items()}}
            points.append(point)
            print(
                f"  poly{p} d={d} N={n}: "
                + ", ".join(f"{k} {point[k] * 1e6:.1f} us" for k in times)
                + f"; state x{point['sdpa'] / point['state']:.1f} sdpa",
                flush=True,
            )
        state = [point["state"] for point in points if point["n"] >= 1024] or [point["state"] for point in points]
        n_star = crossing([pt["n"] for pt in points], [pt["state"] / pt["kv"] for pt in points])
        rows.append(
            {
                "p": p,
                "d": d,
                "points": points,
                "flatness": max(state) / min(state),
                "decode_crossover": None if n_star is None else round(n_star),
            }
        )
    return rows


def model_generation(prompts: list[int], new_tokens: int, repeats: int) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    from ..attention import set_attention
    from ..attention.switch.hf import RecurrentCache

    config = dict(LLAMA, max_position_embeddings=max(prompts) + new_tokens + 8)  # bench hf's tiny Llama
    torch.manual_seed(0)
    base_model = LlamaForCausalLM(LlamaConfig(**config, attn_implementation="sdpa")).eval()
    switched = LlamaForCausalLM(LlamaConfig(**config, attn_implementation="sdpa")).eval()
    switched.load_state_dict(base_model.state_dict())
    set_attention(switched, "poly3")
    results = {}
    for length in prompts:
        prompt = torch.randint(2, 384, (1, length), generator=torch.Generator().manual_seed(length))

        def generate(model, cache=None):
            def run(_):
                with torch.no_grad():
                    model.generate(
                        prompt,
                        max_new_tokens=new_tokens,
                        min_new_tokens=new_tokens,
                        do_sample=False,
                        pad_token_id=0,
                        cache=None if cache is None else cache(),
                    )

            return run

        cases = {
            "sdpa": generate(base_model),
            "poly3 kv": generate(switched),
            "poly3 recurrent": generate(switched, lambda: RecurrentCache(switched)),
            "poly3 recurrent from token 0": generate(switched, lambda: RecurrentCache(switched, threshold=0)),
        }
        times = {name: statistics.median(t) for name, t in interleaved(cases, repeats).items()}
        results[length] = {
            name: {"s": s, "tokens_per_s": new_tokens / s, "x_sdpa": s / times["sdpa"]} for name, s in times.items()
        }
        print(
            f"  tiny Llama, prompt {length}, {new_tokens} new tokens: "
            + ", ".join(f"{k} {v['s']:.3f} s ({v['x_sdpa']:.2f}x sdpa)" for k, v in results[length].items())
        )
    return results


def goal_lines(rows: list[dict]) -> list[str]:
    lines = []
    for row in rows:
        at = max(row["points"], key=lambda point: point["n"])
        speedup = at["sdpa"] / at["state"]
        goal = GOALS.get(row["p"])
        verdict = "" if goal is None else (" MET" if speedup >= goal else " MISS") + f" (goal >= {goal}x)"
        lines.append(
            f"poly{row['p']} d={row['d']}: state step flat within {row['flatness']:.2f}x "
            f"({'MET' if row['flatness'] <= 1.5 else 'MISS'}, goal <= 1.5x); at N={at['n']} "
            f"x{speedup:.1f} sdpa{verdict}; beats the kv step from N={row['decode_crossover']}"
        )
    return lines


def _configs(text: str) -> list[tuple[int, int]]:
    pairs = []
    for item in text.split(","):
        name, _, d = item.partition("/")
        pairs.append((int(name.removeprefix("poly")), int(d)))
    return pairs


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m polyattn_lightning.bench decode", description=__doc__.split("\n")[0])
    parser.add_argument("--configs", type=_configs, default=_configs("poly1/64,poly2/64,poly3/32"))
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=list(DEFAULT_LENGTHS))
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="tokens per timed sample")
    parser.add_argument("--model", action="store_true", help="also the tiny Llama's generation")
    parser.add_argument("--prompts", type=lambda s: [int(x) for x in s.split(",")], default=[8, 2048])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument(
        "--write",
        nargs="?",
        const=str(base.CROSSOVER_TABLE),
        default=None,
        help="merge the decode crossovers into the table (default: the shipped one)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--json", default=None)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    report = {"command": " ".join(["python -m polyattn_lightning.bench decode", *argv])}
    report["layer"] = layer_curves(args.configs, args.lengths, args.heads, args.repeats, args.steps)
    if args.model:
        report["model"] = model_generation(args.prompts, args.new_tokens, args.repeats)
    report["machine"] = machine(load_before)
    print("| power | d | " + " | ".join(f"N={n}: sdpa / kv / state us (x sdpa)" for n in args.lengths) + " |")
    print("|---|---|" + "---|" * len(args.lengths))
    for row in report["layer"]:
        cells = [
            f"{pt['sdpa'] * 1e6:.0f} / {pt['kv'] * 1e6:.0f} / {pt['state'] * 1e6:.0f} ({pt['sdpa'] / pt['state']:.1f}x)"
            for pt in row["points"]
        ]
        print(f"| {row['p']} | {row['d']} | " + " | ".join(cells) + " |")
    for line in goal_lines(report["layer"]):
        print(line)
    print(f"load average before {load_before}, after {report['machine']['load_average_after']}")
    if args.write:
        rows = [
            dict(p=row["p"], d=row["d"], causal=True, mode="decode", n=row["decode_crossover"])
            for row in report["layer"]
        ]
        write_table_rows(
            args.write,
            base.device_key(torch.device("cpu")),
            rows,
            command=report["command"],
            load=[load_before, report["machine"]["load_average_after"]],
            threads=torch.get_num_threads(),
        )
    write_report(report, args.json)
    return 0
