"""A transformers ``Cache`` for switched causal LMs that keeps a fixed-size state instead of keys and values.

With ``poly{p}`` attention and the scale ``c(n)`` (no row-sum denominator) a causal layer's next output is
``c(n) m(q t) S`` with ``S = sum_j w m(k_j) v_j^T`` (``D x dv`` per kv head, ``D = C(d+p-1, p)``; ``m(x) = x``
for p = 1) and ``n`` the keys seen (:mod:`~polyattn_lightning.attention.kernels.power`). So a layer may keep
``(S, n)`` instead of its keys and values: one generation step then costs O(D dv) whatever the context, where a
KV cache costs O(N (d + dv)). Below the crossover length (a KV step is cheaper while ``N (d + dv) < D dv``, as
measured by ``python -m polyattn_lightning.bench crossover``: the table's ``decode`` rows) a layer is an
ordinary KV cache; when the context passes it, the keys and values are folded into the state and dropped.
poly1, poly2, and poly3 at small head dims have a state worth keeping; poly5 or ``relu`` have none, and the
cache stays a KV cache.

How it fits transformers 5.x without patching it (``generate(..., cache=RecurrentCache(model))``):

* each layer is a ``CacheLayerMixin`` (not ``LinearAttentionCacheLayerMixin``, for which transformers'
  ``get_seq_length`` / ``get_mask_sizes`` raise): ``get_seq_length`` is the tokens seen (for positions and
  RoPE), ``get_mask_sizes`` asks for a mask over the new tokens only once the layer holds a state (HF's
  padding mask then covers exactly them), beam search's reorder / select index the state, ``is_croppable``
  is False (a state cannot forget the last tokens: no assisted decoding);
* ``update()`` receives the new post-RoPE keys and values but not the mask, and the attention function
  receives no cache: so ``update`` hands the new keys to the attention function tagged with their layer
  (``interface.cache_layer``), and the attention function (``interface.py``) lets the layer fold them in where the
  padding mask is known: left padding enters neither the state nor ``n``.

The state is fp32 (fp64 for an fp64 model) whatever the model's dtype.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from transformers.cache_utils import Cache, CacheLayerMixin

from ....errors import ConfigError
from ...kernels import base, power
from ...registry import Activation, get_activation
from ..base import SwitchedAttention
from .interface import CACHE_TAG, IMPLEMENTATION
from .masks import split_mask


def decode_crossover(device: torch.device, d: int, activation: Activation) -> float:
    """Context length from which a state step beats a KV step for this head dim and activation (the table's
    ``decode`` rows for this device); ``inf`` for an activation without a linear form or a device without a row."""
    p = power.power_of(activation)
    if p is None or p > max(power.POWERS) or activation.shift is not None:
        return math.inf
    return base.measured_crossover(str(device), d, p, True, "decode")


class RecurrentLayer(CacheLayerMixin):
    """One layer: keys and values while the context is shorter than ``threshold`` tokens, ``(S, n)`` after.

    ``state`` ``(B, Hkv, D, dv)`` and ``count`` ``(B, Hkv)`` (the keys in it, padding excluded) once it holds a
    state; ``seen`` the tokens seen, padding included.
    """

    is_croppable = False
    is_compileable = False
    is_sliding = False
    supports_early_init = False

    def __init__(self, threshold: float):
        super().__init__()
        self.threshold = threshold
        self.state: Tensor | None = None
        self.count: Tensor | None = None
        self.seen = 0
        self.pending: Tensor | None = None

    @property
    def recurrent(self) -> bool:
        return self.state is not None

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.keys = key_states[:, :, :0]
        self.values = value_states[:, :, :0]
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Below the threshold: append (as ``DynamicLayer``) and return every key; with a state: return the new
        keys only. Either way tagged for the attention function, which must receive them."""
        if self.pending is not None:
            raise RuntimeError(
                "RecurrentCache: the keys of the last update never reached the polyattn attention function (a "
                "model must call ALL_ATTENTION_FUNCTIONS['polyattn'] with the keys its cache returned)"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        new = key_states.shape[-2]
        if not self.recurrent and self.seen == 0 and new >= self.threshold:
            self._start_state(key_states, value_states)  # a long prompt: straight into the state, one pass
        if self.recurrent:
            keys, values = key_states, value_states
        else:
            self.keys = torch.cat([self.keys, key_states], dim=-2)
            self.values = torch.cat([self.values, value_states], dim=-2)
            keys, values = self.keys, self.values
        self.seen += new
        setattr(keys, CACHE_TAG, self)
        self.pending = keys
        return keys, values

    def _start_state(self, keys: Tensor, values: Tensor) -> None:
        batch, kv_heads, _, d = keys.shape
        p = power.power_of(self.activation)
        dtype = torch.promote_types(keys.dtype, torch.float32)
        self.state = keys.new_zeros(batch, kv_heads, power.state_size(d, p), values.shape[-1], dtype=dtype)
        self.count = keys.new_zeros(batch, kv_heads, dtype=dtype)

    def attend(
        self, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, act: Activation, t: float, regular
    ) -> Tensor:
        """The attention function's output, HF's ``(B, Q, H, dv)``, for keys this layer returned. ``regular()`` is
        the attention function's own path (used below the threshold, over every key)."""
        self.pending = None
        if not self.recurrent:
            out = regular()
            if self.seen >= self.threshold:  # the context passed the crossover: fold the keys, drop them
                self._start_state(key, value)
                power.fold(self.state, self.count, key, value, self._keep(mask, key), power.power_of(act))
                self.keys = self.values = None
            return out
        if torch.is_grad_enabled() and any(x.requires_grad for x in (query, key, value)):
            raise ConfigError("RecurrentCache is for generation (no gradient flows through its state)")
        out = power.step(query, key, value, self._keep(mask, key), self.state, self.count, act, t)
        return out.transpose(1, 2).contiguous()

    @staticmethod
    def _keep(mask: Tensor | None, key: Tensor) -> Tensor:
        """1 for each key in ``mask``'s last row (the keys HF's causal + padding mask lets the last token see)."""
        if mask is None:
            return key.new_ones(key.shape[0], key.shape[-2], dtype=torch.bool)
        causal, masks = split_mask(mask)
        if "attn_mask" in masks:
            raise ConfigError(
                "RecurrentCache takes causal and padding masks only (no sliding window, chunks or custom masks)"
            )
        padding = masks.get("key_padding_mask")
        return key.new_ones(key.shape[0], key.shape[-2], dtype=torch.bool) if padding is None else ~padding

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)``: every key while keys are kept, the new tokens only with a state."""
        return (query_length, self.seen) if self.recurrent else (self.seen + query_length, 0)

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.keys = self.values = self.state = self.count = self.pending = None
        self.seen = 0
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError("RecurrentCache cannot be cropped: a state cannot forget its last tokens")

    def _index(self, select) -> None:
        for name in ("keys", "values", "state", "count"):
            tensor = getattr(self, name)
            if tensor is not None and tensor.shape[0]:
                setattr(self, name, select(tensor))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._index(lambda x: x.index_select(0, beam_idx.to(x.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._index(lambda x: x.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: Tensor) -> None:
        self._index(lambda x: x[indices])

    def offload(self) -> None:
        raise ValueError("RecurrentCache does not offload")


class RecurrentCache(Cache):
    """A cache for a causal LM switched by ``set_attention`` to ``poly{p}``: ``model.generate(ids,
    cache=RecurrentCache(model))`` gives the tokens a KV cache gives, from a fixed-size state past the crossover.

    Args:
        model: the switched model (its config holds the activation and the head dims).
        threshold: the context length from which layers keep a state (default: the crossover measured for this
            device, head dim and power; 0: from the first token; ``math.inf``: never, a KV cache).
    """

    def __init__(self, model: nn.Module, threshold: float | None = None):
        config = model.config.get_text_config(decoder=True)
        spec = next((m.activation_spec for m in model.modules() if isinstance(m, SwitchedAttention)), None)
        if spec is None or model.config._attn_implementation != IMPLEMENTATION:
            raise ConfigError(
                f"RecurrentCache needs a model switched by set_attention(model, 'poly3'...); "
                f"{type(model).__name__} attends with {model.config._attn_implementation!r}"
            )
        if getattr(config, "sliding_window", None) or any(
            kind != "full_attention" for kind in getattr(config, "layer_types", None) or []
        ):
            raise ConfigError(f"RecurrentCache: {type(model).__name__} has layers that are not full attention")
        act = get_activation(spec)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        if threshold is None:
            threshold = decode_crossover(next(model.parameters()).device, head_dim, act)
        elif threshold < math.inf and power.power_of(act) not in (1, *power.POWERS):
            raise ConfigError(f"RecurrentCache: activation {act.name!r} has no linear form to keep as a state")
        self.activation, self.threshold = act, threshold
        layers = [RecurrentLayer(threshold) for _ in range(config.num_hidden_layers)]
        for layer in layers:
            layer.activation = act
        super().__init__(layers=layers)

    @property
    def recurrent(self) -> list[bool]:
        """Which layers hold a state now (the rest keys and values)."""
        return [layer.recurrent for layer in self.layers]


__all__ = ["RecurrentCache", "RecurrentLayer", "decode_crossover"]
