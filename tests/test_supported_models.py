"""docs/supported_models.md is generated from the adapter registry; it must be current, and every ✓ in it must be a
method the family's adapter lets run (the shared family tests run them)."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

from vitlens.catalog import supported_models_markdown

ROOT = Path(__file__).resolve().parents[1]


def test_supported_models_doc_is_current():
    logging.disable(logging.WARNING)
    try:
        text = supported_models_markdown()
    finally:
        logging.disable(logging.NOTSET)
    current = (ROOT / "docs" / "supported_models.md").read_text(encoding="utf-8")
    assert current == text, "docs/supported_models.md is stale: run python scripts/supported_models.py"


def test_generator_script_check_mode():
    env_path = str(ROOT / "src")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "supported_models.py"), "--check"],
                          capture_output=True, text=True, env={"PYTHONPATH": env_path, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr


def test_readme_links_the_table():
    assert "docs/supported_models.md" in (ROOT / "README.md").read_text(encoding="utf-8")
