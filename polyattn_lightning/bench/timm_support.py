"""What ``set_attention`` switches, measured per timm model module: the table of ``docs/reference/timm-models.md``.

:func:`support_rows` builds one small model per model module of ``timm.list_models()`` (the first
name by :data:`SIZE_ORDER`, ``pretrained=False``, on the meta-free CPU), plus the :data:`VARIANTS`
whose attention differs within a module, and switches each to ``poly3`` with ``strict=False``: the
probe forward says what switched and what stays softmax, and why. ``python -m
polyattn_lightning.bench timm-support --write docs/reference/timm-models.md`` rewrites the table between its
markers; ``--check docs/reference/timm-models.md`` fails when that page's table differs from the measurement. The
``exports`` column says which ``polyattn export`` formats work for a switched row's model, read from
``docs/export-support.json`` (measured by exporting it: ``python -m polyattn_lightning.bench export-support
--kind timm``). A
module whose first model has no attention but a variant has (fastvit, mobilenetv3) shows the variant's row only.
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from dataclasses import dataclass

import timm
import torch

from ..attention.switch.base import SwitchedAttention
from ..attention.switch.timm import AttentionRefused, switch_modules
from ..attention.switch.timm.tables import class_name
from .export_table import export_cell
from .readme_table import Markers, table_command

#: Name parts of the small members of a model family, smallest first.
SIZE_ORDER = (
    "test",
    "atto",
    "femto",
    "pico",
    "nano",
    "xxxs",
    "xxs",
    "xx",
    "tiny",
    "xs",
    "x",
    "t",
    "mini",
    "small",
    "s",
    "b",
    "m",
    "base",
    "medium",
)

#: Variants whose attention differs from their module's first model: (module, timm model name, kwargs).
VARIANTS: tuple[tuple[str, str, dict], ...] = (
    ("vision_transformer", "vit_base_patch16_siglip_224", {}),  # global_pool='map': AttentionPoolLatent head
    ("vision_transformer", "vit_tiny_patch16_224", {"attn_layer": "diff"}),
    ("vision_transformer", "vit_small_patch16_18x2_224", {}),  # parallel blocks
    ("mobilevit", "mobilevitv2_050", {}),  # linear attention
    ("fastvit", "fastvit_sa12", {}),  # the first models have no attention stage
    ("mobilenetv3", "mobilenetv4_hybrid_medium", {}),  # MobileNetV4 hybrids: multi-query attention
)

#: The verdicts of the rows whose model is exported (``bench export-support``): the others switch nothing.
EXPORTED_VERDICTS = ("switched", "switched, pooling head softmax", "partly switched")

#: Smaller builds of models whose smallest registered size is slow on CPU (depth only: same classes).
SMALLER = {
    "beit_base_patch16_224": {"depth": 2},
    "deepseek_vit_412m": {"depth": 2},
    "gemma4_vit_167m": {"depth": 2},
    "qwen3_vit_88m": {"depth": 2},
    "samvit_base_patch16": {"depth": 2, "img_size": 256},
    "vit_base_patch16_siglip_224": {"depth": 2},
    "naflexvit_base_patch16_gap": {"depth": 2},
}

#: The documentation page that holds the table, relative to the checkout
PAGE = "docs/reference/timm-models.md"
BEGIN = f"<!-- timm-support: begin (python -m polyattn_lightning.bench timm-support --write {PAGE}) -->"
END = "<!-- timm-support: end -->"


@dataclass(frozen=True)
class SupportRow:
    family: str  # the timm model module
    model: str  # the timm model name (with the kwargs that make the variant)
    verdict: str  # "switched" | "switched, pooling head softmax" | "partly switched" | "refused" | "no attention"
    switched: str  # switched classes with counts
    softmax: str  # what stays softmax: class: reason
    exports: str = ""  # the export formats that work (export_table.export_cell); "" where nothing switched

    def markdown(self) -> str:
        cells = (self.family, f"`{self.model}`", self.verdict, self.switched, self.softmax, self.exports)
        return "| " + " | ".join(cells) + " |"


def model_modules() -> dict[str, list[str]]:
    """timm model module -> its registered model names."""
    return {module: names for module in timm.list_modules() if (names := timm.list_models(module=module))}


def smallest(names: list[str]) -> str:
    def rank(name: str) -> tuple[int, int, str]:
        parts = [re.sub(r"\d+$", "", p) for p in re.split(r"[_.]", name)]
        sizes = [SIZE_ORDER.index(p) for p in parts if p in SIZE_ORDER]
        return min(sizes, default=len(SIZE_ORDER)), len(name), name

    return min(names, key=rank)


def measure(family: str, name: str, kwargs: dict | None = None) -> SupportRow:
    """Build ``name`` (with ``kwargs``), switch it to poly3 non-strictly and say what happened."""
    return measure_model(family, name, kwargs)[0]


def measure_model(family: str, name: str, kwargs: dict | None = None) -> tuple[SupportRow, torch.nn.Module | None]:
    """:func:`measure`'s row and the model it built and switched (None where timm could not build it or the switch
    failed): ``bench export-support`` exports that model."""
    label = model_label(name, kwargs)
    kwargs = {**SMALLER.get(name, {}), **(kwargs or {})}
    torch.manual_seed(0)
    try:
        model = timm.create_model(name, pretrained=False, **kwargs)
    except Exception as err:  # noqa: BLE001 - a model timm cannot build here is a row, not a crash
        return SupportRow(family, label, "not built", "", f"timm.create_model failed: {type(err).__name__}"), None
    try:
        switched, unswitched = switch_modules(model, "poly3", False, None)
    except AttentionRefused as refused:
        switched, unswitched = [], refused.unswitched
    except Exception as err:  # noqa: BLE001
        return SupportRow(family, label, "error", "", f"{type(err).__name__}: {err}".replace("|", "/")[:200]), None
    counts = Counter(class_name(timm_class(m)) for m in switched)
    kept = Counter((class_name(u.cls), u.reason, u.by_decision) for u in unswitched)
    if not switched and not unswitched:
        verdict = "no attention"
    elif not switched:
        verdict = "refused"
    elif any(not by_decision for _, _, by_decision in kept):
        verdict = "partly switched"
    else:
        verdict = "switched" + (", pooling head softmax" if kept else "")
    row = SupportRow(
        family,
        label,
        verdict,
        "<br>".join(f"`{c}` x{n}" for c, n in sorted(counts.items())),
        "<br>".join(f"`{c}` x{n}: {reason}" for (c, reason, _), n in sorted(kept.items())),
        export_cell("timm", label) if verdict in EXPORTED_VERDICTS else "",
    )
    return row, model


def model_label(name: str, kwargs: dict | None = None) -> str:
    """A row's ``model measured`` cell: ``name`` with the kwargs it is built with (:data:`SMALLER`'s, then
    ``kwargs``)."""
    kwargs = {**SMALLER.get(name, {}), **(kwargs or {})}
    return name + "".join(f", {k}={v!r}" for k, v in kwargs.items())


def timm_class(module: torch.nn.Module) -> type:
    """The timm class a switched module was made from (the first of its bases that is no switch)."""
    return next(c for c in type(module).__mro__ if not issubclass(c, SwitchedAttention))


def support_rows(families: list[str] | None = None) -> list[SupportRow]:
    """One row per model module (``families``: only those) and per :data:`VARIANTS` entry of them."""
    modules = model_modules()
    rows = []
    for family in sorted(families or modules):
        rows.append(measure(family, smallest(modules[family])))
        rows += [measure(family, name, kwargs) for module, name, kwargs in VARIANTS if module == family]
    return rows


def table(rows: list[SupportRow]) -> str:
    attention = [r for r in rows if r.verdict != "no attention"]
    with_attention = {r.family for r in attention}
    none = sorted({r.family for r in rows} - with_attention)
    lines = [
        "| timm module | model measured | verdict | switched | stays softmax | exports |",
        "| --- | --- | --- | --- | --- | --- |",
        *(r.markdown() for r in attention),
    ]
    if none:
        lines += ["", f"No attention module (nothing to switch): {', '.join(none)}."]
    return "\n".join(lines)


MARKERS = Markers(BEGIN, END, "support-table")


def replace_table(text: str, new_table: str) -> str:
    return MARKERS.replace(text, new_table)


def main(argv: list[str] | None = None) -> int:
    return table_command(
        argv,
        prog="python -m polyattn_lightning.bench timm-support",
        description=__doc__.split("\n")[0],
        markers=MARKERS,
        measure=lambda names: table(support_rows(names or None)),
        subset_help="only these timm model modules",
    )


if __name__ == "__main__":
    sys.exit(main())
