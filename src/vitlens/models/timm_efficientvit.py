"""Adapter for timm ``EfficientVitMsra`` (EfficientViT-MSRA, ``efficientvit_m0``–``m5``): the final feature map for
class-activation maps, the stages' maps for AHA; its attention is not propagated, and the capability notes say why.
(EfficientViT-MIT, ``efficientvit_b*``/``l*``, is another class, read as a CNN by :mod:`.timm_cnn`.)

Its blocks work on a ``(B, C, h, w)`` map: a depthwise convolution and a feed-forward of 1×1 convolutions with batch
norm before and after *cascaded group attention* in local windows (``LocalWindowAttention``: the map is cut into
windows, padded to a multiple of the window; every head reads its own channel split, plus the previous head's
output, and its queries pass a depthwise convolution; a learned bias indexed by the window's offsets is added to
the logits), and its stages are joined by subsample blocks (strided convolutions with a squeeze-excitation). The
heads are chained, the attention is windowed on padded maps, and the blocks mix tokens with convolutions between
attentions: the relevance rules vitlens implements have no hand-back through any of this, so no attention is
recorded. The model is read as timm's CNNs are: its final feature map (the last stage's output, the input of the
global pool) is Grad-CAM's layer, and timm's ``feature_info`` (every stage's map) is AHA's multi-depth input.

Input sizes: the attention biases are built for the windows of the model's ``img_size``; another size is tried once
and refused with the model's words where it cannot run.
"""

from __future__ import annotations

from torch import nn

from ._feature_layer import FeatureLayerAdapter

__all__ = ["TimmEfficientVitMsraAdapter"]

_WHY = ("EfficientViT-MSRA's blocks are depthwise convolutions and convolution feed-forwards around cascaded group "
        "attention in padded local windows of the feature map (each head reads its own channel split plus the "
        "previous head's output, its queries pass a depthwise convolution), with subsample convolution blocks "
        "between stages; vitlens' relevance rules have no hand-back through the chained heads or the "
        "convolutions, so no attention is recorded")


class TimmEfficientVitMsraAdapter(FeatureLayerAdapter):
    """timm ``EfficientVitMsra``: class logits, the final feature map, multi-depth maps for AHA."""

    family = "timm-efficientvit-msra"
    layout = "nchw"

    @staticmethod
    def matches(model: nn.Module) -> bool:
        return (type(model).__name__ == "EfficientVitMsra" and type(model).__module__.startswith("timm.")
                and hasattr(model, "stages") and isinstance(getattr(model, "global_pool", None), nn.Module))

    def __init__(self, model: nn.Module) -> None:
        size = int(getattr(model, "img_size"))
        super().__init__(model, _WHY, "its convolutions and windows need the full feature map: tokens cannot be "
                                      "dropped", (size, size))
        self.any_size = True

    def feature_module(self) -> nn.Module:
        """The global pool: its input is the last stage's feature map."""
        return self.model.global_pool
