"""Adapter for timm ``VOLO`` (``volo_d1``–``d5``): the last stage's tokens for class-activation maps, the stages'
maps for AHA; its attention is not propagated, and the capability notes say why.

VOLO's first stage is made of *outlookers*: outlook attention, where every token predicts, by a linear map of its
own features (no query-key product), the weights with which it aggregates the values of its k×k neighbourhood
(unfolded, weighted, folded back, so overlapping windows are summed); a patch-merging convolution then halves the
grid, plain transformer blocks follow on the ``(B, h, w, C)`` map, and class-attention blocks (the class token
attends over the patch tokens, which they pass on unchanged) end it. The head classifies the class token and adds
half the maximum over the patch tokens of an auxiliary head (token labelling). The relevance rules vitlens
implements have no hand-back through outlook attention's fold of overlapping windows or the merging convolution,
so no attention is recorded.

Grad-CAM's layer: the last stage's output ``(B, h, w, C)`` before the class token is prepended (the tensor every
path to the prediction passes through: the class-attention blocks read it, and the auxiliary head reads it through
them unchanged). AHA reads timm's ``feature_info`` stage outputs. Input sizes: the position embedding is built for
the grid of ``img_size``; a size whose merged grid differs is refused with the model's words (another size is tried
once, in a forward without gradients in eval mode; one that rounds down to the same grid runs).
"""

from __future__ import annotations

from torch import nn

from ..errors import UnsupportedModelError
from ._feature_layer import FeatureLayerAdapter

__all__ = ["TimmVoloAdapter"]

_WHY = ("VOLO's first stage uses outlook attention (each token predicts, from its own features and without a "
        "query-key product, weights over its kxk neighbourhood, aggregated over overlapping windows that are folded "
        "back), a patch-merging convolution, then transformer blocks and class-attention blocks; vitlens' relevance "
        "rules have no hand-back through outlook attention's folded windows or the merging convolution, so no "
        "attention is recorded")


class TimmVoloAdapter(FeatureLayerAdapter):
    """timm ``VOLO``: class logits and one feature layer, the last stage's token map."""

    family = "timm-volo"
    layout = "nhwc"
    on_output = True

    @staticmethod
    def matches(model: nn.Module) -> bool:
        return (type(model).__name__ == "VOLO" and type(model).__module__.startswith("timm.")
                and hasattr(model, "network") and hasattr(model, "patch_embed"))

    def __init__(self, model: nn.Module) -> None:
        embed = getattr(model, "patch_embed")
        stride = int(embed.proj.stride[0]) * (int(embed.conv[0].stride[0]) if embed.conv is not None else 1)
        pos = getattr(model, "pos_embed")  # (1, h, w, C) on the grid after the patch merging
        if pos is None:
            raise UnsupportedModelError("VOLO without a position embedding")
        scale = stride * int(getattr(model, "pooling_scale"))
        super().__init__(model, _WHY, "its outlook attention, merging convolution and position embedding need the "
                                      "full token grid: tokens cannot be dropped",
                         (int(pos.shape[1]) * scale, int(pos.shape[2]) * scale))
        self.any_size = False  # the position embedding fixes the merged grid

    def feature_module(self) -> nn.Module:
        """The last stage (its output is the last stage's token map)."""
        return self.model.network[-1]
