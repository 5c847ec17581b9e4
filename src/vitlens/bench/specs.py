"""Method, metric and data specs of the benchmark command line: ``name`` or ``name:key=value;key=value``."""

from __future__ import annotations

from typing import Any, Sequence

from ..errors import InputError
from ..runtime import parse_key_value, split_top

__all__ = ["parse_spec", "split_specs", "spec_label", "safe_label"]


def parse_spec(text: str) -> tuple[str, dict[str, Any]]:
    """``"name:key=value;key=value"`` → ``("name", {key: value})``; values are Python literals, else strings."""
    name, _, rest = text.partition(":")
    opts: dict[str, Any] = {}
    for part in split_top(rest, ";"):
        key, value = parse_key_value(part, what=f"setting in {text!r}:")
        opts[key] = value
    if not name.strip():
        raise InputError(f"empty name in {text!r}")
    return name.strip(), opts


def split_specs(texts: str | Sequence[str]) -> list[tuple[str, dict[str, Any]]]:
    """Method/metric specs from the command line: ``"gradskip,gradskip:skip='fixed';alpha=0"`` or a list of them.

    Specs are separated by commas (outside brackets and quotes); settings inside a spec by semicolons.
    """
    if isinstance(texts, str):
        texts = [texts]
    return [parse_spec(s) for t in texts for s in split_top(t, ",")]


def spec_label(name: str, opts: dict[str, Any]) -> str:
    """A stable label for a configured method/metric, e.g. ``gradskip[alpha=0,skip=fixed]``."""
    if not opts:
        return name
    return name + "[" + ",".join(f"{k}={opts[k]}" for k in sorted(opts)) + "]"


def safe_label(label: str) -> str:
    """A spec label as a file-name part: characters other than letters, digits, ``-``, ``_`` and ``.`` become ``_``."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in label)
