"""Building timm models offline, with a clear error for a bad name or a missing weight file."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import timm
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from safetensors import safe_open
from torch import nn

from ..checkpoint import CheckpointLoadError, describe_error, load_checkpoint
from ..errors import ConfigError, MissingPathError, UnknownNameError

#: Weight files a Hugging Face snapshot of a timm model holds, in order of preference.
HF_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def check_model_name(name: str) -> None:
    """Raise an :class:`UnknownNameError` listing close timm model names if ``name`` is not one."""
    if not timm.is_model(name):
        close = difflib.get_close_matches(name, timm.list_models(), n=8, cutoff=0.6)
        raise UnknownNameError(
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
                raise ConfigError(f"{snapshot} holds several {name} files, pass one of them: {found}")
            if found:
                return found[0]
    raise MissingPathError(
        f"pretrained weights {path} not found: expected a weight file (.safetensors, .pth, .bin) or a Hugging Face "
        "cache directory (models--<org>--<model> or one of its snapshots/<revision>) holding "
        f"{' or '.join(HF_WEIGHT_FILES)}; nothing is downloaded (docs/papers.md, 'Fine-tuning', says how to get one)"
    )


Shapes = dict[str, tuple[int, ...]]


def weight_shapes(file: Path) -> Shapes:
    """The tensor shapes of a weight file by name; a :class:`CheckpointLoadError` naming ``file`` if it cannot be read.

    timm's own errors for a damaged file (``[Errno 22] Invalid argument``, ``header too large``) do not name it.
    """
    if file.suffix != ".safetensors":
        state = load_checkpoint(file)  # weights_only, with a CRC check of every record; timm loads it again
        while isinstance(state, dict) and not any(torch.is_tensor(v) for v in state.values()):
            inner = next((state[key] for key in ("state_dict", "model", "module") if key in state), None)
            if inner is None:
                break
            state = inner  # the wrappers timm's load_state_dict also looks into
        return {
            name: tuple(v.shape) for name, v in (state.items() if isinstance(state, dict) else ()) if torch.is_tensor(v)
        }
    try:
        with safe_open(str(file), framework="pt") as weights:  # checks the header and that the byte ranges fit
            return {name: tuple(weights.get_slice(name).get_shape()) for name in weights.keys()}
    except Exception as err:
        raise CheckpointLoadError(
            f"pretrained weights {file} are truncated or corrupt ({describe_error(err)})"
        ) from err


def loading_report(file: Path, source: Shapes, model: nn.Module) -> str:
    """One block saying what loading ``file`` into ``model`` did: tensors loaded, classifier re-initialised for a
    new class count, tensors resampled to a new shape (position embeddings, relative position tables), and the
    file's tensors the model has no place for."""
    target = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    classifiers = model.pretrained_cfg.get("classifier") or ()
    classifiers = (classifiers,) if isinstance(classifiers, str) else tuple(classifiers)
    head = [name for name in target if name.rsplit(".", 1)[0] in classifiers]
    common = [name for name in target if name in source]
    new_head = [name for name in head if source.get(name, target[name])[:1] != target[name][:1] or name not in source]
    resampled = [name for name in common if source[name] != target[name] and name not in new_head]
    loaded = [name for name in common if name not in new_head]
    unused = [name for name in source if name not in target]
    lines = [f"pretrained weights {file}: {len(loaded)} of the model's {len(target)} tensors loaded"]
    if new_head:
        rows = {source[name][0] for name in head if name in source}
        was = f"the file has {rows.pop()} classes" if len(rows) == 1 else "the file has no classifier"
        lines.append(f"  re-initialised: {', '.join(new_head)} ({was}, the model {target[new_head[0]][0]})")
    for name in resampled:
        lines.append(f"  resampled: {name} {list(source[name])} -> {list(target[name])}")
    if unused:
        more = f" ... ({len(unused) - 5} more)" if len(unused) > 5 else ""
        lines.append(
            f"  not used (renamed by timm's checkpoint filter or not in the model): {', '.join(unused[:5])}{more}"
        )
    return "\n".join(lines)


def pretrained_overlay(path: str | Path) -> tuple[dict[str, Any], Path, Shapes]:
    """timm's ``pretrained_cfg_overlay`` for local weights, the weight file and its tensor shapes.

    A ``.ckpt`` is taken for a checkpoint of this project's ClassificationModule
    (e.g. a softmax run to fine-tune into poly3): its timm model's weights are
    the ``model.*`` entries (the EMA weights when the run kept an EMA), and its
    classifier is kept when the class count is unchanged.
    """
    file = resolve_pretrained_file(path)
    if file.suffix != ".ckpt":
        return dict(file=str(file)), file, weight_shapes(file)
    checkpoint = load_checkpoint(file)
    state = checkpoint["state_dict"]
    weights = {name.removeprefix("model."): state[name] for name in state if name.startswith("model.")}
    shapes = {name: tuple(tensor.shape) for name, tensor in weights.items()}
    return dict(state_dict=weights, num_classes=checkpoint["hyper_parameters"]["num_classes"]), file, shapes


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
    ``img_size`` and a classifier with another class count is dropped. What
    loading did is logged as one block (:func:`loading_report`).
    """
    check_model_name(model_name)
    if img_size is not None:
        model_kwargs["img_size"] = img_size
    given = dict(model_kwargs)
    overlay, file, shapes = pretrained_overlay(pretrained) if pretrained is not None else (None, None, None)
    if overlay is not None:
        model_kwargs.update(pretrained=True, pretrained_cfg_overlay=overlay)
    try:
        model = timm.create_model(model_name, num_classes=num_classes, drop_path_rate=drop_path_rate, **model_kwargs)
    except (TypeError, ValueError, AssertionError, KeyError) as err:  # an argument the class does not take or accept
        raise ConfigError(
            f"timm cannot build {model_name} with model_kwargs {given}: {type(err).__name__}: {err}"
        ) from err
    if file is not None:
        rank_zero_info(loading_report(file, shapes, model))
    return model
