"""Every family the Hugging Face switch covers outside transformers' ``AttentionInterface`` (the adapters of
``switch/hf/families/``, PyTorch's ``nn.MultiheadAttention`` in ``switch/mha.py``) against the tests' own float64
reference: ``references.py``, HF's eager attention of the family written again with phi = S^3 / sqrt(N) in place
of the softmax (not from the switch's code), run in a float64 copy of the model.

Each case is a tiny model of a family (its ``hf_support.FAMILIES`` config, or a variant: a decoder, the other
attention class, options the adapter reads) with trained-like weights (:func:`hf_models.trained_like`: unit
scale, position tables and biases included), on a padded batch wherever the model takes a mask (visual tokens and
encoder states padded too). Per case:

* poly3 through the switch: the outputs, and the gradients of the input embeddings (and of the pixels, visual
  features or encoder states given) and of every parameter, equal the float64 reference's;
* softmax through the switch: the same outputs and gradients as the unswitched model;
* the causal ones (GPT-Neo, BLOOM, and RoFormer, Megatron-BERT and RemBERT built as decoders, RoFormer's and
  RemBERT's with cross attention): ``generate`` with the cache after a left-padded prompt equals, step by step, the
  reference run once over the generated sequence without a cache; with softmax, HF's own cached generation.

The gradients are those of a fixed random weighting of every output of the real tokens (a padded query's output
is not defined: DeBERTa's attends nothing). ``PYTHONPATH=.:tests/attention/switch/hf python
tests/attention/switch/hf/test_hf_adapters.py`` prints the worst relative error of each check per case.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import pytest
import torch
from hf_models import trained_like
from references import RefMultiheadAttention, reference_twin
from torch import nn
from transformers import DynamicCache, EncoderDecoderCache

from polyattn_lightning.attention import attention_modules, set_attention
from polyattn_lightning.attention.switch.hf import probe_inputs
from polyattn_lightning.attention.switch.hf.families import adapter_for
from polyattn_lightning.bench.hf_support import FAMILIES, REFERENCE_CHECKS, build, family, outputs, real_rows

#: The largest difference from the reference relative to the reference's largest value, per output and per
#: gradient tensor: poly3 in float32 against the float64 reference, softmax against HF's own float32 model.
RELATIVE = 1e-4
#: A gradient smaller than this fraction of the largest is compared relative to that fraction of the largest
#: (softmax's gradients of the key biases are 0 but for rounding).
GRADIENT_FLOOR = 1e-2
ACTIVATIONS = ["poly3", "softmax"]


def _padded(length: int, padded: int, left: bool = False) -> torch.Tensor:
    """An attention mask of 2 rows whose second has ``padded`` positions of padding at its end (at its start with
    ``left``, as ``generate`` pads a batch)."""
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, slice(0, padded) if left else slice(length - padded, length)] = 0
    return mask


def _visual(generator: torch.Generator) -> dict:
    """VisualBERT's visual tokens: 4 features per row, the second row's last one padding."""
    return {"visual_embeds": torch.randn(2, 4, 16, generator=generator), "visual_attention_mask": _padded(4, 1)}


def _encoder(generator: torch.Generator) -> dict:
    """An encoder's states for cross attention: 5 per row, the second row's last 2 padding."""
    states = torch.randn(2, 5, 32, generator=generator)
    return {"encoder_hidden_states": states, "encoder_attention_mask": _padded(5, 2)}


def _resized(generator: torch.Generator) -> dict:
    """A 24 x 24 image for a model configured for 16 x 16: its position biases interpolated."""
    return {"pixel_values": torch.randn(1, 3, 24, 24, generator=generator), "interpolate_pos_encoding": True}


@dataclass(frozen=True)
class Case:
    """A model of a hand-switched family: its ``FAMILIES`` entry, with another class or more config options."""

    key: str
    family: str
    model: str = ""  # another transformers class of the family (a causal LM head); the family's by default
    config: dict = field(default_factory=dict)  # options over the family's config
    extra: Callable[[torch.Generator], dict] | None = None  # inputs beside (or instead of) the default probe's

    @property
    def causal(self) -> bool:
        return self.model.endswith("ForCausalLM")

    def build(self) -> nn.Module:
        fam = family(self.family)
        return trained_like(build(replace(fam, model=self.model or fam.model, config={**fam.config, **self.config})))

    def extra_inputs(self) -> dict:
        return {} if self.extra is None else self.extra(torch.Generator().manual_seed(1))

    def inputs(self, model: nn.Module) -> dict:
        """The default probe's inputs (9 tokens, the second row's last 3 padding) and the case's own."""
        inputs = probe_inputs(model, tokens=9, padded=3) | ({"use_cache": False} if self.causal else {})
        return inputs | self.extra_inputs()


DECODER = dict(is_decoder=True)
CROSS = dict(is_decoder=True, add_cross_attention=True)

# fmt: off
CASES = (
    Case("deberta", "deberta"),
    Case("deberta-v2", "deberta-v2"),
    Case("deberta-v2-shared-keys", "deberta-v2", config=dict(share_att_key=True, norm_rel_ebd="layer_norm")),
    # a position type v2 does not count in its scale (v1 does), in the string form older configs hold
    Case("deberta-v2-p2p", "deberta-v2", config=dict(pos_att_type="c2p|p2c|p2p")),
    Case("mpnet", "mpnet"),
    Case("roformer", "roformer"),
    Case("roformer-decoder", "roformer", "RoFormerForCausalLM", dict(CROSS, rotary_value=True), _encoder),
    Case("megatron-bert", "megatron-bert"),
    # no cross attention: Megatron-BERT's own (and TAPAS's) views the encoder's keys at the decoder's length
    Case("megatron-bert-decoder", "megatron-bert", "MegatronBertForCausalLM", DECODER),
    Case("rembert", "rembert"),
    Case("rembert-decoder", "rembert", "RemBertForCausalLM", CROSS, _encoder),
    Case("tapas", "tapas"),
    Case("visualbert", "visualbert", extra=_visual),
    Case("data2vec-vision", "data2vec-vision"),  # Data2VecVisionSdpaSelfAttention, HF's default
    # the eager class, the model's shared bias beside each layer's, both interpolated to another resolution
    Case("data2vec-vision-eager", "data2vec-vision",
         config=dict(attn_implementation="eager", use_shared_relative_position_bias=True), extra=_resized),
    Case("swin-v2", "swin-v2"),
    Case("siglip", "siglip"),  # the attention-pooling head (nn.MultiheadAttention) beside the interface's layers
    Case("gpt-neo", "gpt-neo", "GPTNeoForCausalLM"),
    Case("bloom", "bloom", "BloomForCausalLM"),
    Case("bloom-tensor-parallel", "bloom", "BloomForCausalLM", dict(pretraining_tp=2, slow_but_exact=True)),
)
# fmt: on
CAUSAL = [case for case in CASES if case.causal]


def _case(key: str) -> Case:
    return next(case for case in CASES if case.key == key)


def _floating(x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def _float64(inputs: dict) -> dict:
    """The inputs of a float64 copy of the model; masks stay as given (a float mask's ``finfo.min`` masks)."""
    return {name: x.double() if _floating(x) and not name.endswith("mask") else x for name, x in inputs.items()}


def outputs_and_gradients(model: nn.Module, inputs: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
    """One forward and backward: the real tokens' outputs (flat) and the gradients of ``w . outputs`` (``w`` fixed,
    N(0, 1)) with respect to the input embeddings, every floating input and every trained parameter, by name."""
    inputs = {name: x.detach().requires_grad_() if _floating(x) else x for name, x in inputs.items()}
    embedded, hook = [], None
    table = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if isinstance(table, nn.Embedding):
        hook = table.register_forward_hook(lambda module, args, out: embedded.append(out))
    try:
        torch.manual_seed(0)
        out = real_rows(outputs(model(**inputs)), inputs)
    finally:
        if hook is not None:
            hook.remove()
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(out.dtype)
    wrt = {f"input {name}": x for name, x in inputs.items() if _floating(x)}
    wrt |= {"input embeddings": embedded[0]} if embedded else {}
    wrt |= {name: p for name, p in model.named_parameters() if p.requires_grad}  # not RoFormer's sinusoidal table
    gradients = torch.autograd.grad((out * weights).sum(), list(wrt.values()), allow_unused=True)
    return out.detach(), dict(zip(wrt, gradients, strict=True))


def relative_error(got: torch.Tensor, want: torch.Tensor, scale: float | None = None) -> float:
    """``max |got - want| / max |want|`` in float64 (``scale`` in place of ``max |want|`` when given)."""
    want = want.double()
    return ((got.double() - want).abs().max() / (want.abs().max() if scale is None else scale)).item()


def compare(switched: nn.Module, expected: nn.Module, inputs: dict) -> tuple[float, str, float]:
    """``(the outputs' relative error, the worst gradient's name, its relative error)`` of ``switched`` against
    ``expected`` (a float64 model gets the inputs in float64). A gradient is compared relative to its own largest
    value, or to :data:`GRADIENT_FLOOR` of the largest gradient when larger; one that only one side has is inf."""
    out, grads = outputs_and_gradients(switched, inputs)
    float64 = next(expected.parameters()).dtype == torch.float64
    want, want_grads = outputs_and_gradients(expected, _float64(inputs) if float64 else inputs)
    floor = GRADIENT_FLOOR * max(g.abs().max().item() for g in want_grads.values() if g is not None)
    errors = {}
    for name in grads.keys() | want_grads.keys():
        got, wanted = grads.get(name), want_grads.get(name)
        if got is None or wanted is None:
            errors[name] = 0.0 if got is None and wanted is None else float("inf")
        else:
            errors[name] = relative_error(got, wanted, max(wanted.abs().max().item(), floor))
    worst = max(errors, key=errors.get)
    return relative_error(out, want), worst, errors[worst]


def expected_model(model: nn.Module, activation: str) -> nn.Module:
    """What ``model`` switched to ``activation`` should compute: itself unswitched for softmax, else its float64
    reference twin."""
    return copy.deepcopy(model) if activation == "softmax" else reference_twin(model).double()


def family_errors(case: Case, activation: str) -> tuple[float, str, float]:
    """:func:`compare` of the case's model switched to ``activation`` (probed on its inputs: cross attention runs)."""
    model = case.build()
    inputs = case.inputs(model)
    expected = expected_model(model, activation)
    assert set_attention(model, activation, probe=inputs) == len(attention_modules(model)) > 0
    return compare(model, expected, inputs)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("key", [case.key for case in CASES])
def test_outputs_and_gradients_equal_the_reference(key, activation):
    """poly3 against the float64 reference, softmax against the unswitched model."""
    out, name, gradient = family_errors(_case(key), activation)
    assert out <= RELATIVE
    assert gradient <= RELATIVE, name


PROMPT, NEW_TOKENS = 6, 4


def generation(model: nn.Module, case: Case) -> tuple[torch.Tensor, list[torch.Tensor], dict]:
    """Greedy ``generate`` with the cache after a left-padded prompt: ``(sequences, the logits of each step, the
    inputs of one forward over the whole sequence without a cache)``."""
    ids = torch.randint(1, 64, (2, PROMPT), generator=torch.Generator().manual_seed(7))
    mask, extra = _padded(PROMPT, 2, left=True), case.extra_inputs()
    # cross attention needs its cache given: generate()'s own (one DynamicCache) would hold both attentions' keys
    cache = {"cache": EncoderDecoderCache(DynamicCache(), DynamicCache())} if "encoder_hidden_states" in extra else {}
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
        **cache,
        **extra,
    )
    mask = torch.cat([mask, torch.ones(2, NEW_TOKENS, dtype=torch.long)], dim=1)
    whole = {"input_ids": out.sequences, "attention_mask": mask, "use_cache": False, **extra}
    if "position_ids" in inspect.signature(model.forward).parameters:  # as generate() numbers a left-padded row
        whole["position_ids"] = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    return out.sequences, list(out.logits), whole


def generation_errors(case: Case) -> tuple[float, float]:
    """``(poly3's cached steps against the float64 reference without a cache, softmax's cached steps through the
    switch against HF's)``: the worst step's logits, relative to their largest."""
    model = case.build()
    inputs = case.inputs(model)
    reference, softmax = reference_twin(model).double(), copy.deepcopy(model)
    set_attention(model, "poly3", probe=inputs)
    _, steps, whole = generation(model, case)
    with torch.no_grad():
        expected = reference(**_float64(whole)).logits[:, PROMPT - 1 : -1]
    poly3 = max(relative_error(step, expected[:, i]) for i, step in enumerate(steps))
    sequences, hf_steps, _ = generation(softmax, case)
    set_attention(softmax, "softmax", probe=inputs)
    switched, steps, _ = generation(softmax, case)
    assert torch.equal(switched, sequences)
    return poly3, max(relative_error(step, hf_step) for step, hf_step in zip(steps, hf_steps, strict=True))


@pytest.mark.parametrize("key", [case.key for case in CAUSAL])
def test_cached_generation_equals_the_reference_without_a_cache(key):
    poly3, softmax = generation_errors(_case(key))
    assert poly3 <= RELATIVE
    assert softmax <= RELATIVE


def test_every_hand_switched_family_has_a_case_and_the_readme_says_what_is_checked():
    """The table's families that hold a class the adapters switch (Falcon's, on the interface from transformers 5.25, in test_hf_falcon.py)
    are the cases' families, and ``hf_support.REFERENCE_CHECKS`` (the README table's column) says what is checked
    here."""
    adapted = {
        fam.key
        for fam in FAMILIES
        if not fam.key.startswith("falcon") and any(adapter_for(module) for module in build(fam).modules())
    }
    assert adapted == {case.family for case in CASES}
    cached = {case.family for case in CAUSAL}
    falcon = {key: "outputs, gradients, cache" for key in ("falcon", "falcon-alibi")}  # test_hf_falcon.py
    assert REFERENCE_CHECKS == {key: "outputs, gradients" + (", cache" * (key in cached)) for key in adapted} | falcon


# --------------------------------------------------------------------------- torch.nn.MultiheadAttention


class UserModel(nn.Module):
    """A user's model holding PyTorch's attention module: its output (residual, normalised) and weights."""

    def __init__(self, **kwargs):
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 4, **kwargs)
        self.norm = nn.LayerNorm(16)

    def forward(self, query, key, value, **masks):
        out, weights = self.attn(query, key, value, **masks)
        return self.norm(query + out), weights


#: Module options: the packed projection, batch first, separate projections of other widths, the extra keys, and
#: the packed one on unbatched ``(L, E)`` inputs.
MHA_KINDS = {
    "plain": {},
    "batch_first": {"batch_first": True},
    "kdim": {"kdim": 8, "vdim": 12},
    "bias_kv": {"add_bias_kv": True, "add_zero_attn": True},
    "unbatched": {},
}


def _mha_masks(kind: str) -> dict[str, dict]:
    """Masks as PyTorch takes them (True = may not attend; a float mask is added to the scores) for 2 rows of 6
    tokens: padded keys; a causal bool mask with the ``is_causal`` hint; a float bias of both signs; a float
    padding mask beside a float ``(B * heads, L, S)`` mask holding ``-inf``, ``finfo.min`` and a bias, with the
    weights per head."""
    g = torch.Generator().manual_seed(6)
    causal = torch.ones(6, 6, dtype=torch.bool).triu(1)
    bias = torch.randn(6, 6, generator=g) - 0.5
    padding = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])
    masks = {
        "none": {},
        "padding": {"key_padding_mask": padding[1] if kind == "unbatched" else padding},
        "causal": {"attn_mask": causal, "is_causal": True},
        "float": {"attn_mask": bias},
    }
    if kind != "unbatched":
        below = torch.eye(6, dtype=torch.bool).roll(1, 0)  # (i, i - 1), and (0, 5)
        masked = (bias - 1.0).masked_fill(causal, -torch.inf).masked_fill(below, torch.finfo(torch.float32).min)
        masks["float-inf"] = {
            "attn_mask": masked.repeat(8, 1, 1),
            "key_padding_mask": torch.zeros(2, 6).masked_fill(padding, -torch.inf),
            "average_attn_weights": False,
        }
    return masks


MHA_CASES = [(kind, masks) for kind in MHA_KINDS for masks in _mha_masks(kind)]


def _mha(kind: str, masks: str) -> tuple[nn.Module, dict]:
    """The user's model with trained-like weights, and its inputs."""
    model = trained_like(UserModel(**MHA_KINDS[kind]).eval())
    attn, g = model.attn, torch.Generator().manual_seed(5)
    shape = (6, 16) if kind == "unbatched" else (2, 6, 16) if attn.batch_first else (6, 2, 16)
    query = torch.randn(shape, generator=g)
    key = torch.randn(shape[:-1] + (attn.kdim,), generator=g) if kind == "kdim" else query
    value = torch.randn(shape[:-1] + (attn.vdim,), generator=g) if kind == "kdim" else query
    return model, {"query": query, "key": key, "value": value, **_mha_masks(kind)[masks]}


def mha_errors(kind: str, masks: str, activation: str) -> tuple[float, str, float]:
    """:func:`compare` of the user's model switched to ``activation``: poly3 against the float64 reference (HF's
    swap: the module's class is PyTorch's steps with phi), softmax against PyTorch."""
    model, inputs = _mha(kind, masks)
    expected = copy.deepcopy(model)
    if activation != "softmax":
        expected.double()
        expected.attn.__class__ = RefMultiheadAttention
    assert set_attention(nn.Sequential(model), activation, probe=lambda: model(**inputs)) == 1
    return compare(model, expected, inputs)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("kind, masks", MHA_CASES)
def test_multihead_attention_outputs_and_gradients_equal_the_reference(kind, masks, activation):
    """The outputs are the module's and its weights (averaged over the heads, or per head): poly3 against the
    float64 reference, softmax against PyTorch's module."""
    out, name, gradient = mha_errors(kind, masks, activation)
    assert out <= RELATIVE
    assert gradient <= RELATIVE, name


if __name__ == "__main__":  # the worst relative error of each check, per case
    for case in CASES:
        line = f"{case.key:24s}"
        for activation in ACTIVATIONS:
            out, name, gradient = family_errors(case, activation)
            line += f" | {activation} outputs {out:.1e} gradients {gradient:.1e} ({name})"
        if case.causal:
            line += " | cached steps: poly3 %.1e, softmax %.1e" % generation_errors(case)
        print(line, flush=True)
    for kind, masks in MHA_CASES:
        line = f"{'nn.MultiheadAttention ' + kind + ' ' + masks:40s}"
        for activation in ACTIVATIONS:
            out, name, gradient = mha_errors(kind, masks, activation)
            line += f" | {activation} outputs {out:.1e} gradients {gradient:.1e} ({name})"
        print(line, flush=True)
