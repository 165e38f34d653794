"""A transformers ``Cache`` for switched causal LMs that keeps a fixed-size state instead of keys and values.

With ``poly{p}`` attention and the scale ``c(n)`` (no row-sum denominator) a causal layer's next output is
``c(n) m(q t) S`` with ``S = sum_j w m(k_j) v_j^T`` (``D x dv`` per kv head, ``D = C(d+p-1, p)``; ``m(x) = x``
for p = 1) and ``n`` the keys seen (a recurrent state: ``attention.functional.recurrent_state``). So a layer may keep
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

The layer steps from its state through ``attention(..., state=...)``, the door every attention call takes: the kernel
of the step is ``auto``'s choice (``kernel_choice(..., state=...)`` says which). The state is fp32 (fp64 for an
fp64 model) whatever the model's dtype.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from transformers.cache_utils import Cache, CacheLayerMixin

from ....errors import ConfigError
from ...functional import attention, decode_crossover, recurrent_state
from ...registry import ActivationSpec
from ..base import SwitchedAttention
from .interface import CACHE_TAG, IMPLEMENTATION
from .masks import split_mask


class RecurrentLayer(CacheLayerMixin):
    """One layer: keys and values while the context is shorter than ``threshold`` tokens, ``(S, n)`` after.

    ``state`` (a ``RecurrentState``: ``kv`` ``(B, Hkv, D, dv)``, ``count`` ``(B, Hkv)``, the keys in it, padding
    excluded) once it holds one; ``seen`` the tokens seen, padding included.
    """

    is_croppable = False
    is_compileable = False
    is_sliding = False
    supports_early_init = False

    def __init__(self, threshold: float, activation: ActivationSpec):
        super().__init__()
        self.threshold, self.activation = threshold, activation
        self.state = None
        self.seen = 0
        self.pending: Tensor | None = None

    @property
    def recurrent(self) -> bool:
        return self.state is not None

    @property
    def count(self) -> Tensor | None:
        """The keys in the state, ``(B, Hkv)`` (padding excluded); None while the layer keeps keys."""
        return None if self.state is None else self.state.count

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
        if not self.recurrent and self.seen == 0 and new >= self.threshold:  # a long prompt: straight into a state
            self.state = recurrent_state(key_states[:, :, :0], value_states[:, :, :0], self.activation)
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

    def attend(
        self, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, spec: ActivationSpec, t: float, regular
    ) -> Tensor:
        """The attention function's output, HF's ``(B, Q, H, dv)``, for keys this layer returned. ``regular()`` is
        the attention function's own path (used below the threshold, over every key)."""
        self.pending = None
        if not self.recurrent:
            out = regular()
            if self.seen >= self.threshold:  # the context passed the crossover: fold the keys, drop them
                self.state = recurrent_state(key, value, spec, key_padding_mask=self._padding(mask))
                self.keys = self.values = None
            return out
        if torch.is_grad_enabled() and any(x.requires_grad for x in (query, key, value)):
            raise ConfigError("RecurrentCache is for generation (no gradient flows through its state)")
        padding = self._padding(mask)
        out = attention(
            query, key, value, spec, temperature=t, key_padding_mask=padding, is_causal=True, state=self.state
        )
        return out.transpose(1, 2).contiguous()

    @staticmethod
    def _padding(mask: Tensor | None) -> Tensor | None:
        """The padded keys (True) of ``mask``'s last row (the keys HF's causal + padding mask keeps from the last
        token); None: no padding."""
        if mask is None:
            return None
        causal, masks = split_mask(mask)
        if "attn_mask" in masks:
            raise ConfigError(
                "RecurrentCache takes causal and padding masks only (no sliding window, chunks or custom masks)"
            )
        return masks.get("key_padding_mask")

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)``: every key while keys are kept, the new tokens only with a state."""
        return (query_length, self.seen) if self.recurrent else (self.seen + query_length, 0)

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.keys = self.values = self.state = self.pending = None
        self.seen = 0
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError("RecurrentCache cannot be cropped: a state cannot forget its last tokens")

    def _index(self, select) -> None:
        for name in ("keys", "values"):
            tensor = getattr(self, name)
            if tensor is not None and tensor.shape[0]:
                setattr(self, name, select(tensor))
        if self.state is not None and self.state.kv.shape[0]:
            self.state.select(select)

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
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        if threshold is None:
            threshold = decode_crossover(next(model.parameters()).device, head_dim, spec)
        elif threshold < math.inf:
            try:  # an empty state of the activation: it has one, or says it has none
                recurrent_state(torch.empty(1, 1, 0, head_dim), torch.empty(1, 1, 0, head_dim), spec)
            except ValueError:
                raise ConfigError(
                    f"RecurrentCache: activation {spec!r} has no linear form to keep as a state"
                ) from None
        self.activation, self.threshold = spec, threshold
        super().__init__(layers=[RecurrentLayer(threshold, spec) for _ in range(config.num_hidden_layers)])

    @property
    def recurrent(self) -> list[bool]:
        """Which layers hold a state now (the rest keys and values)."""
        return [layer.recurrent for layer in self.layers]


__all__ = ["RecurrentCache", "RecurrentLayer", "decode_crossover"]
