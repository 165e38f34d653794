"""The ``AttentionInterface`` function: what every switched Hugging Face attention module calls.

transformers 5.x routes attention through ``AttentionInterface``: each attention module calls
``ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, q, k, v, mask, dropout=, scaling=, **kwargs)``
and the model builds its mask with the ``AttentionMaskInterface`` function of the same name. :func:`register`
registers one attention function (:func:`polyattn_attention`) under two names (once per process; the
registry is global): :data:`IMPLEMENTATION` with HF's boolean mask function, and
:data:`EAGER_MASKS_IMPLEMENTATION` with its float eager masks, for the models that do not support SDPA (some
read the mask themselves in that format). The activation is not global: it is read
from the module being called (``module.activation_spec``), so two models with different activations live in
one process.

What the function honours: HF's boolean masks ((B, 1, Q, KV), True = attend: padding, causal, sliding window,
chunked; causal and padding masks become ``is_causal`` and ``key_padding_mask``), the float masks models build
themselves, split into mask and score bias by how each model builds them (BEiT's, Doge's, Swin's and ALiBi
Falcon's carry a bias: ``masks.py``), causality without a mask (``is_causal`` kwarg, else ``module.is_causal``,
else causal as HF's SDPA path assumes; only when more than one query row), grouped-query attention (the kv heads go to
``attention()`` as they are: the linear ``power`` kernel builds one state per kv head, the others get them
repeated; a capture, a softcap, a bias or sinks get them repeated here), ``scaling`` as the temperature,
attention dropout (HF passes 0 in eval), the (B, L, H, D) output layout, and the keyword arguments some families
add (``extras.py``): ``position_bias`` (T5: a score bias), ``s_aux`` / ``sinks`` (GPT-OSS's and Inkling 2's
attention sinks: one more key with value 0) and ``softcap`` (Gemma 2: ``c * tanh(S / c)`` before ``phi``). Other
keyword arguments are ignored, as HF's own SDPA function ignores them. A cached-generation step or a short
prompt's prefill (a few query rows, no mask, no gradient) takes :func:`decode_step`: on CPU one C++ call, cheaper
than HF's own ``sdpa`` call;
a one-row step on CPU reaches that call first, by the shortest path (:func:`_cpu_step`).
Keys returned by a :class:`~.cache.RecurrentCache` layer go to that layer, which folds them into its state
(``cache.py``).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

from ....errors import ConfigError
from ...functional import attention
from ...kernels import fused_cpu
from ...kernels.materialized import materialized
from ...masks import causal_mask
from ...registry import Activation, ActivationSpec, get_activation
from ..base import AttentionInputs, Capture
from .extras import softcapped_attention, with_position_bias, with_sinks
from .masks import interface_masks

#: The name the attention and mask functions are registered under (``config._attn_implementation``).
IMPLEMENTATION = "polyattn"
#: The same attention function with HF's eager masks (float, 0 keep / ``finfo.min``), for models that do not
#: support SDPA: some read the 4-D mask themselves in that format (NLLB-MoE's router takes ``mask.bool()`` as
#: padding), which a boolean mask would invert.
EAGER_MASKS_IMPLEMENTATION = "polyattn_eager_masks"
#: Query rows up to which an unmasked inference call takes :func:`decode_step` (a KV-cache step: one row, which
#: no causal mask restricts; a short causal prompt; a few unmasked rows of an encoder's short input).
DECODE_ROWS = 8
#: The attribute a ``RecurrentCache`` layer tags the keys its ``update`` returns with (``cache.py``).
CACHE_TAG = "_polyattn_cache_layer"
#: Keyword arguments that change the scores (``extras.py``): a call given any of them takes the general path.
SCORE_KWARGS = frozenset({"softcap", "position_bias", "s_aux", "sinks"})


class Probe:
    """The probe in progress: the spec to attend with, how often each module attended (through this function
    or an adapter's ``_attend``), and the ``capture`` every module gets meanwhile (None: none, the diagnostics'
    hooks are off during a probe)."""

    def __init__(self, spec: ActivationSpec, capture: Capture | None = None):
        self.spec = spec
        self.calls: dict[int, int] = {}
        self.capture = capture

    def seen(self, module: nn.Module, inputs: AttentionInputs) -> None:
        """A module's capture during the probe: counts the call, then hands it to ``capture``."""
        self.calls[id(module)] = self.calls.get(id(module), 0) + 1
        if self.capture is not None:
            self.capture(module, inputs)


_probe: Probe | None = None


@contextmanager
def probing(probe: Probe) -> Iterator[Probe]:
    """Route every polyattn call through ``probe`` meanwhile (one probe forward at a time)."""
    global _probe
    _probe = probe
    try:
        yield probe
    finally:
        _probe = None


def polyattn_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """The ``AttentionInterface`` function: ``attention()`` with the activation of ``module``.

    q ``(B, H, Q, D)``, k/v ``(B, H_kv, KV, D)``; returns ``((B, Q, H, D), None)`` (no attention weights).
    """
    if attention_mask is None and query.shape[2] == 1 and not dropout and SCORE_KWARGS.isdisjoint(kwargs):
        step = _cpu_step(module, query, key)  # a KV-cache step: as few Python lines as HF's own sdpa call
        if step is not None:
            plan, act = step
            temperature = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
            return fused_cpu.decode_with(plan, query, key, value, act, temperature), None
    spec = _spec_of(module)
    softcap, position_bias = kwargs.get("softcap"), kwargs.get("position_bias")
    sinks = kwargs.get("s_aux") if kwargs.get("s_aux") is not None else kwargs.get("sinks")
    plain = softcap is None and sinks is None and position_bias is None
    q_len = query.shape[2]
    temperature = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    layer = cache_layer(key)
    if layer is not None:  # keys from a RecurrentCache: the layer folds them in where the mask is known
        if not plain:
            raise ConfigError(
                f"RecurrentCache cannot fold softcap, attention sinks or position_bias into its state "
                f"({type(module).__name__}): generate with the model's own cache"
            )
        args = (module, query, key, value, attention_mask, dropout, scaling, is_causal)
        regular = lambda: polyattn_attention(*args, **kwargs)[0]  # noqa: E731 (the path below, for a KV layer)
        return layer.attend(query, key, value, attention_mask, get_activation(spec), temperature, regular), None
    causal, masks = False, {}
    if attention_mask is None:
        causal = q_len > 1 and (is_causal if is_causal is not None else getattr(module, "is_causal", True))
        if causal and key.shape[2] > q_len:
            # HF skips the mask only in a prefill of an empty static cache: the keys past q_len are empty slots
            key, value = key[:, :, :q_len], value[:, :, :q_len]
            position_bias = None if position_bias is None else position_bias[..., :q_len]
        if (
            plain
            and q_len <= DECODE_ROWS
            and not torch.is_grad_enabled()
            and not dropout
            and getattr(module, "capture", None) is None
            and _probe is None
        ):
            act = get_activation(spec)
            if not act.is_softmax:
                return decode_step(query, key, value, act, temperature, causal), None
    capture = _probe.seen if _probe is not None else getattr(module, "capture", None)
    groups = query.shape[1] // key.shape[1]
    if groups > 1 and (capture is not None or not plain):  # attention() takes grouped kv heads; these take q's
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    if attention_mask is not None:
        causal, masks = interface_masks(module, attention_mask, softmax=get_activation(spec).is_softmax)
    if position_bias is not None:
        masks = with_position_bias(masks, position_bias)
    if sinks is not None:
        key, value, masks = with_sinks(key, value, masks, sinks)
    if capture is not None:  # the capture contract has no is_causal: it gets the causal mask written out
        seen = masks
        if causal:
            written = causal_mask(q_len, key.shape[2], query.device)
            given = masks.get("attn_mask")
            seen = {**masks, "attn_mask": written if given is None else given & written}
        capture(module, AttentionInputs(query, key, value, temperature, **seen))
    if softcap is not None:
        out = softcapped_attention(query, key, value, spec, temperature, softcap, dropout, causal, masks)
    else:
        out = attention(query, key, value, spec, temperature=temperature, dropout_p=dropout, is_causal=causal, **masks)
    return out.transpose(1, 2).contiguous(), None


def _cpu_step(module: nn.Module, query: Tensor, key: Tensor) -> tuple[tuple, Activation] | None:
    """``(plan, activation)`` for :func:`~...kernels.fused_cpu.decode_with` in a one-row call of ``module`` (no
    mask, no score keywords: checked by the caller), or None where the call takes the general path: a probe, a
    capture, a gradient, not CPU, keys of a ``RecurrentCache``, softmax or an activation without a fused form.
    Per call the spec's plan is one dict lookup: in generation the step runs between the model's other code, where
    every Python line costs (BENCHMARKS.md: through the general path's checks the tiny Llama's 128 tokens took
    1.01-1.02x ``sdpa``, through this one 0.997-1.006x)."""
    if (
        _probe is not None
        or torch.is_grad_enabled()
        or not query.is_cpu  # (not device.type: that builds a torch.device, 0.3 us)
        or getattr(module, "capture", None) is not None
        or cache_layer(key) is not None
    ):
        return None
    spec = _spec_of(module)
    entry = _STEP_PLANS.get(id(spec))
    if entry is None or entry[0] is not spec:  # a spec object seen first (or an id reused by a new one)
        act = get_activation(spec)
        plan = fused_cpu.decode_plan(act)
        entry = _STEP_PLANS[id(spec)] = (spec, None if plan is None else (plan, act))
    return entry[1]


#: id(spec) -> (spec, its one-row plan or None); the spec is kept so that its id is not reused meanwhile.
_STEP_PLANS: dict[int, tuple[ActivationSpec, tuple | None]] = {}


def cache_layer(key: Tensor):
    """The ``RecurrentCache`` layer ``key`` came from, if that layer's ``update`` returned it just now."""
    layer = getattr(key, CACHE_TAG, None)
    return layer if layer is not None and layer.pending is key else None


def decode_step(
    query: Tensor, key: Tensor, value: Tensor, act: Activation, temperature: float, causal: bool = False
) -> Tensor:
    """A cached-generation step, or a short prompt's prefill: a few query rows, no mask, no gradient.

    Only taken without a mask. Not causal (a step: one query row is never causal-masked): every row attends all
    ``Nk`` keys, ``N = Nk``. Causal (the prompt of an empty cache): the rows are the last ``R`` positions, row
    ``r`` attends the first ``Nk - R + r + 1`` keys. On CPU with a built-in form: one C++ call
    (:func:`~...kernels.fused_cpu.decode`), cheaper than HF's own ``sdpa`` call; elsewhere
    :func:`materialized_step`. Returns HF's ``(B, Q, H, D)`` layout.
    """
    out = fused_cpu.decode(query, key, value, act, temperature, causal)
    return materialized_step(query, key, value, act, temperature, causal) if out is None else out


def materialized_step(
    query: Tensor, key: Tensor, value: Tensor, act: Activation, temperature: float, causal: bool = False
) -> Tensor:
    """:func:`decode_step` in PyTorch ops: the materialized kernel on the small ``(rows x cache)`` scores,
    grouped-query heads side by side on their kv head (broadcast, so the cache is not repeated). Some 3x HF's
    SDPA call for the tiny Llama's step on CPU (``bench hf --parts calls``), which is why CPU takes the C++ op."""
    batch, heads, rows, dim = query.shape
    kv_heads, num_keys = key.shape[1], key.shape[2]
    group = heads // kv_heads
    grouped = query.reshape(batch, kv_heads, group * rows, dim)  # row g * rows + r: head g of the group, row r
    allowed = None
    if causal:
        allowed = causal_mask(rows, num_keys, query.device).repeat(group, 1)
        first = num_keys - rows + 1  # the keys row 0 attends (a count below 1 is clamped by the activation)
        keys = torch.arange(first, first + rows, dtype=torch.float32, device=query.device).repeat(group).view(-1, 1)
    else:
        keys = torch.full((1, 1, 1, 1), float(num_keys), device=query.device)
    out = materialized(grouped, key, value, act, temperature, allowed, None, keys, 0.0)
    return out.view(batch, heads, rows, -1).transpose(1, 2).contiguous()


def _spec_of(module: nn.Module) -> ActivationSpec:
    if _probe is not None:
        return _probe.spec
    spec = getattr(module, "activation_spec", None)
    if spec is None:
        raise ConfigError(
            f"{type(module).__name__} attends through attn_implementation={IMPLEMENTATION!r} but was not switched by "
            "polyattn_lightning's set_attention(model, activation); call it on the model (a folder saved switched: "
            "load it with polyattn_lightning.attention.switch.hf.load_pretrained)"
        )
    return spec


def register() -> None:
    if AttentionInterface._global_mapping.get(IMPLEMENTATION) is not polyattn_attention:
        AttentionInterface.register(IMPLEMENTATION, polyattn_attention)
        # HF's boolean (B, 1, Q, KV) mask, True = attend; None where SDPA could rely on is_causal or no mask
        AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)
        AttentionInterface.register(EAGER_MASKS_IMPLEMENTATION, polyattn_attention)
        AttentionMaskInterface.register(EAGER_MASKS_IMPLEMENTATION, eager_mask)


def implementation_for(model: nn.Module) -> str:
    """The name a model is switched to: :data:`IMPLEMENTATION` (boolean masks) where it supports SDPA, else
    :data:`EAGER_MASKS_IMPLEMENTATION` (the float masks its eager code was written for)."""
    return IMPLEMENTATION if getattr(type(model), "_supports_sdpa", True) else EAGER_MASKS_IMPLEMENTATION
