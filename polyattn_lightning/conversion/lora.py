"""LoRA fine-tuning through peft: adapters on each attention module's own q/k/v/o layers, merged on export.

:func:`add_lora` puts peft LoRA adapters (``peft.inject_adapter_in_model``: in place, the model keeps its own
class) on the layers that compute the letters of ``LoraRecipe.target`` in every switched attention module, as
:func:`~.folding.projection_modules` finds them: ``q_proj``/``query``/``q_lin``..., a fused projection (timm's
``qkv``, GPT-2's ``c_attn``) once for all its letters, and ``o`` where it is (``o_proj``, timm's ``proj``, BERT's
``output.dense`` beside the self-attention). The modules are given to peft by their full names, anchored
(``^(blocks\\.0\\.attn\\.qkv|...)$``), so a bare suffix such as ``proj`` never also hits ``patch_embed.proj``.
peft freezes every other parameter of the model; the ``trainable`` modules passed (a new classification head)
are unfrozen again.

:func:`merged` is a copy with every adapter merged into its base layer (peft's own ``merge``) and the peft layers
replaced by those base layers: the model as it was built, with the fine-tuned weights, which
``save_pretrained`` writes and ``from_pretrained`` loads without peft. The tasks' export merges the model's
whole state dict instead (:func:`merged_state_dict`, the same weights under the same names): no copy of the model,
which a sharded one refuses.

peft is the optional extra ``[lora]``; it is imported only when adapters are added or merged.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from torch import Tensor, nn

from ..attention.switch import attention_modules
from ..checkpoint import checkpoint_safe
from ..errors import ConfigError, check_options, options_checked
from .folding import base_layer, is_conv1d, library_class, projection_modules

#: The letters a LoRA target may name.
LETTERS = ("q", "k", "v", "o")


@checkpoint_safe
@options_checked("lora")
@dataclass
class LoraRecipe:
    """LoRA settings: rank ``r``, ``alpha`` (the update is scaled by ``alpha / r``), dropout on the adapter's input,
    and which of each attention module's ``q``, ``k``, ``v``, ``o`` layers get an adapter."""

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target: list[str] = field(default_factory=lambda: list(LETTERS))

    def __post_init__(self):
        if self.r < 1:
            raise ConfigError(f"lora.r must be at least 1, got {self.r}")
        unknown = [letter for letter in self.target if letter not in LETTERS]
        if unknown or not self.target:
            raise ConfigError(f"lora.target: {unknown or self.target} is not a list of {', '.join(LETTERS)}")


def lora_targets(model: nn.Module, letters: Sequence[str]) -> list[str]:
    """The full names (from ``model``) of the layers the letters name, every switched attention module's, once
    each, in ``named_modules`` order."""
    names = {id(m): name for name, m in model.named_modules()}
    wanted: dict[int, str] = {}
    for module_name, module in attention_modules(model):
        found = projection_modules(model, module)
        missing = [letter for letter in letters if letter not in found]
        if missing:
            raise ConfigError(
                f"lora.target: {module_name} ({library_class(module)}) has no layer for {', '.join(missing)} "
                f"(it has {', '.join(found) or 'none'})"
            )
        for letter in letters:
            wanted.setdefault(id(found[letter]), names[id(found[letter])])
    if not wanted:
        raise ConfigError(f"lora: {type(model).__name__} has no switched attention module to put adapters on")
    order = {id(m): i for i, (_, m) in enumerate(model.named_modules())}
    return [wanted[key] for key in sorted(wanted, key=order.__getitem__)]


def add_lora(
    model: nn.Module,
    recipe: LoraRecipe | Mapping[str, Any] | None = None,
    trainable: Sequence[nn.Module] = (),
    **options: Any,
) -> dict[str, float]:
    """Put adapters on ``model`` (in place; see the module docstring) as ``recipe`` says, or its options given as
    a mapping or as keywords (``add_lora(model, r=4, target=["q", "v"])``; none: the defaults); an unknown option
    is refused in one line naming them all. Returns :func:`lora_summary`."""
    check_options(("recipe", "trainable", *(f.name for f in fields(LoraRecipe))), options, "add_lora")
    if recipe is not None and options:
        raise ConfigError(f"add_lora: the options are given twice, as recipe and as {', '.join(options)}; give one")
    if not isinstance(recipe, LoraRecipe):
        recipe = LoraRecipe(**(recipe or options))
    import peft

    targets = lora_targets(model, recipe.target)
    conv1d = [is_conv1d(base_layer(model.get_submodule(name))) for name in targets]
    if any(conv1d) and not all(conv1d):
        raise ConfigError(f"lora: {type(model).__name__} mixes Conv1D and Linear projections; peft takes one layout")
    config = peft.LoraConfig(
        r=recipe.r,
        lora_alpha=recipe.alpha,
        lora_dropout=recipe.dropout,
        target_modules="^(" + "|".join(re.escape(name) for name in targets) + ")$",
        fan_in_fan_out=all(conv1d),  # GPT-2's Conv1D keeps its weight as (in, out)
    )
    peft.inject_adapter_in_model(config, model)
    for module in trainable:
        module.requires_grad_(True)
    return lora_summary(model)


def is_lora(model: nn.Module) -> bool:
    """Whether ``model`` holds peft adapters (without importing peft)."""
    return any(hasattr(m, "lora_A") and hasattr(m, "get_base_layer") for m in model.modules())


def lora_summary(model: nn.Module) -> dict[str, float]:
    """Adapter, trainable and base parameter counts, and the adapters as a fraction of the base model."""
    adapters = sum(p.numel() for name, p in model.named_parameters() if "lora_" in name)
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    base = total - adapters
    return {"adapters": adapters, "trainable": trainable, "base": base, "adapter_fraction": adapters / max(base, 1)}


def merged(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with every adapter merged into its base layer and the peft layers gone."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    copied = copy.deepcopy(model)
    layers = [(name, m) for name, m in copied.named_modules() if isinstance(m, BaseTunerLayer)]
    for name, layer in layers:
        layer.merge()
        parent_name, _, child = name.rpartition(".")
        setattr(copied.get_submodule(parent_name), child, layer.get_base_layer())
    if hasattr(copied, "peft_config"):
        del copied.peft_config
    copied.requires_grad_(True)
    return copied


def merged_state_dict(model: nn.Module, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """``state`` (``model``'s whole state dict, e.g. gathered from its shards) with every adapter merged into its
    base weight, ``W + scaling * B A`` (transposed for a ``Conv1D``), under the base layer's own names: the state
    dict of :func:`merged`'s copy, without copying the model (FSDP2 shards refuse ``deepcopy``)."""
    from peft.tuners.lora import LoraLayer

    out = dict(state)
    for name, layer in model.named_modules():
        if not isinstance(layer, LoraLayer):
            continue
        prefix = f"{name}."
        base = f"{prefix}base_layer.weight"
        for adapter in layer.active_adapters:
            down, up = out.pop(f"{prefix}lora_A.{adapter}.weight"), out.pop(f"{prefix}lora_B.{adapter}.weight")
            delta = (up.double() @ down.double()) * layer.scaling[adapter]
            out[base] = (out[base].double() + (delta.T if layer.fan_in_fan_out else delta)).to(out[base].dtype)
        for key in [key for key in out if key.startswith(f"{prefix}base_layer.")]:
            out[prefix + key[len(f"{prefix}base_layer.") :]] = out.pop(key)
    return out


__all__ = [
    "LETTERS",
    "LoraRecipe",
    "add_lora",
    "is_lora",
    "lora_summary",
    "lora_targets",
    "merged",
    "merged_state_dict",
]
