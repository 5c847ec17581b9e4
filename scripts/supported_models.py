"""Write docs/supported_models.md (family × method table) from the adapter registry and the family catalogue.

    python scripts/supported_models.py          # rewrite the file
    python scripts/supported_models.py --check  # exit 1 if the file is not current
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from vitlens.catalog import supported_models_markdown

OUT = Path(__file__).resolve().parents[1] / "docs" / "supported_models.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check that the file is current")
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)  # transformers' config warnings for the tiny configs
    text = supported_models_markdown()
    if args.check:
        current = OUT.read_text(encoding="utf-8") if OUT.is_file() else ""
        if current != text:
            print(f"{OUT} is not current: run python scripts/supported_models.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
