"""The README's Python examples run as written, and its two commands are the ones CI runs."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_python_examples():
    assert python_blocks()


def test_readme_python_examples_run():
    for block in python_blocks():
        namespace: dict = {"__name__": "readme"}
        exec(compile(block, str(README), "exec"), namespace)


def test_readme_commands_match_ci():
    first_bash = re.search(r"```bash\n(.*?)```", README.read_text(), flags=re.S).group(1)
    commands = [line.split("#")[0].strip() for line in first_bash.strip().splitlines()]
    ci = (README.parent / ".ci" / "run").read_text()
    assert len(commands) == 2
    setup, tests = commands
    assert setup.split("&&")[0].strip() in ci and ".venv/bin/vitlens demo" in ci
    assert tests in ci


def test_cli_lists_every_command():
    from vitlens.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert {"demo", "explain", "bench", "train-aha", "methods"} <= set(sub.choices)
