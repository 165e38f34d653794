"""Errors caused by what the user gave (names, values, paths, files, data, checkpoints), and how the CLI shows them.

Raise a subclass of :class:`UserInputError` for anything the user can fix by changing a config value,
a path or a file; its message leads with what is wrong, says where (file, line, key, image, checkpoint)
and what was expected. Every CLI verb runs under :func:`reported`: such an error, also when a library
(jsonargparse, Lightning) has wrapped it, prints as one short ``error: <message>`` and exits with
status 2; any other exception is a bug and keeps its traceback. ``POLYATTN_DEBUG=1`` shows the full
traceback of user errors too.

Each class also derives from the built-in exception a caller would catch (``ValueError``,
``FileNotFoundError``, ``KeyError``), so ``except ValueError`` keeps working.

No option is taken by a name that is not its own: the plain ``argparse`` parsers of the verbs and benchmarks are
:class:`ArgumentParser` (options matched in full, a bad command line in one ``error:`` line that names the closest
option), and a Python entry point with keyword options refuses an unknown one with :func:`check_options`.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import inspect
import os
import sys
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable)
C = TypeVar("C", bound=type)

#: Set to 1 to see the full traceback of user-input errors.
DEBUG_ENV = "POLYATTN_DEBUG"
#: Exit status of a run stopped by a user-input error (argparse's status for a bad command line).
EXIT_USER_ERROR = 2


class UserInputError(Exception):
    """Base of every error the user causes and can fix; its message is all the CLI prints."""


class ConfigError(UserInputError, ValueError):
    """A config value that is not valid: an unknown name, a bad option, a class count or size that disagrees."""


class UnknownNameError(ConfigError, KeyError):
    """An unknown registry or model name (also a ``KeyError``, for lookups)."""

    def __str__(self) -> str:  # KeyError's str() would quote the message
        return str(self.args[0]) if self.args else ""


class UnknownOptionError(ConfigError, TypeError):
    """A keyword option a function or class does not take (also a ``TypeError``, as Python's own would be)."""


class MissingPathError(UserInputError, FileNotFoundError):
    """A file or directory the config names that does not exist, is empty, or lacks the expected layout."""


class DataError(UserInputError, ValueError):
    """A data file whose content is wrong (an annotation line, an unreadable image)."""


def find_user_error(error: BaseException | None) -> UserInputError | None:
    """The :class:`UserInputError` behind ``error``: itself, or one it was raised from or while handling.

    jsonargparse reports a failed ``__init__`` as ``Does not validate against any of the Union subtypes``
    raised ``from`` the original error; Lightning and DataLoader workers wrap errors too.
    """
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, UserInputError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def message(error: UserInputError) -> str:
    """The error's message; for one re-raised from a DataLoader worker, the worker's message without its traceback."""
    text = str(error)
    if "\nOriginal Traceback" in text:
        last = [line for line in text.splitlines() if line.strip()][-1]
        text = last.split(f"{type(error).__name__}: ", 1)[-1]
    return text


def reported(main: F) -> F:
    """Decorate a CLI entry point: user-input errors print as ``error: <message>`` and exit with status 2."""

    @functools.wraps(main)
    def run(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except Exception as error:
            user_error = find_user_error(error)
            if user_error is None or os.environ.get(DEBUG_ENV, "0") not in ("", "0"):
                raise
            print(f"error: {message(user_error)}\n(set {DEBUG_ENV}=1 for the traceback)", file=sys.stderr)
            raise SystemExit(EXIT_USER_ERROR) from None

    return run


# --------------------------------------------------------------------------- options

#: How argparse (and jsonargparse) begins the error for command-line words no option takes.
UNRECOGNIZED = "unrecognized arguments: "


def closest_option(given: str, options: Iterable[str]) -> str | None:
    """The option of ``options`` a misspelt or shortened ``given`` most likely meant: the only one it begins (what
    argparse's abbreviation would have taken), else the nearest by spelling; None when none is near."""
    options = list(options)
    extending = [option for option in options if option.startswith(given)]
    if len(extending) == 1:
        return extending[0]
    near = difflib.get_close_matches(given, options, n=1, cutoff=0.6)
    return near[0] if near else None


def unknown_options_message(message: str, options: Iterable[str]) -> str:
    """argparse's ``unrecognized arguments: --ste 5`` as ``unknown option --ste (did you mean --steps?)``, one
    entry per unknown ``--`` option; other messages as they are."""
    if not message.startswith(UNRECOGNIZED):
        return message
    options = list(options)
    names = [arg.split("=", 1)[0] for arg in message[len(UNRECOGNIZED) :].split() if arg.startswith("--")]
    if not names:
        return message
    described = []
    for name in dict.fromkeys(names):
        closest = closest_option(name, options)
        described.append(name + (f" (did you mean {closest}?)" if closest else ""))
    return f"unknown option{'s' if len(described) > 1 else ''} {', '.join(described)}"


class ArgumentParser(argparse.ArgumentParser):
    """The parser of the project's verbs and benchmarks: options are matched in full (``--ste`` is an error, never
    ``--steps``), and a bad command line is one ``error:`` line (an unknown option with the closest one, as
    :func:`unknown_options_message` words it) and a hint naming ``--help``, with exit status 2."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        text = unknown_options_message(message, self.option_names())
        sys.stderr.write(f"error: {text}\n(`{self.prog} --help` lists every option)\n")
        raise SystemExit(EXIT_USER_ERROR)

    def option_names(self) -> list[str]:
        """Every option string of this parser and of its subcommands' (argparse reports their unknown options)."""
        names = []
        for action in self._actions:
            names += action.option_strings
            if isinstance(action, argparse._SubParsersAction):
                names += [name for parser in action.choices.values() for name in parser.option_names()]
        return list(dict.fromkeys(names))


def check_options(options: Callable | Iterable[str], given: Iterable[str], owner: str | None = None) -> None:
    """Refuse, before anything runs, a keyword of ``given`` that is not an option: an :class:`UnknownOptionError`
    naming it, the closest option and every option. ``options`` are the names, or a function (a class's
    ``__init__``) whose keyword parameters they are (one with ``**kwargs`` takes any keyword); ``owner`` is the name
    the message uses, by default the function's."""
    if callable(options):
        parameters = inspect.signature(options).parameters.values()
        if any(parameter.kind is parameter.VAR_KEYWORD for parameter in parameters):
            return
        owner = owner or options.__qualname__
        kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        valid = [p.name for p in parameters if p.kind in kinds and p.name != "self"]
    else:
        valid = list(options)
    unknown = [name for name in given if name not in valid]
    if unknown:
        described = [
            repr(name) + (f" (did you mean {closest!r}?)" if (closest := closest_option(name, valid)) else "")
            for name in unknown
        ]
        raise UnknownOptionError(
            f"{owner} has no option{'s' if len(unknown) > 1 else ''} {', '.join(described)}; "
            f"its options: {', '.join(valid)}"
        )


def options_checked(owner: str) -> Callable[[C], C]:
    """Decorate a dataclass (over ``@dataclass``) built from the user's options, e.g. from a config's mapping: an
    unknown keyword is :func:`check_options`' one line naming ``owner`` instead of Python's bare ``TypeError``."""

    def decorate(cls: C) -> C:
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            check_options(init, kwargs, owner)
            init(self, *args, **kwargs)

        cls.__init__ = __init__
        return cls

    return decorate
