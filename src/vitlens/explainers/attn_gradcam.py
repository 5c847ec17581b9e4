"""Attention Grad-CAM, the "GC" baseline of Chefer et al. (CVPR 2021) and MDA: Grad-CAM on one block's attention.

Token-level, one forward and one activation-only backward pass; the attention probabilities come from the adapter's
capture session and the layer choice is Grad-CAM's (:mod:`._cam`). Settings and sources: ``docs/methods/cams.md``.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ..models import Adapter
from ..models.base import recorded
from ..models.capabilities import ATTENTION, TOKEN_SEQUENCE
from ..targets import Target
from ._cam import OneLayerCAM
from .base import Attribution, image_size
from .registry import register

__all__ = ["AttentionGradCAM"]


@register
class AttentionGradCAM(OneLayerCAM):
    """Attention Grad-CAM, the "GC" baseline of Chefer et al. (CVPR 2021) and MDA, ``(B, gh, gw)``.

    At block ``layer`` (default the last): the readout row of every head's attention over the patch tokens, weighted
    per head by the mean of its gradient over those patch tokens, averaged over heads, ReLU:
    ``ReLU(mean_h ḡ_h · A_h[r, p:])`` with ``ḡ_h = mean_j ∂y/∂A_h[r, p + j]``.

    Readout row ``r``: the CLS token's row. Models with several readout tokens (distilled DeiT: CLS and DIST) and
    pooled-readout models (no CLS; every patch token feeds the head) use several rows, each weighted by its own
    gradient mean and then averaged: the readout tokens' rows, or all patch-token rows.

    Options:
        layer: block index (negative counts from the end).
    """

    name = "attn_gradcam"
    value_kind = "nonnegative"
    description = "Grad-CAM on the last block's attention"
    needs = (ATTENTION, TOKEN_SEQUENCE)
    display_name = "Attention Grad-CAM"
    defaults: dict[str, Any] = {"layer": -1}

    def attribute(self, adapter: Adapter, x: Tensor, target: Target) -> tuple[Attribution, Tensor, Target]:
        i = self.layer_index(adapter)
        logits, tgt, (attn,), (grad,) = self.forward_and_gradients(
            adapter, x, target, lambda rec: [recorded(rec.blocks[i].attn, "attention")])
        p = adapter.num_prefix_tokens
        readout = adapter.readout_tokens
        rows = list(readout) if readout is not None else list(range(p, attn.shape[2]))
        a = attn[:, :, rows, p:]  # (B, H, R, N)
        g = grad[:, :, rows, p:]
        cam = (g.mean(dim=-1, keepdim=True) * a).mean(dim=(1, 2)).clamp_min(0)  # (B, N)
        return Attribution(values=self.on_grid(adapter, cam, image_size(x))), logits, tgt
