"""What the HuggingFace adapters share: switching their configs (or, for the families that choose the attention class
when the model is built, their attention modules) to eager attention for a capture session."""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator

from torch import nn

__all__ = ["eager_attention", "eager_modules"]


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


@contextlib.contextmanager
def eager_modules(modules: Iterable[nn.Module]) -> Iterator[None]:
    """Run every SDPA attention module in ``modules`` (class name containing ``Sdpa``, whose parent class is the
    family's eager attention with the same parameters, as transformers 4.x layouts build them) as that eager parent
    class for the duration of the context: only these instances change, and each gets its class back in ``finally``.
    Other modules are left as they are."""
    saved: list[tuple[nn.Module, type]] = []
    try:
        for m in modules:
            cls = type(m)
            base = cls.__bases__[0] if cls.__bases__ else None
            if "Sdpa" in cls.__name__ and base is not None and issubclass(base, nn.Module) and \
                    base.__name__ == cls.__name__.replace("Sdpa", ""):
                saved.append((m, cls))
                m.__class__ = base
        yield
    finally:
        for m, cls in saved:
            m.__class__ = cls
