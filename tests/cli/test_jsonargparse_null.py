"""jsonargparse 4.53 reads ``null`` given on the command line to a dataclass field inside a class-typed (subclass
mode) option as the string ``'None'`` (and an ``int | None`` field not at all), where YAML's ``null`` is None: the
reason for :func:`polyattn_lightning.cli.parser.nulls_as_config`. Reproduced here with jsonargparse alone, so that
the day jsonargparse reads it right, this test fails and says the workaround can go."""

from __future__ import annotations

from dataclasses import dataclass

from jsonargparse import ArgumentParser

from polyattn_lightning.cli.parser import nulls_as_config


@dataclass
class Recipe:
    name: str | None = "rand"
    count: int | None = 1


class Holder:
    def __init__(self, recipe: Recipe = Recipe(), label: str | None = "a"):
        self.recipe, self.label = recipe, label


def holder_parser() -> ArgumentParser:
    parser = ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(Holder, "holder")
    return parser


def test_jsonargparse_reads_a_nested_null_as_the_string_none():
    parser = holder_parser()
    as_yaml = parser.parse_args(["--holder", '{"class_path": "Holder", "init_args": {"recipe": {"name": null}}}'])
    assert as_yaml.holder.init_args.recipe.name is None
    assert parser.parse_args(["--holder", "Holder", "--holder.label", "null"]).holder.init_args.label is None
    nested = parser.parse_args(["--holder", "Holder", "--holder.recipe.name", "null"]).holder.init_args.recipe.name
    assert nested == "None", (
        f"jsonargparse now reads --holder.recipe.name null as {nested!r}: it reads a nested null right, so "
        "nulls_as_config (polyattn_lightning/cli/parser.py) and this test can go"
    )


def test_nulls_as_config_reads_them_as_yaml_does():
    parser = holder_parser()
    args = nulls_as_config(["--holder", "Holder", "--holder.recipe.name", "null", "--holder.recipe.count=~"], parser)
    recipe = parser.parse_args(args).holder.init_args.recipe
    assert (recipe.name, recipe.count) == (None, None)
    kept = ["--holder", "Holder", "--holder.recipe.name", "none", "--holder.label", "null"]
    assert nulls_as_config(kept, parser)[:4] == kept[:4]  # only YAML's spellings of null are rewritten
