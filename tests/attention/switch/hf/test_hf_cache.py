"""``RecurrentCache``: generation from a fixed-size state gives the tokens and logits of a KV cache and of the
parallel (uncached) forward. A tiny random grouped-query Llama (4 query heads on 2 kv heads, head dim 8) generates
200 tokens after a left-padded prompt; ``threshold=0`` keeps a state from the first token, ``threshold=50``
starts as a KV cache and folds it into the state when the context passes 50 tokens.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from hf_models import tiny_llama
from torch.utils._python_dispatch import TorchDispatchMode

from polyattn_lightning.attention import set_attention
from polyattn_lightning.attention.functional import recurrent_state
from polyattn_lightning.attention.kernels import base
from polyattn_lightning.attention.kernels.base import cpp
from polyattn_lightning.attention.kernels.base.state import RecurrentState, features, monomial_count, monomials
from polyattn_lightning.attention.kernels.power import recurrent
from polyattn_lightning.attention.switch.hf import RecurrentCache
from polyattn_lightning.attention.switch.hf.cache import decode_crossover
from polyattn_lightning.errors import ConfigError

NEW_TOKENS = 200


@pytest.fixture(scope="module", params=["poly3", "poly1"])
def model(request):
    model = tiny_llama(max_position_embeddings=256)
    set_attention(model, request.param)
    return model


def prompt():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 64, (2, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding, as generate() pads a batch
    return ids, mask


def generate(model, cache, **options):
    ids, mask = prompt()
    torch.manual_seed(0)
    return model.generate(
        ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=0,
        output_logits=True, return_dict_in_generate=True, cache=cache, **options,
    )


def assert_same_generation(out, reference):
    assert torch.equal(out.sequences, reference.sequences)
    for got, want in zip(out.logits, reference.logits):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("threshold", [0, 50])
@pytest.mark.parametrize("options", [dict(do_sample=False), dict(do_sample=True, top_k=0)], ids=["greedy", "sampled"])
def test_tokens_and_logits_equal_the_kv_cache(model, options, threshold):
    cache = RecurrentCache(model, threshold=threshold)
    assert_same_generation(generate(model, cache, **options), generate(model, None, **options))
    assert cache.recurrent == [True, True] and all(layer.keys is None or not layer.keys.numel() for layer in cache.layers)
    assert cache.get_seq_length() == 7 + NEW_TOKENS - 1  # the last token is returned, never fed back
    # left padding entered neither the state nor n: row 1 has 3 keys fewer
    counts = cache.layers[0].count
    assert torch.equal(counts, torch.tensor([[206.0, 206.0], [203.0, 203.0]]))


def test_beam_search_reorders_the_state(model):
    options = dict(num_beams=3, do_sample=False)
    out = generate(model, RecurrentCache(model, threshold=0), **options)
    assert torch.equal(out.sequences, generate(model, None, **options).sequences)


def test_generation_equals_the_parallel_forward(model):
    """The cached steps' logits are those of one uncached forward over the generated sequence."""
    out = generate(model, RecurrentCache(model, threshold=0), do_sample=False)
    ids, mask = prompt()
    full_mask = torch.cat([mask, torch.ones(2, NEW_TOKENS, dtype=mask.dtype)], dim=1)
    with torch.no_grad():
        logits = model(out.sequences, attention_mask=full_mask).logits
    for step, got in enumerate(out.logits):
        torch.testing.assert_close(got, logits[:, ids.shape[1] - 1 + step], rtol=0, atol=1e-5)


def test_the_state_is_the_sum_of_weighted_features():
    """``S = sum_j w m(k_j) v_j^T`` over the unpadded keys, the kernels' state against one written here."""
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 2, 9, 4, generator=g, dtype=torch.float64), torch.randn(2, 2, 9, 3, generator=g).double()
    keep = torch.ones(2, 9, dtype=torch.bool)
    keep[1, :4] = False
    for p in (1, 2, 3):
        index, weight = monomials(4, p)
        assert len(weight) == math.comb(4 + p - 1, p) and weight.sum() == 4**p  # sum of multinomials: d^p
        folded = recurrent_state(k, v, f"poly{p}", key_padding_mask=~keep)
        state, count = folded.kv, folded.count
        kept = keep[:, None, :, None]
        explicit = (k[..., index].prod(-1) * weight * kept).transpose(-2, -1) @ (v * kept)
        torch.testing.assert_close(state, explicit)
        assert torch.equal(count, torch.tensor([[9.0, 9.0], [5.0, 5.0]], dtype=torch.float64))
        q = torch.randn(2, 2, 1, 4, generator=g, dtype=torch.float64)
        torch.testing.assert_close(features(q, p) @ state, (q @ (k * kept).transpose(-2, -1)) ** p @ v)


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("d, dv, heads", [(4, 3, 4), (6, 16, 4), (3, 32, 2)], ids=["any", "dv16-gqa", "dv32-mha"])
def test_a_step_equals_the_pytorch_step_and_the_materialised_causal_power(rows, d, dv, heads):
    """C++ (``power_decode`` for one token: a generic loop, and its compiled widths; the chunked kernel from a
    state for more) against the PyTorch step and ``c(n) (q k^T t)^p v`` over every key so far."""
    from polyattn_lightning.attention import get_activation

    act = get_activation("poly3")
    g = torch.Generator().manual_seed(1)
    past_k, past_v = torch.randn(1, 2, 6, d, generator=g).double(), torch.randn(1, 2, 6, dv, generator=g).double()
    q = torch.randn(1, heads, rows, d, generator=g).double()
    k, v = torch.randn(1, 2, rows, d, generator=g).double(), torch.randn(1, 2, rows, dv, generator=g).double()
    keep = torch.ones(1, rows, dtype=torch.bool)
    outs = []
    for step in (recurrent.step, recurrent.chunked_step):
        state = recurrent_state(past_k, past_v, act)
        outs.append(step(q, k, v, keep, state, act, 0.5))
        assert torch.equal(state.count, torch.full((1, 2), 6.0 + rows, dtype=torch.float64))
    groups = heads // 2
    keys = torch.cat([past_k, k], 2).repeat_interleave(groups, 1)
    values = torch.cat([past_v, v], 2).repeat_interleave(groups, 1)
    allowed = torch.ones(rows, 6 + rows, dtype=torch.bool).tril(6)
    n = allowed.sum(-1, keepdim=True).double()
    expected = (((q @ keys.transpose(-2, -1)) * 0.5) ** 3 * allowed / n.sqrt()) @ values
    torch.testing.assert_close(outs[0], expected)
    torch.testing.assert_close(outs[1], expected)


class OpCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def test_one_decode_step_dispatches_the_same_ops_for_2_and_16_heads():
    """No Python-level loop over heads: the step's operator count does not grow with the head count."""
    from polyattn_lightning.attention import get_activation

    act = get_activation("poly2")
    counts = []
    for heads in (2, 16):
        state = RecurrentState(torch.zeros(1, heads, monomial_count(8, 2), 8), torch.zeros(1, heads), 2)
        q, k, v = (torch.randn(1, heads, 1, 8) for _ in range(3))
        with OpCount() as ops:
            recurrent.step(q, k, v, torch.ones(1, 1, dtype=torch.bool), state, act, 0.3)
        counts.append(ops.calls)
    assert counts[0] == counts[1] and counts[0] < 20
    assert cpp.load()  # and on this machine the step was the one C++ call (power_decode), not the PyTorch form


def test_refusals_and_a_kv_cache_without_a_linear_form():
    unswitched = tiny_llama()
    with pytest.raises(ConfigError, match="switched by set_attention"):
        RecurrentCache(unswitched)
    relu = tiny_llama()
    set_attention(relu, "relu")
    assert math.isinf(RecurrentCache(relu).threshold)  # a KV cache
    with pytest.raises(ConfigError, match="no linear form"):
        RecurrentCache(relu, threshold=0)
    poly3 = tiny_llama()
    set_attention(poly3, "poly3")
    cache = RecurrentCache(poly3, threshold=0)
    assert not cache.is_croppable
    with pytest.raises(ValueError, match="cannot be cropped"):
        cache.crop(-1)


def test_the_default_threshold_is_the_tables_decode_crossover(tmp_path, monkeypatch):
    from polyattn_lightning.attention import get_activation

    key = base.device_key(torch.device("cpu"))
    rows = [dict(p=3, d=8, causal=True, mode="decode", n=123)]
    path = tmp_path / "crossover.json"
    path.write_text(json.dumps({"devices": {key: {"quadratic_seconds": 1e-10, "crossover": rows}}}))
    monkeypatch.setenv("POLYATTN_CROSSOVER", str(path))
    base.reload_crossover_table()
    try:
        model = tiny_llama()
        set_attention(model, "poly3")
        assert RecurrentCache(model).threshold == 123
        assert math.isinf(decode_crossover(torch.device("cpu"), 8, get_activation("poly2")))  # no row: KV
        assert math.isinf(decode_crossover(torch.device("cpu"), 8, get_activation("poly5")))
    finally:
        monkeypatch.delenv("POLYATTN_CROSSOVER")
        base.reload_crossover_table()


def test_a_decode_step_on_two_threads_equals_one():
    """``power_decode`` splits the kv heads over threads: the same state and output as on one thread."""
    from polyattn_lightning.attention import get_activation

    act = get_activation("poly2")
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 4, 1, 16, generator=g) for _ in range(3))
    results = []
    for threads in (1, 2):
        state = RecurrentState(torch.ones(2, 4, monomial_count(16, 2), 16), torch.full((2, 4), 3.0), 2)
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            out = recurrent.step(q, k, v, torch.ones(2, 1, dtype=torch.bool), state, act, 0.25)
        finally:
            torch.set_num_threads(before)
        results.append((out, state.kv))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=0)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=0, atol=0)
