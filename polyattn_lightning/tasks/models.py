"""Building timm models offline, with a clear error for a bad name or a missing weight file."""
from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import timm
from safetensors import safe_open
from torch import nn

from ..checkpoint import CheckpointLoadError, describe_error, load_checkpoint

#: Weight files a Hugging Face snapshot of a timm model holds, in order of preference.
HF_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def check_model_name(name: str) -> None:
    """Raise a ValueError listing close timm model names if ``name`` is not one."""
    if not timm.is_model(name):
        close = difflib.get_close_matches(name, timm.list_models(), n=8, cutoff=0.6)
        raise ValueError(
            f"unknown timm model {name!r}; close matches: {', '.join(close) or 'none'} "
            "(timm.list_models('*vit*') lists them all)"
        )


def resolve_pretrained_file(path: str | Path) -> Path:
    """A weight file, given the file itself or a Hugging Face cache directory of the model.

    The directory may be the repository folder (``models--timm--<name>``: its
    ``refs/main`` snapshot is used) or one ``snapshots/<revision>`` folder.
    """
    path = Path(path).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        ref = path / "refs" / "main"
        snapshot = path / "snapshots" / ref.read_text().strip() if ref.is_file() else path
        for name in HF_WEIGHT_FILES:
            found = sorted(snapshot.rglob(name))
            if len(found) > 1:
                raise ValueError(f"{snapshot} holds several {name} files, pass one of them: {found}")
            if found:
                return found[0]
    raise FileNotFoundError(
        f"pretrained weights {path} not found: expected a weight file (.safetensors, .pth, .bin) or a Hugging Face "
        "cache directory (models--<org>--<model> or one of its snapshots/<revision>) holding "
        f"{' or '.join(HF_WEIGHT_FILES)}"
    )


def check_weight_file(file: Path) -> None:
    """Raise a :class:`CheckpointLoadError` naming ``file`` if it cannot be read as weights.

    timm's own errors for a damaged file (``[Errno 22] Invalid argument``, ``header too large``) do not name it.
    """
    if file.suffix != ".safetensors":
        load_checkpoint(file)  # weights_only, with a CRC check of every record; timm loads it again
        return
    try:
        with safe_open(str(file), framework="pt"):
            pass  # opening checks the header and that the tensors' byte ranges fit the file
    except Exception as err:
        raise CheckpointLoadError(f"pretrained weights {file} are truncated or corrupt ({describe_error(err)})") from err


def pretrained_overlay(path: str | Path) -> dict[str, Any]:
    """timm's ``pretrained_cfg_overlay`` for local weights.

    A ``.ckpt`` is taken for a checkpoint of this project's ClassificationModule
    (e.g. a softmax run to fine-tune into poly3): its timm model's weights are
    the ``model.*`` entries (the EMA weights when the run kept an EMA), and its
    classifier is kept when the class count is unchanged.
    """
    file = resolve_pretrained_file(path)
    if file.suffix != ".ckpt":
        check_weight_file(file)
        return dict(file=str(file))
    checkpoint = load_checkpoint(file)
    state = checkpoint["state_dict"]
    weights = {name.removeprefix("model."): state[name] for name in state if name.startswith("model.")}
    return dict(state_dict=weights, num_classes=checkpoint["hyper_parameters"]["num_classes"])


def create_timm_model(
    model_name: str,
    num_classes: int,
    img_size: int | None = None,
    drop_path_rate: float = 0.0,
    pretrained: str | None = None,
    **model_kwargs: Any,
) -> nn.Module:
    """``timm.create_model`` that never downloads.

    ``pretrained`` goes through timm's own loading (``pretrained_cfg_overlay``),
    so its checkpoint filters still run: position embeddings are resampled to
    ``img_size`` and a classifier with another class count is dropped.
    """
    check_model_name(model_name)
    if img_size is not None:
        model_kwargs["img_size"] = img_size
    if pretrained is not None:
        model_kwargs.update(pretrained=True, pretrained_cfg_overlay=pretrained_overlay(pretrained))
    return timm.create_model(model_name, num_classes=num_classes, drop_path_rate=drop_path_rate, **model_kwargs)
