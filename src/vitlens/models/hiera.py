"""Adapters for Hiera image classifiers (timm ``Hiera``, transformers ``HieraForImageClassification``): the mask-unit
attention and pooling blocks recorded for GradSkip's mask-unit path, and the final tokens for class-activation maps.

Hiera embeds the image with a 7×7, stride-4 convolution, adds an absolute position embedding and *unrolls* the token
grid: the tokens are reordered so that every query-pooling step is a max over contiguous slices and every mask unit
(an ``8×8`` patch window at 224 px) is a strided set of the sequence. Its blocks attend within mask units (global
attention in the later stages); the first block of each pooling stage max-pools its queries over the ``2×2`` query
stride (so its output has a quarter of the tokens it reads) and replaces the identity skip by a pooled one (the same
max over a linear map of the normed input; without the expansion projection, the max and the mean over the stride
side by side).

What a capture session records (:class:`HieraRecording`), per block in forward order (:class:`HieraBlockRecord`):
``u`` (block input ``(B, T, C)``, in the graph; block 0's a fresh leaf), ``qkv`` (the attention's fused projection
output ``(B, T, 3C')``, detached: the probabilities are recomputed from it), ``out`` (the attention output before its
projection ``(B, T', C')``, in the graph: ``∂y/∂A = ∂y/∂out · vᵀ``), ``h`` (the stream after the attention residual
``(B, T', C')``, in the graph), ``skip_in`` (the pooling block's max-pool input ``W·LN(u)`` ``(B, T, C')``, or ``u``
itself without the expansion projection, detached) and the layout (heads, flattened query stride, number of mask
units; 1 = global attention). ``final`` is the last block's output as the head reads it (model order);
``features`` the same tokens in raster order on the last stage's grid. :meth:`_HieraAdapter.patch_order` gives the
unrolled index of every cell of the patch grid. How GradSkip propagates through it: ``docs/methods/gradskip.md``
(Hiera).

What the feature layer offers (Grad-CAM): the last block's output ``(B, h·w, C)``, the input of the mean-pooling head
(timm ``head``, HF ``hiera.pooler``), on the last stage's grid. That output is still in the model's unrolled order
where not every unroll was consumed by a pooling (``q_pool`` < stages − 1); the capture puts the tokens in raster
order on the grid with the model's own re-roll (the head's mean does not depend on the order, and the forward is fed
the same values in the model's order, so it is unchanged).

Input sizes: the position embedding and the unroll are built for the model's ``img_size``; other sizes are refused
with the model's reason (:meth:`_HieraAdapter.check_input`).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import Tensor, nn

from ..errors import InputError, UnsupportedModelError
from ._stages import conv_output_size
from .base import Adapter, BlockRecord, Recording, int_pair, logits_of, switched
from .capabilities import (ATTENTION, BLOCK_IO, CLASS_ATTENTION, CLASS_LOGITS, FEATURE_MAPS, FEATURES, LINEAR_HEAD,
                           LRP_LINEARS, LRP_VARIANT_LINEARS, MASK_UNITS, PIXEL_LOGITS, STAGES, TOKEN_GRID,
                           TOKEN_SEQUENCE, TOKENS, WINDOWS)
from .feature_maps import feature_maps_reason

__all__ = ["TimmHieraAdapter", "HFHieraAdapter", "HieraBlockRecord", "HieraRecording"]

_POOLING = ("first block of each pooling stage max-pools its queries over the query stride (its attention maps "
            "the tokens it reads to fewer pooled queries, a quarter for the 2x2 stride) and replaces the identity "
            "skip by a max-pooled projection of the normed input (without the expansion projection, the max and the "
            "mean over the stride side by side), and its blocks attend within mask units of its unrolled token order")
_PRODUCTS = (f"Hiera's {_POOLING}: products of attention matrices (rollout, GAE, attention Grad-CAM's one sequence) "
             "need square attention on the same tokens in successive blocks and an identity skip, which a pooling "
             "block has neither of (GradSkip's mask-unit path hands the relevance back through the max instead)")
_LRP = (f"Hiera's {_POOLING}: vitlens' LRP rules need plain pre-norm blocks on one token sequence with an identity "
        "skip and a declared linear head on the final tokens")
_NOTES = {c: _PRODUCTS for c in (TOKEN_SEQUENCE, WINDOWS, STAGES)}
_STREAM = (f"Hiera's {_POOLING}: there is no residual stream of the same tokens through every block to read block "
           "by block")
_NOTES.update({c: _LRP for c in (LRP_LINEARS, LRP_VARIANT_LINEARS, LINEAR_HEAD)})
_NOTES[BLOCK_IO] = _STREAM
_NOTES.update({
    CLASS_ATTENTION: "it has no class token: the classifier reads the mean of the last stage's tokens",
    TOKENS: "its unroll, mask units and query pooling are built for the full token grid: tokens cannot be dropped",
    PIXEL_LOGITS: "the model outputs class logits (B, K), not per-pixel logits",
})


@dataclass
class HieraBlockRecord(BlockRecord):
    """One Hiera block (module docstring): :class:`BlockRecord`'s ``u``, ``h``, ``out`` plus the detached ``qkv``
    and pooling input ``skip_in`` and the block's layout."""

    qkv: Tensor | None = None
    skip_in: Tensor | None = None
    heads: int = 1
    #: flattened query stride (1: the block does not pool)
    q_stride: int = 1
    #: number of mask units the attention runs in (1: global attention)
    windows: int = 1
    #: the pooled skip: ``"proj"`` (max over ``W·LN(u)``), ``"cat"`` (max and mean of ``u`` side by side), ``""``
    #: (identity skip)
    skip: str = ""


@dataclass
class HieraRecording(Recording):
    """Blocks in forward order; ``final``: the head's input (model order); ``features``: it in raster order."""

    features: list[Tensor] = field(default_factory=list)


class _HieraAdapter(Adapter):
    """What the timm and HF Hiera adapters share: one feature layer (the head's input, in raster order on the last
    stage's grid), the input-size check, the capture of every block (module docstring). Subclasses set
    :attr:`embed`, :attr:`head_input` (the module whose input is the last block's output), :attr:`built` (the patch
    grid of ``img_size``), :attr:`q_stride`, :attr:`q_pool`, :attr:`_reroll` (the model's re-roll of the last block's
    output to ``(B, h, w, C)``), :attr:`_reroll_first` (the same for block 0's input) and :attr:`_blocks`, and
    implement :meth:`_parts`."""

    #: the wrapped model; typed ``Any`` because the family's submodules are reached by attribute
    model: Any

    capabilities = frozenset({CLASS_LOGITS, FEATURES, TOKEN_GRID, ATTENTION, MASK_UNITS})
    capability_notes = _NOTES
    embed: nn.Conv2d
    head_input: nn.Module
    built: tuple[int, int]
    q_stride: tuple[int, int]
    q_pool: int
    _reroll: Callable[[Tensor], Tensor]
    _reroll_first: Callable[[Tensor], Tensor]
    _blocks: list[nn.Module]
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
        gh, gw = self.built
        first = self._reroll_first(torch.arange(gh * gw).view(1, gh * gw, 1))
        self._patch_order = first.reshape(-1).clone()
        for i, blk in enumerate(self._blocks):
            self._parts(blk, i)  # checks every block's layout now, not in the middle of a forward

    def _parts(self, blk: Any, index: int) -> dict[str, Any]:
        """Block ``index``'s modules and layout: ``attn`` (the attention module), ``qkv``, ``proj`` (its fused
        projections), ``h_site`` (the module whose input is the stream after the attention residual), ``skip``
        (``"proj"``, ``"cat"`` or ``""``), ``skip_proj`` (the skip's linear map or ``None``), ``heads``,
        ``q_stride`` (flattened), ``window`` (tokens per mask unit after pooling), ``mask_units`` (bool)."""
        raise NotImplementedError

    def blocks(self) -> Sequence[nn.Module]:
        return list(self._blocks)

    def patch_order(self) -> Tensor:
        """``(gh·gw,)``: the index in block 0's (unrolled) token order of every cell of the patch grid, row-major
        (``relevance[:, patch_order()]`` puts block-0 relevance on the grid)."""
        return self._patch_order

    def _new_recording(self) -> HieraRecording:
        return HieraRecording()

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
        assert isinstance(rec, HieraRecording)
        for i, blk in enumerate(self._blocks):
            parts = self._parts(blk, i)
            brec = HieraBlockRecord(heads=parts["heads"], q_stride=parts["q_stride"], skip=parts["skip"])
            rec.blocks.append(brec)
            hooks.append(blk.register_forward_pre_hook(self._leaf_first_block_hook(rec, i), with_kwargs=True))
            hooks.append(parts["qkv"].register_forward_hook(_qkv_hook(brec, parts)))
            hooks.append(parts["proj"].register_forward_pre_hook(_keep_input(brec, "out")))
            hooks.append(parts["h_site"].register_forward_pre_hook(_keep_input(brec, "h")))
            if parts["skip_proj"] is not None:
                hooks.append(parts["skip_proj"].register_forward_hook(_skip_hook(brec)))
        order, inverse = self._order, self._inverse

        def hook(module: nn.Module, args: tuple) -> Any:
            x = args[0]
            if x.shape[1] != order.numel():
                raise UnsupportedModelError(f"the last Hiera block output {x.shape[1]} tokens, not the "
                                            f"{order.numel()} of the last stage's grid (masked forward?)")
            rec.final = x
            # raster order on the grid, in the graph; the head reads the same values in the model's order
            u = x[:, order.to(x.device)]
            rec.features = [u]
            return (u[:, inverse.to(x.device)], *args[1:])

        hooks.append(self.head_input.register_forward_pre_hook(hook))


def _keep_input(brec: HieraBlockRecord, name: str) -> Callable:
    def hook(module: nn.Module, args: tuple) -> None:
        setattr(brec, name, args[0])

    return hook


def _qkv_hook(brec: HieraBlockRecord, parts: dict[str, Any]) -> Callable:
    def hook(module: nn.Module, args: tuple, out: Tensor) -> None:
        n = int(out.shape[1])
        brec.qkv = out.detach()
        brec.windows = n // (parts["q_stride"] * parts["window"]) if parts["mask_units"] else 1
        if brec.skip == "cat":  # the max and the mean of the (un-normed) block input side by side
            brec.skip_in = None if brec.u is None else brec.u.detach()

    return hook


def _skip_hook(brec: HieraBlockRecord) -> Callable:
    def hook(module: nn.Module, args: tuple, out: Tensor) -> None:
        brec.skip_in = out.detach()

    return hook


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
        self._reroll_first = lambda t: m.reroll(t, 0)
        self._blocks = list(m.blocks)
        self._finish()

    def _parts(self, blk: Any, index: int) -> dict[str, Any]:
        att: Any = getattr(blk, "attn", None)
        if type(blk).__name__ != "HieraBlock" or type(att).__name__ != "MaskUnitAttention" or not all(
                isinstance(getattr(att, n, None), nn.Linear) for n in ("qkv", "proj")):
            raise UnsupportedModelError(f"Hiera block {index} ({type(blk).__name__}) is not a timm HieraBlock with "
                                        "MaskUnitAttention")
        skip = "" if not blk.do_expand else "proj" if blk.proj is not None else "cat"
        return {"attn": att, "qkv": att.qkv, "proj": att.proj, "h_site": blk.norm2, "skip": skip,
                "skip_proj": blk.proj if skip == "proj" else None, "heads": int(att.heads),
                "q_stride": int(att.q_stride), "window": int(att.window_size),
                "mask_units": bool(att.use_mask_unit_attn)}

    @contextlib.contextmanager
    def _explicit_attention(self) -> Iterator[None]:
        with switched([blk.attn for blk in self._blocks], "fused_attn", False):
            yield

    def recomputes_attention(self) -> bool:
        """Yes: the recording holds ``qkv`` and the attention output whichever path runs, and GradSkip's mask-unit
        path recomputes the probabilities from them, so a ``recompute`` session keeps timm's fused attention."""
        return True


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
        self._reroll_first = lambda t: encoder.reroll(t, stage_idx=0)
        self._blocks = [layer for stage in encoder.stages for layer in stage.layers]
        self._finish()

    def _parts(self, blk: Any, index: int) -> dict[str, Any]:
        att: Any = getattr(blk, "attn", None)
        if type(blk).__name__ != "HieraLayer" or type(att).__name__ != "HieraMaskUnitAttention" or not all(
                isinstance(getattr(att, n, None), nn.Linear) for n in ("qkv", "proj")):
            raise UnsupportedModelError(f"Hiera layer {index} ({type(blk).__name__}) is not a transformers HieraLayer "
                                        "with HieraMaskUnitAttention")
        pooled = int(blk.hidden_size) != int(blk.hidden_size_output)
        return {"attn": att, "qkv": att.qkv, "proj": att.proj, "h_site": blk.layernorm_after,
                "skip": "proj" if pooled else "", "skip_proj": blk.proj if pooled else None,
                "heads": int(att.num_heads), "q_stride": int(att.query_stride), "window": int(att.window_size),
                "mask_units": bool(att.use_mask_unit_attn)}

    def _forward(self, x: Tensor) -> Tensor:
        return logits_of(self.model(pixel_values=x))
