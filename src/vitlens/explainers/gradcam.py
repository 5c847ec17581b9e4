"""Grad-CAM (Selvaraju et al., ICCV 2017) on the token features of a vision transformer (or a CNN's feature map).

Token-level, one forward and one activation-only backward pass. The features it reads (the residual stream entering
a block, a CNN's or SegFormer's final feature map) come from the adapter's capture session, so the token layout
(prefix tokens, grid) is the model's own. Finer-CAM (:mod:`.finercam`) and attention Grad-CAM (:mod:`.attn_gradcam`)
share its machinery (:mod:`._cam`). Settings, sources and cross-checks: ``docs/methods/cams.md``.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ..models import Adapter
from ..models.capabilities import FEATURES
from ..targets import Target
from ._cam import OneLayerCAM, features_at, token_gradcam
from .base import Attribution, image_size
from .registry import register

__all__ = ["GradCAM"]


@register
class GradCAM(OneLayerCAM):
    """Grad-CAM (Selvaraju et al., ICCV 2017) on the token features of a ViT, ``(B, gh, gw)``.

    Features: the residual stream entering block ``layer`` (default the last block), which is the input of that
    block's first LayerNorm; on a timm CNN the feature map the classifier pools, on a SegFormer the decode head's
    fused feature map (the input of its 1×1 classifier, on the logits' grid; one layer). Channel weights: the
    target's gradient with respect to those features, averaged over the patch tokens; map: ReLU of the weighted
    channel sum at every patch token, on the model's own token grid (prefix tokens — CLS, distillation, registers —
    are left out). With a :class:`~vitlens.targets.SegmentationTarget` this is Seg-Grad-CAM (Vinogradova et al.,
    AAAI 2020).

    Options:
        layer: feature layer index (negative counts from the end): a block of a ViT, 0/−1 on a CNN or SegFormer.
    """

    name = "gradcam"
    value_kind = "nonnegative"
    description = "Grad-CAM on the ViT's tokens (or a CNN's last feature map)"
    needs = (FEATURES,)
    display_name = "Grad-CAM"
    defaults: dict[str, Any] = {"layer": -1}

    def attribute(self, adapter: Adapter, x: Tensor, target: Target) -> tuple[Attribution, Tensor, Target]:
        i = self.layer_index(adapter)
        logits, tgt, (u,), (g,) = self.forward_and_gradients(adapter, x, target, lambda rec: [features_at(rec, i)])
        cam = token_gradcam(u, g, adapter.feature_prefix_tokens())
        return Attribution(values=self.on_grid(adapter, cam, image_size(x), features=True)), logits, tgt
