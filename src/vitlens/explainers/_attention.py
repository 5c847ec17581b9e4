"""Token-mixing helpers shared by the attention methods (rollout, GAE, transformer attribution, the LRP methods).

Package-internal: a method file imports these and :mod:`.base`, never another method file.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from ..errors import InputError, UnsupportedModelError
from ..models import Adapter
from .base import Explainer, image_size

__all__ = ["readout_row", "rollout_row", "relevance_rollout", "token_map", "fuse_heads", "discard_lowest", "FUSIONS", "DISCARD_PER"]


def readout_row(joint: Tensor, readout: tuple[int, ...] | None, num_prefix: int) -> Tensor:
    """The row of a token-mixing matrix ``(B, T, T)`` that the classifier reads, ``(B, T)``.

    One readout token: its row. Several (distilled DeiT: CLS and DIST, whose heads are averaged): the mean of their
    rows. Pooled readout (no readout token): the mean of the patch-token rows (the tokens the pool averages).
    """
    if readout is None:
        return joint[:, num_prefix:].mean(dim=1)
    return joint[:, list(readout)].mean(dim=1)


def rollout_row(maps: Sequence[Tensor], readout: tuple[int, ...] | None, num_prefix: int) -> Tensor:
    """The readout row ``(B, T)`` of the rollout ``R = (I + M_L) ⋯ (I + M_1)`` (:func:`relevance_rollout`; GAE and
    transformer attribution).

    On a pooled readout the identity's share is left out (the row of ``R − I``): it is ``1/N`` on every patch token
    whatever the image and the class — each token's own path through the skip connections, which the average pool
    weighs equally — and it dwarfs the attention terms (``~1e-7`` on a tiny ViT), so the map would be a constant
    ``1/N``. On a readout token that share lands on the readout token itself, outside the map, and the map is the
    row of ``R − I`` there too.
    """
    joint = relevance_rollout(maps)
    if readout is None:
        joint = joint - torch.eye(joint.shape[-1], device=joint.device, dtype=joint.dtype)
    return readout_row(joint, readout, num_prefix)


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
    if r is None:
        raise UnsupportedModelError("the model has no transformer blocks: there is no attention to roll out")
    return r


FUSIONS = ("mean", "max", "min")
DISCARD_PER = ("matrix", "row")


def fuse_heads(attn: Tensor, mode: str = "mean") -> Tensor:
    """Fuse the heads of attention probabilities ``(B, H, T, T)`` into ``(B, T, T)`` by their mean, max or min."""
    if mode == "mean":
        return attn.mean(dim=1)
    if mode == "max":
        return attn.amax(dim=1)
    if mode == "min":
        return attn.amin(dim=1)
    raise InputError(f"head_fusion must be one of {FUSIONS}, got {mode!r}")


def discard_lowest(fused: Tensor, ratio: float, protect: tuple[int, ...] = (), per: str = "matrix") -> Tensor:
    """Zero the lowest entries of each image's fused ``(T, T)`` attention matrix (or ``(1, T)`` row).

    ``per="matrix"`` (default, as the widely used implementation jacobgil/vit-explain): the ``⌊ratio·T²⌋`` lowest
    entries of the whole matrix of one image. ``per="row"``: the ``⌊ratio·T⌋`` lowest entries of every row.
    In both, the diagonal entries ``(r, r)`` of the tokens in ``protect`` (the readout tokens) are never zeroed — the
    common implementation protects exactly the entry ``(0, 0)``, i.e. CLS attending to itself; the rest of the readout
    row and the readout column can be dropped. Protected entries count towards the number dropped (so fewer than
    ``⌊ratio·…⌋`` entries are zeroed when one is among the lowest), as in that implementation. Ties are broken by
    :func:`torch.topk`.
    """
    if ratio <= 0:
        return fused
    b, t, tk = fused.shape  # (B, T, T); CaiT's class attention: one row (B, 1, 1 + N), where both kinds agree
    flat = fused.reshape(b, t * tk) if per == "matrix" else fused
    k = int(flat.shape[-1] * ratio)
    if k == 0:
        return fused
    drop = torch.zeros_like(flat, dtype=torch.bool)
    drop.scatter_(-1, flat.topk(k, dim=-1, largest=False).indices, True)
    drop = drop.reshape(b, t, tk)
    for r in protect:
        drop[:, r, r] = False
    return fused.masked_fill(drop, 0.0)
