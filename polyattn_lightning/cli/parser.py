"""The CLI's parser: options matched in full, errors in a few lines with the error first, help that keeps its
lines, and deprecated option names read as their new ones.

jsonargparse's own errors run to 40 lines of usage and Union-subtype dumps, and argparse takes ``--trainer.max_epoch``
for ``max_epochs``; here an unknown option is one line naming the closest one, also where jsonargparse builds a
parser for a class's arguments (``--model.init_args.*``): it builds those from :class:`ShortErrorParser` too.

``null`` on the command line is read as in YAML (:func:`nulls_as_config`): jsonargparse 4.53 reads
``--data.augment.auto_augment null`` (a field of a dataclass inside a class-typed option) as the string ``'None'``,
and an ``int | None`` field there not at all. ``tests/cli/test_jsonargparse_null.py`` reproduces it with
jsonargparse alone and fails once jsonargparse reads it right: then :func:`nulls_as_config` can go.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Sequence

from jsonargparse import ArgumentError, ArgumentParser, DefaultHelpFormatter
from jsonargparse._typehints import ActionTypeHint  # what jsonargparse reads a class-typed option with
from lightning.pytorch.cli import LightningArgumentParser

from ..errors import DEBUG_ENV, EXIT_USER_ERROR, UNRECOGNIZED, closest_option, unknown_options_message
from .config import resolve_task_defaults

#: Where ``--data.root`` meets a data set that reads no folder (the quickstart's bundled digits): the README's line.
OWN_IMAGES_HINT = (
    "this data set reads no folder (the quickstart's are bundled digits); to train on your own "
    "images (<root>/train/<class>/*, <root>/val/<class>/*): --data ImageFolderDataModule --data.root DIR "
    "(docs/howto/own-images.md)"
)
#: A class parser's words for an option it does not have: given on the command line, as a key of a config file, or
#: as a key of a group's mapping (``--model.init_args.convert '{hold_out: 0.2}'``).
NESTED_UNKNOWN = re.compile(
    rf"{UNRECOGNIZED}(?P<argument>--\S+)|Option '(?P<key>[^']+)' is not accepted"
    r"|Group '(?P<group>[^']+)' does not accept option '(?P<group_key>[^']+)'"
)
#: YAML's spellings of null: a config file's ``key: null`` (or ``~``) is None
YAML_NULLS = ("null", "Null", "NULL", "~")
#: jsonargparse's words for a config file's key that a group (``trainer``, ``checkpoint``) or the verb does not have.
GROUP_UNKNOWN = re.compile(r"(?:Group '(?P<group>[^']+)'|Subcommand '[^']+') does not accept option '(?P<key>[^']+)'")


class KeepLinesHelpFormatter(DefaultHelpFormatter):
    """jsonargparse's help, with the description and epilog (the list of verbs) kept line by line."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "".join(indent + line for line in text.splitlines(keepends=True))


def short_parse_message(message: str) -> str:
    """jsonargparse's message without its ``Does not validate against any of the Union subtypes`` dumps (nested
    ones too): the errors of the subtypes that were meant (not ``Expected a <class 'NoneType'>``), with the value."""
    if "Does not validate against any of the Union subtypes" not in message:
        return message
    dropped = (
        "Does not validate against any of the Union subtypes",
        "Subtypes: [",
        "Errors:",
        "Given value type:",
        "Expected a <class 'NoneType'>",
        "Given value: NestedArg(",
    )
    lines = [line.strip().removeprefix("- ").strip() for line in message.splitlines()]
    lines = [line for line in lines if line and not line.startswith(dropped)]
    given = [line for line in lines if line.startswith("Given value: ")]
    lines = [line for line in lines if not line.startswith("Given value: ")]
    if given and lines:
        lines[-1] += f". Got value: {given[0].removeprefix('Given value: ')}"
    return lines[0] + "".join(f"\n  {line}" for line in lines[1:])


def help_hint(prog: str, message: str) -> str:
    """The help that lists what ``message`` is about: for an option of a class (``--data.rooot`` of
    ``DigitsDataModule``), ``prog --data.help DigitsDataModule``; else ``prog --help``."""
    key = re.match(r'Parser key "([^"]+)"', message)
    owner = re.search(r"Problem with given class_path '([^']+)'", message)
    if key is not None and owner is not None:
        name = owner[1].rpartition(".")[2]
        return f"(`{prog} --{key[1]}.help {name}` lists the options of {name}; `{prog} --help` every option)"
    return (
        f"(`{prog} --help` lists every option; `{prog} --model.help CLASS`, `{prog} --data.help CLASS` a model or "
        "data class's, e.g. ClassificationModule, ImageFolderDataModule)"
    )


class ShortErrorParser(LightningArgumentParser):
    """Command-line errors in a few lines, the error first: no 40-line usage, no Union-subtype dump; a dumped
    config (``--print_config``) shows the best checkpoint's monitor as the task gives it.

    Options are matched in full (``--trainer.max_epoch`` is an error, not ``max_epochs``), here and in the parsers
    jsonargparse builds for a class's arguments (``--model.init_args.*``): it builds those from this class; an
    unknown option is one line naming the closest one (:meth:`unknown_option_message`)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_args(self, args: Sequence[str] | None = None, *rest, **kwargs):
        """jsonargparse's, with ``null`` read as in YAML (:func:`nulls_as_config`)."""
        args = sys.argv[1:] if args is None else args
        return super().parse_args(nulls_as_config(list(args), self), *rest, **kwargs)

    def dump(self, cfg, *args, **kwargs):
        if "checkpoint" in cfg and "model" in cfg:
            cfg = cfg.clone()
            resolve_task_defaults(cfg)
        return super().dump(cfg, *args, **kwargs)

    def error(self, message: str, ex: Exception | None = None):
        if not self.exit_on_error:  # a class's parser: the outer parser reports it, with the option found here
            try:
                super().error(message, ex)
            except ArgumentError as error:
                error.unknown_option = self.unknown_option(message)
                raise
        if os.environ.get(DEBUG_ENV, "0") not in ("", "0"):
            return super().error(message, ex)
        prog = self.prog.replace(" [options]", "")
        hint = f"\n{OWN_IMAGES_HINT}" if 'key "data"' in message and "Option 'root' is not accepted" in message else ""
        text = (
            self.unknown_option_message(message, ex)
            or self.unknown_group_key_message(message)
            or unknown_options_message(short_parse_message(message), self.option_names())
        )
        sys.stderr.write(f"error: {text}{hint}\n{help_hint(prog, message)}\n")
        raise SystemExit(EXIT_USER_ERROR)

    def option_names(self) -> list[str]:
        """Every option string of this parser and of its subcommands' (``--trainer.max_epochs``...)."""
        names = [option for action in self._actions for option in action.option_strings]
        subcommands = self._subcommands_action._name_parser_map if self._subcommands_action else {}
        for parser in subcommands.values():
            names += parser.option_names()
        return list(dict.fromkeys(names))

    def unknown_group_key_message(self, message: str) -> str | None:
        """``trainer.max_epoch is not an option (did you mean trainer.max_epochs?)`` for a config file's key that
        its group does not have, else None."""
        match = GROUP_UNKNOWN.search(message)
        if match is None:
            return None
        key = f"{match['group']}.{match['key']}" if match["group"] else match["key"]
        closest = closest_option(f"--{key}", self.option_names())
        return f"{key} is not an option" + (f" (did you mean {closest[2:]}?)" if closest else "")

    def unknown_option(self, message: str) -> tuple[str, str | None] | None:
        """The option a class's parser does not have (``convert.step``), with its closest one (``convert.steps``),
        or None when ``message`` is about something else."""
        match = NESTED_UNKNOWN.search(message)
        if match is None:
            return None
        key = match["key"] or (match["group_key"] and f"{match['group']}.{match['group_key']}")
        given = (match["argument"] or f"--{key}").split("=", 1)[0]
        closest = closest_option(given, [option for option in self.option_names() if option.startswith("--")])
        return given[2:], closest[2:] if closest else None

    @staticmethod
    def unknown_option_message(message: str, ex: Exception | None) -> str | None:
        """``model.init_args.convert.step is not an option of ClassificationModule (did you mean ...steps?)`` for an
        option a class's parser did not have (found in the chain of ``ex``), else None."""
        found = None
        while ex is not None and found is None:
            found, ex = getattr(ex, "unknown_option", None), ex.__cause__ or ex.__context__
        key = re.match(r'Parser key "([^"]+)"', message)
        owner = re.search(r"Problem with given class_path '([^']+)'", message)
        if found is None or key is None or owner is None:
            return None
        prefix, (given, closest) = f"{key[1]}.init_args.", found
        return f"{prefix}{given} is not an option of {owner[1].rpartition('.')[2]}" + (
            f" (did you mean {prefix}{closest}?)" if closest else ""
        )


def renamed_options(args: list[str], renamed: dict[str, str]) -> tuple[list[str], list[str]]:
    """``args`` with each ``--model[.init_args].<old>...`` option of ``renamed`` (old path -> new path) spelled
    with its new path, and one deprecation line for each."""
    if not renamed:
        return args, []
    pattern = re.compile(
        r"--model\.(init_args\.)?(" + "|".join(re.escape(old) for old in renamed) + r")(?=[.=]|$)(.*)", re.DOTALL
    )
    rewritten, messages = [], []
    for arg in args:
        match = pattern.fullmatch(arg)
        if match is None:
            rewritten.append(arg)
            continue
        prefix, old, rest = match.groups()
        new = f"--model.{prefix or ''}{renamed[old]}{rest}"
        rewritten.append(new)
        given, used = arg.split("=", 1)[0], new.split("=", 1)[0]
        messages.append(f"{given} is deprecated: it is {used} now (given as that)")
    return rewritten, messages


def nulls_as_config(args: list[str], parser: ArgumentParser) -> list[str]:
    """``args`` with each ``--<option>.<field path> null`` under a class-typed option (``--model``, ``--data``,
    ``--trainer.logger``...) given as that option's config, ``--data '{"init_args": {"augment": {"auto_augment":
    null}}}'``, which jsonargparse reads as it reads YAML: None. It reads the dotted form through a nested parser
    that is handed ``--auto_augment=None``, the string (jsonargparse 4.53). Other arguments are kept as given, in
    their order, so later ones still override earlier ones."""
    subcommands = parser._subcommands_action._name_parser_map if parser._subcommands_action else {}
    options = subcommands[args[0]] if args and args[0] in subcommands else parser
    rewritten, index = [], 0
    while index < len(args):
        key, equals, value = args[index].partition("=")
        taken = 1 if equals else 2
        if not equals:
            value = args[index + 1] if index + 1 < len(args) else None
        config = class_option_null(options, key) if value in YAML_NULLS else None
        if config is None:
            rewritten.append(args[index])
            index += 1
        else:
            rewritten += config
            index += taken
    return rewritten


def class_option_null(parser: ArgumentParser, key: str) -> list[str] | None:
    """``[--<option>, <config>]`` setting ``key``'s field to null when ``key`` (``--data.init_args.augment.re_prob``)
    is a field under a class-typed option of ``parser``; else None."""
    if not key.startswith("--"):
        return None
    parts = key[2:].split(".")
    for length in range(len(parts) - 1, 0, -1):
        option = "--" + ".".join(parts[:length])
        action = parser._option_string_actions.get(option)
        if action is not None:
            break
    else:
        return None
    path = parts[length:]
    path = path[1:] if path[0] == "init_args" else path
    if not path or path[0] == "dict_kwargs" or not ActionTypeHint.is_subclass_typehint(action, all_subtypes=False):
        return None
    config = None
    for part in reversed(path):
        config = {part: config}
    return [option, json.dumps({"init_args": config})]
