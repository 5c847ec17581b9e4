"""Adapter for timm ``MultiScaleVit`` (MViTv2): its final token features for class-activation maps; its pooling
attention is not propagated, and the capability notes say why.

An MViTv2 block pools inside its attention: the queries by a 3×3 depthwise convolution (strided at the first block of
a stage, so the block's output has fewer tokens than its input), the keys and values by strided depthwise
convolutions; it adds the pooled queries to the attention output (residual pooling), adds a decomposed relative
position bias to the logits, and max-pools (and, where the width changes, projects) its residual path at stage
transitions. The relevance rules vitlens implements need an identity skip on the block's own tokens and at most one
key-reduction convolution per block (SegFormer, PVTv2), and products of attention matrices need the same tokens on
both sides; neither holds here, so the adapter records no attention. What it offers is the feature layer the
classifier reads: the last stage's output tokens ``(B, [CLS +] h·w, C)``, the input of the final norm (the counterpart
of a CNN's final feature map), on the last stage's grid.

Input sizes: the model's relative position tables are built for its ``img_size``; smaller inputs run (the tables
are indexed for the smaller grid), larger ones index past them, so :meth:`TimmMViTAdapter.check_input` refuses a
token grid larger than the one the model was built for (and, with absolute position embeddings, any other size).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from ..errors import InputError, UnsupportedModelError
from ._stages import conv_output_size
from .base import Adapter, BlockRecord, Recording, int_pair
from .capabilities import (ATTENTION, BLOCK_IO, CLASS_ATTENTION, CLASS_LOGITS, FEATURE_MAPS, FEATURES, LRP_LINEARS,
                           PIXEL_LOGITS, STAGES, TOKEN_GRID, TOKEN_SEQUENCE, TOKENS, WINDOWS)
from .feature_maps import feature_maps_reason

__all__ = ["TimmMViTAdapter"]

_POOLING = ("MViTv2's pooling attention pools each block's queries (a 3×3 depthwise convolution, strided at stage "
            "transitions, so a block's output has fewer tokens than its input), keys and values (strided depthwise "
            "convolutions), adds the pooled queries to the attention output (residual pooling) and max-pools the "
            "residual path at stage transitions; vitlens' relevance rules need an identity skip on the block's own "
            "tokens and at most one key-reduction convolution per block, and products of attention matrices the same "
            "tokens on both sides, so no attention is recorded")
_NOTES = {
    ATTENTION: _POOLING, BLOCK_IO: _POOLING, TOKEN_SEQUENCE: _POOLING, LRP_LINEARS: _POOLING, STAGES: _POOLING,
    WINDOWS: _POOLING, CLASS_ATTENTION: _POOLING,
    TOKENS: "its query pooling and relative position tables are built for the full token grid: tokens cannot be "
            "dropped",
    PIXEL_LOGITS: "the model outputs class logits (B, K), not per-pixel logits",
}


class TimmMViTAdapter(Adapter):
    """timm ``MultiScaleVit`` (MViTv2): class logits and one feature layer, the last stage's tokens."""

    #: the wrapped model; typed ``Any`` because the family's submodules are reached by attribute
    model: Any

    family = "timm-mvitv2"
    capabilities = frozenset({CLASS_LOGITS, FEATURES, TOKEN_GRID})
    capability_notes = _NOTES

    @staticmethod
    def matches(model: nn.Module) -> bool:
        return (type(model).__name__ == "MultiScaleVit" and type(model).__module__.startswith("timm.")
                and hasattr(model, "stages") and hasattr(model, "patch_embed"))

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        m = self.model
        if m.global_pool not in ("avg", "token"):
            raise UnsupportedModelError(f"global_pool={m.global_pool!r}: the model outputs its tokens, not class "
                                        "logits")
        self.embed: nn.Conv2d = m.patch_embed.proj
        self.num_classes = int(m.num_classes)
        self.in_chans = int(self.embed.in_channels)
        self.num_prefix_tokens = int(m.num_prefix_tokens)
        self.readout_tokens = (0,) if m.global_pool == "token" else None
        self.patch_size = int_pair(self.embed.stride)
        self.pools = [b.attn.pool_q for st in m.stages for b in st.blocks if b.attn.pool_q is not None]
        if any(not isinstance(p, nn.Conv2d) for p in self.pools):
            raise UnsupportedModelError("MViTv2 query pooling that is not a convolution (mode='avg'/'max')")
        first = m.stages[0].blocks[0].attn
        self.built = self._built_grid(first)
        self.exact = m.pos_embed is not None  # absolute position embeddings: the built size only
        self.size = (self.built[0] * self.patch_size[0], self.built[1] * self.patch_size[1])
        self.default_size = self.size
        self._maps_reason = feature_maps_reason(m, self.size)

    def _built_grid(self, attn: nn.Module) -> tuple[int, int]:
        """The patch grid the model was built for: from its absolute position embedding, else from the first
        block's relative position table (``2·n − 1`` rows for an ``n × n`` grid)."""
        pos = self.model.pos_embed
        if pos is not None:
            n = int(round((pos.shape[1] - self.num_prefix_tokens) ** 0.5))
            return n, n
        table = getattr(attn, "rel_pos_h", None)
        if table is None:
            raise UnsupportedModelError("MViTv2 without position embeddings or relative position tables")
        n = (int(table.shape[0]) + 1) // 2
        return n, n

    def lacking(self, capability: str) -> str:
        if capability == FEATURE_MAPS:
            return self._maps_reason or "its timm feature_info modules output token blocks, not (B, C, h, w) maps"
        return super().lacking(capability)

    def grid(self, input_hw: tuple[int, int]) -> tuple[int, int]:
        """The patch grid (the first stage's tokens): ``⌈H/4⌉ × ⌈W/4⌉`` for the 7×7, stride-4 embedding."""
        return conv_output_size(self.embed, int_pair(input_hw))

    def feature_grid(self, input_hw: tuple[int, int]) -> tuple[int, int]:
        """The last stage's grid, after every query pooling."""
        hw = self.grid(input_hw)
        for conv in self.pools:
            hw = conv_output_size(conv, hw)
        return hw

    def blocks(self) -> list[nn.Module]:
        return [b for st in self.model.stages for b in st.blocks]

    def feature_layers(self) -> list[nn.Module]:
        """One feature layer (``layer`` 0 or −1): the final norm, whose input is the last stage's output."""
        return [self.model.norm]

    def check_input(self, x: Tensor) -> None:
        if x.shape[1] != self.in_chans:
            raise InputError(f"model expects {self.in_chans} input channels; got a batch with {x.shape[1]}")
        hw, (gh, gw), (bh, bw) = int_pair(x.shape[-2:]), self.grid(int_pair(x.shape[-2:])), self.built
        if (self.exact and (gh, gw) != (bh, bw)) or gh > bh or gw > bw:
            what = "its absolute position embedding is" if self.exact else "its relative position tables are"
            bound = "" if self.exact else " or smaller"
            raise InputError(f"MultiScaleVit expects {self.size[0]}x{self.size[1]} inputs{bound}; got "
                             f"{hw[0]}x{hw[1]} ({what} built for a {bh}x{bw} token grid)")

    def _install_capture(self, rec: Recording, hooks: list) -> None:
        rec.blocks.append(BlockRecord())

        def hook(module: nn.Module, args: tuple) -> Any:
            # a leaf: the backward stops here (only the final norm and the head are differentiated)
            u = args[0].detach().requires_grad_(True)
            rec.blocks[0].u = u
            return (u, *args[1:])

        hooks.append(self.model.norm.register_forward_pre_hook(hook))
