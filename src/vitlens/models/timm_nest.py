"""Adapter for timm ``Nest`` (NesT, ``nest_*``/``jx_nest_*``): the final feature map for class-activation maps, the
levels' maps for AHA; its attention is not propagated, and the capability notes say why.

NesT cuts the patch grid into non-overlapping *blocks* (4^(L−1) of them at the first of L levels) and runs plain
transformer layers inside every block, each block its own token sequence with its own position embedding; between
levels, *block aggregation* (a 3×3 convolution, a channel norm and a 3×3 stride-2 max pool on the re-assembled map)
merges every 2×2 blocks into one, until the last level is one block over the whole (halved) grid. Relevance through
the aggregation's convolution and max pool, and through attention confined to blocks, is not among the rules
vitlens implements, so no attention is recorded. The model is read as timm's CNNs are: its final feature map
``(B, C, h, w)`` (the last level's output after the final norm, the input of the global pool) is Grad-CAM's layer,
and timm's ``feature_info`` (every level's ``(B, C, h, w)`` map) is AHA's multi-depth input.

Input sizes: the position embeddings and the block partition are built for ``img_size`` (the patch embedding
checks it); another size is tried once and refused with the model's words.
"""

from __future__ import annotations

from torch import nn

from ._feature_layer import FeatureLayerAdapter
from .base import int_pair

__all__ = ["TimmNestAdapter"]

_WHY = ("NesT runs its transformer layers inside non-overlapping blocks of the patch grid (each block its own token "
        "sequence) and merges every 2x2 blocks between levels by block aggregation (a 3x3 convolution, a norm and a "
        "stride-2 max pool); vitlens' relevance rules have no hand-back through the block aggregation, so no "
        "attention is recorded")


class TimmNestAdapter(FeatureLayerAdapter):
    """timm ``Nest``: class logits, the final feature map, multi-depth maps for AHA."""

    family = "timm-nest"
    layout = "nchw"

    @staticmethod
    def matches(model: nn.Module) -> bool:
        return (type(model).__name__ == "Nest" and type(model).__module__.startswith("timm.")
                and hasattr(model, "levels") and isinstance(getattr(model, "global_pool", None), nn.Module))

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model, _WHY, "its blocks and block aggregation need the full patch grid: tokens cannot be "
                                      "dropped", int_pair(tuple(getattr(model, "patch_embed").img_size)))
        self.any_size = False  # the patch embedding checks img_size

    def feature_module(self) -> nn.Module:
        """The global pool: its input is the final (normed) feature map."""
        return self.model.global_pool
