"""No option is taken by a name that is not its own: on every verb, benchmark and data command an abbreviated option
is an error (exit 2) in one line naming it and the option it abbreviates, where argparse would have expanded it.

The plain ``argparse`` commands are walked: each command's parser is found by running it until it parses (its
``parse_known_args`` records the parser and stops it there), a command line is built that the parser accepts but
for one option given abbreviated, and the real command runs on it. The LightningCLI verbs are run as processes:
the abbreviation of a ``--model.init_args.*`` option is refused as well as a top-level one.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from training_helpers import error_lines, run_commands

from polyattn_lightning import cli
from polyattn_lightning.cli import dispatch
from polyattn_lightning.bench import __main__ as bench
from polyattn_lightning.data.lra import __main__ as lra_data
from polyattn_lightning.errors import ArgumentParser

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "configs" / "classification" / "quickstart.yaml"

#: Every command with a plain argparse parser, as ``(entry point, the words naming the command)``.
COMMANDS = [(cli.main, [verb]) for verb in dispatch.COMMANDS] + [(bench.main, [name]) for name in bench.BENCHMARKS]
COMMANDS.append((lra_data.main, []))


class Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


def command_parser(monkeypatch, main, words: list[str]) -> ArgumentParser:
    """The parser the command builds, stopped where it parses."""

    def stop(self, *args, **kwargs):
        raise Parsed(self)

    with monkeypatch.context() as patch:
        patch.setattr(ArgumentParser, "parse_known_args", stop)
        with pytest.raises(Parsed) as parsed:
            main([*words, "--help"])
    return parsed.value.parser


def value(action: argparse.Action) -> list[str]:
    """A value ``action`` accepts (none for a flag)."""
    if action.nargs == 0:
        return []
    if action.choices:
        return [str(next(iter(action.choices)))]
    return ["1" if action.type in (int, float) else "x"]


def with_one_abbreviation(parser: argparse.ArgumentParser) -> tuple[list[str], str, str]:
    """A command line ``parser`` accepts but for one optional option given shortened by its last letter (a prefix
    of that option alone, which argparse's abbreviation would have taken): ``(argv, abbreviation, option)``."""
    argv: list[str] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            name, subparser = next(iter(action.choices.items()))
            rest, abbreviation, option = with_one_abbreviation(subparser)
            return [*argv, name, *rest], abbreviation, option
        if not action.option_strings:
            argv += value(action) if action.nargs not in ("*", "?", argparse.REMAINDER) else []
        elif action.required:
            argv += [action.option_strings[-1], *value(action)]
    for group in parser._mutually_exclusive_groups:
        if group.required:
            argv += [group._group_actions[0].option_strings[-1], *value(group._group_actions[0])]
    options = [option for action in parser._actions for option in action.option_strings]
    candidates = [
        (action, option)
        for action in parser._actions
        if not action.required
        for option in action.option_strings
        if option.startswith("--") and len(option) > 4 and [o for o in options if o.startswith(option[:-1])] == [option]
    ]
    candidates.sort(key=lambda candidate: isinstance(candidate[0], argparse._HelpAction))  # --help: when alone
    action, option = candidates[0]
    abbreviation = option[:-1]
    given = f"{abbreviation}={value(action)[0]}" if action.nargs != 0 else abbreviation
    return [*argv, given], abbreviation, option


@pytest.mark.parametrize("main, words", COMMANDS, ids=[" ".join(words) or "data.lra" for _, words in COMMANDS])
def test_an_abbreviated_option_is_an_error_naming_the_option(monkeypatch, capsys, main, words):
    parser = command_parser(monkeypatch, main, words)
    assert not parser.allow_abbrev
    argv, abbreviation, option = with_one_abbreviation(parser)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main([*words, *argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    lines = err.splitlines()
    assert lines[0] == f"error: unknown option {abbreviation} (did you mean {option}?)", err
    assert len(lines) == 2 and lines[1].endswith("--help` lists every option)"), err


def test_an_unknown_option_of_check_data_is_its_own_not_passed_on(capsys):
    """check-data passes --data.* / --model.* / --trainer.* on to the fit parser; any other option is its own."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["check-data", "--config", str(QUICKSTART), "--work", "2"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines()[0] == "error: unknown option --work (did you mean --workers?)"


def test_misspelt_and_unknown_options_are_named_with_the_closest(capsys):
    with pytest.raises(SystemExit):
        bench.main(["convert", "llama", "--techer", "x", "--nothing-like-it", "1"])
    first = capsys.readouterr().err.splitlines()[0]
    assert first == "error: unknown options --techer (did you mean --teacher?), --nothing-like-it"


def test_hf_sweep_takes_model_types_and_refuses_an_unknown_one(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["hf-sweep", "lama"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines()[0] == (
        "error: 'lama' is not a model type of transformers' auto mapping (did you mean 'llama'?)"
    )


def test_fit_refuses_abbreviated_options_at_every_level(tmp_path):
    """Top-level, standard callback, a class's own argument, a dataclass group inside it (``convert.step`` was taken
    as ``convert.steps``, silently), a DataModule's argument, a user callback's, and misspelt keys of config files;
    each one line naming the closest option, exit 2."""
    fit = ["fit", "--config", str(QUICKSTART)]
    cases = [
        ([*fit, "--trainer.max_epoch", "1"], "unknown option --trainer.max_epoch (did you mean --trainer.max_epochs?)"),
        ([*fit, "--checkpoint.monito", "x"], "unknown option --checkpoint.monito (did you mean --checkpoint.monitor?)"),
        (
            [*fit, "--model.init_args.convert.step", "50"],
            "model.init_args.convert.step is not an option of ClassificationModule "
            "(did you mean model.init_args.convert.steps?)",
        ),
        (
            [*fit, "--model.convert.step=50"],
            "model.init_args.convert.step is not an option of ClassificationModule "
            "(did you mean model.init_args.convert.steps?)",
        ),
        (
            [*fit, "--model.init_args.attentio", "poly3"],
            "model.init_args.attentio is not an option of ClassificationModule "
            "(did you mean model.init_args.attention?)",
        ),
        (
            [*fit, "--data.init_args.batch_siz", "8"],
            "data.init_args.batch_siz is not an option of DigitsDataModule (did you mean data.init_args.batch_size?)",
        ),
        (
            [*fit, "--trainer.callbacks+=EarlyStopping", "--trainer.callbacks.init_args.patienc", "3"],
            "trainer.callbacks.init_args.patienc is not an option of EarlyStopping "
            "(did you mean trainer.callbacks.init_args.patience?)",
        ),
        (
            [*fit, "--config", "misspelt_trainer.yaml"],
            "trainer.max_epoch is not an option (did you mean trainer.max_epochs?)",
        ),
        (
            [*fit, "--config", "misspelt_model.yaml"],
            "model.init_args.atention is not an option of ClassificationModule "
            "(did you mean model.init_args.attention?)",
        ),
    ]
    (tmp_path / "misspelt_trainer.yaml").write_text("trainer: {max_epoch: 1}\n")
    (tmp_path / "misspelt_model.yaml").write_text("model: {init_args: {atention: poly3}}\n")
    results = run_commands(tmp_path, *(argv for argv, _ in cases))
    for (argv, expected), result in zip(cases, results):
        output = result["output"]
        assert result["rc"] == 2, (argv, output)
        errors = error_lines(output)
        assert errors == [f"error: {expected}"], (argv, output)
        assert "Traceback" not in output and "was expanded to" not in output
        assert not (tmp_path / "runs").exists()
