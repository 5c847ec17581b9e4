"""What the HuggingFace adapters share: switching their configs to eager attention for a capture session."""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator

__all__ = ["eager_attention"]


@contextlib.contextmanager
def eager_attention(configs: Iterable[Any]) -> Iterator[None]:
    """Set ``_attn_implementation = "eager"`` (the attention path that returns the probabilities) on every distinct
    config in ``configs`` for the duration of the context; each is restored in ``finally``, also after an exception."""
    unique = {id(c): c for c in configs}
    saved = {k: c._attn_implementation for k, c in unique.items()}
    try:
        for c in unique.values():
            c._attn_implementation = "eager"
        yield
    finally:
        for k, c in unique.items():
            c._attn_implementation = saved[k]
