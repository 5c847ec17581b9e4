"""Time every ``vitlens …`` line of the README's command-line block, one after another, and print the table of
docs/cli.md ("Timings of the README examples").

    OMP_NUM_THREADS=1 python benchmarks/readme_timings.py [--scratch DIR]

Each command runs as written (``vitlens`` from this environment), from a scratch folder holding a copy of
``docs/images`` so its ``--out runs/…`` folders are fresh; wall time from start to exit, with the 1-minute load
average when it ended (a shared machine's load is part of the number).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    """The ``vitlens …`` lines of the bash block after "## Command line" in README.md."""
    text = (ROOT / "README.md").read_text().split("## Command line", 1)[1]
    block = re.search(r"```bash\n(.*?)```", text, flags=re.S).group(1)
    return [line.strip() for line in block.splitlines() if line.strip().startswith("vitlens ")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scratch", type=Path, default=None, help="folder to run in (default: a temporary one)")
    args = parser.parse_args()
    scratch = args.scratch or Path(tempfile.mkdtemp(prefix="vitlens-readme-"))
    (scratch / "docs").mkdir(parents=True, exist_ok=True)
    shutil.copytree(ROOT / "docs" / "images", scratch / "docs" / "images", dirs_exist_ok=True)
    vitlens = str(Path(sys.executable).with_name("vitlens"))
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    print("| command | seconds | load average |\n|---|---|---|")
    for command in readme_commands():
        argv = shlex.split(command)
        t0 = time.perf_counter()
        run = subprocess.run([vitlens, *argv[1:]], cwd=scratch, env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - t0
        load = os.getloadavg()[0]
        shown = command if len(command) <= 110 else command[:105].rsplit(" ", 1)[0] + " …"
        status = "" if run.returncode == 0 else f" (exit {run.returncode})"
        print(f"| `{shown}` | {seconds:.1f}{status} | {load:.1f} |", flush=True)


if __name__ == "__main__":
    main()
