"""Token-mixing helpers shared by the attention methods (rollout, GAE, transformer attribution, the LRP methods).

Package-internal: a method file imports these and :mod:`.base`, never another method file.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from ..models import Adapter
from .base import Explainer, image_size

__all__ = ["readout_row", "relevance_rollout", "token_map"]


def readout_row(joint: Tensor, readout: tuple[int, ...] | None, num_prefix: int) -> Tensor:
    """The row of a token-mixing matrix ``(B, T, T)`` that the classifier reads, ``(B, T)``.

    One readout token: its row. Several (distilled DeiT: CLS and DIST, whose heads are averaged): the mean of their
    rows. Pooled readout (no readout token): the mean of the patch-token rows (the tokens the pool averages).
    """
    if readout is None:
        return joint[:, num_prefix:].mean(dim=1)
    return joint[:, list(readout)].mean(dim=1)


def token_map(adapter: Adapter, row: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
    """Split a token row ``(B, T)`` into the patch-token map ``(B, gh, gw)`` and the prefix-token sum ``(B,)``."""
    p = adapter.num_prefix_tokens
    return Explainer.on_grid(adapter, row[:, p:], image_size(x)), row[:, :p].sum(dim=-1)


def relevance_rollout(maps: Sequence[Tensor]) -> Tensor:
    """``R = (I + M_L) ⋯ (I + M_1)`` for per-layer token-mixing maps ``M_l`` ``(B, T, T)`` (first layer first).

    This is Chefer et al.'s update ``R ← R + M_l·R`` from ``R = I``, block by block (no row normalisation).
    """
    r = None
    for m in maps:
        r = m + torch.eye(m.shape[-1], device=m.device, dtype=m.dtype) if r is None else r + m.bmm(r)
    return r
