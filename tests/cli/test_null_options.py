"""Every nullable option of every task and DataModule the CLI exposes takes ``null`` from the command line as from
YAML: set alone to ``null``, it parses (no traceback, no error) to None. The options are walked, not listed: each
class's signature as jsonargparse reads it, and the fields of each dataclass or class-typed option within it
(``--data.augment.auto_augment``), so a new option is walked without being told. Parse only: nothing is built."""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing

import lightning.pytorch as pl
import pytest
from jsonargparse import ArgumentParser, Namespace

from polyattn_lightning import data, tasks
from polyattn_lightning.cli import make_cli
from polyattn_lightning.cli.polyattn_cli import PolyattnCLI

TASKS = [
    cls
    for cls in map(vars(tasks).get, tasks.__all__)
    if inspect.isclass(cls) and issubclass(cls, pl.LightningModule) and cls is not tasks.TaskModule
]
DATA = [
    cls
    for cls in map(vars(data).get, data.__all__)
    if inspect.isclass(cls) and issubclass(cls, pl.LightningDataModule) and cls is not data.DataModule
]
#: the required arguments of a class, given so that the command line parses; any value of the right type
REQUIRED = {
    "ClassificationModule": ["--model.model_name", "vit_tiny_patch16_224"],
    "DetectionModule": ["--model.detector", "{}"],
    "ImageFolderDataModule": ["--data.root", "DIR"],
    "TinyImageNetDataModule": ["--data.root", "DIR"],
}
#: the task and the data that the walk of the other's options is given
PARTNERS = {"model": ["--model", "LRAModule"], "data": ["--data", "ListOpsDataModule"]}


class Parsed(Exception):
    def __init__(self, parser: ArgumentParser):
        self.parser = parser


class ParserOnly(PolyattnCLI):
    """The CLI built up to its parser, which it hands over instead of parsing."""

    def parse_arguments(self, parser, args) -> None:
        raise Parsed(parser)


@pytest.fixture(scope="module")
def fit_parser() -> ArgumentParser:
    with pytest.raises(Parsed) as parsed:
        make_cli(["fit"], cli_class=ParserOnly)
    return parsed.value.parser


def nullable(typehint) -> bool:
    return typing.get_origin(typehint) in (typing.Union, types.UnionType) and type(None) in typing.get_args(typehint)


def classes_within(typehint) -> list[type]:
    """The project's classes (recipe dataclasses) a type hint takes, where it takes nothing else but None: their
    fields are options of their own (``--data.augment.auto_augment``). A union that also takes a string or a mapping
    (``attention``) has none: a dotted key there is a mapping's key."""
    args = typing.get_args(typehint) if typing.get_origin(typehint) in (typing.Union, types.UnionType) else (typehint,)
    classes = [arg for arg in args if arg is not type(None)]
    project = all(inspect.isclass(arg) and arg.__module__.startswith("polyattn_lightning") for arg in classes)
    return classes if project else []


def nullable_options(cls: type, prefix: str = "") -> list[str]:
    """The dotted names of ``cls``'s nullable options as the CLI reads its signature, fields of the classes within
    them included (``augment.auto_augment``)."""
    parser = ArgumentParser()
    if dataclasses.is_dataclass(cls):
        parser.add_dataclass_arguments(cls, "x")
    else:
        parser.add_class_arguments(cls, "x")
    found = []
    for action in parser._actions:
        name, typehint = action.dest.removeprefix("x."), getattr(action, "_typehint", None)
        if not action.dest.startswith("x.") or name.endswith(".help") or typehint is None:
            continue
        if nullable(typehint):
            found.append(prefix + name)
        for within in classes_within(typehint):
            found += nullable_options(within, f"{prefix}{name}.")
    return found


WALK = [(key, cls) for key, classes in (("model", TASKS), ("data", DATA)) for cls in classes]


@pytest.mark.parametrize("key, cls", WALK, ids=[cls.__name__ for _, cls in WALK])
def test_every_nullable_option_takes_null_from_the_command_line(fit_parser, key, cls, capsys):
    options = nullable_options(cls)
    assert options or cls.__name__ == "DigitsDataModule"  # the walk finds what it walks (the digits have none)
    other = "data" if key == "model" else "model"
    base = ["fit", f"--{key}", cls.__name__, *REQUIRED.get(cls.__name__, []), *PARTNERS[other]]
    wrong = []
    for option in options:
        try:
            value = fit_parser.parse_args([*base, f"--{key}.{option}", "null"]).fit[key].init_args
        except SystemExit:
            wrong.append(f"--{key}.{option} null: {capsys.readouterr().err.strip()}")
            continue
        for part in option.split("."):
            value = value[part] if isinstance(value, Namespace) else getattr(value, part)
        if value is not None:
            wrong.append(f"--{key}.{option} null gave {value!r}")
    assert wrong == []
    assert "Traceback" not in capsys.readouterr().err
