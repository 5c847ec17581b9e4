"""Relevance across shifted windows and patch merging (Swin), shared by GradSkip's windowed path and the windowed
rollout / GAE. Package-internal: method files import these, never each other. Definitions:
``docs/methods/gradskip_swin.md``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from ..models.timm_swin import from_windows, to_windows

__all__ = ["merge_handback", "windowed_row"]


def merge_handback(relevance: Tensor, x: Tensor, grad: Tensor) -> tuple[Tensor, Tensor]:
    """Relevance ``(B, h·w)`` on a patch-merging output → ``(B, H·W)`` on its input ``x`` ``(B, H, W, C)``.

    Each output token ``(i, j)`` reads the input tokens ``(2i + a, 2j + b)``, ``a, b ∈ {0, 1}`` (the grid padded to
    even size); its relevance is split in proportion to ``⟨x, ∂y/∂x⟩⁺`` of those four, uniformly if all are 0.
    Returns the input-grid relevance and what fell on padding ``(B,)``.
    """
    b, hh, ww, _ = x.shape
    c = (x * grad).sum(-1).clamp_min(0)  # (B, H, W)
    ph, pw = hh % 2, ww % 2
    valid = torch.ones(b, hh, ww, dtype=c.dtype, device=c.device)
    c = torch.nn.functional.pad(c, (0, pw, 0, ph))
    valid = torch.nn.functional.pad(valid, (0, pw, 0, ph))
    hp, wp = hh + ph, ww + pw
    groups = c.reshape(b, hp // 2, 2, wp // 2, 2).permute(0, 1, 3, 2, 4).reshape(b, -1, 4)
    vgroups = valid.reshape(b, hp // 2, 2, wp // 2, 2).permute(0, 1, 3, 2, 4).reshape(b, -1, 4)
    total = groups.sum(-1, keepdim=True)
    share = torch.where(total > 0, groups / total.clamp_min(torch.finfo(c.dtype).tiny), vgroups / vgroups.sum(-1, True))
    r = (share * relevance[:, :, None]).reshape(b, hp // 2, wp // 2, 2, 2).permute(0, 1, 3, 2, 4).reshape(b, hp, wp)
    lost = r.sum((1, 2)) - r[:, :hh, :ww].sum((1, 2))
    return r[:, :hh, :ww].reshape(b, -1), lost


def windowed_row(rec: Any, mats: list[Tensor], batch: int, combine: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
    """The readout row of a token-mixing product on a windowed model, ``(B, T_0)`` on the first stage's grid.

    ``mats[l]``: block ``l``'s token mixing inside its windows ``(B·nW, N, N)`` (forward order). Starting from the
    classifier's row — the mean over the last stage's tokens — each block maps the row ``r`` through its windows
    (``r_w · M_w`` per window, with the block's own shift and partition) and ``combine(r, r·M)`` gives the new row
    (rollout: ``r·M``; GAE: ``r + r·M``). A patch merging hands each merged token's value to its 2×2 input tokens
    in equal parts (:func:`merge_handback` without gradients). Padding tokens are dropped.
    """
    last = rec.blocks[-1]
    gh, gw = last.grid
    r = torch.full((batch, gh * gw), 1.0 / (gh * gw), dtype=mats[-1].dtype, device=mats[-1].device)
    for li in range(len(mats) - 1, -1, -1):
        b = rec.blocks[li]
        gh, gw = b.grid
        win, padded = to_windows(r.reshape(batch, gh, gw), b.shift, b.window, b.pad_first)
        mixed, _ = from_windows(win[:, None, :].bmm(mats[li])[:, 0], batch, (gh, gw), padded, b.shift,
                                  b.window, b.pad_first)
        r = combine(r, mixed.reshape(batch, -1))
        first_of_stage = li == 0 or rec.blocks[li - 1].stage != b.stage
        m = rec.merges[b.stage] if first_of_stage else None
        if m is not None:
            zeros = torch.zeros(m.shape, dtype=r.dtype, device=r.device)
            r, _ = merge_handback(r, zeros, zeros)
    return r
