"""The README's Python examples and its command-line examples run as written, and its two commands are the ones
CI runs."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

#: real command-line processes, training or a sweep over every family: left out of `pytest -m "not slow"`
pytestmark = pytest.mark.slow

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


def cli_examples() -> list[str]:
    """The ``vitlens ...`` lines of the README's command-line block (the bash block after "## Command line")."""
    text = README.read_text().split("## Command line", 1)[1]
    block = re.search(r"```bash\n(.*?)```", text, flags=re.S).group(1)
    return [line.strip() for line in block.splitlines() if line.strip().startswith("vitlens ")]


def test_readme_has_cli_examples():
    commands = cli_examples()
    assert len(commands) >= 6
    assert {c.split()[1] for c in commands} >= {"models", "methods", "demo", "explain", "bench", "train-aha"}


@pytest.mark.parametrize("command", cli_examples(), ids=lambda c: " ".join(c.split()[:2]))
def test_readme_cli_example_runs(command: str, tmp_path: Path) -> None:
    """Each example as written, from a folder that holds the repository's docs/ (inputs) and receives runs/."""
    (tmp_path / "docs").symlink_to(README.parent / "docs", target_is_directory=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(README.parent / "src")}
    argv = [sys.executable, "-m", "vitlens.cli", *shlex.split(command)[1:]]
    proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{command}\n{proc.stderr[-2000:]}"
    assert proc.stdout.strip(), command
    out = re.search(r"--out (\S+)", command)
    if out:
        written = [p for p in (tmp_path / out.group(1)).rglob("*") if p.is_file()]
        assert written, f"{command} wrote nothing under {out.group(1)}"


def test_cli_lists_every_command():
    from vitlens.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert {"demo", "explain", "bench", "train-aha", "methods", "models"} <= set(sub.choices)
