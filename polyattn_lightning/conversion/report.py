"""What a conversion did, per layer, as one record: logged, written as JSON and a figure, kept in checkpoints."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class ConversionReport:
    """One conversion: its method and activation, each layer's relative error to softmax (``sum ||out -
    softmax||^2 / sum ||softmax||^2`` over the samples' real tokens; 1.0 = a zero output) right after the switch
    (``error_before``), at the transfer's closed-form start (``error_start``) and converted (``error_after``), and
    what the method fitted. Plain values only, so it goes into a ``weights_only`` checkpoint as it is."""

    method: str
    activation: Any
    layers: list[str]
    error_before: list[float]
    error_after: list[float]
    samples: int
    seconds: float
    error_start: list[float] | None = None
    temperatures: list[list[float]] | None = None  # calibrate's (and a transfer's for softplus/sigmoid)
    gains: list[list[float]] | None = None  # a transfer's per-head output gains
    transfer: dict[str, Any] = field(default_factory=dict)  # steps, epochs, stopped, trainable, qk, rank

    def as_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(asdict(self)))

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ConversionReport:
        return cls(**values)

    def summary(self) -> str:
        """One line: the method, the median layer error before and after, what it trained."""
        before, after = statistics.median(self.error_before), statistics.median(self.error_after)
        line = (
            f"convert {self.method} to {self.activation}: {len(self.layers)} layers, median layer error "
            f"{before:.3g} -> {after:.3g} (max {max(self.error_before):.3g} -> {max(self.error_after):.3g}) "
            f"on {self.samples} samples, {self.seconds:.1f} s"
        )
        if self.transfer:
            t = self.transfer
            line += f"; {t['steps']} steps ({t['stopped']}), {t['trainable']} trained values (qk={t['qk']}), folded"
        return line

    def write(self, folder: str | Path) -> tuple[Path, Path]:
        """``conversion.json`` and ``conversion.png`` (per-layer error, before and after) in ``folder``."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        data = folder / "conversion.json"
        data.write_text(json.dumps(self.as_dict(), indent=1) + "\n")
        return data, self.figure(folder / "conversion.png")

    def figure(self, path: str | Path) -> Path:
        """Bars per layer (log scale): the error right after the switch, at the start, converted."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        series = [("switched as it is", self.error_before)]
        if self.error_start is not None:
            series.append(("closed-form start", self.error_start))
        series.append((f"{self.method}", self.error_after))
        count, width = len(self.layers), 0.8 / len(series)
        fig, ax = plt.subplots(figsize=(max(4.0, 0.5 * count + 2), 3.2))
        for i, (label, values) in enumerate(series):
            ax.bar([x + (i - (len(series) - 1) / 2) * width for x in range(count)], values, width, label=label)
        ax.set_yscale("log")
        ax.set_xticks(range(count), [str(i + 1) for i in range(count)])
        ax.set_xlabel("attention layer")
        ax.set_ylabel("relative error to softmax")
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")  # a zero output
        ax.set_title(f"{self.method} to {self.activation}", fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return Path(path)


__all__ = ["ConversionReport"]
