"""Adapters for Hiera image classifiers (timm ``Hiera``, transformers ``HieraForImageClassification``): the final
tokens for class-activation maps; the mask-unit attention is not propagated, and the capability notes say why.

Hiera embeds the image with a 7×7, stride-4 convolution, adds an absolute position embedding and *unrolls* the token
grid: the tokens are reordered so that every query-pooling step is a max over contiguous slices and every mask unit
(an ``8×8`` patch window at 224 px) is a contiguous run. Its blocks attend within mask units (global attention in the
later stages); the first block of each pooling stage max-pools its queries over the ``2×2`` query stride (so its
output has a quarter of the tokens it reads) and replaces the identity skip by a pooled one (the same max over a
linear map of the normed input; without the expansion projection, the max and the mean over the stride side by
side). The relevance rules vitlens implements need an identity skip on a block's own tokens, and products of
attention matrices the same tokens on both sides, so no attention is recorded.

What the adapters offer is the feature layer the classifier reads: the last block's output ``(B, h·w, C)``, the input
of the mean-pooling head (timm ``head``, HF ``hiera.pooler``), on the last stage's grid. That output is still in the
model's unrolled order where not every unroll was consumed by a pooling (``q_pool`` < stages − 1); the capture puts
the tokens in raster order on the grid with the model's own re-roll (the head's mean does not depend on the order,
and the forward is fed the same values in the model's order, so it is unchanged).

Input sizes: the position embedding and the unroll are built for the model's ``img_size``; other sizes are refused
with the model's reason (:meth:`_HieraAdapter.check_input`).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import Tensor, nn

from ..errors import InputError, UnsupportedModelError
from ._stages import conv_output_size
from .base import Adapter, BlockRecord, Recording, int_pair, logits_of, switched
from .capabilities import (ATTENTION, BLOCK_IO, CLASS_ATTENTION, CLASS_LOGITS, FEATURE_MAPS, FEATURES, LINEAR_HEAD,
                           LRP_LINEARS, LRP_VARIANT_LINEARS, PIXEL_LOGITS, STAGES, TOKEN_GRID, TOKEN_SEQUENCE, TOKENS,
                           WINDOWS)
from .feature_maps import feature_maps_reason

__all__ = ["TimmHieraAdapter", "HFHieraAdapter"]

_MASK_UNITS = ("Hiera's mask-unit attention attends within mask units of its unrolled token order, and the first "
               "block of each pooling stage max-pools its queries over the query stride (so the block outputs fewer "
               "tokens than it reads) and replaces the identity skip by a pooled, widened one (a max over the stride "
               "of a linear map of the normed input; without the expansion projection, the max and the mean over the "
               "stride side by side); vitlens' relevance rules need an identity skip on the "
               "block's own tokens, and products of attention matrices the same tokens on both sides, so no "
               "attention is recorded")
_NOTES = {
    c: _MASK_UNITS for c in (ATTENTION, BLOCK_IO, TOKEN_SEQUENCE, LRP_LINEARS, LRP_VARIANT_LINEARS, LINEAR_HEAD,
                             STAGES, WINDOWS)
}
_NOTES.update({
    CLASS_ATTENTION: "it has no class token: the classifier reads the mean of the last stage's tokens",
    TOKENS: "its unroll, mask units and query pooling are built for the full token grid: tokens cannot be dropped",
    PIXEL_LOGITS: "the model outputs class logits (B, K), not per-pixel logits",
})


class _HieraAdapter(Adapter):
    """What the timm and HF Hiera adapters share: one feature layer (the head's input, in raster order on the last
    stage's grid), the input-size check, the capture. Subclasses set :attr:`embed`, :attr:`head_input` (the module
    whose input is the last block's output), :attr:`built` (the patch grid of ``img_size``), :attr:`q_stride`,
    :attr:`q_pool` and :attr:`_reroll` (the model's re-roll of the last block's output to ``(B, h, w, C)``)."""

    #: the wrapped model; typed ``Any`` because the family's submodules are reached by attribute
    model: Any

    capabilities = frozenset({CLASS_LOGITS, FEATURES, TOKEN_GRID})
    capability_notes = _NOTES
    embed: nn.Conv2d
    head_input: nn.Module
    built: tuple[int, int]
    q_stride: tuple[int, int]
    q_pool: int
    _reroll: Callable[[Tensor], Tensor]
    #: what ties the model to its ``img_size`` (the refusal of other sizes quotes it)
    _size_why = "its absolute position embedding and its token unroll are"

    @staticmethod
    def _embedding(conv: Any) -> nn.Conv2d:
        """The patch-embedding convolution, checked to be 2-d (Hiera also builds video models with a 3-d one)."""
        if not isinstance(conv, nn.Conv2d):
            raise UnsupportedModelError(f"Hiera with a {type(conv).__name__} patch embedding (a video model): vitlens "
                                        "explains 2-d images")
        return conv

    def _finish(self) -> None:
        """Checks and derived attributes, once the subclass has set the family's modules."""
        self.patch_size = int_pair(self.embed.stride)
        self.size = (self.built[0] * self.patch_size[0], self.built[1] * self.patch_size[1])
        self.default_size = self.size
        self.any_size = False
        fh, fw = self.feature_grid(self.size)
        idx = torch.arange(fh * fw).view(1, fh * fw, 1)
        order = self._reroll(idx)  # (1, h, w, 1): the unrolled index of the token at each grid cell
        self._order = order.reshape(-1).clone()
        self._inverse = torch.argsort(self._order)

    def lacking(self, capability: str) -> str:
        if capability == FEATURE_MAPS:
            reason = feature_maps_reason(self.model, self.size)
            order = "its blocks output tokens in Hiera's unrolled mask-unit order"
            return f"{reason} ({order})" if reason else f"{order}, not (B, C, h, w) maps"
        return super().lacking(capability)

    def grid(self, input_hw: tuple[int, int]) -> tuple[int, int]:
        """The patch grid (the first stage's tokens): ``⌈H/4⌉ × ⌈W/4⌉`` for the 7×7, stride-4, padding-3
        embedding."""
        return conv_output_size(self.embed, int_pair(input_hw))

    def feature_grid(self, input_hw: tuple[int, int]) -> tuple[int, int]:
        """The last stage's grid: the patch grid divided by the query stride once per pooling stage."""
        gh, gw = self.grid(input_hw)
        return gh // self.q_stride[0] ** self.q_pool, gw // self.q_stride[1] ** self.q_pool

    def feature_layers(self) -> list[nn.Module]:
        """One feature layer (``layer`` 0 or −1): the last block's output, as the mean-pooling head reads it."""
        return [self.head_input]

    def check_input(self, x: Tensor) -> None:
        if x.shape[1] != self.in_chans:
            raise InputError(f"model expects {self.in_chans} input channels; got a batch with {x.shape[1]}")
        hw = int_pair(x.shape[-2:])
        if hw == self.size:
            return
        bh, bw = self.built
        reason = f"{self._size_why} built for the {bh}x{bw} token grid of that size"
        try:  # the model's own words, from a forward in eval mode
            with torch.no_grad(), switched(list(self.model.modules()), "training", False):
                self._forward(x[:1].detach())
        except (RuntimeError, ValueError, AssertionError) as e:
            reason += f"; the model refuses it: {str(e).splitlines()[0][:200]}"
        raise InputError(f"{type(self.model).__name__} expects {self.size[0]}x{self.size[1]} inputs; got "
                         f"{hw[0]}x{hw[1]} ({reason})")

    def _install_capture(self, rec: Recording, hooks: list) -> None:
        rec.blocks.append(BlockRecord())
        order, inverse = self._order, self._inverse

        def hook(module: nn.Module, args: tuple) -> Any:
            x = args[0]
            if x.shape[1] != order.numel():
                raise UnsupportedModelError(f"the last Hiera block output {x.shape[1]} tokens, not the "
                                            f"{order.numel()} of the last stage's grid (masked forward?)")
            # a leaf in raster order on the grid: the backward stops here (only the head is differentiated)
            u = x.detach()[:, order.to(x.device)].requires_grad_(True)
            rec.blocks[0].u = u
            return (u[:, inverse.to(x.device)], *args[1:])

        hooks.append(self.head_input.register_forward_pre_hook(hook))


class TimmHieraAdapter(_HieraAdapter):
    """timm ``Hiera``: class logits and one feature layer, the last block's output (the head's input)."""

    family = "timm-hiera"

    @staticmethod
    def matches(model: nn.Module) -> bool:
        return (type(model).__name__ == "Hiera" and type(model).__module__.startswith("timm.")
                and hasattr(model, "blocks") and hasattr(model, "patch_embed") and hasattr(model, "reroll"))

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        m = self.model
        if getattr(m.head, "pool_type", "avg") == "":
            raise UnsupportedModelError("global_pool='': the model outputs its tokens, not class logits")
        self.embed = self._embedding(m.patch_embed.proj)
        self.head_input = m.head
        self.num_classes = int(m.num_classes)
        self.in_chans = int(self.embed.in_channels)
        self.built = int_pair(tuple(m.tokens_spatial_shape))
        self.q_stride, self.q_pool = int_pair(tuple(m.q_stride)), int(m.q_pool)
        last = len(m.blocks) - 1
        self._reroll = lambda t: m.reroll(t, last)
        self._finish()


class HFHieraAdapter(_HieraAdapter):
    """transformers ``HieraForImageClassification``: class logits and one feature layer, the last layer's output
    (the pooler's input)."""

    family = "hf-hiera"
    _size_why = "its absolute position embedding (not interpolated) is"

    @staticmethod
    def matches(model: nn.Module) -> bool:
        return (type(model).__name__ == "HieraForImageClassification" and hasattr(model, "config")
                and hasattr(getattr(model, "hiera", None), "encoder"))

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        m, cfg = self.model, self.model.config
        if m.hiera.pooler is None:
            raise UnsupportedModelError("HieraModel without its pooling layer: no class logits")
        self.embed = self._embedding(m.hiera.embeddings.patch_embeddings.projection)
        self.head_input = m.hiera.pooler
        self.num_classes = int(cfg.num_labels)
        self.in_chans = int(cfg.num_channels)
        stride = int_pair(tuple(cfg.patch_stride))
        self.built = (int(cfg.image_size[0]) // stride[0], int(cfg.image_size[1]) // stride[1])
        if math.prod(self.built) != int(m.hiera.embeddings.position_embeddings.shape[1]):
            raise UnsupportedModelError("HieraForImageClassification whose position embedding does not match its "
                                        "image_size")
        self.q_stride, self.q_pool = int_pair(tuple(cfg.query_stride)), int(cfg.num_query_pool)
        encoder, last = m.hiera.encoder, len(cfg.depths) - 1
        self._reroll = lambda t: encoder.reroll(t, stage_idx=last)
        self._finish()

    def _forward(self, x: Tensor) -> Tensor:
        return logits_of(self.model(pixel_values=x))
