"""What ``polyattn export`` exports: the model of a run's checkpoint (a timm image model, or a Hugging Face model of
the ``hf`` task family) or of a saved switched Hugging Face folder, as one module that takes tensors and returns one
tensor, with the inputs its exports are traced with and checked on.

The inputs are the run's own: the first validation batch of the data its saved config names (the config beside the
checkpoint, as ``polyattn maps`` finds it), traced on two of its rows and checked on all of them (another batch
size: the exported batch is dynamic). A saved folder has no run: its inputs are drawn at random (token ids below the
vocabulary size, the last row padded in its second half; or images at the model's size), and the command says so.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import Tensor, nn

from ...attention import set_attention
from ...cli import make_cli
from ...cli.runs import checkpoint_run_dir, newest_saved_config
from ...errors import ConfigError, MissingPathError
from ..check_data import DataOnlyCLI
from ..maps import load_module

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


def load_source(path: Path) -> Source:
    """The model of a run's checkpoint (file or sharded folder) or of a saved Hugging Face folder, with its inputs;
    refuses, in one line, what is neither a timm image model nor a Hugging Face model taking ids or images."""
    if not path.exists():
        raise MissingPathError(f"checkpoint {path} does not exist (a run's checkpoint, or a saved model folder)")
    if path.is_dir() and (path / "config.json").is_file():
        return _saved_folder(path)
    module = load_module(path, None)
    model = exportable(module).eval()
    batch, inputs_from = run_batch(path)
    if hasattr(model, "pretrained_cfg"):
        images = batch[0] if isinstance(batch, (tuple, list)) else None
        if not isinstance(images, Tensor):
            raise ConfigError(f"{inputs_from}: the run's batches are not (images, labels) as a timm model takes")
        return Source(
            "timm",
            type(model).__name__,
            model,
            ("images",),
            (images.float(),),
            inputs_from,
            rebuild=lambda: fresh_timm_model(module),
        )
    source = hf_source(model, batch, inputs_from)
    source.save_pretrained = module.export
    return source


def exportable(module) -> nn.Module:
    """The module's network, refused in one line (with the reason) where it is neither a timm image model nor a
    Hugging Face model."""
    model = getattr(module, "model", None)
    if isinstance(model, nn.Module) and (hasattr(model, "pretrained_cfg") or _is_hf(model)):
        return model
    raise ConfigError(
        f"polyattn export takes timm image models and Hugging Face models; {type(module).__name__}'s "
        f"{type(model).__name__} is neither (a detector's post-processing is data-dependent and does not export)"
    )


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


def run_batch(ckpt: Path) -> tuple[Any, str]:
    """The first validation batch of the run that wrote ``ckpt`` (built from the config saved beside it), and where
    it comes from in words."""
    config = newest_saved_config(checkpoint_run_dir(ckpt))
    if config is None:
        raise ConfigError(
            f"no config saved beside {ckpt} (its run folder's config.yaml): the export is checked on a batch of the "
            "run's data, which that config names"
        )
    sys.argv = sys.argv[:1]  # parsed here: LightningCLI would warn that its args and sys.argv both hold some
    saved = yaml.safe_load(config.read_text()) or {}
    pieces = {key: saved[key] for key in ("model", "data") if key in saved}  # the fit-only keys (ckpt_path) left out
    with tempfile.TemporaryDirectory() as folder:
        config_piece = Path(folder, "config.yaml")
        config_piece.write_text(yaml.safe_dump(pieces))
        datamodule = make_cli(["--config", str(config_piece)], run=False, cli_class=DataOnlyCLI).datamodule
    datamodule.prepare_data()
    datamodule.setup("validate")
    return next(iter(datamodule.val_dataloader())), "the run's data"


def fresh_timm_model(module) -> nn.Module:
    """The module's timm model built anew as a user would: ``timm.create_model`` and ``set_attention``."""
    import timm

    hp = module.hparams
    kwargs = dict(hp.get("model_kwargs") or {})
    if hp.get("img_size") is not None:
        kwargs["img_size"] = hp.img_size
    model = timm.create_model(hp.model_name, num_classes=hp.num_classes, **kwargs)
    if hp.get("attention") is not None:
        set_attention(model, hp.attention)
    return model.eval()


def _saved_folder(folder: Path) -> Source:
    import transformers

    from ...attention.switch.hf import load_pretrained

    config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    architectures = getattr(config, "architectures", None) or []
    cls = getattr(transformers, architectures[0], None) if architectures else None
    model = load_pretrained(folder, auto_class=cls)
    return hf_source(model, None, f"random inputs (a saved folder, {folder}, has no run to take a batch from)")


def _is_hf(model: nn.Module) -> bool:
    return hasattr(model, "config") and type(model).__module__.startswith("transformers.")


def _random_images(config) -> tuple[Tensor]:
    size = config.image_size if isinstance(config.image_size, int) else config.image_size[0]
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(RANDOM_ROWS, config.num_channels, size, size, generator=generator),)


def _random_text(config) -> tuple[Tensor, Tensor]:
    """Token ids below the vocabulary size, the last row padded in its second half."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, config.vocab_size, (RANDOM_ROWS, RANDOM_TOKENS), generator=generator)
    mask = torch.ones_like(ids)
    mask[-1, RANDOM_TOKENS // 2 :] = 0
    return ids, mask
