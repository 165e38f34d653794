"""The default probe: the inputs of one small forward, built from a Hugging Face model's config.

``set_attention`` without ``probe=`` runs the model once on these, to prove that every attention layer runs
the registry activation. Each modality's input comes from the model's forward signature and its config:

* text (``input_ids``): two rows of :data:`PROBE_TOKENS` random ids below ``vocab_size``, the second row's
  last :data:`PADDED` positions padding (``attention_mask``), so padding reaches every layer; an
  encoder-decoder also gets them as ``decoder_input_ids``;
* image (``pixel_values``): one random image ``(1, num_channels, *image_size)`` per row; video (a config with
  ``num_frames``, e.g. VideoMAE): ``(B, num_frames, C, H, W)``;
* image + text (CLIP, SigLIP, ... a config with a ``vision_config`` whose forward takes ``pixel_values``
  beside ``input_ids``): both;
* audio waveform (``input_values``, wav2vec2 / HuBERT / WavLM): the samples that make :data:`PROBE_TOKENS`
  frames through the config's ``conv_kernel`` / ``conv_stride`` feature encoder;
* log-mel features (``input_features``, Whisper): ``(B, num_mel_bins, 2 * max_source_positions)``, the
  length its encoder requires, plus ``decoder_input_ids``.

Any other main input (``inputs_embeds`` only, a speech model with another feature layout, ...) is a one-line
:class:`~polyattn_lightning.errors.ConfigError` naming the model and saying to pass ``probe=``. The inputs
come from a private generator (seeded), so the global RNG is untouched.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor, nn

from ....errors import ConfigError

#: Tokens per row (and audio frames) of the probe forward: a few, so a causal model has several query rows.
PROBE_TOKENS = 6
#: Padding positions at the end of the second row of token ids.
PADDED = 2


def probe_inputs(model: nn.Module, *, tokens: int = PROBE_TOKENS, padded: int = PADDED, seed: int = 0) -> dict:
    """The keyword arguments of one small forward of ``model`` (module docstring), on its device."""
    config = model.config
    params = inspect.signature(model.forward).parameters
    main = getattr(model, "main_input_name", "input_ids")
    generator = torch.Generator().manual_seed(seed)
    parameter = next(model.parameters(), None)
    device = parameter.device if parameter is not None else None
    dtype = parameter.dtype if parameter is not None and parameter.is_floating_point() else torch.float32
    inputs: dict[str, Tensor] = {}
    if main == "input_ids":
        inputs.update(_tokens(config.get_text_config(), tokens, padded, generator, "attention_mask" in params))
        if "pixel_values" in params and getattr(config, "vision_config", None) is not None:
            inputs["pixel_values"] = _pixels(config.vision_config, 2, generator)
    elif main in ("pixel_values", "pixel_values_videos"):
        inputs[main] = _pixels(getattr(config, "vision_config", None) or config, 1, generator)
    elif main == "input_values" and hasattr(config, "conv_kernel"):
        inputs[main] = torch.randn(2, _waveform_length(config, tokens), generator=generator)
    elif main == "input_features" and hasattr(config, "max_source_positions") and hasattr(config, "num_mel_bins"):
        inputs[main] = torch.randn(2, config.num_mel_bins, 2 * config.max_source_positions, generator=generator)
    else:
        raise ConfigError(
            f"{type(model).__name__} takes {main!r}, for which no default probe is built from its config: pass "
            "probe= to set_attention (a mapping of the keyword arguments of one small forward, or a callable)"
        )
    if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in params:
        decoder = config.get_text_config(decoder=True)
        inputs["decoder_input_ids"] = _tokens(decoder, tokens, 0, generator, False)["input_ids"]
    return {name: x.to(device=device, dtype=dtype if x.is_floating_point() else x.dtype) for name, x in inputs.items()}


def _tokens(config, tokens: int, padded: int, generator: torch.Generator, with_mask: bool) -> dict[str, Tensor]:
    """Two rows of ids in ``1 .. vocab_size - 1`` (0 is often the padding id); the second row's last ``padded``
    positions masked."""
    length = min(tokens, getattr(config, "max_position_embeddings", tokens) or tokens)
    ids = torch.randint(1, config.vocab_size, (2, length), generator=generator)
    if not with_mask:
        return {"input_ids": ids}
    mask = torch.ones_like(ids)
    if padded:
        mask[1, -padded:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _pixels(config, batch: int, generator: torch.Generator) -> Tensor:
    """Random images ``(batch, C, H, W)``, or videos ``(batch, frames, C, H, W)`` for a config with frames."""
    size = config.image_size if isinstance(config.image_size, (tuple, list)) else (config.image_size,) * 2
    frames = getattr(config, "num_frames", None)
    shape = (batch, config.num_channels, *size) if frames is None else (batch, frames, config.num_channels, *size)
    return torch.randn(shape, generator=generator)


def _waveform_length(config, frames: int) -> int:
    """The fewest samples from which the convolutional feature encoder makes ``frames`` frames."""
    length = frames
    for kernel, stride in reversed(list(zip(config.conv_kernel, config.conv_stride))):
        length = (length - 1) * stride + kernel
    return length


__all__ = ["PADDED", "PROBE_TOKENS", "probe_inputs"]
