"""mmdet model configs as YAML: a mapping, or a file holding one, over a ``_base_`` it names (mmdet's
``_base_`` convention, for this project's YAML configs), and the RoI heads' class counts."""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from ..errors import ConfigError, MissingPathError


def load_detector_config(detector: Mapping[str, Any] | str | os.PathLike) -> dict[str, Any]:
    """The mmdet model config: the mapping itself, or the mapping held by a YAML file, over its ``_base_``.

    A mapping with ``_base_: <yaml file>`` (relative to the file holding the mapping; for a mapping given inline,
    to the working directory) is that file's mapping (itself loaded this way) deep-merged with the rest: mappings
    are merged key by key, any other value (a list too) replaces the base's. A path given in a config file arrives
    as jsonargparse's ``Path_fr``, already resolved against that config file's folder (its ``absolute``).
    """
    if isinstance(detector, Mapping):
        return _with_base(copy.deepcopy(dict(detector)), Path.cwd(), "the detector mapping")
    absolute = getattr(detector, "absolute", None)  # jsonargparse's Path_fr: a str; pathlib's Path: a method
    path = Path(absolute if isinstance(absolute, str) else detector)
    if not path.is_file():
        raise MissingPathError(f"detector config {path} does not exist (a YAML file holding an mmdet model mapping)")
    try:
        config = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError(f"cannot read the detector config {path}: {err}") from err
    if not isinstance(config, dict) or not ("type" in config or "_base_" in config):
        raise ConfigError(f"{path}: expected an mmdet model config mapping with a 'type' (e.g. MaskRCNN)")
    return _with_base(config, path.parent, str(path))


def _with_base(config: dict[str, Any], folder: Path, where: str) -> dict[str, Any]:
    """``config`` deep-merged over the mapping its ``_base_`` names (relative to ``folder``); itself without one."""
    base = config.pop("_base_", None)
    if base is None:
        if "type" not in config:
            raise ConfigError(f"{where}: expected an mmdet model config mapping with a 'type' (e.g. MaskRCNN)")
        return config
    if not isinstance(base, str):
        raise ConfigError(f"{where}: _base_ must name one YAML file, got {base!r}")
    return deep_merge(load_detector_config(folder / base), config)


def deep_merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``override``'s values: mappings merged key by key, anything else (lists too) replaced."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


#: the RoI heads that have a ``num_classes`` (Mask R-CNN: the box and the mask head)
CLASS_HEADS = ("bbox_head", "mask_head")


def heads_num_classes(config: Mapping[str, Any]) -> int | None:
    """The ``num_classes`` the detector config's RoI heads state (None if none does); they must agree."""
    roi_head = config.get("roi_head")
    stated = (
        {
            f"roi_head.{key}.num_classes": roi_head[key]["num_classes"]
            for key in CLASS_HEADS
            if isinstance(roi_head, Mapping)
            and isinstance(roi_head.get(key), Mapping)
            and "num_classes" in roi_head[key]
        }
        if isinstance(roi_head, Mapping)
        else {}
    )
    if len(set(stated.values())) > 1:
        raise ConfigError(f"the detector config's heads disagree on the class count: {stated}")
    return next(iter(stated.values()), None)


def with_num_classes(config: dict, num_classes: int) -> dict:
    """``config`` with every RoI head's ``num_classes`` set (Mask R-CNN: the box and the mask head)."""
    roi_head = config.get("roi_head")
    heads = (
        [roi_head[key] for key in CLASS_HEADS if isinstance(roi_head.get(key), dict)]
        if isinstance(roi_head, dict)
        else []
    )
    if not heads:
        raise ConfigError("the detector config has no roi_head.bbox_head or mask_head to set num_classes on")
    for head in heads:
        head["num_classes"] = num_classes
    return config
