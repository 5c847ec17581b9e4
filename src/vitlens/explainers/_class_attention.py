"""Token rows through CaiT's two phases (class-attention blocks on CLS, self-attention blocks on the patch tokens),
shared by GradSkip's class-attention path and the class-attention rollout / GAE. Package-internal: method files import
these, never each other. Definitions: ``docs/methods/gradskip_cait.md``.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

__all__ = ["class_attention_row", "magnitude_rows", "readout_start"]


def magnitude_rows(mixing: Tensor) -> Tensor:
    """``rownorm(|A'|)`` per head ``(B, H, T, T_k)``: the mixing tensor's magnitudes with rows summing to 1 (an
    all-zero row becomes uniform). For a softmax this is the softmax itself (up to rounding)."""
    mag = mixing.abs()
    rows = mag.sum(dim=-1, keepdim=True)
    uniform = torch.full_like(mag, 1.0 / mag.shape[-1])
    return torch.where(rows > 0, mag / rows.clamp_min(torch.finfo(mag.dtype).tiny), uniform)


def readout_start(readout: tuple[int, ...] | None, tokens: int, batch: int, like: Tensor) -> Tensor:
    """The classifier's row on the final stream ``[CLS, patches]`` ``(B, 1 + N)``: ``e_CLS`` for the token readout,
    the patch mean (``1/N`` on every patch token) for the average readout."""
    r = like.new_zeros(batch, tokens)
    if readout is not None:
        r[:, list(readout)] = 1.0 / len(readout)
    else:
        r[:, 1:] = 1.0 / (tokens - 1)
    return r


def class_attention_row(start: Tensor, ca_rows: Sequence[Tensor], sa_mats: Sequence[Tensor], add: bool
                        ) -> tuple[Tensor, Tensor]:
    """A readout row pushed back through the class-attention blocks, then the self-attention blocks.

    ``start``: ``(B, 1 + N)`` on ``[CLS, patches]``; ``ca_rows[l]``: class-attention block ``l``'s mixing row
    ``(B, 1 + N)``; ``sa_mats[l]``: self-attention block ``l``'s token mixing ``(B, N, N)`` (both in forward order).
    ``add=False`` (rollout, the residual already inside the matrices): a CA block maps ``r`` to
    ``[0, r_patches] + r_CLS · row`` (it keeps the patch tokens and replaces CLS by its row), an SA block to
    ``r · M``. ``add=True`` (GAE's ``R ← R + M·R``): ``r + r_CLS · row`` and ``r + r · M``. Returns the patch-token
    row ``(B, N)`` and what is left on CLS after the class-attention stage ``(B,)`` (the learned token).
    """
    r = start
    for row in reversed(list(ca_rows)):
        cls = r[:, :1]
        base = r if add else torch.cat([torch.zeros_like(cls), r[:, 1:]], dim=1)
        r = base + cls * row
    cls_left, patches = r[:, 0], r[:, 1:]
    for m in reversed(list(sa_mats)):
        mixed = patches[:, None, :].bmm(m)[:, 0]
        patches = patches + mixed if add else mixed
    return patches, cls_left
