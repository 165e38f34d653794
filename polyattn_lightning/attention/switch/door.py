"""The one door: :func:`set_attention` routes a model to its library's switch (``hf/`` for a transformers
``PreTrainedModel``, ``timm/`` for everything else), importing that library only then."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping

from torch import nn

from ...errors import ConfigError
from ..registry import ActivationSpec


def set_attention(
    model: nn.Module,
    activation: ActivationSpec,
    *,
    strict: bool = True,
    probe: Callable[[], object] | Mapping | bool | None = None,
    calibrate: bool = False,
) -> int:
    """Switch every attention of ``model`` to ``activation``, in place; returns how many modules were switched.

    Args:
        model: a timm model, a part of one (a block, one attention module), a module holding switched ones
            (the LRA encoder), or a Hugging Face ``transformers`` ``PreTrainedModel``.
        activation: a registry activation (``"poly3"``, ``{name: poly3, scale: 0.0714}``...); ``softmax`` too.
        strict: refuse (:class:`~.timm.AttentionRefused`, a ``ConfigError``; nothing changed) when any module
            would keep softmax, attention pooling heads aside; False switches the rest and logs one line naming
            what stays softmax. With nothing to switch it always refuses. An HF model is always switched whole.
        probe: the forward that shows what still computes softmax after the switch (a callable running one
            forward of ``model``; an HF model also takes a mapping of its keyword arguments). None makes one
            from the model (timm: an image at the size it was built for, skipped where it keeps none; HF: inputs
            from its config); False skips it (timm only). A given probe that fails on the model as built is a
            :class:`~.timm.ProbeInputError` naming the class: the input does not fit the model.
        calibrate: removed: converting a pretrained softmax model (calibration, attention transfer) is
            ``polyattn_lightning.convert(model, activation, samples, method=...)``; True is an error saying so.

    Example:
        A small timm ViT switched to x^3 attention scaled by 1/sqrt(N); two blocks, so two attention modules:

        >>> import timm
        >>> from polyattn_lightning import set_attention
        >>> model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=10)
        >>> set_attention(model, {"name": "poly3", "scale": "inv_sqrt_n"})
        2
    """
    if calibrate:
        raise ConfigError(
            "set_attention(calibrate=True) moved: call polyattn_lightning.convert(model, activation, samples, "
            "method='calibrate') (or method='transfer', which keeps more of the pretrained model)"
        )
    if _is_hf_model(model):
        from .hf import set_attention as set_hf_attention

        if not strict or probe is False:
            raise ConfigError(
                f"{type(model).__name__}: a Hugging Face model is switched whole, after its probe "
                "forward; strict=False and probe=False are for timm models"
            )
        return set_hf_attention(model, activation, probe=None if probe is True else probe)
    from .timm import set_attention as set_timm_attention

    return set_timm_attention(model, activation, strict=strict, probe=probe)


def _is_hf_model(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers ``PreTrainedModel`` (without importing transformers: one exists only
    once ``transformers.modeling_utils`` is imported)."""
    hf_models = sys.modules.get("transformers.modeling_utils")
    return hf_models is not None and isinstance(model, hf_models.PreTrainedModel)


__all__ = ["set_attention"]
