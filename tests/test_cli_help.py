"""Every ``--help`` is complete: each command has a description, each option a help text, a default is shown at
most once, and no docstring markup leaks into what a user reads."""

from __future__ import annotations

import argparse
import re

import pytest

from vitlens.cli import build_parser


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_every_command_is_walked() -> None:
    assert {"demo", "explain", "bench", "report", "train-aha", "methods", "models", "conformance"} <= set(_commands())


@pytest.mark.parametrize("name", sorted(_commands()))
def test_every_option_has_help_and_its_default_once(name: str) -> None:
    parser = _commands()[name]
    assert parser.description and len(parser.description) > 30, f"{name} has no description"
    text = parser.format_help()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help and action.help.strip(), f"{name} {action.option_strings or action.dest}: no help text"
    flat = " ".join(text.split())  # argparse wraps lines
    for option in re.split(r"\n  (?=-)", text):
        assert len(re.findall(r"\(default", " ".join(option.split()))) <= 1, f"{name}: default twice in {option}"
    assert not re.search(r":func:|:class:|:mod:|``", flat), f"{name} --help shows docstring markup"


def test_top_level_help_names_every_command() -> None:
    text = build_parser().format_help()
    for name in _commands():
        assert name in text


def test_unsupported_model_error_is_one_short_line_pointing_to_models(capsys: pytest.CaptureFixture,
                                                                      tmp_path) -> None:
    from vitlens.cli import main

    code = main(["bench", "--model", "no-such-model", "--num-images", "1", "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and len(err) < 300, err
    assert "vitlens models" in err


def test_bench_device_is_checked_like_explains(capsys: pytest.CaptureFixture, tmp_path) -> None:
    from vitlens.cli import main

    code = main(["bench", "--device", "cuda:7", "--num-images", "1", "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("vitlens: error: --device:") and "\n" not in err, err
    assert not (tmp_path / "r").exists()  # refused before anything is loaded or written
