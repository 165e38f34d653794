"""Switch a Hugging Face ``transformers`` model's attention to a registry activation, through transformers' own door.

transformers 5.x routes attention through ``AttentionInterface``: each attention module calls
``ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, q, k, v, mask, dropout=, scaling=, **kwargs)``
and the model builds its mask with the ``AttentionMaskInterface`` function of the same name.
:func:`set_attention` registers one attention function (:func:`polyattn_attention`) and one boolean mask
function under :data:`IMPLEMENTATION` (once per process; the registry is global) and calls
``model.set_attn_implementation``. The activation is not global: it is read from the module being called
(``module.activation_spec``), so two models with different activations live in one process.

What the function honours: HF's boolean masks ((B, 1, Q, KV), True = attend: padding, causal, sliding
window, chunked; causal and padding masks become ``is_causal`` and ``key_padding_mask``, see :func:`split_mask`),
causality without a mask (``is_causal`` kwarg, else ``module.is_causal``, else causal as HF's SDPA path
assumes; only when more than one query row), grouped-query attention (``num_key_value_groups``: the kv
heads are repeated), ``scaling`` as the temperature, attention dropout (HF passes 0 in eval), and the
(B, L, H, D) output layout. A cached-generation step (a few query rows, no mask, no gradient) takes
:func:`decode_step`, two products without the general path's per-call overhead. What it refuses, naming the module's class: ``softcap``, ``s_aux`` (attention
sinks) and ``position_bias``, which a non-softmax activation cannot take as they are meant.

Why a probe: ``set_attn_implementation`` on a model whose attention does not call the interface (DeBERTa,
Swin V2, ...) only logs a warning. After switching, :func:`set_attention` runs one small forward, counts
the calls into the function per module, and refuses the model (putting its implementation back) unless
every attention module was called. The modules it found are then given the project's
:class:`~polyattn_lightning.attention.timm_patch.SwitchedAttention` mixin (their class is swapped for a
subclass; HF's ``forward`` and parameters are untouched), so the diagnostics' ``capture`` contract holds:
``attention_modules`` lists them in forward order and ``capture`` gets what ``attention()`` is given.
The probe's inputs are set_attention's ``probe=`` (as for timm models: a callable running one forward, or here
also a mapping of the model's keyword arguments). ``calibrate=True`` runs one more probe forward, with softmax,
and folds a temperature per head into the query weights
(:mod:`~polyattn_lightning.attention.hf_calibration`): what makes a pretrained softmax model fine-tune
into ``x^3`` (configs/README.md).

Saved models: :func:`set_attention` writes the spec into ``config.polyattn_attention``, so a
``save_pretrained`` folder carries it; :func:`load_pretrained` loads such a folder and switches it back.

This module imports transformers; nothing else in the project does unless it is given an HF model.
"""
from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..errors import ConfigError, MissingPathError
from .functional import attention
from .registry import Activation, ActivationSpec, get_activation
from .hf_calibration import fold_temperatures
from .switched import AttentionInputs, Capture, SwitchedAttention

#: The name the attention and mask functions are registered under (``config._attn_implementation``).
IMPLEMENTATION = "polyattn"
#: The config attribute that stores the activation spec (saved by ``save_pretrained``).
CONFIG_KEY = "polyattn_attention"
#: Keyword arguments of HF attention calls that a non-softmax activation cannot honour.
UNSUPPORTED_KWARGS = ("softcap", "s_aux", "position_bias")
#: Query rows up to which an unmasked, non-causal inference call takes :func:`decode_step` (a KV-cache step:
#: one row, which no causal mask restricts; a few unmasked rows of an encoder's short input).
DECODE_ROWS = 8
#: Tokens per row of the probe forward (a few, so a causal model has more than one query row).
PROBE_TOKENS = 6


class _Probe:
    """The probe in progress: the spec to attend with, how often each module called the function, and the
    ``capture`` every module gets meanwhile (None: none, the diagnostics' hooks are off during a probe)."""

    def __init__(self, spec: ActivationSpec, capture: Capture | None = None):
        self.spec = spec
        self.calls: dict[int, int] = {}
        self.capture = capture


_probe: _Probe | None = None


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
    for name in UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise ConfigError(
                f"{type(module).__name__} passes {name}= to its attention, which polyattn attention cannot honour "
                f"(supported: models whose attention takes q, k, v, a mask, dropout and scaling only)"
            )
    spec = _spec_of(module)
    q_len = query.shape[2]
    temperature = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    causal, masks = False, {}
    if attention_mask is None:
        causal = q_len > 1 and (is_causal if is_causal is not None else getattr(module, "is_causal", True))
        if (not causal and q_len <= DECODE_ROWS and not torch.is_grad_enabled() and not dropout
                and getattr(module, "capture", None) is None and _probe is None):
            act = get_activation(spec)
            if not act.is_softmax:
                return decode_step(query, key, value, act, temperature), None
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # grouped-query / multi-query attention: each kv head serves `groups` query heads
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    if attention_mask is None:
        if causal and key.shape[2] > q_len:
            # HF skips the mask only in a prefill of an empty static cache: the keys past q_len are empty slots
            key, value = key[:, :, :q_len], value[:, :, :q_len]
    else:
        causal, masks = split_mask(attention_mask)
    capture = _probe.capture if _probe is not None else getattr(module, "capture", None)
    if capture is not None:  # the capture contract has no is_causal: it gets the causal mask written out
        seen = dict(masks, attn_mask=_causal(q_len, key.shape[2], query.device)) if causal else masks
        capture(module, AttentionInputs(query, key, value, temperature, **seen))
    out = attention(query, key, value, spec, temperature=temperature, dropout_p=dropout, is_causal=causal, **masks)
    return out.transpose(1, 2).contiguous(), None


def decode_step(query: Tensor, key: Tensor, value: Tensor, act: Activation, temperature: float) -> Tensor:
    """A cached-generation step: a few query rows attending every key of the cache, no mask, no gradient.

    The materialized kernel on the small ``(rows x cache)`` scores, grouped-query heads side by side on their kv
    head (broadcast, so the cache is not repeated). The general path's checks, mask handling and kernel layout
    cost several times these products at this size (BENCHMARKS.md). Returns HF's ``(B, Q, H, D)`` layout. Only
    taken without a mask and without causality (one query row is never causal-masked), so every row attends all
    ``Nk`` keys: ``N = Nk``.
    """
    from .kernels import materialized  # late import, as attention()'s: it loads the Triton and C++ kernel modules

    batch, heads, rows, dim = query.shape
    kv_heads, num_keys = key.shape[1], key.shape[2]
    grouped = query.reshape(batch, kv_heads, (heads // kv_heads) * rows, dim)
    keys = torch.full((1, 1, 1, 1), float(num_keys), device=query.device)
    out = materialized(grouped, key, value, act, temperature, None, None, keys, 0.0)
    return out.view(batch, heads, rows, -1).transpose(1, 2).contiguous()


def _spec_of(module: nn.Module) -> ActivationSpec:
    if _probe is not None:
        _probe.calls[id(module)] = _probe.calls.get(id(module), 0) + 1
        return _probe.spec
    spec = getattr(module, "activation_spec", None)
    if spec is None:
        raise ConfigError(
            f"{type(module).__name__} attends through attn_implementation={IMPLEMENTATION!r} but was not switched by "
            "polyattn_lightning's set_attention(model, activation); call it on the model"
        )
    return spec


def _causal(q_len: int, kv_len: int, device: torch.device) -> Tensor:
    """Bottom-right causal: query ``i`` attends keys ``0 .. i + kv_len - q_len``."""
    return torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril(kv_len - q_len)


def split_mask(mask: Tensor) -> tuple[bool, dict[str, Tensor]]:
    """HF's mask as ``attention()`` takes it best: ``(is_causal, masks)``.

    A boolean mask that is causal (bottom-right) and/or key padding is passed as ``is_causal`` plus a
    ``key_padding_mask``, so the kernels skip the tiles above the diagonal and the padding and poly1 keeps its
    linear form; anything else (sliding window, chunks, an additive float mask) stays ``attn_mask``. The last
    query row sees every key either pattern allows, so it is the padding. Under ``torch.compile`` (no
    data-dependent test) the mask is passed as it is.
    """
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1 or torch.compiler.is_compiling():
        return False, {"attn_mask": mask}
    row = mask[:, :, -1:]
    padding = {} if bool(row.all()) else {"key_padding_mask": ~row[:, 0, 0]}
    if bool((mask == row).all()):
        return False, padding
    if bool((mask == (_causal(*mask.shape[-2:], mask.device) & row)).all()):
        return True, padding
    return False, {"attn_mask": mask}


# --------------------------------------------------------------------------- switching


def set_attention(
    model: PreTrainedModel,
    activation: ActivationSpec,
    *,
    probe: Mapping | Callable[[], object] | None = None,
    calibrate: bool = False,
) -> int:
    """Switch every attention layer of an HF ``PreTrainedModel`` to ``activation``; returns how many.

    Args:
        model: a ``transformers`` model whose attention goes through ``AttentionInterface`` (BERT, ViT, Llama...).
        activation: a registry activation (``"poly3"``, ``{name: poly3, scale: 0.0714}``...); ``softmax`` too.
        probe: the forward that shows every layer goes through the interface (and that ``calibrate`` measures):
            a mapping of ``model``'s keyword arguments (``{"input_ids": ..., "attention_mask": ...}``) or, as for
            timm models, a callable running one forward of ``model``; None makes a few token ids (two rows, the
            second padded) or one blank image, as the model's ``main_input_name`` asks. A batch of real inputs
            (e.g. training data) gives ``calibrate`` real scores to measure.
        calibrate: also fold one temperature per head into the query projections, chosen so that each layer's
            output starts nearest to the softmax output of the weights it was given
            (:mod:`~polyattn_lightning.attention.hf_calibration`): once, when switching a pretrained softmax model.

    Raises :class:`ConfigError`, leaving the model as it was, when the model's attention does not go through
    transformers' ``AttentionInterface`` in every layer, passes a keyword argument the activation cannot honour,
    or (``calibrate``) has no query projection to fold the temperatures into.
    """
    get_activation(activation)  # fail on a bad spec before changing anything
    if isinstance(activation, Mapping):
        activation = dict(activation)
    model_name = type(model).__name__
    for sub in model.modules():
        if isinstance(sub, PreTrainedModel) and not type(sub)._can_set_attn_implementation():
            raise ConfigError(
                f"{model_name} cannot be switched: {type(sub).__name__}'s attention does not go through transformers' "
                "AttentionInterface (set_attention needs models whose attention modules call "
                "ALL_ATTENTION_FUNCTIONS.get_interface, e.g. BERT, ViT, Llama, Qwen2, Mistral, GPT-2)"
            )
    run = _probe_forward(model, probe)
    _register()
    previous = model.config._attn_implementation
    model.set_attn_implementation(IMPLEMENTATION)
    try:
        found = _check_every_layer(model, _run_probe(model, run, _Probe(activation)).calls)
        if calibrate:  # every check before a weight changes: a refusal leaves the model as it was
            fold_temperatures(found, _softmax_inputs(model, run), activation)
    except BaseException:
        model.set_attn_implementation(previous)
        raise
    for module in found:
        if not isinstance(module, SwitchedAttention):
            module.__class__ = switched_class(type(module))
            module.capture = None
        module.activation_spec = activation
    setattr(model.config, CONFIG_KEY, activation)
    return len(found)


def _register() -> None:
    if AttentionInterface._global_mapping.get(IMPLEMENTATION) is not polyattn_attention:
        AttentionInterface.register(IMPLEMENTATION, polyattn_attention)
        # HF's boolean (B, 1, Q, KV) mask, True = attend; None where SDPA could rely on is_causal or no mask
        AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)


def _probe_forward(model: PreTrainedModel, probe: Mapping | Callable[[], object] | None) -> Callable[[], object]:
    """``probe`` as a callable running one forward of ``model``."""
    if callable(probe):
        return probe
    if probe is not None and not isinstance(probe, Mapping):
        raise ConfigError(f"{type(model).__name__}: probe= must be a mapping of the model's keyword arguments or a "
                          f"callable running one forward, got {type(probe).__name__}")
    inputs = dict(probe) if probe is not None else _default_probe_inputs(model)
    return lambda: model(**inputs)


def _run_probe(model: PreTrainedModel, run: Callable[[], object], probe: _Probe) -> _Probe:
    """One eval, no-grad forward (``run``) with every polyattn call going through ``probe``."""
    global _probe
    was_training = model.training
    _probe = probe
    try:
        model.eval()
        with torch.no_grad():
            run()
        return probe
    except ConfigError as error:
        raise ConfigError(f"{type(model).__name__}: {error}") from None
    finally:
        _probe = None
        model.train(was_training)


def _softmax_inputs(model: PreTrainedModel, run: Callable[[], object]) -> dict[int, AttentionInputs]:
    """What each attention module attends in a softmax forward of ``run`` (its first call), by module id."""
    recorded: dict[int, AttentionInputs] = {}
    _run_probe(model, run, _Probe("softmax", capture=lambda module, inputs: recorded.setdefault(id(module), inputs)))
    return recorded


def _default_probe_inputs(model: PreTrainedModel) -> dict[str, Tensor]:
    """A few tokens (two rows, the second padded) or one image, on the model's device."""
    config = model.config.get_text_config() if model.main_input_name == "input_ids" else model.config
    device = next(model.parameters()).device
    if model.main_input_name == "input_ids":
        ids = torch.arange(2 * PROBE_TOKENS, device=device).reshape(2, PROBE_TOKENS) % config.vocab_size
        mask = torch.ones_like(ids)
        mask[1, -2:] = 0
        inputs = {"input_ids": ids, "attention_mask": mask}
        if getattr(model.config, "is_encoder_decoder", False):
            inputs["decoder_input_ids"] = ids
        return inputs
    if model.main_input_name == "pixel_values":
        size = config.image_size if isinstance(config.image_size, (tuple, list)) else (config.image_size,) * 2
        return {"pixel_values": torch.zeros(1, config.num_channels, *size, device=device, dtype=model.dtype)}
    raise ConfigError(
        f"{type(model).__name__} takes {model.main_input_name!r}: pass probe= (the keyword arguments of one "
        "small forward) to set_attention"
    )


def _check_every_layer(model: PreTrainedModel, calls: dict[int, int]) -> list[nn.Module]:
    """The modules the probe reached, in ``named_modules`` order; refuse the model if an attention layer
    (a leaf-most module whose class name says ``Attention``) was not reached."""
    reached = [module for module in model.modules() if id(module) in calls]
    missed = [f"{name} ({type(m).__name__})" for name, m in _attention_like(model) if id(m) not in calls]
    if missed or not reached:
        raise ConfigError(
            f"{type(model).__name__} cannot be switched: the probe forward reached "
            f"{len(reached)} attention call(s) through transformers' AttentionInterface but not "
            f"{', '.join(missed) or 'any attention layer'}; these layers compute attention themselves"
        )
    return reached


def _attention_like(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of modules whose class name contains ``Attention`` and which hold no such module."""
    candidates = [(name, m) for name, m in model.named_modules() if "Attention" in type(m).__name__]
    inner = {id(m) for _, m in candidates}
    return [
        (name, m) for name, m in candidates if not any(id(c) in inner for c in m.modules() if c is not m)
    ]


# --------------------------------------------------------------------------- switched classes


_SWITCHED_PREFIX = "Switched__"
_switched: dict[type[nn.Module], type[SwitchedAttention]] = {}


def switched_class(cls: type[nn.Module]) -> type[SwitchedAttention]:
    """``SwitchedAttention`` + the HF class (its forward unchanged), one per class, picklable by name."""
    if cls not in _switched:
        name = _SWITCHED_PREFIX + f"{cls.__module__}.{cls.__qualname__}".replace(".", "__")
        _switched[cls] = type(name, (SwitchedAttention, cls), {"__module__": __name__, "__qualname__": name})
    return _switched[cls]


def __getattr__(name: str) -> type[SwitchedAttention]:
    """Unpickling finds a switched class by its name: rebuild it from the HF class it names."""
    if not name.startswith(_SWITCHED_PREFIX):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module_name, _, qualname = name[len(_SWITCHED_PREFIX):].replace("__", ".").rpartition(".")
    __import__(module_name)
    return switched_class(getattr(sys.modules[module_name], qualname))


# --------------------------------------------------------------------------- saved models


def load_pretrained(folder: str | Path, auto_class: type | None = None, **kwargs: Any) -> PreTrainedModel:
    """Load a ``save_pretrained`` folder of a switched model (offline) and switch it back to its activation.

    ``auto_class``: e.g. ``AutoModelForSequenceClassification`` (default ``AutoModel``); ``kwargs`` go to
    ``from_pretrained``. A folder saved without an activation loads as it is (softmax).
    """
    from transformers import AutoModel

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise MissingPathError(f"{folder} is not a saved model folder: no config.json in it")
    model = (auto_class or AutoModel).from_pretrained(folder, local_files_only=True, **kwargs)
    spec = getattr(model.config, CONFIG_KEY, None)
    if spec is not None:
        set_attention(model, spec)
    return model


__all__ = ["CONFIG_KEY", "IMPLEMENTATION", "load_pretrained", "polyattn_attention", "set_attention", "split_mask", "switched_class"]
