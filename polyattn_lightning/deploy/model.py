"""What an export exports (:class:`Source`): a model as one module that takes tensors and returns one tensor, with
the inputs the export is traced on (two of their rows) and checked on (all of them: another batch size, so the
exported batch is dynamic). A Hugging Face model (:func:`hf_source`) is called with its inputs by name and returns
its first output; one that takes more than token ids (and their mask) or images is refused in one line. Without a
run to take a batch from, its inputs are drawn at random (token ids below the vocabulary size, the last row padded
in its second half; or images at the model's size).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import ConfigError

#: The inputs a Hugging Face model may take to be exported: token ids (and their mask), or images.
HF_INPUTS = (("input_ids", "attention_mask"), ("pixel_values",))
#: Rows and tokens of the random inputs of a saved folder.
RANDOM_ROWS, RANDOM_TOKENS = 3, 16


class ExportRefused(ConfigError):
    """A model, or a family, that a format cannot export; the message says which and why, in one line."""


class FirstOutput(nn.Module):
    """A Hugging Face model called with named tensors, returning its first output (``last_hidden_state``,
    ``logits``): what the exports trace, so that an exported graph takes and returns plain tensors. A causal LM runs
    without its KV cache (``use_cache=False``): the export is of one whole forward pass."""

    def __init__(self, model: nn.Module, names: tuple[str, ...]):
        super().__init__()
        self.model, self.names = model, names
        self.options = {"use_cache": False} if hasattr(model.config, "use_cache") else {}

    def forward(self, *tensors: Tensor) -> Tensor:
        return self.model(**dict(zip(self.names, tensors)), **self.options, return_dict=True)[0]


@dataclass
class Source:
    """A model to export: ``kind`` (``timm`` or ``hf``), ``family`` (its class), ``model`` (what the exports trace:
    tensors in, one tensor out), ``names`` (its inputs' names), ``inputs`` (the run's batch, or random ones),
    ``inputs_from`` (where they come from, in words), ``sequence_dim`` (the inputs' sequence dimension; None:
    images), ``rebuild`` (timm: builds the model anew from the checkpoint's hyperparameters, as a user would) and
    ``save_pretrained`` (a Hugging Face run: writes the task's ``save_pretrained`` folder)."""

    kind: str
    family: str
    model: nn.Module
    names: tuple[str, ...]
    inputs: tuple[Tensor, ...]
    inputs_from: str
    sequence_dim: int | None = None
    rebuild: Callable[[], nn.Module] | None = None
    save_pretrained: Callable[[Path], Any] | None = None

    @property
    def sample(self) -> tuple[Tensor, ...]:
        """Two rows of the inputs (repeated where there is one): what the exports are traced on."""
        return tuple(t[:2] if len(t) >= 2 else t.repeat(2, *[1] * (t.dim() - 1)) for t in self.inputs)


def hf_source(model: nn.Module, batch: Any, inputs_from: str) -> Source:
    """A Hugging Face model with the inputs of ``batch`` (a mapping of named tensors; None: random ones)."""
    model.eval()
    family = type(model).__name__
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        raise ExportRefused(f"{family} cannot be exported: an encoder-decoder takes decoder inputs ({WHAT_IT_TAKES})")
    names = next((names for names in HF_INPUTS if names[0] == model.main_input_name), None)
    if names is None or (names[0] == "input_ids" and not hasattr(config, "vocab_size")):
        raise ExportRefused(
            f"{family} cannot be exported: it takes {model.main_input_name} with other inputs ({WHAT_IT_TAKES})"
        )
    if batch is not None:
        names = tuple(name for name in names if name in batch)  # a causal LM's batch may hold no mask
        inputs = tuple(batch[name] for name in names)
    else:
        inputs = _random_images(config) if names[0] == "pixel_values" else _random_text(config)
    sequence_dim = 1 if names[0] == "input_ids" else None
    return Source("hf", family, FirstOutput(model, names).eval(), names, inputs, inputs_from, sequence_dim)


#: What a Hugging Face model must take to be exported, said in its refusal.
WHAT_IT_TAKES = "polyattn export traces text models on input_ids and attention_mask, vision models on pixel_values"


def _random_images(config) -> tuple[Tensor]:
    """Images at the model's size (a video model's: ``num_frames`` of them per row)."""
    size = config.image_size if isinstance(config.image_size, int) else config.image_size[0]
    frames = (config.num_frames,) if getattr(config, "num_frames", None) else ()
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(RANDOM_ROWS, *frames, config.num_channels, size, size, generator=generator),)


def _random_text(config) -> tuple[Tensor, Tensor]:
    """Token ids below the vocabulary size, the last row padded in its second half."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, config.vocab_size, (RANDOM_ROWS, RANDOM_TOKENS), generator=generator)
    mask = torch.ones_like(ids)
    mask[-1, RANDOM_TOKENS // 2 :] = 0
    return ids, mask
