"""A saved switched model's own attention, for ``from_pretrained(folder, trust_remote_code=True)`` without the project.

:func:`~.remote_code.write_remote_code` copies this file into a ``save_pretrained`` folder as ``modeling_polyattn.py``
and points the config's ``auto_map`` at it. It imports only torch and transformers: a process that never installed
the project loads the folder through it. Importing it registers :func:`polyattn_attention` under the name the folder
names (``attn_implementation: "polyattn"``) with HF's boolean masks, unless a function is registered under that name
already (the project's, where it is imported); the model classes are transformers' own, under their names here
(``__getattr__``), so the model loads as the architecture it is, its attention reading the activation from its config
(``polyattn_attention``). The attention is the project's definition written out plainly: the scores
``S = q k^T * scaling`` in fp32, ``phi(S) = c(n) f(S + b(n))`` over the ``n`` keys a row attends, masked keys
contributing zero (``registry.py``; the project's tests hold this function to ``attention()``). Not supported here,
and refused in one line: softcapped scores, attention sinks and score biases (T5's ``position_bias``), float masks.
"""

from __future__ import annotations

import re

import torch
import transformers
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

#: The implementation name a saved folder of an interface-switched model names.
IMPLEMENTATION = "polyattn"
#: The config attribute that holds the activation.
CONFIG_KEY = "polyattn_attention"
#: name -> (elementwise function, default length scale, shift): the project's built-in activations.
FUNCTIONS = {
    "relu": (torch.relu, "inv_n", None),
    "softplus": (torch.nn.functional.softplus, "inv_n", None),
    "sigmoid": (torch.sigmoid, "none", "neg_log_n"),
}
#: The polynomial activations ``poly1`` ... ``poly8`` (default scale ``1/sqrt(n)``).
POLY = re.compile(r"^poly([1-8])$")
#: Keyword arguments that would change the scores; this function does not implement them.
UNSUPPORTED = ("softcap", "position_bias", "s_aux", "sinks")


def activation(spec):
    """``(f, scale, shift)`` of a spec: a name (``"poly3"``) or a mapping with its ``name`` and ``scale``."""
    options = dict(spec) if isinstance(spec, dict) else {"name": spec}
    name, scale = options.pop("name", None), options.pop("scale", None)
    if options:
        raise ValueError(f"{CONFIG_KEY}: options {sorted(options)} are not supported by modeling_polyattn.py")
    match = POLY.match(str(name))
    if match:
        power = int(match.group(1))
        return (lambda s: s if power == 1 else s.pow(power)), scale or "inv_sqrt_n", None
    if name not in FUNCTIONS:
        raise ValueError(f"{CONFIG_KEY}: activation {name!r} is not one modeling_polyattn.py knows")
    function, default, shift = FUNCTIONS[name]
    return function, scale or default, shift


def row_scale(scale, n: torch.Tensor) -> torch.Tensor:
    """``c(n)``: ``1/sqrt(n)``, ``1/n``, 1 or a fixed number."""
    if scale == "inv_sqrt_n":
        return n.clamp_min(1).rsqrt()
    if scale == "inv_n":
        return n.clamp_min(1).reciprocal()
    return torch.full_like(n, 1.0 if scale == "none" else float(scale))


def polyattn_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' attention-function contract: q ``(B, H, Q, D)``, k/v ``(B, H_kv, K, D)``, HF's boolean mask
    (True: attend) or None; returns ``((B, Q, H, D), None)``."""
    given = [name for name in UNSUPPORTED if kwargs.get(name) is not None]
    if given:
        raise NotImplementedError(f"modeling_polyattn.py does not implement {given}: load with polyattn_lightning")
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        raise NotImplementedError("modeling_polyattn.py takes boolean masks only: load with polyattn_lightning")
    function, scale, shift = activation(getattr(module.config, CONFIG_KEY))
    temperature = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    rows, keys = query.shape[2], key.shape[2]
    keep = attention_mask
    if keep is None and rows > 1:
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        if causal:
            if keys > rows:  # HF skips the mask only in the prefill of an empty static cache: the rest is empty
                key, value, keys = key[:, :, :rows], value[:, :, :rows], rows
            keep = torch.ones(rows, keys, dtype=torch.bool, device=query.device).tril(keys - rows)
    scores = (query.float() @ key.float().transpose(-1, -2)) * temperature
    if keep is None:
        n = torch.full((1, 1, 1, 1), float(keys), device=query.device)
    else:
        keep = keep.expand(scores.shape)
        n = keep.sum(-1, keepdim=True).float()
    if shift == "neg_log_n":
        scores = scores - torch.log(n.clamp_min(1))
    weights = row_scale(scale, n) * function(scores)
    if keep is not None:
        weights = weights.masked_fill(~keep, 0.0)
    if dropout > 0 and module.training:
        weights = torch.nn.functional.dropout(weights, dropout)
    out = weights @ value.float()
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def register() -> None:
    """Register :func:`polyattn_attention` and HF's boolean masks under :data:`IMPLEMENTATION`, unless a function
    is registered under it already."""
    if IMPLEMENTATION not in AttentionInterface._global_mapping:
        AttentionInterface.register(IMPLEMENTATION, polyattn_attention)
        AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)


register()


#: name -> the loading class :func:`__getattr__` made for it (one per name: transformers registers it).
LOADING_CLASSES = {}


def loading_class(base):
    """transformers' class ``base`` under its own name in this file. transformers registers the class the
    ``auto_map`` names for its auto class, so registering this one leaves ``base`` alone, and a re-save copies this
    file and keeps the ``auto_map``; its ``from_pretrained`` puts the folder's ``attn_implementation`` back into the
    config (transformers pops it when it reads a config), so a re-saved folder refuses to load without this file or
    the project, as this folder does."""

    def from_pretrained(cls, *args, **kwargs):
        model = super(loader, cls).from_pretrained(*args, **kwargs)
        if getattr(model.config, CONFIG_KEY, None) is not None:
            model.config.attn_implementation = IMPLEMENTATION
        return model

    loader = type(base.__name__, (base,), {"__module__": __name__, "from_pretrained": classmethod(from_pretrained)})
    return loader


def __getattr__(name: str):
    """The folder's ``auto_map`` names transformers' classes here (``modeling_polyattn.LlamaForCausalLM``): each
    is :func:`loading_class` of transformers' own."""
    if name.startswith("__"):
        raise AttributeError(name)
    if name not in LOADING_CLASSES:
        LOADING_CLASSES[name] = loading_class(getattr(transformers, name))
    return LOADING_CLASSES[name]
