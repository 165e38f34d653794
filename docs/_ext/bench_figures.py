"""The benchmark pages' figures, drawn with matplotlib from the committed JSON in ``benchmarks/`` at build time.

No figure is committed: each is drawn from the file the page's table comes from, so a figure always shows the
measurement beside it and a fresh clone draws the same ones. The build writes them to
``docs/benchmarks/figures/`` (git-ignored) before it reads the pages, which show them with ordinary Markdown
images. Without Sphinx: ``python docs/_ext/bench_figures.py OUTDIR`` draws them into OUTDIR.

Each figure is a function of the checkout's root returning the matplotlib figure; ``FIGURES`` names them by
file name. A JSON file that is missing or lacks a key fails the build naming the file.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "docs" / "benchmarks" / "figures"


def load(root: Path, name: str) -> dict:
    path = root / "benchmarks" / name
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise RuntimeError(f"bench_figures: cannot read {path}: {error}") from error


def machine_line(data: dict) -> str:
    m = data.get("machine", {})
    return f"{m.get('cpu', '?')}, {m.get('cpu_count', '?')} cores, {m.get('torch_threads', '?')} torch threads, fp32"


def crossover(root: Path):
    """Kernel time against N: the fused quadratic kernel and the exact linear form, and where they cross."""
    import matplotlib.pyplot as plt

    long = load(root, "long_context_poly3_cpu_2core.json")
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    points = long["results"][0]["points"]
    n = [p["n"] for p in points]
    left.loglog(n, [p["quadratic_s"] for p in points], "o-", label="quadratic (fused_cpu)")
    left.loglog(n, [p["linear_s"] for p in points], "s-", label="linear (power)")
    left.loglog(n, [p["auto_s"] for p in points], "x--", color="black", label='kernel="auto"')
    left.set(xlabel="sequence length N", ylabel="forward+backward (s)",
             title="poly3, d = 32, B = 1, H = 2: time per call")  # fmt: skip
    left.legend()
    for name in ("crossover_cpu_2core_d32.json", "crossover_cpu_2core_d64.json"):
        for row in load(root, name)["rows"]:
            if row["mode"] != "train" or not row.get("points"):
                continue
            label = f"poly{row['p']}, d = {row['d']}{', causal' if row['causal'] else ''}"
            right.loglog([p["n"] for p in row["points"]], [p["ratio"] for p in row["points"]], "o-", label=label)
    right.axhline(1.0, color="black", linewidth=0.8)
    right.set(xlabel="sequence length N", ylabel="linear / quadratic time",
              title="forward+backward: below 1 the linear form is faster")  # fmt: skip
    right.legend(fontsize=8)
    fig.suptitle(machine_line(long), fontsize=9)
    fig.tight_layout()
    return fig


def decode(root: Path):
    """Microseconds per generated token of one layer: softmax over a KV cache, poly over a KV cache, poly's state."""
    import matplotlib.pyplot as plt

    data = load(root, "decode_cpu_2core.json")
    rows = [r for r in data["layer"] if (r["p"], r["d"]) in {(1, 64), (3, 32)}]
    fig, axes = plt.subplots(1, len(rows), figsize=(5.5 * len(rows), 4.2), squeeze=False)
    for axis, row in zip(axes[0], rows):
        n = [p["n"] for p in row["points"]]
        for key, label, style in (("sdpa", "softmax (SDPA) over the KV cache", "o-"),
                                  ("kv", f"poly{row['p']} over the KV cache", "s-"),
                                  ("state", f"poly{row['p']} from its state", "^-")):  # fmt: skip
            axis.loglog(n, [p[key] * 1e6 for p in row["points"]], style, label=label)
        axis.set(xlabel="tokens so far N", ylabel="us per step", title=f"poly{row['p']}, d = {row['d']}, 8 heads")
        axis.legend(fontsize=8)
    fig.suptitle(machine_line(data) + ", one thread", fontsize=9)
    fig.tight_layout()
    return fig


def kernels_cpu(root: Path):
    """Forward+backward time of each kernel as a multiple of SDPA softmax, at the four shapes."""
    import matplotlib.pyplot as plt

    data = load(root, "attention_cpu_2core.json")
    shapes = list(data["results"])
    cases = [c for c in data["results"][shapes[0]]["cases"] if c not in ("softmax/sdpa", "poly3/naive")]
    fig, axis = plt.subplots(figsize=(11, 4.2))
    width = 0.8 / len(shapes)
    for i, shape in enumerate(shapes):
        got = data["results"][shape]["cases"]
        axis.bar([c + i * width for c in range(len(cases))], [got[c]["ratio"]["fwd_bwd_s"] for c in cases], width,
                 label=f"{shape} (N = {data['results'][shape]['shape']['N']})")  # fmt: skip
    axis.axhline(1.0, color="black", linewidth=0.8)
    axis.set_yscale("log")
    axis.set_xticks([c + 0.4 - width / 2 for c in range(len(cases))], cases, rotation=20, fontsize=8)
    axis.set(ylabel="forward+backward time / SDPA's", title="each kernel against softmax (SDPA), same shape, same run")
    axis.legend(fontsize=8)
    fig.suptitle(machine_line(data), fontsize=9)
    fig.tight_layout()
    return fig


FIGURES = {"crossover.png": crossover, "decode.png": decode, "kernels_cpu.png": kernels_cpu}


def draw(out: Path, root: Path = ROOT) -> list[Path]:
    """Every figure of ``FIGURES`` into ``out``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, figure in FIGURES.items():
        fig = figure(root)
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(out / name)
    return written


def builder_inited(app) -> None:
    draw(Path(app.srcdir) / "benchmarks" / "figures")


def setup(app):
    app.connect("builder-inited", builder_inited)
    return {"parallel_read_safe": True, "parallel_write_safe": True}


if __name__ == "__main__":
    for path in draw(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT):
        print(path)
