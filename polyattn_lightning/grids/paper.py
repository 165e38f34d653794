"""The papers' reported numbers, to print beside a grid's own (the grid file's ``report.paper`` names a table here).

Only numbers the paper states are here, each with its source; where a paper gives no number for a table (or it
was not found), the table exists with no rows and the report says "not reported", never a guess. A cell is matched
to a number by what it actually trained: the timm model name and the attention activation (resolved through the
attention registry, so ``poly3`` and ``{name: poly3, scale: inv_sqrt_n}`` are the same activation). The paper's
x^3 runs use the fixed scale 1/14 (14 = sqrt(196 patches)); x^3 with another scale, 1/sqrt(N) included, has no
paper number.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..attention import get_activation
from ..errors import ConfigError, UnknownNameError, closest_option

POLYNOMIAL_PAPER = (
    "Saratchandran, Zheng, Ji, Wang, Lucey, 'Rethinking Softmax: Self-Attention with Polynomial Activations' "
    "(arXiv 2410.18613, later version)"
)

#: The activations the papers' tables name, as the registry resolves them: (name, scale) -> the column's label.
SOFTMAX = "softmax"
CUBIC_FIXED = "x^3, scale 1/14"


@dataclass(frozen=True)
class PaperValue:
    """One reported number: ``reported`` as printed in the paper, ``value`` in the grid metric's units."""

    reported: float
    value: float
    unit: str
    model: str
    activation: str
    source: str


@dataclass(frozen=True)
class PaperTable:
    """A paper table: its numbers by timm model name and activation label, the quantity and where it comes from.

    ``metric_suffix``: the logged metrics it may stand beside (``val/top1``, ``test/top1`` for ``top1``);
    ``per_metric_unit``: the paper's units in one unit of the logged metric (a percent against a fraction: 100).
    """

    key: str
    quantity: str
    source: str
    metric_suffix: str
    unit: str = "%"
    per_metric_unit: float = 100.0
    models: Mapping[str, str] = field(default_factory=dict)  # timm name -> the paper's name
    numbers: Mapping[str, Mapping[str, float]] = field(default_factory=dict)  # paper's name -> activation -> value

    def compares_with(self, metric: str) -> bool:
        return metric.rsplit("/", 1)[-1] == self.metric_suffix

    def lookup(self, model_name: str | None, attention: Any) -> PaperValue | None:
        """The number for a run of ``model_name`` (a timm name, a ``.tag`` ignored) with ``attention``, if any."""
        model = self.models.get((model_name or "").split(".", 1)[0])
        column = activation_column(attention)
        if model is None or column is None or column not in self.numbers.get(model, {}):
            return None
        reported = self.numbers[model][column]
        value = round(reported / self.per_metric_unit, 12)  # 0.796, not 79.6 / 100's 0.7959999999999999
        return PaperValue(reported, value, self.unit, model, column, self.source)


def activation_column(attention: Any) -> str | None:
    """The paper column an attention spec is (:data:`SOFTMAX`, :data:`CUBIC_FIXED`), or None (no paper column)."""
    if attention is None:
        return None
    try:
        activation = get_activation(attention)
    except (ConfigError, TypeError, ValueError):  # an activation this build does not know: no paper number
        return None
    if activation.is_softmax:
        return SOFTMAX
    scale = activation.scale
    if activation.name == "poly3" and not isinstance(scale, str) and math.isclose(scale, 1 / 14, rel_tol=1e-6):
        return CUBIC_FIXED
    return None


def _not_reported(key: str, quantity: str) -> PaperTable:
    return PaperTable(
        key,
        quantity,
        f"{POLYNOMIAL_PAPER}: no numbers for this table were found in the paper",
        metric_suffix="",
    )


PAPERS: dict[str, PaperTable] = {
    table.key: table
    for table in (
        PaperTable(
            "imagenet_top1",
            "ImageNet-1k top-1 accuracy (%)",
            f"{POLYNOMIAL_PAPER}, ImageNet-1k table: softmax against x^3 with the fixed scale 1/14",
            metric_suffix="top1",
            models={
                "vit_base_patch16_224": "ViT-B",
                "vit_small_patch16_224": "ViT-S",
                "swin_base_patch4_window7_224": "Swin-B",
                "swin_small_patch4_window7_224": "Swin-S",
                "xcit_small_12_p16_224": "XCiT-S12",
            },
            numbers={
                "ViT-B": {SOFTMAX: 79.6, CUBIC_FIXED: 79.6},
                "ViT-S": {SOFTMAX: 80.2, CUBIC_FIXED: 80.5},
                "Swin-B": {SOFTMAX: 83.0, CUBIC_FIXED: 83.2},
                "Swin-S": {SOFTMAX: 83.3, CUBIC_FIXED: 83.4},
                "XCiT-S12": {SOFTMAX: 81.2, CUBIC_FIXED: 82.1},
            },
        ),
        _not_reported("tiny_imagenet_top1", "Tiny-ImageNet top-1 accuracy (table 1, figure 1)"),
        _not_reported("coco", "COCO box and mask AP"),
        _not_reported("lra", "Long Range Arena accuracy (table 4)"),
    )
}


def paper_table(key: str, where: str = "report.paper") -> PaperTable:
    """The table ``report.paper`` names; an error (led by ``where``) names the closest key and lists the known ones."""
    if key not in PAPERS:
        closest = closest_option(str(key), PAPERS)
        hint = f" (did you mean {closest!r}?)" if closest else ""
        raise UnknownNameError(f"{where}: unknown paper table {key!r}{hint}; known: {', '.join(PAPERS)}")
    return PAPERS[key]
