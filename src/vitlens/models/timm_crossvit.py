"""Adapter for timm ``CrossVit`` (``crossvit_*``): one branch's tokens for class-activation maps; its attention is not
propagated, and the capability notes say why.

CrossViT runs two token sequences side by side, each with its own class token: the image at two scales
(``img_scale``: it is resized to both) cut into patches of two sizes (e.g. 12 and 16 pixels), so the branches have
token grids of different sizes and widths. Every multi-scale block runs each branch's own ViT blocks, then *fuses*
them by cross-attention: the class token of each branch, projected to the other branch's width, attends over the
other branch's patch tokens and is projected back. The head classifies each branch's class token and averages the
two branches' logits. No single token sequence crosses every block, and the fusion is attention of one query over
another sequence's tokens, which no relevance rule of vitlens reads, so no attention is recorded.

Grad-CAM's layer: the patch tokens of the branch with the finer grid (the most patch tokens; branch 0, the small
patches, in every timm preset) entering the last multi-scale block, ``(B, 1 + h·w, C)`` with its class token first
(left out of the map). The prediction reaches those tokens through both heads: through its own branch's blocks
into its own class token, and through the fusion into the other branch's class token. What reaches the prediction
only through the other branch's patch tokens (the coarser grid) is not in the map; no single feature map of
CrossViT carries all of it. Input sizes: any, because the model resizes every input to its two branch sizes, so
the grid is the same for every input size.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from ._feature_layer import FeatureLayerAdapter
from .base import int_pair

__all__ = ["TimmCrossVitAdapter"]

_WHY = ("CrossViT runs two token sequences of different patch sizes and grids side by side, each with its own class "
        "token, fused in every multi-scale block by cross-attention of one branch's class token over the other "
        "branch's patch tokens, and averages the two branches' logits; there is no single token sequence and "
        "vitlens' relevance rules do not read cross-attention between sequences, so no attention is recorded")


class TimmCrossVitAdapter(FeatureLayerAdapter):
    """timm ``CrossVit``: class logits and one feature layer, the finer branch's tokens (module docstring)."""

    family = "timm-crossvit"
    layout = "tokens"

    @staticmethod
    def matches(model: nn.Module) -> bool:
        return (type(model).__name__ == "CrossVit" and type(model).__module__.startswith("timm.")
                and hasattr(model, "patch_embed") and hasattr(model, "blocks"))

    def __init__(self, model: nn.Module) -> None:
        embeds: Any = getattr(model, "patch_embed")
        super().__init__(model, _WHY, "its two branches are resized copies of the whole image, fused by "
                                      "cross-attention: tokens cannot be dropped",
                         int_pair(tuple(getattr(model, "img_size"))))
        grids = [(int(e.img_size[0]) // int(e.patch_size[0]), int(e.img_size[1]) // int(e.patch_size[1]))
                 for e in embeds]
        #: the branch Grad-CAM reads: the one with the most patch tokens
        self.branch = max(range(len(grids)), key=lambda b: grids[b][0] * grids[b][1])
        self.branch_grid = grids[self.branch]
        self.num_prefix_tokens = 1
        self.readout_tokens = (0,) if self.model.global_pool == "token" else None
        self.any_size = True

    def feature_module(self) -> nn.Module:
        """The last multi-scale block: its input is the list of the branches' token sequences."""
        return self.model.blocks[-1]

    def take(self, value: Any) -> Tensor:
        return value[0][self.branch]

    def put(self, value: Any, t: Tensor) -> Any:
        xs = list(value[0])
        xs[self.branch] = t
        return (xs, *value[1:])

    def token_grid(self, input_hw: tuple[int, int]) -> tuple[int, int]:
        """The branch's own grid (every input is resized to the branch's size)."""
        return self.branch_grid
