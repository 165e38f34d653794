"""Errors caused by what the user gave (names, values, paths, files, data, checkpoints), and how the CLI shows them.

Raise a subclass of :class:`UserInputError` for anything the user can fix by changing a config value,
a path or a file; its message leads with what is wrong, says where (file, line, key, image, checkpoint)
and what was expected. Every CLI verb runs under :func:`reported`: such an error, also when a library
(jsonargparse, Lightning) has wrapped it, prints as one short ``error: <message>`` and exits with
status 2; any other exception is a bug and keeps its traceback. ``POLYATTN_DEBUG=1`` shows the full
traceback of user errors too.

Each class also derives from the built-in exception a caller would catch (``ValueError``,
``FileNotFoundError``, ``KeyError``), so ``except ValueError`` keeps working.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import sys
from collections.abc import Iterable, Sequence
from typing import Callable, TypeVar

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


class MissingPathError(UserInputError, FileNotFoundError):
    """A file or directory the config names that does not exist, is empty, or lacks the expected layout."""


class DataError(UserInputError, ValueError):
    """A data file whose content is wrong (an annotation line, an unreadable image)."""


def check_options(where: str, given: Iterable[str], valid: Sequence[str]) -> None:
    """Refuse the first of ``given`` (option names) that is not in ``valid``, in one line naming ``where`` it was
    given, the closest valid name and all of them (an option is never taken by a near name)."""
    for name in given:
        if name not in valid:
            close = difflib.get_close_matches(name, valid, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{where}: unknown option {name!r}{hint}; the options are {', '.join(valid)}")


def options_checked(where: str) -> Callable[[C], C]:
    """Decorate a dataclass (over ``@dataclass``) built from the user's options, e.g. from a config's mapping:
    an unknown keyword is :func:`check_options`' one-line :class:`ConfigError` instead of a ``TypeError``."""

    def decorate(cls: C) -> C:
        init, valid = cls.__init__, [f.name for f in dataclasses.fields(cls) if f.init]

        @functools.wraps(init)
        def __init__(self, *args, **kwargs):
            check_options(where, kwargs, valid)
            init(self, *args, **kwargs)

        cls.__init__ = __init__
        return cls

    return decorate


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
