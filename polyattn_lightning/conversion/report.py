"""What a conversion did, per layer, as one record: logged, written as JSON and a figure, kept in checkpoints."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

#: Why a transfer stopped, in words.
STOPPED = {
    "held-out": "held-out error no longer falling",
    "plateau": "training loss no longer falling, nothing held out",
    "steps": "step cap, still falling",
}


@dataclass
class ConversionReport:
    """One conversion: its method and activation, each layer's relative error to softmax (``sum ||out -
    softmax||^2 / sum ||softmax||^2`` over the samples' real tokens; 1.0 = a zero output) on the samples the method
    fitted (a transfer's training part) right after the switch (``error_before``), at the transfer's closed-form
    start (``error_start``) and converted (``error_after``); converted, on the ``held_out`` samples a transfer did
    not train on (``error_held_out``); what the method fitted, and the warnings it gave (samples too few or too
    alike to judge it, a step cap reached). Plain values only, so it goes into a ``weights_only`` checkpoint as it
    is."""

    method: str
    activation: Any
    layers: list[str]
    error_before: list[float]
    error_after: list[float]
    samples: int
    seconds: float
    held_out: int = 0  # of the samples
    error_held_out: list[float] | None = None
    error_start: list[float] | None = None
    temperatures: list[list[float]] | None = None  # calibrate's (and a transfer's for softplus/sigmoid)
    gains: list[list[float]] | None = None  # a transfer's per-head output gains
    transfer: dict[str, Any] = field(default_factory=dict)  # steps, stopped, kept_steps, curve, trainable, qk, rank
    warnings: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(asdict(self)))

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ConversionReport:
        return cls(**values)

    def summary(self) -> str:
        """One line: the method, the median (and max) layer error before and after, on the training and held-out
        samples, what it trained and why it stopped, and how many warnings it gave."""
        before, after = statistics.median(self.error_before), statistics.median(self.error_after)
        line = (
            f"convert {self.method} to {self.activation}: {len(self.layers)} layers, median layer error "
            f"{before:.3g} -> {after:.3g} (max {max(self.error_before):.3g} -> {max(self.error_after):.3g})"
        )
        if self.error_held_out is not None:
            held_out = self.error_held_out
            line += (
                f" on {self.samples - self.held_out} training samples, {statistics.median(held_out):.3g} (max "
                f"{max(held_out):.3g}) on {self.held_out} held out"
            )
        else:
            line += f" on {self.samples} samples"
        line += f", {self.seconds:.1f} s"
        if self.transfer:
            t = self.transfer
            line += f"; {t['steps']} steps ({STOPPED.get(t['stopped'], t['stopped'])}), {t['trainable']} trained values"
            line += f" (qk={t['qk']}), folded"
        if self.warnings:
            line += f"; {len(self.warnings)} warning{'s' if len(self.warnings) > 1 else ''}: {self.warnings[0]}"
        return line

    def write(self, folder: str | Path) -> tuple[Path, Path]:
        """``conversion.json`` and ``conversion.png`` (per-layer error, before and after) in ``folder``."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        data = folder / "conversion.json"
        data.write_text(json.dumps(self.as_dict(), indent=1) + "\n")
        return data, self.figure(folder / "conversion.png")

    def figure(self, path: str | Path) -> Path:
        """Bars per layer (log scale): the error right after the switch, at the start, converted, and converted on
        the held-out samples; beside them, a transfer's errors at each check against its steps."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        series = [("switched as it is", self.error_before)]
        if self.error_start is not None:
            series.append(("closed-form start", self.error_start))
        series.append((f"{self.method}", self.error_after))
        if self.error_held_out is not None:
            series.append((f"{self.method}, held out", self.error_held_out))
        curve = self.transfer.get("curve") or []
        count, width = len(self.layers), 0.8 / len(series)
        fig, axes = plt.subplots(1, 2 if curve else 1, figsize=(max(4.0, 0.5 * count + 2) + (4.0 if curve else 0), 3.2))
        ax = axes[0] if curve else axes
        for i, (label, values) in enumerate(series):
            ax.bar([x + (i - (len(series) - 1) / 2) * width for x in range(count)], values, width, label=label)
        ax.set_yscale("log")
        ax.set_xticks(range(count), [str(i + 1) for i in range(count)])
        ax.set_xlabel("attention layer")
        ax.set_ylabel("relative error to softmax")
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")  # a zero output
        ax.set_title(f"{self.method} to {self.activation}", fontsize=9)
        ax.legend(fontsize=7)
        if curve:
            self._curve(axes[1], curve)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return Path(path)

    def _curve(self, ax, curve: list[list]) -> None:
        """A transfer's checks: the training loss and the held-out error (summed over a chunk's layers) against
        the steps, one pair of lines per chunk of layers, each chunk's kept step marked."""
        chunks = sorted({point[0] for point in curve})
        for number, first in enumerate(chunks):
            points = [p for p in curve if p[0] == first]
            suffix = f", layers from {first + 1}" if len(chunks) > 1 else ""
            for column, label, style in ((2, "training", "-"), (3, "held out", "--")):
                xs = [p[1] for p in points if p[column] is not None]
                if xs:
                    ys = [p[column] for p in points if p[column] is not None]
                    ax.plot(xs, ys, ls=style, color=f"C{number % 10}", label=label + suffix)
            kept = self.transfer.get("kept_steps") or []
            if number < len(kept):
                ax.axvline(kept[number], color=f"C{number % 10}", lw=0.8, ls=":")
        ax.set_yscale("log")
        ax.set_xlabel("transfer step (dotted: the weights kept)")
        ax.set_ylabel("layer error, summed")
        ax.set_title(f"stopped: {STOPPED.get(self.transfer.get('stopped'), '-')}", fontsize=9)
        ax.legend(fontsize=7)


__all__ = ["ConversionReport"]
