"""``polyattn_lightning/cli.py`` became the package ``cli/``: every name code imported from it still imports from
``polyattn_lightning.cli``, for one release, as the very object of its new home; the entry points are public there,
the rest says where it went in one ``FutureWarning``. The console scripts still name ``polyattn_lightning.cli:main``.
"""

from __future__ import annotations

import importlib
import tomllib
import warnings
from pathlib import Path

import pytest

from polyattn_lightning import cli

ROOT = Path(__file__).resolve().parents[2]
#: The public names of the old ``cli.py``, by the module of ``cli/`` that holds each now.
OLD_NAMES = {
    "config": ["class_from_path", "init_args", "as_list", "resolve_task_defaults"],
    "prechecks": ["yaml_references", "check_yaml_syntax", "config_attention", "check_config"],
    "ckpt_path": ["is_lightning_checkpoint", "saved_run_config"],
    "runs": [
        "DEFAULT_RUN_NAME",
        "RUNS_DIR",
        "FOLDER_LOGGERS",
        "EVALUATION_VERBS",
        "KeepingSaveConfigCallback",
        "task_family",
        "activation_label",
        "checkpoint_run_dir",
        "evaluation_dir",
        "saved_configs",
        "resumed_run_dir",
        "resume_command",
    ],
    "parser": [
        "OWN_IMAGES_HINT",
        "NESTED_UNKNOWN",
        "GROUP_UNKNOWN",
        "KeepLinesHelpFormatter",
        "ShortErrorParser",
        "short_parse_message",
        "renamed_options",
    ],
    "defaults": ["default_precision"],
    "console": ["RICH_AVAILABLE", "quiet_known_noise", "without_version"],
    "dispatch": ["COMMANDS", "main", "make_cli"],
    "polyattn_cli": ["PolyattnCLI"],
}
PUBLIC = {"main", "make_cli", "PolyattnCLI"}


@pytest.mark.parametrize("module, name", [(module, name) for module, names in OLD_NAMES.items() for name in names])
def test_each_old_name_is_its_new_home_s_object_and_says_where_it_went(module, name):
    new = f"polyattn_lightning.cli.{module}"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = getattr(cli, name)
    assert value is getattr(importlib.import_module(new), name)
    lines = [str(w.message) for w in caught if w.category is FutureWarning]
    if name in PUBLIC:
        assert lines == []
    else:
        assert lines == [
            f"polyattn_lightning.cli.{name} moved to {new}.{name}; the old path is an alias that goes in the next release"
        ]


def test_a_name_the_cli_never_had_is_an_attribute_error():
    with pytest.raises(AttributeError, match="'polyattn_lightning.cli' has no attribute 'make_cil'"):
        cli.make_cil


def test_the_console_scripts_are_the_cli_s_main():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert set(scripts) == {"lightning", "polyattn"}
    for target in scripts.values():
        module, _, name = target.partition(":")
        assert getattr(importlib.import_module(module), name) is cli.main


def test_class_paths_and_help_name_a_class_s_new_home_without_a_warning(capsys, monkeypatch):
    """jsonargparse writes a class's shortest import path (in ``--help`` and in saved configs) by asking each parent
    package for it by name: an old alias does not answer, so no path that goes in the next release is written and
    ``fit --help`` prints no deprecation line."""
    from jsonargparse._util import get_import_path

    from polyattn_lightning.cli.runs import KeepingSaveConfigCallback

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert get_import_path(KeepingSaveConfigCallback) == "polyattn_lightning.cli.runs.KeepingSaveConfigCallback"
        monkeypatch.setattr("sys.argv", ["polyattn", "fit", "--help"])
        with pytest.raises(SystemExit) as stopped:
            cli.main()
    assert stopped.value.code == 0
    captured = capsys.readouterr()
    assert "--trainer.callbacks" in captured.out and "moved to" not in captured.out + captured.err
