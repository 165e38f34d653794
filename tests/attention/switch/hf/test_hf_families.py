"""Every Hugging Face family of the README's table (``polyattn_lightning.bench.hf_support.FAMILIES``), switched
through the one door with its default probe: softmax equals HF's own outputs, poly3 equals the tests' own
reference (``references.py``: HF's eager code of the family with its softmax replaced by S^3 / sqrt(N)), with
position tables drawn at unit scale and a padded batch where the model takes text. The families switched by the
project's adapters (``hf_support.REFERENCE_CHECKS``) are checked more closely in ``test_hf_adapters.py``: in
float64, with gradients and caches."""
from __future__ import annotations

import copy

import pytest
import torch
from references import reference_twin

from polyattn_lightning.attention import attention_modules, set_attention
from polyattn_lightning.attention.switch.hf import probe_inputs
from polyattn_lightning.bench.hf_support import FAMILIES, REFERENCE_CHECKS, SOFTMAX_PARITY, build, run

#: poly3 against the reference: the largest difference relative to the largest output.
RELATIVE = 1e-4

FAMILY_KEYS = [f.key for f in FAMILIES if f.key not in REFERENCE_CHECKS]


def _relative_error(out, expected):
    return ((out - expected).abs().max() / expected.abs().max()).item()


@pytest.mark.parametrize("key", FAMILY_KEYS)
def test_softmax_equals_hf_and_poly3_equals_the_reference(key):
    fam = next(f for f in FAMILIES if f.key == key)
    model = build(fam)
    inputs = probe_inputs(model, tokens=9, padded=3)
    expected_softmax = run(model, inputs)
    reference = run(reference_twin(model), inputs)

    softmax = copy.deepcopy(model)
    count = set_attention(softmax, "softmax")
    assert count == len(attention_modules(softmax)) > 0
    assert (run(softmax, inputs) - expected_softmax).abs().max().item() <= SOFTMAX_PARITY

    assert set_attention(model, "poly3") == count
    out = run(model, inputs)
    assert _relative_error(out, reference) <= RELATIVE
    assert _relative_error(out, expected_softmax) > 1e-2  # the activation changed the outputs


def test_every_family_has_a_distinct_key_and_the_position_tables_are_not_zero():
    assert len({f.key for f in FAMILIES}) == len(FAMILIES)
    for key in ("beit", "swin", "data2vec-vision", "t5", "gpt-oss", "deberta", "mpnet"):
        model = build(next(f for f in FAMILIES if f.key == key))
        tables = [p for n, p in model.named_parameters() if "relative" in n or "sinks" in n or "rel_emb" in n]
        assert tables and all(p.abs().mean() > 0.3 for p in tables), key


def test_a_padded_text_batch_reaches_the_layers():
    """The probe's padding matters: the padded row's real tokens equal the same tokens alone (poly3, DeBERTa-v2
    through its adapter and BERT through the interface)."""
    for key in ("bert", "deberta-v2", "mpnet"):
        model = build(next(f for f in FAMILIES if f.key == key))
        set_attention(model, "poly3")
        inputs = probe_inputs(model, tokens=9, padded=3)
        with torch.no_grad():
            batch = model(**inputs).last_hidden_state
            alone = model(input_ids=inputs["input_ids"][1:, :6]).last_hidden_state
        torch.testing.assert_close(batch[1, :6], alone[0], atol=1e-5, rtol=1e-4, msg=key)


def measured_errors(key):
    """``(softmax max abs difference from HF, poly3 max difference relative to the reference)`` of one family."""
    fam = next(f for f in FAMILIES if f.key == key)
    model = build(fam)
    inputs = probe_inputs(model, tokens=9, padded=3)
    expected, reference = run(model, inputs), run(reference_twin(model), inputs)
    softmax = copy.deepcopy(model)
    set_attention(softmax, "softmax")
    set_attention(model, "poly3")
    return (run(softmax, inputs) - expected).abs().max().item(), _relative_error(run(model, inputs), reference)


if __name__ == "__main__":  # the README's numbers: PYTHONPATH=.:tests/attention/switch/hf python <this file>
    for key in FAMILY_KEYS:
        print("%-16s softmax %.1e  poly3 %.1e" % (key, *measured_errors(key)))
