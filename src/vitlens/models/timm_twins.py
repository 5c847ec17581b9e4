"""Adapter for timm ``Twins`` (Twins-SVT ``twins_svt_*``, Twins-PCPVT ``twins_pcpvt_*``): the last stage's tokens for
class-activation maps; its attention is not propagated, and the capability notes say why.

Every stage starts with a patch-embedding convolution (4×4 stride 4, then 2×2 stride 2) and adds a conditional
position encoding after its first block (``PosConv``: a 3×3 depthwise convolution on the token grid, with a skip).
Twins-SVT alternates *locally-grouped* self-attention (``LocallyGroupedAttn``: attention inside non-overlapping
windows of the grid, padded to a multiple of the window) with *global sub-sampled* attention
(``GlobalSubSampleAttn``: every token attends to keys and values taken from a grid reduced by a strided
convolution); Twins-PCPVT uses the sub-sampled attention in every block. The tokens are cells of a 2-d grid that
convolutions mix between blocks, and the relevance rules vitlens implements have no hand-back through the position
encoding convolutions, the padded windows or this key reduction, so no attention is recorded.

Grad-CAM's layer: the last stage's output tokens ``(B, h·w, C)`` (no prefix tokens), the input of the final norm,
which the head averages (the counterpart of a CNN's final feature map). Input sizes: the model runs any size
whose every stage grid is non-empty (the windows are padded); a size other than ``img_size`` is tried once, in a
forward without gradients in eval mode, and refused with the model's own words.
"""

from __future__ import annotations

from torch import nn

from ..errors import UnsupportedModelError
from ._feature_layer import FeatureLayerAdapter
from ._stages import stage_grids
from .base import int_pair

__all__ = ["TimmTwinsAdapter"]

_SVT = ("Twins-SVT's blocks alternate locally-grouped self-attention (inside padded windows of the token grid) and "
        "global sub-sampled attention (keys and values from a grid reduced by a strided convolution), with a "
        "depthwise-convolution position encoding after each stage's first block; vitlens' relevance rules have no "
        "hand-back through the padded windows, the key reduction or the position-encoding convolutions, so no "
        "attention is recorded")
_PCPVT = ("Twins-PCPVT's blocks use global sub-sampled attention (keys and values from a grid reduced by a strided "
          "convolution), with a depthwise-convolution position encoding after each stage's first block; vitlens' "
          "relevance rules have no hand-back through the position-encoding convolutions inside a stage, so no "
          "attention is recorded")


class TimmTwinsAdapter(FeatureLayerAdapter):
    """timm ``Twins`` (SVT, PCPVT): class logits and one feature layer, the last stage's tokens."""

    family = "timm-twins"
    layout = "tokens"

    @staticmethod
    def matches(model: nn.Module) -> bool:
        return (type(model).__name__ == "Twins" and type(model).__module__.startswith("timm.")
                and hasattr(model, "patch_embeds") and hasattr(model, "norm"))

    def __init__(self, model: nn.Module) -> None:
        kinds = {type(b.attn).__name__ for st in getattr(model, "blocks") for b in st}
        why = _SVT if "LocallyGroupedAttn" in kinds else _PCPVT
        embeds = getattr(model, "patch_embeds")
        size = getattr(embeds[0], "img_size", None)
        if size is None:
            raise UnsupportedModelError("Twins without a patch embedding img_size")
        super().__init__(model, why, "its position-encoding convolutions and windows need the full token grid: tokens "
                                     "cannot be dropped", int_pair(tuple(size)))
        self.embeds = [e.proj for e in embeds]

    def feature_module(self) -> nn.Module:
        """The final norm: its input is the last stage's output tokens."""
        return self.model.norm

    def token_grid(self, input_hw: tuple[int, int]) -> tuple[int, int]:
        """The last stage's grid: every patch embedding's convolution applied in turn."""
        return stage_grids(self.embeds, input_hw)[-1]

    def maps_note(self) -> str:
        return (f"{super().maps_note()} (timm's Twins feature_info names 'block.k' where the stages are the "
                "containers 'blocks.k', never called as layers)")
