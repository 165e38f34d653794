"""The Hugging Face table of docs/reference/hf-models.md is what the code measures (a few families here; all of them, slow)."""
from __future__ import annotations

from pathlib import Path

import pytest

from polyattn_lightning.bench import hf_support

TABLE = Path(__file__).resolve().parents[2] / hf_support.PAGE
#: Families whose rows exercise each route: mask/bias splits, extras, adapters, nn.MultiheadAttention.
SAMPLED = ["beit", "swin", "t5", "gpt-oss", "deberta-v2", "falcon-alibi", "siglip"]


def table_rows() -> dict[str, str]:
    text = TABLE.read_text()
    block = text[text.index(hf_support.BEGIN):text.index(hf_support.END)]
    return {line.split("|")[1].strip(): line for line in block.splitlines()
            if line.startswith("| ") and not line.startswith(("| family", "| ---"))}


def test_the_readme_has_one_row_per_family_of_the_tests():
    assert list(table_rows()) == [f.name for f in hf_support.FAMILIES]


def test_sampled_rows_of_the_table_are_measured():
    rows = table_rows()
    for key in SAMPLED:
        measured = hf_support.measure(hf_support.family(key))
        assert measured.markdown() == rows[measured.family]
        assert measured.state == "switched"
    assert "interface + adapter" in rows["SigLIP"] and "`MultiheadAttention` x1" in rows["SigLIP"]


def test_table_markers_are_required():
    with pytest.raises(ValueError, match="no Hugging Face table markers"):
        hf_support.replace_table("no table here", "| x |")
    text = f"before\n{hf_support.BEGIN}\nold\n{hf_support.END}\nafter"
    assert hf_support.replace_table(text, "new") == f"before\n{hf_support.BEGIN}\nnew\n{hf_support.END}\nafter"


def test_an_unknown_family_key_names_the_known_ones():
    with pytest.raises(KeyError, match="no family 'gpt-5'; known: bert, roberta"):
        hf_support.family("gpt-5")


@pytest.mark.slow
def test_whole_table_is_measured():
    """Every family (about 30 s on 2 cores): after adding one, run --write docs/reference/hf-models.md."""
    assert hf_support.main(["--check", str(TABLE)]) == 0


def test_the_sweep_switches_refuses_and_skips_with_a_reason():
    from polyattn_lightning.bench import hf_sweep

    assert hf_sweep.verdict("bert", "BertModel")[0] == "switched"
    kind, detail = hf_sweep.verdict("convbert", "ConvBertModel")
    assert kind == "refused" and detail.startswith("ConvBertModel cannot be switched: ") and "\n" not in detail
    config = hf_sweep.shrink(__import__("transformers").AutoConfig.for_model("clip"))
    assert config.text_config.hidden_size == config.vision_config.hidden_size == 32  # sub-configs too
