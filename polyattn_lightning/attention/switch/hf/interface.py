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
keyword arguments are ignored, as HF's own SDPA function ignores them.

Like transformers' own attention functions (``integrations/sdpa_attention.py``), :func:`polyattn_attention` checks
its preconditions and makes one call, ``attention()`` (Gemma 2's ``softcap`` aside: ``extras.softcapped_attention``
materialises the capped scores, as HF's eager path does); the kernel is ``attention()``'s choice. A cached-generation
step or a short prompt's prefill (a few query rows, no mask, no gradient) is a KV-cache step there, which the kernels
keep resolved (on CPU one C++ call, cheaper than HF's own ``sdpa`` call), so the one-row step costs the checks below
and that call. Keys returned by a :class:`~.cache.RecurrentCache` layer go to that layer, which keeps them or folds
them into its state and steps from it through the same ``attention()`` (``cache.py``).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

from .... import deprecated
from ....errors import ConfigError
from ...functional import attention
from ...masks import causal_mask
from ...registry import ActivationSpec, get_activation
from ..base import AttentionInputs
from .extras import softcapped_attention, with_position_bias, with_sinks
from .masks import adds_bias_to_mask, interface_masks

#: The config attribute that stores a switched model's activation (``saved/`` writes it; here it is read).
CONFIG_KEY = "polyattn_attention"
#: The config attribute transformers reads back as the implementation to load a saved model with (``saved/marks.py``).
SAVED_IMPLEMENTATION_KEY = "attn_implementation"
#: The name the attention and mask functions are registered under (``config._attn_implementation``).
IMPLEMENTATION = "polyattn"
#: The same attention function with HF's eager masks (float, 0 keep / ``finfo.min``), for models that do not
#: support SDPA: some read the 4-D mask themselves in that format (NLLB-MoE's router takes ``mask.bool()`` as
#: padding), which a boolean mask would invert.
EAGER_MASKS_IMPLEMENTATION = "polyattn_eager_masks"
#: The attribute a ``RecurrentCache`` layer tags the keys its ``update`` returns with (``cache.py``).
CACHE_TAG = "_polyattn_cache_layer"
#: Keyword arguments that change the scores (``extras.py``); HF passes others (``position_ids``...), which are ignored.
SCORE_KWARGS = frozenset({"softcap", "position_bias", "s_aux", "sinks"})


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
    spec = _spec_of(module)
    temperature = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    softcap = position_bias = sinks = None
    if not SCORE_KWARGS.isdisjoint(kwargs):
        softcap, position_bias = kwargs.get("softcap"), kwargs.get("position_bias")
        sinks = kwargs.get("s_aux") if kwargs.get("s_aux") is not None else kwargs.get("sinks")
    plain = softcap is None and sinks is None and position_bias is None
    layer = cache_layer(key)
    if layer is not None:  # keys from a RecurrentCache: the layer keeps them, or folds them into its state
        if not plain:
            raise ConfigError(
                f"RecurrentCache cannot fold softcap, attention sinks or position_bias into its state "
                f"({type(module).__name__}): generate with the model's own cache"
            )
        args = (module, query, key, value, attention_mask, dropout, scaling, is_causal)
        regular = lambda: polyattn_attention(*args, **kwargs)[0]  # noqa: E731 (the path below, for a KV layer)
        return layer.attend(query, key, value, attention_mask, spec, temperature, regular), None
    q_len = query.shape[2]
    causal, masks = False, {}
    if attention_mask is not None:
        causal, masks = interface_masks(module, attention_mask, softmax=get_activation(spec).is_softmax)
    elif q_len > 1:  # causality without a mask (one row is never causal-masked)
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        if causal and key.shape[2] > q_len:
            # HF skips the mask only in a prefill of an empty static cache: the keys past q_len are empty slots
            key, value = key[:, :, :q_len], value[:, :, :q_len]
            position_bias = None if position_bias is None else position_bias[..., :q_len]
    capture = getattr(module, "capture", None)
    if capture is not None or not plain:  # attention() takes grouped kv heads; these take q's
        groups = query.shape[1] // key.shape[1]
        if groups > 1:
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
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


def cache_layer(key: Tensor):
    """The ``RecurrentCache`` layer ``key`` came from, if that layer's ``update`` returned it just now."""
    layer = getattr(key, CACHE_TAG, None)
    return layer if layer is not None and layer.pending is key else None


def decode_step(
    query: Tensor, key: Tensor, value: Tensor, act: ActivationSpec, temperature: float, causal: bool = False
) -> Tensor:
    """A cached-generation step, or a short prompt's prefill (a few query rows, no mask, no gradient) in HF's
    ``(B, Q, H, D)`` layout: ``attention()``'s KV-cache step. Not causal: every row attends all ``Nk`` keys. Causal
    (the prompt of an empty cache): the rows are the last ``R`` positions, row ``r`` attends the first
    ``Nk - R + r + 1`` keys."""
    return attention(query, key, value, act, temperature=temperature, is_causal=causal).transpose(1, 2).contiguous()


def _spec_of(module: nn.Module) -> ActivationSpec:
    """The module's activation: set by ``set_attention``, else its config's (a ``save_pretrained`` folder of a switched
    model loaded with ``from_pretrained``: ``saved/``), whose mark (``attn_implementation``, which transformers pops
    when it reads a config) it puts back, so that the folder saved again still refuses to load without the project."""
    spec = getattr(module, "activation_spec", None)
    if spec is None:
        config = getattr(module, "config", None)
        spec = getattr(config, CONFIG_KEY, None)
        if spec is not None and SAVED_IMPLEMENTATION_KEY not in vars(config):  # transformers popped the mark on load:
            setattr(config, SAVED_IMPLEMENTATION_KEY, config._attn_implementation)  # a re-saved folder keeps it
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
    :data:`EAGER_MASKS_IMPLEMENTATION` (the float masks its eager code was written for), as for a model that adds
    a score bias to its mask (``masks.BIAS_ADDED_TO_MASK``)."""
    if getattr(type(model), "_supports_sdpa", True) and not adds_bias_to_mask(model):
        return IMPLEMENTATION
    return EAGER_MASKS_IMPLEMENTATION


def __getattr__(name: str):
    """Names that moved or went: where to (``polyattn_lightning/deprecated.py``)."""
    return deprecated.attribute(__name__, name)
