"""Adapters for PVTv2 image classifiers: timm ``PyramidVisionTransformerV2`` and transformers
``PvtV2ForImageClassification``.

PVTv2 is built like SegFormer's encoder (Mix Transformer): ``S`` hierarchical stages; stage ``s`` embeds the previous
stage's output (the image for stage 1) with an overlapping strided convolution onto a coarser token grid (7×7 stride 4,
then 3×3 stride 2, each followed by a LayerNorm), runs pre-norm blocks whose attention takes its keys and values
from a spatially reduced grid (an ``r×r``, stride-``r`` convolution and a LayerNorm, ``r`` = the stage's
``sr_ratio``; none when ``r = 1``) and a Mix-FFN with a 3×3 depthwise convolution, and ends with a LayerNorm. Unlike
SegFormer's decode head, the classifier reads **one** stage: the mean over the last stage's tokens, then a linear
map. So a capture session records the same :class:`~vitlens.models._stages.StageRecording` as SegFormer, with one
readout (the last stage's output, its own graph node, so its gradient is the head's) and no key/value reduction in
stages with ``r = 1``; the hierarchical relevance path of SegFormer reads it unchanged.

The token grid is stage 1's (``⌈H/4⌉ × ⌈W/4⌉``); :attr:`patch_size` is that embedding's stride (4×4 pixels per
token, the cell a pixel-level map is pooled onto; each token's 7×7 kernel overlaps its neighbours' cells).

Features (the ``"features"`` capability): one feature layer, the last stage's output as the classifier pools it,
``(B, h_S·w_S, C_S)`` in token layout (row-major, no prefix tokens) on the last stage's grid (:meth:`feature_grid`).

Not read (the generic adapter takes the model, with the reason): the "linear" variants (``pvt_v2_b2_li``,
``linear_attention=True``), whose keys come from an adaptive average pooling to 7×7 and a GELU, not from a
stride-``r`` convolution; a timm model built without the average-pool head (``global_pool=''``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence, cast

from torch import Tensor, nn

from ..errors import UnsupportedModelError
from ._stages import (StageBlockRecord, StageRecord, StageRecording, check_stage_input, conv_hook, residual_input_hook,
                      stage_grids)
from .base import Adapter, Recording, int_pair, logits_of, switched
from .capabilities import (ATTENTION, BLOCK_IO, CLASS_ATTENTION, CLASS_LOGITS, FEATURE_MAPS, FEATURES, LRP_LINEARS,
                           PIXEL_LOGITS, STAGES, TOKEN_GRID, TOKEN_SEQUENCE, TOKENS, WINDOWS)
from .feature_maps import feature_maps_reason

__all__ = ["TimmPvtV2Adapter", "HFPvtV2Adapter"]

_NO_SEQUENCE = ("every stage has its own token grid, its attention maps the stage's T_s tokens onto the T_s/r² keys "
                "of a spatially reduced grid (not a square token-to-token matrix, so the attention of successive "
                "blocks cannot be multiplied) and an overlapping patch-embedding convolution joins the stages: there "
                "is no single sequence of block inputs, outputs and attention rows")
_NOTES = {
    TOKEN_SEQUENCE: _NO_SEQUENCE, BLOCK_IO: _NO_SEQUENCE, LRP_LINEARS: _NO_SEQUENCE,
    WINDOWS: "its attention is global over spatially reduced keys, not windowed",
    CLASS_ATTENTION: "it has no class token: the classifier reads the mean of the last stage's tokens",
    TOKENS: "each stage embeds the previous stage's grid with an overlapping convolution: tokens cannot be dropped",
    PIXEL_LOGITS: "the model outputs class logits (B, K), not per-pixel logits",
}
_LINEAR = ("its linear spatial-reduction attention takes keys from an adaptive 7×7 average pooling and a GELU, not "
           "from an r×r, stride-r convolution (the key hand-back rule vitlens implements)")


@dataclass(frozen=True)
class _Block:
    """What the capture reads of one block: the block, the norm before its MLP (its input is ``h``), the attention
    dropout (its output: the probabilities), the linear map whose output holds the values (``value_half``: the
    second half of a fused key/value map), the key/value reduction convolution (``None`` when ``r = 1``)."""

    block: nn.Module
    norm2: nn.Module
    attn_drop: nn.Module
    value: nn.Linear
    value_half: bool
    heads: int
    reduction: nn.Conv2d | None


@dataclass(frozen=True)
class _Stage:
    """One stage: the convolution that embeds its tokens, its blocks, and the module whose output is the stage
    output (timm: the stage, ``(B, C, h, w)``; transformers: the encoder layer, ``((tokens,), h, w)``)."""

    embed: nn.Conv2d
    blocks: tuple[_Block, ...]
    out: nn.Module


class _PvtV2Adapter(Adapter):
    """What the timm and HF PVTv2 adapters share: layout, input checks, the capture session. Subclasses read the
    model into :attr:`layout` (a :class:`_Stage` per stage) and say how a stage's output holds its tokens."""

    model: Any
    capabilities = frozenset({CLASS_LOGITS, ATTENTION, STAGES, FEATURES, TOKEN_GRID})
    capability_notes = {**_NOTES, FEATURE_MAPS: "the model has no timm feature_info to read multi-depth features from"}
    layout: list[_Stage]

    def _check_layout(self) -> None:
        for s, st in enumerate(self.layout):
            if st.embed.groups != 1 or isinstance(st.embed.padding, str):
                raise UnsupportedModelError(f"PVTv2 stage {s + 1} has no plain patch-embedding convolution")
            if not st.blocks:
                raise UnsupportedModelError(f"PVTv2 stage {s + 1} has no blocks")
            for j, blk in enumerate(st.blocks):
                red = blk.reduction
                if red is not None and (red.groups != 1 or red.kernel_size != red.stride or red.padding != (0, 0)):
                    raise UnsupportedModelError(
                        f"PVTv2 stage {s + 1} block {j}: the key reduction is not an r×r, stride-r convolution")

    # -- layout --------------------------------------------------------------------------------------------------
    def stage_grids(self, input_hw: tuple[int, int]) -> list[tuple[int, int]]:
        """Token grid ``(h_s, w_s)`` of every stage for an input of size ``input_hw``."""
        return stage_grids([st.embed for st in self.layout], input_hw)

    def grid(self, input_hw: tuple[int, int]) -> tuple[int, int]:
        """The finest (stage-1) token grid, where the token maps of relevance propagation live (``⌈H/4⌉ × ⌈W/4⌉``
        for the 7×7, stride-4 stage-1 embedding)."""
        return self.stage_grids(input_hw)[0]

    def feature_grid(self, input_hw: tuple[int, int]) -> tuple[int, int]:
        """The last stage's grid, where the feature layer's tokens are."""
        return self.stage_grids(input_hw)[-1]

    def blocks(self) -> Sequence[nn.Module]:
        return [blk.block for st in self.layout for blk in st.blocks]

    def feature_layers(self) -> list[nn.Module]:
        """One feature layer (``layer`` 0 or −1): the last stage, whose output the classifier pools."""
        return [self.layout[-1].out]

    def check_input(self, x: Tensor) -> None:
        grids = self.stage_grids(int_pair(x.shape[-2:]))
        check_stage_input(x, self.in_chans, "PVTv2", grids, [st.blocks[0].reduction for st in self.layout])

    # -- running -------------------------------------------------------------------------------------------------
    def _new_recording(self) -> StageRecording:
        return StageRecording("PVTv2", _NO_SEQUENCE)

    def _stage_tokens(self, out: Any) -> tuple[Tensor, Callable[[Tensor], Any]]:
        """A stage output's tokens ``(B, T, C)`` and how to rebuild the output from (a graph node of) them."""
        raise NotImplementedError

    def _install_capture(self, rec: Recording, hooks: list) -> None:
        record = cast(StageRecording, rec)  # what _new_recording made (the base types it as Recording)
        last = len(self.layout) - 1
        for s, st in enumerate(self.layout):
            srec = StageRecord()
            record.stages.append(srec)

            def embed_hook(module, args, output, srec=srec, merge=s > 0):
                srec.grid = (int(output.shape[-2]), int(output.shape[-1]))
                if merge:
                    conv_hook(srec, "merge")(module, args, output)

            hooks.append(st.embed.register_forward_hook(embed_hook))
            for j, blk in enumerate(st.blocks):
                brec = StageBlockRecord()
                srec.blocks.append(brec)
                self._capture_block(blk, brec, leaf=(s == 0 and j == 0), hooks=hooks)
            if s == last:
                hooks.append(st.out.register_forward_hook(self._readout_hook(record, srec)))

    def _readout_hook(self, record: StageRecording, srec: StageRecord):
        def hook(module, args, output):
            tokens, rebuild = self._stage_tokens(output)
            view = tokens.view_as(tokens)  # its own graph node: the gradient here is the classifier's
            srec.readout = view
            record.features = [view]
            return rebuild(view)

        return hook

    @staticmethod
    def _capture_block(blk: _Block, brec: StageBlockRecord, leaf: bool, hooks: list) -> None:
        hooks.append(blk.block.register_forward_pre_hook(residual_input_hook(brec, leaf=leaf), with_kwargs=True))

        def h_hook(module, args):
            brec.h = args[0]

        def attn_hook(module, args, output):
            brec.attn = output  # the softmax probabilities (dropout is the identity in eval mode)

        def value_hook(module, args, output):
            v = output[..., output.shape[-1] // 2:] if blk.value_half else output
            b, n, d = v.shape
            brec.value = v.detach().reshape(b, n, blk.heads, d // blk.heads).permute(0, 2, 1, 3)

        hooks.append(blk.norm2.register_forward_pre_hook(h_hook))
        hooks.append(blk.attn_drop.register_forward_hook(attn_hook))
        hooks.append(blk.value.register_forward_hook(value_hook))
        if blk.reduction is not None:
            hooks.append(blk.reduction.register_forward_hook(conv_hook(brec, "reduction")))


class TimmPvtV2Adapter(_PvtV2Adapter):
    """timm ``PyramidVisionTransformerV2`` (hierarchical stages, spatially reduced keys, mean-pooled last stage).
    Explicit attention (``fused_attn = False``) in sessions; features: the last stage's output."""

    family = "timm-pvt-v2"

    @staticmethod
    def matches(model: nn.Module) -> bool:
        return (type(model).__name__ == "PyramidVisionTransformerV2" and type(model).__module__.startswith("timm.")
                and hasattr(model, "stages") and hasattr(model, "patch_embed"))

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        m = self.model
        if m.global_pool != "avg":
            raise UnsupportedModelError(f"global_pool={m.global_pool!r}: the model outputs its last feature map, not "
                                        "class logits")
        self.num_classes = int(m.num_classes)
        self.in_chans = int(m.patch_embed.proj.in_channels)
        size = (getattr(m, "pretrained_cfg", None) or {}).get("input_size")
        self.default_size = (int(size[1]), int(size[2])) if size and len(size) == 3 else None
        layout = []
        for s, stage in enumerate(m.stages):
            embed = m.patch_embed.proj if s == 0 else stage.downsample.proj
            blocks = []
            for blk in stage.blocks:
                att = blk.attn
                if att.pool is not None:
                    raise UnsupportedModelError(_LINEAR)
                blocks.append(_Block(blk, blk.norm2, att.attn_drop, att.kv, True, int(att.num_heads), att.sr))
            layout.append(_Stage(embed, tuple(blocks), stage))
        self.layout = layout
        self._check_layout()
        self.patch_size = int_pair(layout[0].embed.stride)
        self._maps_reason = feature_maps_reason(m, self.default_size)
        if self._maps_reason is None:
            self.capabilities = self.capabilities | {FEATURE_MAPS}

    def lacking(self, capability: str) -> str:
        if capability == FEATURE_MAPS and self._maps_reason is not None:
            return self._maps_reason
        return super().lacking(capability)

    @contextlib.contextmanager
    def _explicit_attention(self) -> Iterator[None]:
        with switched([blk.block.attn for st in self.layout for blk in st.blocks], "fused_attn", False):
            yield

    def _stage_tokens(self, out: Any) -> tuple[Tensor, Callable[[Tensor], Any]]:
        b, c, h, w = out.shape  # (B, C, h, w)

        def rebuild(tokens: Tensor) -> Tensor:
            return tokens.transpose(1, 2).reshape(b, c, h, w)

        return out.flatten(2).transpose(1, 2), rebuild


class HFPvtV2Adapter(_PvtV2Adapter):
    """transformers ``PvtV2ForImageClassification`` (hierarchical stages, spatially reduced keys, mean-pooled last
    stage; its attention is always explicit). Features: the last stage's output."""

    family = "hf-pvt-v2"

    @staticmethod
    def matches(model: nn.Module) -> bool:
        return (type(model).__name__ == "PvtV2ForImageClassification" and hasattr(model, "config")
                and hasattr(getattr(getattr(model, "pvt_v2", None), "encoder", None), "layers"))

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        cfg = self.model.config
        if bool(getattr(cfg, "linear_attention", False)):
            raise UnsupportedModelError(_LINEAR)
        self.num_classes = int(cfg.num_labels)
        self.in_chans = int(cfg.num_channels)
        self.default_size = int_pair(cfg.image_size) if getattr(cfg, "image_size", None) else None
        layout = []
        for layer in self.model.pvt_v2.encoder.layers:
            blocks = []
            for blk in layer.blocks:
                att = blk.attention
                red = att.spatial_reduction if int(att.spatial_reduction_ratio) > 1 else None
                blocks.append(_Block(blk, blk.layer_norm_2, att.attn_drop, att.value, False,
                                     int(att.num_attention_heads), red))
            layout.append(_Stage(layer.patch_embedding.proj, tuple(blocks), layer))
        self.layout = layout
        self._check_layout()
        self.patch_size = int_pair(layout[0].embed.stride)

    def _forward(self, x: Tensor) -> Tensor:
        return logits_of(self.model(pixel_values=x))

    def _stage_tokens(self, out: Any) -> tuple[Tensor, Callable[[Tensor], Any]]:
        ok = isinstance(out, tuple) and len(out) == 3 and isinstance(out[0], tuple) and isinstance(out[0][0], Tensor)
        if not ok:
            raise UnsupportedModelError("a PvtV2 encoder layer returned no ((hidden_states, ...), height, width)")
        (hidden, *rest), h, w = out

        def rebuild(tokens: Tensor) -> Any:
            return (tokens, *rest), h, w

        return hidden, rebuild
