"""The recurrent form beside the parallel one: a step from a state (``attention(..., state=...)``) against the plain
references of ``power/naive.py`` and against the parallel form over every key, for p = 1..4, grouped heads, prompts of
1 to 19 tokens, left padding; and ``kernel_choice`` for both kinds of decoding step (from a state, against a KV
cache), the kept choice, and what a step refuses.
"""

from __future__ import annotations

import pytest
import torch

from polyattn_lightning.attention import Activation, attention, get_activation, kernel_choice
from polyattn_lightning.attention.functional import recurrent_state
from polyattn_lightning.attention.kernels import BACKENDS, KernelNotSupported, dispatch, fused_cpu
from polyattn_lightning.attention.kernels.base import cpp
from polyattn_lightning.attention.kernels.base.state import RecurrentState, monomial_count
from polyattn_lightning.attention.kernels.power import naive, recurrent

POWERS = [1, 2, 3, 4]
CUSTOM = Activation("cube", fn=lambda s: s**3, grad=lambda s: 3 * s**2, scale="inv_sqrt_n")
#: (prompt tokens folded into the state, new tokens stepped): a one-token prompt, one token at a time, a chunk
PROMPTS = [(1, 1), (5, 3), (19, 6)]


def tensors(batch=2, heads=4, kv_heads=2, rows=3, d=4, dv=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, rows, d, generator=g, dtype=torch.float64)
    k = torch.randn(batch, kv_heads, rows, d, generator=g, dtype=torch.float64)
    v = torch.randn(batch, kv_heads, rows, dv, generator=g, dtype=torch.float64)
    return q, k, v


def random_state(batch, kv_heads, d, dv, p, seed=1) -> RecurrentState:
    """A state no prompt need have produced: any ``S`` and any count."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(batch, kv_heads, monomial_count(d, p), dv, generator=g, dtype=torch.float64)
    count = torch.randint(1, 30, (batch, 1), generator=g).double().expand(batch, kv_heads).contiguous()
    return RecurrentState(kv, count, p)


def copy(state: RecurrentState) -> RecurrentState:
    return RecurrentState(state.kv.clone(), state.count.clone(), state.power)


def through_the_door(named: bool):
    """A step from a state through ``attention()``: ``auto``'s choice, or the backend whose recurrent form it is."""

    def step(q, k, v, keep, state, act, t):
        kernel = ("associative" if state.power == 1 else "power") if named else "auto"
        padding = None if keep is None else ~keep
        return attention(
            q, k, v, act, temperature=t, key_padding_mask=padding, is_causal=True, state=state, kernel=kernel
        )

    return step


def steps():
    """The recurrent forms: the door (auto's choice, and the backend by name), the C++ step, the PyTorch step."""
    return {
        "attention": through_the_door(False),
        "backend": through_the_door(True),
        "cpp": recurrent.step,
        "pytorch": recurrent.chunked_step,
    }


@pytest.mark.parametrize("p", POWERS)
@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("form", ["attention", "backend", "cpp", "pytorch"])
def test_a_step_from_a_random_state_equals_the_naive_recurrence(form, rows, p):
    """Outputs and final state against the token-by-token reference, from a state no prompt made; grouped heads
    (4 query heads on 2 kv heads), a padded new key in one sequence."""
    if form == "cpp" and not cpp.load():
        pytest.skip("the C++ kernels could not be built")
    act = get_activation(f"poly{p}")
    q, k, v = tensors(rows=rows)
    keep = torch.ones(2, rows, dtype=torch.bool)
    keep[1, 0] = False
    initial = random_state(2, 2, 4, 3, p)
    state = copy(initial)
    out = steps()[form](q, k, v, keep, state, act, 0.6)
    expected, final = naive.recurrent(q, k, v, keep, initial, act, 0.6)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state.kv, final.kv, rtol=1e-10, atol=1e-10)
    assert torch.equal(state.count, final.count)
    assert torch.equal(state.count, initial.count + keep.sum(-1, keepdim=True))


@pytest.mark.parametrize("p", POWERS)
@pytest.mark.parametrize("prompt, rows", PROMPTS, ids=lambda x: str(x))
@pytest.mark.parametrize("form", ["attention", "backend", "cpp", "pytorch"])
def test_a_step_after_a_prompt_equals_the_parallel_form_over_every_key(form, prompt, rows, p):
    """A state folded from a left-padded prompt, then ``rows`` new tokens: the outputs are the parallel form's (the
    backend's own, by name) over the prompt and the new tokens (causal, bottom-right), and the final state is the fold
    of them all."""
    if form == "cpp" and not cpp.load():
        pytest.skip("the C++ kernels could not be built")
    act = get_activation(f"poly{p}")
    kernel = "associative" if p == 1 else "power"
    _, past_k, past_v = tensors(rows=prompt, seed=2)
    q, k, v = tensors(rows=rows, seed=3)
    padding = torch.zeros(2, prompt + rows, dtype=torch.bool)
    padding[1, : min(2, prompt)] = True  # left padding in the prompt of the second sequence
    state = recurrent_state(past_k, past_v, act, key_padding_mask=padding[:, :prompt])
    out = steps()[form](q, k, v, ~padding[:, prompt:], state, act, 0.6)
    keys, values = torch.cat([past_k, k], 2), torch.cat([past_v, v], 2)
    parallel = attention(q, keys, values, act, temperature=0.6, is_causal=True, key_padding_mask=padding, kernel=kernel)
    torch.testing.assert_close(out, parallel, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(out, naive.parallel(q, keys, values, act, 0.6, ~padding, causal=True))
    everything = recurrent_state(keys, values, act, key_padding_mask=padding)
    torch.testing.assert_close(state.kv, everything.kv, rtol=1e-10, atol=1e-10)
    assert torch.equal(state.count, everything.count)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_state_stays_fp32_for_lower_precision_inputs(dtype):
    q, k, v = (x.to(dtype) for x in tensors(rows=1))
    state = recurrent_state(k, v, "poly2")
    assert state.kv.dtype == state.count.dtype == torch.float32
    out = attention(q, k, v, "poly2", state=state)
    assert out.dtype == dtype and out.shape == (2, 4, 1, 3)


def test_kernel_choice_explains_a_step_from_a_state():
    q, k, v = tensors(rows=3)
    for p, kernel in [(1, "associative"), (3, "power")]:
        state = recurrent_state(k, v, f"poly{p}")
        choice = kernel_choice(q, k, v, f"poly{p}", state=state, is_causal=True)
        assert (choice.kernel, choice.kind) == (kernel, "step from a state")
        assert str(choice).splitlines()[0] == f"auto picks {kernel!r} for a step from a state"
        for name in ("sdpa", "triton", "fused_cpu", "blocked"):
            assert f"the {name} kernel attends the keys themselves and keeps no state" in choice.passed_over[name][0]
    poly1 = kernel_choice(q, k, v, "poly1", state=recurrent_state(k, v, "poly1"), is_causal=True)
    assert "is not poly2-poly4" in poly1.passed_over["power"][0]


def test_a_step_from_a_state_refuses_what_it_cannot_fold():
    """Each refusal is the message of the reasons, also once a step of the same activation is kept (the kept
    function is taken only for inputs it can fold: the shortest path checks them first)."""
    q, k, v = tensors(rows=3)
    state = recurrent_state(k, v, "poly2")
    attention(q, k, v, "poly2", is_causal=True, state=recurrent_state(k, v, "poly2"))  # the choice is kept now
    cases = [
        (dict(activation="poly3", is_causal=True), "the state holds poly2's features; the activation is 'poly3'"),
        (dict(activation="poly2"), "a step from a state is causal"),
        (dict(activation="poly2", is_causal=True, attn_mask=torch.ones(3, 3, dtype=torch.bool)), "pairwise attn_mask"),
        (dict(activation="relu", is_causal=True), "is not poly2-poly4"),
    ]
    for options, words in cases:
        with pytest.raises(KernelNotSupported, match=words):
            attention(q, k, v, state=state, **options)
    with pytest.raises(KernelNotSupported, match="one per query row"):
        attention(q, torch.cat([k, k], 2), torch.cat([v, v], 2), "poly2", is_causal=True, state=state)
    with pytest.raises(KernelNotSupported, match=r"a state of shape \(2, 2, 10, 3\) .* is \(2, 2, 10, 5\)"):
        attention(q, k, torch.cat([v, v[..., :2]], -1), "poly2", is_causal=True, state=state)
    with pytest.raises(KernelNotSupported, match=r"a state of shape \(2, 2, 10, 3\) .* is \(2, 1, 10, 3\)"):
        attention(q, k[:, :1], v[:, :1], "poly2", is_causal=True, state=state)
    with pytest.raises(KernelNotSupported, match="no gradient flows"):
        attention(q.requires_grad_(), k, v, "poly2", is_causal=True, state=state)
    with pytest.raises(KernelNotSupported, match="cannot take these inputs: a step from a recurrent state"):
        attention(q.detach(), k, v, "poly2", is_causal=True, state=state, kernel="fused_cpu")
    with pytest.raises(TypeError, match="key_padding_mask must be bool"):
        attention(q.detach(), k, v, "poly2", is_causal=True, state=state, key_padding_mask=torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape \(B, Nk\) = \(2, 3\)"):
        attention(q.detach(), k, v, "poly2", is_causal=True, state=state, key_padding_mask=torch.zeros(2, 4).bool())
    with pytest.raises(TypeError, match="state must be a RecurrentState .* got Tensor"):
        attention(q.detach(), k, v, "poly2", is_causal=True, state=state.kv)
    with pytest.raises(ValueError, match="activation 'relu' has no recurrent state"):
        recurrent_state(k, v, "relu")
    with pytest.raises(ValueError, match=r"key_padding_mask must be bool \(B, N\) = \(2, 3\), True = padding; got"):
        recurrent_state(k, v, "poly2", key_padding_mask=torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"key_padding_mask must be bool \(B, N\) = \(2, 3\)"):
        recurrent_state(k, v, "poly2", key_padding_mask=torch.zeros(2, 4, dtype=torch.bool))
    assert torch.equal(state.count, torch.full((2, 2), 3.0, dtype=torch.float64))  # no refused step folded a key


def test_a_kept_kv_cache_step_still_checks_shapes():
    q, k, v = tensors(rows=1)[0], *tensors(rows=6, seed=4)[1:]
    attention(q, k, v, "poly3")  # the choice is kept now
    with pytest.raises(ValueError, match="Hkv dividing H"):
        attention(q[:, :3], k, v, "poly3")
    with pytest.raises(ValueError, match="Hkv dividing H"):
        attention(q[..., :3], k, v, "poly3")


@pytest.mark.parametrize("batch, rows", [(2, 0), (0, 1)], ids=["no new token", "no sequence"])
@pytest.mark.parametrize("p", [1, 3])
def test_an_empty_step_is_empty_and_folds_nothing(batch, rows, p):
    q, k, v = (x[:batch] for x in tensors(rows=rows))
    cache_k, cache_v = (x[:batch] for x in tensors(rows=6, seed=7)[1:])
    for _ in range(2):  # the first call resolves the step, the second takes the kept one
        assert attention(q, cache_k, cache_v, f"poly{p}").shape == (batch, 4, rows, 3)
        state = recurrent_state(cache_k, cache_v, f"poly{p}")
        kv, count = state.kv.clone(), state.count.clone()
        assert attention(q, k, v, f"poly{p}", is_causal=True, state=state).shape == (batch, 4, rows, 3)
        assert torch.equal(state.kv, kv) and torch.equal(state.count, count)


@pytest.mark.parametrize("built", [True, False], ids=["C++ fold", "PyTorch fold"])
def test_the_recurrent_form_keeps_fp32_under_autocast(built, monkeypatch):
    """The fold, the PyTorch step and a step through the door keep their products in the state's dtype (fp32) when
    autocast would run them in bf16: the same outputs and states as without autocast, fp32-close to the fp64
    reference (bf16 products would be off by about 1e-2)."""
    if built and not cpp.load():
        pytest.skip("the C++ kernels could not be built")
    if not built:  # no C++ build: the fold and the door's step run in PyTorch
        monkeypatch.setattr(recurrent, "load", lambda: False)
    act = get_activation("poly3")
    q, k, v = tensors(rows=5)
    past_k, past_v = tensors(rows=7, seed=6)[1:]
    new_k, new_v = tensors(rows=5, seed=8)[1:]
    runs = []
    for autocast in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            state = recurrent_state(past_k.float(), past_v.float(), act)
            stepped = recurrent.chunked_step(q.float(), k.float(), v.float(), None, state, act, 0.5)
            door = attention(q.float(), new_k.float(), new_v.float(), act, temperature=0.5, is_causal=True, state=state)
        runs.append((stepped, door, state.kv))
    for plain, autocast in zip(*runs):
        assert autocast.dtype == torch.float32
        torch.testing.assert_close(autocast, plain, rtol=1e-6, atol=1e-6)
    keys, values = torch.cat([past_k, k, new_k], 2), torch.cat([past_v, v, new_v], 2)
    queries = torch.cat([q, q], 2)
    expected = naive.parallel(queries, keys, values, act, 0.5, causal=True)[:, :, -10:]
    torch.testing.assert_close(torch.cat(runs[1][:2], 2).double(), expected, rtol=1e-5, atol=1e-5)


def test_kernel_choice_explains_a_kv_cache_step(monkeypatch):
    """One new row against a cache: the fused C++ step on CPU, the materialized step where it cannot run; the
    linear forms say why they leave a KV-cache step; a prompt as long as its keys is no step."""
    q, cache_k, cache_v = tensors(rows=1)[0], *tensors(rows=20, seed=4)[1:]
    choice = kernel_choice(q, cache_k, cache_v, "poly3")
    assert (choice.kernel, choice.kind) == ("fused_cpu", "KV-cache step")
    assert "state of every cached key would be built again" in choice.passed_over["power"][0]
    assert "one call of a step form" in choice.passed_over["blocked"][0]
    assert choice.passed_over["materialized"] == ["'fused_cpu' is preferred"]
    assert "state of every cached key" in kernel_choice(q, cache_k, cache_v, "poly1").passed_over["associative"][0]
    assert kernel_choice(q, cache_k, cache_v, CUSTOM).kernel == "materialized"  # the C++ step knows no custom form
    monkeypatch.setattr(fused_cpu, "load", lambda: False)
    assert kernel_choice(q, cache_k, cache_v, "poly3").kernel == "materialized"
    monkeypatch.undo()
    assert kernel_choice(q.requires_grad_(), cache_k, cache_v, "poly3").kind == "parallel"  # a gradient: no step
    prompt = tensors(rows=5)  # as many keys as rows: a call, not a step
    assert kernel_choice(*prompt, "poly1", is_causal=True).kernel == "associative"
    assert kernel_choice(*prompt, "poly3", is_causal=True).kind == "parallel"


def test_a_decoding_step_is_resolved_once_and_then_looked_up(monkeypatch):
    """The first step of an activation, device, dtype and kind goes through pick(); the next ones reuse its choice,
    for a KV-cache step and for a step from a state alike."""
    monkeypatch.setattr(dispatch, "_STEPS", {})
    picked = []
    pick = dispatch.pick
    monkeypatch.setattr(dispatch, "pick", lambda inputs: picked.append(inputs.kind) or pick(inputs))
    q, k, v = tensors(rows=1)
    cache_k, cache_v = tensors(rows=12, seed=5)[1:]
    state = recurrent_state(cache_k, cache_v, "poly3")
    for _ in range(3):
        kv_out = attention(q, cache_k, cache_v, "poly3", temperature=0.5)
        state_out = attention(q, k, v, "poly3", temperature=0.5, state=state)
    assert picked == ["KV-cache step", "step from a state"]
    expected = attention(q, cache_k, cache_v, "poly3", temperature=0.5, kernel="materialized")
    torch.testing.assert_close(kv_out, expected, rtol=1e-10, atol=1e-12)
    assert state_out.shape == (2, 4, 1, 3) and torch.equal(state.count, torch.full((2, 2), 15.0, dtype=torch.float64))
    attention(q, cache_k, cache_v, "relu")  # another activation: resolved in its turn
    assert picked[-1] == "KV-cache step" and len(picked) == 3


def test_the_kept_choice_is_the_one_pick_makes_for_every_shape_of_the_kind():
    """The step kept for an activation, device, dtype and kind is valid for any rows, heads and cache: pick()'s
    choice for a KV-cache step depends on none of them."""
    choices = set()
    for rows, heads, kv_heads, keys in [(1, 4, 2, 5), (8, 6, 3, 300), (2, 1, 1, 3), (1, 8, 8, 4000)]:
        g = torch.Generator().manual_seed(rows)
        q = torch.randn(1, heads, rows, 16, generator=g)
        k, v = (torch.randn(1, kv_heads, keys, 16, generator=g) for _ in range(2))
        for causal in (False, True):
            choices.add(kernel_choice(q, k, v, "poly2", is_causal=causal).kernel)
    assert choices == {"fused_cpu"}


def test_every_backend_says_which_kinds_of_call_it_has_a_form_for():
    forms = {name: sorted(backend.forms) for name, backend in BACKENDS.items()}
    assert forms["power"] == forms["associative"] == ["parallel", "step from a state"]
    assert forms["fused_cpu"] == forms["materialized"] == ["KV-cache step", "parallel"]
    assert forms["sdpa"] == forms["triton"] == forms["blocked"] == ["parallel"]
