"""Adapter for timm ``TNT`` (Transformer in Transformer, ``tnt_*``): the outer (patch) tokens for class-activation
maps; its attention is not propagated, and the capability notes say why.

A TNT block runs two transformers: an *inner* one on the pixel tokens of every patch (each patch's sub-patch
embeddings attend to each other, a sequence per patch), whose output is flattened, normed and projected, then added
to that patch's *outer* token; then an *outer* transformer on the patch tokens (class token first). The relevance
rules vitlens implements follow one token sequence through its blocks; here a second family of sequences feeds the
first in every block, through a projection no rule hands relevance back through, so no attention is recorded.

Grad-CAM's layer: the outer tokens ``(B, 1 + h·w, C)`` entering the last block (the counterpart of a ViT's last
block input; the class token is left out of the map). The pixel tokens' last contribution is added to them inside
that block: what reaches the prediction only through it is not in the map. Input sizes: the pixel embedding checks
``img_size``; another size is tried once and refused with the model's words.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from ._feature_layer import FeatureLayerAdapter
from .base import int_pair

__all__ = ["TimmTNTAdapter"]

_WHY = ("TNT's blocks run an inner transformer on every patch's pixel tokens, project its output into the patch's "
        "outer token, then an outer transformer on the patch tokens; vitlens' relevance rules follow one token "
        "sequence and have no hand-back through the inner-to-outer projection, so no attention is recorded")


class TimmTNTAdapter(FeatureLayerAdapter):
    """timm ``TNT``: class logits and one feature layer, the outer tokens entering the last block."""

    family = "timm-tnt"
    layout = "tokens"

    @staticmethod
    def matches(model: nn.Module) -> bool:
        return (type(model).__name__ == "TNT" and type(model).__module__.startswith("timm.")
                and hasattr(model, "pixel_embed") and hasattr(model, "blocks"))

    def __init__(self, model: nn.Module) -> None:
        embed = getattr(model, "pixel_embed")
        super().__init__(model, _WHY, "its inner transformers and position embeddings need every patch: tokens cannot "
                                      "be dropped", int_pair(tuple(embed.img_size)))
        self.patch: tuple[int, int] = int_pair(tuple(embed.patch_size))
        self.patch_size = self.patch
        self.num_prefix_tokens = int(getattr(model, "num_prefix_tokens", 1))
        self.any_size = False  # the patch embedding checks img_size
        self.readout_tokens = (0,) if self.model.global_pool == "token" else None

    def feature_module(self) -> nn.Module:
        """The last block: its second input is the outer (patch) tokens."""
        return self.model.blocks[-1]

    def take(self, value: Any) -> Tensor:
        return value[1]

    def put(self, value: Any, t: Tensor) -> Any:
        return (value[0], t, *value[2:])

    def token_grid(self, input_hw: tuple[int, int]) -> tuple[int, int]:
        """The patch grid: ``H // p × W // p``."""
        return input_hw[0] // self.patch[0], input_hw[1] // self.patch[1]
