"""The command line explains itself: every command has a description and every flag a help
string, found by walking the parser itself, so a flag added without one fails here."""

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from omniflow.cli import main, make_parser

ROOT = Path(__file__).parents[1]


def _commands(
    parser: argparse.ArgumentParser, words: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every (sub)command's words and parser, the top level first."""
    found = [(words, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                found += _commands(child, (*words, name))
    return found


COMMANDS = [
    pytest.param(words, parser, id=" ".join(words) or "omniflow")
    for words, parser in _commands(make_parser())
]


def test_the_walk_finds_every_command():
    assert {" ".join(command.values[0]) for command in COMMANDS} >= {
        "", "compile", "run", "profile", "models", "models list", "models build-tiny",
        "models build-scaled",
    }  # fmt: skip


@pytest.mark.parametrize("words,parser", COMMANDS)
def test_every_command_has_a_description_and_every_option_a_help_string(words, parser):
    assert parser.description, f"'omniflow {' '.join(words)} --help' has no description"
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:  # each subcommand's line in this --help
                assert choice.help, f"'{choice.dest}' has no help under {words}"
        assert action.help, f"{action.option_strings or action.dest} of {words} has no help"


@pytest.mark.parametrize("words,parser", COMMANDS)
def test_help_prints_the_description(words, parser, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*words, "--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0
    assert " ".join(parser.description.split()[:4]) in " ".join(out.split())


def test_bare_models_prints_its_help_not_an_internal_name():
    result = subprocess.run(
        [sys.executable, "-P", "-m", "omniflow.cli", "models"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: omniflow models")
    assert "build-tiny" in result.stdout and "models_command" not in result.stdout + result.stderr
