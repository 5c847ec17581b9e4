"""``python -m vitlens …``: the same command line as ``vitlens …``."""

import sys

from vitlens.cli import main

sys.exit(main())
