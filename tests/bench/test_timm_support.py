"""The timm support table of docs/reference/timm-models.md is what the code measures (a few cheap modules here; all of them, slow)."""
from __future__ import annotations

from pathlib import Path

import pytest

from polyattn_lightning.bench import timm_support

TABLE = Path(__file__).resolve().parents[2] / timm_support.PAGE
#: Modules whose rows do not depend on the hand-written adapters (generic switches and refusals), cheap to build.
SAMPLED = ["eva", "maxxvit", "pvt_v2", "resnest", "swiftformer", "efficientvit_mit"]


def table_rows() -> dict[str, list[str]]:
    text = TABLE.read_text()
    block = text[text.index(timm_support.BEGIN):text.index(timm_support.END)]
    rows: dict[str, list[str]] = {}
    for line in block.splitlines():
        if line.startswith("| ") and not line.startswith(("| timm module", "| ---")):
            rows.setdefault(line.split("|")[1].strip(), []).append(line)
    return rows


def test_sampled_rows_of_the_table_are_measured():
    rows = table_rows()
    measured = timm_support.support_rows(SAMPLED)
    assert {r.family: [r.markdown()] for r in measured} == {f: rows[f] for f in SAMPLED}
    verdicts = {r.family: r.verdict for r in measured}
    assert verdicts["eva"] == "switched" and verdicts["resnest"] == "refused"
    assert "not attention over tokens" in next(r.softmax for r in measured if r.family == "resnest")


def test_table_markers_are_required(tmp_path):
    with pytest.raises(ValueError, match="no support-table markers"):
        timm_support.replace_table("no table here", "| x |")
    text = f"before\n{timm_support.BEGIN}\nold\n{timm_support.END}\nafter"
    assert timm_support.replace_table(text, "new") == f"before\n{timm_support.BEGIN}\nnew\n{timm_support.END}\nafter"


def test_smallest_model_of_a_module():
    assert timm_support.smallest(["vit_base_patch16_224", "vit_tiny_patch16_224", "vit_small_patch16_224"]) \
        == "vit_tiny_patch16_224"
    assert timm_support.smallest(["cait_m36_384", "cait_xxs24_224", "cait_s24_224"]) == "cait_xxs24_224"


@pytest.mark.slow
def test_whole_table_is_measured():
    """Every timm model module (about 10 minutes on 2 cores): after adding a family, run --write docs/reference/timm-models.md."""
    assert timm_support.main(["--check", str(TABLE)]) == 0
