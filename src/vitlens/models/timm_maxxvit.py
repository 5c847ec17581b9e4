"""Adapter for timm ``MaxxVit`` (MaxViT, and the CoAtNet models built by the same class): the final feature map for
class-activation maps, the stage outputs for AHA; its attention is not propagated, and the capability notes say why.

A MaxViT block (``MaxxVitBlock``) is an MBConv block (1×1 expansion, a 3×3 depthwise convolution, squeeze-excitation,
1×1 projection; at a stage's first block strided, with a pooled and projected shortcut), then *block* attention over
non-overlapping windows of the feature map and *grid* attention over a dilated grid of it (each a pre-norm attention
with a relative position bias over its partition, then an MLP). The tokens are the cells of a 2-d feature map that
convolutions mix between the attentions: there is no token sequence, and the relevance rules vitlens implements have
no hand-back through the MBConv blocks or through the window and grid partitions, so no attention is recorded. The
model is read as timm's CNNs are (:class:`~vitlens.models.timm_cnn.TimmCNNAdapter`): its final feature map, the input
of the global pool, is Grad-CAM's layer, and timm's ``feature_info`` (the stem and every stage, ``(B, C, h, w)``
maps) is AHA's multi-depth input.

Input sizes: the window and grid partitions must divide every stage's feature map (timm asserts it), and the strided
blocks' shortcut must give the main branch's size (a 2×2 average pool with explicit padding rounds down where the
strided convolution rounds up); CoAtNet's transformer blocks have relative position tables built for the feature
maps of the model's ``img_size``. A size other than ``img_size`` is tried once, in a forward without gradients in
eval mode, and refused with the model's own words and the stage whose grid does not fit
(:meth:`TimmMaxxVitAdapter.check_input`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ..errors import InputError, UnsupportedModelError
from .base import int_pair, switched
from .capabilities import (ATTENTION, BLOCK_IO, CLASS_ATTENTION, LINEAR_HEAD, LRP_LINEARS, LRP_VARIANT_LINEARS,
                           PIXEL_LOGITS, STAGES, TOKEN_GRID, TOKEN_SEQUENCE, TOKENS, WINDOWS)
from .timm_cnn import TimmCNNAdapter

__all__ = ["TimmMaxxVitAdapter"]

_MAXVIT = ("MaxViT's blocks are an MBConv convolution block (strided, with a pooled and projected shortcut, at a "
           "stage's first block), then block attention over windows and grid attention over a dilated grid of the "
           "feature map, each with a relative position bias; the tokens are cells of a 2-d feature map that "
           "convolutions mix between the attentions, and vitlens' relevance rules have no hand-back through the "
           "MBConv blocks or the window and grid partitions, so no attention is recorded")
_COATNET = ("CoAtNet's stages are MBConv convolution blocks, then transformer blocks with a relative position bias "
            "whose first block pools its input (stride 2) and projects its shortcut; vitlens' relevance rules have no "
            "hand-back through the MBConv blocks or the pooled, projected shortcuts, so no attention is recorded")
_SEQUENCE_CAPS = (ATTENTION, BLOCK_IO, TOKEN_SEQUENCE, LRP_LINEARS, LRP_VARIANT_LINEARS, LINEAR_HEAD, STAGES, WINDOWS,
                  CLASS_ATTENTION)


def _ceil_half(hw: tuple[int, int]) -> tuple[int, int]:
    """A stride-2 step of the stem or a stage (timm's ``(r − 1) // 2 + 1``)."""
    return (hw[0] - 1) // 2 + 1, (hw[1] - 1) // 2 + 1


class TimmMaxxVitAdapter(TimmCNNAdapter):
    """timm ``MaxxVit`` (MaxViT, CoAtNet): class logits, the final feature map, multi-depth maps for AHA."""

    family = "timm-maxxvit"
    capabilities = TimmCNNAdapter.capabilities | {TOKEN_GRID}

    @staticmethod
    def matches(model: nn.Module) -> bool:
        return (type(model).__name__ == "MaxxVit" and type(model).__module__.startswith("timm.")
                and hasattr(model, "stages") and hasattr(model, "stem") and TimmCNNAdapter.matches(model))

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        m: Any = self.model
        if getattr(m, "global_pool", "avg") == "":
            raise UnsupportedModelError("global_pool='': the model outputs its feature map, not class logits")
        self.in_chans = int(m.in_chans)
        self.size = int_pair(tuple(m.img_size))
        self.default_size = self.size
        kinds = {type(b).__name__ for st in m.stages for b in st.blocks}
        self.transformer = "TransformerBlock2d" in kinds
        if kinds & {"MaxxVitBlock", "ParallelMaxxVitBlock"}:
            why = _MAXVIT
        elif self.transformer:
            why = _COATNET
        else:
            why = "its stages are convolution blocks only (MBConv or ConvNeXt): it has no attention and no tokens"
        self.capability_notes = {c: why for c in _SEQUENCE_CAPS}
        self.capability_notes.update({
            TOKENS: "its convolution blocks and window/grid partitions need the full feature map: tokens cannot be "
                    "dropped",
            PIXEL_LOGITS: "the model outputs class logits (B, K), not per-pixel logits",
        })
        self.any_size = not self.transformer
        #: input size → the refusal of that size (``None``: the model runs it), from one probe forward each
        self._verdicts: dict[tuple[int, int], str | None] = {}
        # per stage, the partition sizes (window, grid) its attention needs to divide the stage's feature map
        self.partitions: list[list[tuple[str, tuple[int, int]]]] = []
        for st in m.stages:
            parts: list[tuple[str, tuple[int, int]]] = []
            for b in st.blocks:
                for attr, what in (("attn_block", "block (window)"), ("attn_grid", "grid"), ("attn", "window/grid")):
                    size = getattr(getattr(b, attr, None), "partition_size", None)
                    if size is not None:
                        parts.append((what, int_pair(tuple(size))))
            self.partitions.append(parts)

    def stage_grids(self, input_hw: tuple[int, int]) -> list[tuple[int, int]]:
        """Every stage's feature-map size for an input of ``input_hw`` (the stem and each stage halve it, rounding
        up)."""
        hw, grids = _ceil_half(int_pair(input_hw)), []
        for _ in self.partitions:
            hw = _ceil_half(hw)
            grids.append(hw)
        return grids

    def grid(self, input_hw: tuple[int, int]) -> tuple[int, int]:
        """The final feature map's size (the last stage's grid)."""
        return self.stage_grids(input_hw)[-1]

    def _size_problem(self, hw: tuple[int, int]) -> str | None:
        if self.transformer:
            if hw == self.size:
                return None
            return (f"its transformer blocks' relative position tables are built for the feature maps of a "
                    f"{self.size[0]}x{self.size[1]} input")
        for s, ((gh, gw), parts) in enumerate(zip(self.stage_grids(hw), self.partitions)):
            for what, (ph, pw) in parts:
                if gh % ph or gw % pw:
                    return (f"stage {s + 1}'s {gh}x{gw} feature map is not divisible by its {ph}x{pw} {what} "
                            "attention partition")
        return None

    def check_input(self, x: Tensor) -> None:
        super().check_input(x)
        hw = int_pair(x.shape[-2:])
        if hw == self.size:
            return
        if hw not in self._verdicts:  # another size: the model's own forward decides (its stride-2 shortcuts and
            # partitions have rules of their own, e.g. a 2x2 average pool that rounds down where the convolution
            # rounds up); the stage grids say why
            refusal = None
            try:  # in eval mode, without gradients: batch-norm statistics untouched
                with torch.no_grad(), switched(list(self.model.modules()), "training", False):
                    self.model(x[:1].detach())
            except (RuntimeError, ValueError, AssertionError, IndexError) as e:
                problem = self._size_problem(hw)
                words = f"the model refuses it: {str(e).splitlines()[0][:200]}"
                refusal = (f"{type(self.model).__name__} cannot run a {hw[0]}x{hw[1]} input ("
                           + (f"{problem}; {words})" if problem else f"{words})"))
            self._verdicts[hw] = refusal
        refusal = self._verdicts[hw]
        if refusal is not None:
            raise InputError(refusal)
