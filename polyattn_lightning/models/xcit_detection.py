"""XCiT as a detection backbone: timm's XCiT, registry attention, four maps at strides 4/8/16/32.

Follows the XCiT authors' detection backbone (facebookresearch/xcit ``detection/backbone/xcit.py``):
the patch tokens after blocks ``out_indices`` (3, 5, 7, 11 for 12 layers; 7, 11, 15, 23 for 24)
become maps at the patch stride and are resampled to strides 4/8/16/32 (patch 16: transposed conv,
BatchNorm, GELU, transposed conv / one transposed conv / identity / 2x2 max-pool). The network
itself is timm's ``Xcit`` (so timm and official weights load), with the classification parts
(class token, class-attention blocks, final norm, head) pruned, the same drop-path rate on every
block as timm and the authors have it, and the Fourier position encoding computed for each input's
size. Its XCA attention goes through :func:`~polyattn_lightning.attention.set_attention`:
XCA attends over the ``d x d`` channel map, so ``N`` in a length scale is the head dim (48 for
XCiT-S); the paper's runs use the fixed ``scale: 0.0714`` (1/14).

BatchNorm: the patch embedding, the local patch interaction and the stride-4 branch use
``BatchNorm2d``; under multi-GPU DDP set the trainer's ``sync_batchnorm: true`` (Lightning
converts every BatchNorm to ``SyncBatchNorm``, as the authors' code hard-codes). torch's
``SyncBatchNorm`` synchronises only on GPUs, so leave it off for CPU runs.

This module knows nothing of mmdet; :mod:`polyattn_lightning.detection.backbones` registers it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

import timm
from safetensors.torch import load_file as load_safetensors
from timm.models.xcit import Xcit, checkpoint_filter_fn
from torch import Tensor, nn

from ..attention.registry import ActivationSpec
from ..attention.switch import set_attention
from ..checkpoint import CheckpointLoadError, describe_error, load_checkpoint
from ..errors import ConfigError, MissingPathError, UnknownNameError

log = logging.getLogger(__name__)

#: The authors' feature layers by depth.
DEFAULT_OUT_INDICES = {12: (3, 5, 7, 11), 24: (7, 11, 15, 23)}
#: Keys of a timm/official XCiT state dict that only classification uses.
CLASSIFICATION_PARTS = ("cls_token", "cls_attn_blocks.", "norm.", "head.")
#: Key endings only XCiT blocks have (XCA temperature, local patch interaction).
XCIT_ONLY = (".attn.temperature", ".local_mp.conv1.weight")


def _upsample_branches(dim: int, patch_size: int) -> list[nn.Module]:
    """The authors' resampling from the patch stride to strides 4, 8, 16, 32."""

    def up() -> nn.ConvTranspose2d:
        return nn.ConvTranspose2d(dim, dim, kernel_size=2, stride=2)

    if patch_size == 16:
        return [nn.Sequential(up(), nn.BatchNorm2d(dim), nn.GELU(), up()), up(), nn.Identity(), nn.MaxPool2d(2, 2)]
    if patch_size == 8:
        return [up(), nn.Identity(), nn.MaxPool2d(2, 2), nn.MaxPool2d(4, 4)]
    raise ConfigError(f"XCiT detection backbone: patch_size must be 8 or 16, got {patch_size}")


class XCiTBackbone(nn.Module):
    """timm XCiT returning four ``(B, embed_dim, H/s, W/s)`` maps, ``s`` = 4, 8, 16, 32."""

    strides = (4, 8, 16, 32)

    def __init__(
        self,
        model_name: str = "xcit_small_12_p16_224",
        attention: ActivationSpec = "softmax",
        out_indices: Sequence[int] | None = None,
        drop_path_rate: float = 0.0,
        pretrained: str | None = None,
        **model_kwargs,
    ):
        """
        Args:
            model_name: a timm XCiT, e.g. ``xcit_small_12_p16_224``, ``xcit_medium_24_p16_224``.
            attention: registry activation of every XCA layer, e.g. ``{name: poly3, scale: 0.0714}``.
            out_indices: the four blocks whose outputs become the maps; default by depth (12 or 24 layers).
            drop_path_rate: stochastic depth, the same on every block (the 3x recipe: 0.05 for XCiT-S12).
            pretrained: weights, never downloaded: the ``.ckpt`` of a ClassificationModule run (its EMA
                weights when it kept an EMA) or a timm/official XCiT state dict (``.pth``, ``.safetensors``).
            model_kwargs: further ``timm.create_model`` arguments (``embed_dim``, ``depth``, ``num_heads``...).
        """
        super().__init__()
        if not timm.is_model(model_name):
            raise UnknownNameError(
                f"unknown timm model {model_name!r}; XCiT models: {', '.join(timm.list_models('xcit_*'))}"
            )
        xcit = timm.create_model(
            model_name, pretrained=False, num_classes=0, drop_path_rate=drop_path_rate, **model_kwargs
        )
        if not isinstance(xcit, Xcit):
            raise ConfigError(f"XCiTBackbone needs a timm XCiT model, got {model_name!r} ({type(xcit).__name__})")
        depth = len(xcit.blocks)
        if out_indices is None:
            if depth not in DEFAULT_OUT_INDICES:
                raise ConfigError(f"{model_name} has {depth} blocks: give out_indices (4 block indices) for it")
            out_indices = DEFAULT_OUT_INDICES[depth]
        out_indices = tuple(int(i) for i in out_indices)
        if (
            len(out_indices) != 4
            or list(out_indices) != sorted(set(out_indices))
            or not 0 <= out_indices[0] < depth
            or out_indices[-1] >= depth
        ):
            raise ConfigError(f"out_indices must be 4 increasing block indices below {depth}, got {list(out_indices)}")
        self.model_name = model_name
        self.out_indices = out_indices
        xcit.prune_intermediate_layers(list(out_indices), prune_norm=True, prune_head=True)
        self.xcit = xcit
        set_attention(self.xcit, attention)
        dim, patch_size = xcit.embed_dim, xcit.patch_embed.patch_size
        self.fpn1, self.fpn2, self.fpn3, self.fpn4 = _upsample_branches(dim, patch_size)
        self.out_channels = (dim,) * 4
        if pretrained is not None:
            self.load_pretrained(pretrained)

    def forward(self, images: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        maps = self.xcit.forward_intermediates(images, indices=list(self.out_indices), intermediates_only=True)
        return tuple(branch(x) for branch, x in zip((self.fpn1, self.fpn2, self.fpn3, self.fpn4), maps))

    def new_modules(self) -> list[nn.Module]:
        """The parts no XCiT weight file holds (the resampling branches): they train from their initialisation,
        also when the XCiT itself is frozen (LoRA)."""
        return [self.fpn1, self.fpn2, self.fpn3, self.fpn4]

    def load_pretrained(self, path: str | Path) -> tuple[list[str], list[str]]:
        """Load XCiT weights non-strictly; logs and returns (missing, unexpected) keys.

        Raises naming the file if it is missing, unreadable, holds no XCiT weights or weights of another size.
        """
        file = Path(path).expanduser()
        state = checkpoint_filter_fn(dict(read_state_dict(file)), self.xcit)
        own = self.xcit.state_dict()
        found = [k for k in state if k in own]
        if not any(k.endswith(XCIT_ONLY) for k in found):  # other ViTs share names such as blocks.0.attn.qkv.weight
            raise ConfigError(
                f"pretrained weights {file} hold no XCiT weights: none of its {len(state)} keys "
                f"(e.g. {', '.join(list(state)[:3]) or 'none'}) is an XCA temperature or local patch interaction "
                "(blocks.<i>.attn.temperature, blocks.<i>.local_mp.*)"
            )
        wrong = [
            f"{k} {tuple(state[k].shape)} (model: {tuple(own[k].shape)})"
            for k in found
            if state[k].shape != own[k].shape
        ]
        if wrong:
            raise ConfigError(f"pretrained weights {file} do not fit {self.model_name}: {'; '.join(wrong[:5])}")
        result = self.xcit.load_state_dict(state, strict=False)
        ignored = [k for k in result.unexpected_keys if k.startswith(CLASSIFICATION_PARTS)]
        unexpected = [k for k in result.unexpected_keys if k not in ignored]
        log.info(
            "XCiT backbone: loaded %d tensors from %s; missing keys (left as initialised): %s; unexpected keys: %s; "
            "classification parts not used: %d keys; the stride 4/8/32 branches start from their initialisation",
            len(found),
            file,
            result.missing_keys or "none",
            unexpected or "none",
            len(ignored),
        )
        return list(result.missing_keys), list(result.unexpected_keys)


def read_state_dict(file: Path) -> Mapping[str, Tensor]:
    """The XCiT weights in ``file``: a Lightning ``.ckpt`` of a ClassificationModule (its ``model.*`` entries,
    which Lightning's EMA callback has replaced by the EMA weights), a timm/official state dict, or either
    wrapped under ``state_dict``/``model``."""
    if not file.is_file():
        raise MissingPathError(
            f"pretrained weights {file} not found: expected the .ckpt of a classification run or an XCiT state "
            "dict (.pth, .safetensors)"
        )
    if file.suffix == ".safetensors":
        try:
            return load_safetensors(str(file))
        except Exception as err:
            message = f"pretrained weights {file} are truncated or corrupt ({describe_error(err)})"
            raise CheckpointLoadError(message) from err
    state = load_checkpoint(file)  # weights_only, CRC-checked; errors name the file
    for key in ("state_dict", "model"):
        if isinstance(state, Mapping) and isinstance(state.get(key), Mapping):
            state = state[key]
    if not isinstance(state, Mapping) or not all(isinstance(v, Tensor) for v in state.values()):
        raise ConfigError(f"pretrained weights {file} hold no state dict (a mapping of names to tensors)")
    if any(k.startswith("model.") for k in state):  # a ClassificationModule: its timm model is ``model``
        state = {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}
    if any(".lora_A." in k for k in state):  # without this, qkv / proj would be left as initialised (missing keys)
        raise ConfigError(
            f"pretrained weights {file} hold LoRA adapters beside their base weights (a classification run with "
            "model.init_args.lora): start detection from a full fine-tune's checkpoint, or give the detection run "
            "the classification run's own pretrained weights and its lora settings"
        )
    return state


__all__ = ["DEFAULT_OUT_INDICES", "XCiTBackbone", "read_state_dict"]
