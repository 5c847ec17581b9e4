"""``python -m vitlens …``: the same command line as ``vitlens …``."""

from vitlens.cli import run

run()
