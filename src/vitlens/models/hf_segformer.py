"""Adapter for HuggingFace SegFormer semantic segmentation (``SegformerForSemanticSegmentation``, transformers ≥ 5).

SegFormer is not one token sequence: its encoder has ``S`` hierarchical stages (usually 4). Stage ``s`` embeds the
previous stage's output (the image for stage 1) with an overlapping strided convolution ("patch merging") onto a
coarser token grid, runs pre-norm blocks whose attention takes its keys and values from a spatially reduced grid
(a ``r×r``, stride-``r`` convolution, ``r`` = the stage's ``sr_ratio``; no reduction when ``r = 1``), and ends with a
LayerNorm. The all-MLP decode head reads **every** stage's output. So a capture session records a
:class:`SegformerRecording` — per stage, per block, the tensors below — instead of the single-sequence
:class:`~vitlens.models.base.Recording`:

- per block (:class:`SegformerBlockRecord`): ``u``/``h`` ``(B, T_s, D_s)`` (residual input, stream after the
  attention add), ``attn`` ``(B, heads, T_s, T_k)`` (probabilities over the ``T_k`` reduced keys, in the graph),
  ``value`` ``(B, heads, T_k, d)`` (detached), and ``reduction`` (a :class:`ConvRecord` of the key/value reduction
  convolution: its input ``(B, D_s, h_s, w_s)``, detached, and its output, in the graph), ``None`` when ``r = 1``;
- per stage (:class:`StageRecord`): ``grid`` ``(h_s, w_s)``, ``merge`` (a :class:`ConvRecord` of the patch-merging
  convolution that made this stage's tokens from the previous stage's output; ``None`` for stage 1, whose input is
  the image) and ``readout`` (this stage's output exactly as the decode head reads it, a separate graph node so its
  gradient is the decode head's *direct* gradient, without what flows through later stages).

The residual stream entering stage 1's first block is a fresh leaf (the backward stops there: the stage-1
convolution on pixels is never back-propagated). Methods that read a single token sequence (``rec.blocks``) get an
:class:`UnsupportedModelError` from the recording. Eager attention is on only inside a session (restored after, also
on error). Note that transformers itself installs output-capturing forward hooks on the stages and attention
modules the first time the model runs (permanently, with or without vitlens).

Features (the ``"features"`` capability, read by Grad-CAM and Finer-CAM): one feature layer, the decode head's fused
feature map — the input of its final 1×1 classifier convolution (after the fusing convolution, BatchNorm, ReLU and
dropout), ``(B, h_1·w_1, C_dec)`` in token layout (row-major, no prefix tokens) on the stage-1 grid, the grid of the
logits and of :meth:`SegformerAdapter.grid`. It is the segmentation counterpart of a CNN's pooled feature map: the
last spatial feature map before the per-pixel classifier. It is recorded as ``SegformerRecording.features[0]``, a
node of the graph (not a leaf: GradSkip back-propagates through it), and the classifier reads exactly that tensor
(reshaped back, the same values and memory layout).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence, cast

from torch import Tensor, nn

from ..errors import UnsupportedModelError
from ._hf import eager_attention
from ._stages import (ConvRecord, StageBlockRecord, StageRecord, StageRecording, check_stage_input, conv_hook,
                      conv_output_size, residual_input_hook, stage_grids)
from .base import Adapter, Recording, int_pair, logits_of
from .capabilities import (ATTENTION, BLOCK_IO, CLASS_LOGITS, FEATURE_MAPS, FEATURES, LRP_LINEARS, PIXEL_LOGITS, STAGES,
                           TOKEN_GRID, TOKEN_SEQUENCE, TOKENS)

_NO_SEQUENCE = ("every stage has its own token grid, reduced keys and an overlapping patch-merging convolution, so "
                "there is no single sequence of block inputs, outputs and attention rows")

__all__ = ["SegformerAdapter", "SegformerRecording", "StageRecord", "SegformerBlockRecord", "ConvRecord",
           "conv_output_size"]


#: a SegFormer block's record (the shared stage-block record, :mod:`._stages`)
SegformerBlockRecord = StageBlockRecord


class SegformerRecording(StageRecording):
    """What a SegFormer capture session records: ``stages`` in forward order (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__("SegFormer", _NO_SEQUENCE)


class SegformerAdapter(Adapter):
    """HuggingFace SegFormer semantic segmentation (hierarchical stages, reduced keys). Eager attention in sessions;
    features: the decode head's fused feature map."""

    #: the wrapped model; typed ``Any`` because the family's submodules and config are reached by attribute
    #: (``nn.Module.__getattr__`` types them loosely), after :meth:`matches` and ``__init__`` checked the layout
    model: Any

    family = "hf-segformer"
    capabilities = frozenset({PIXEL_LOGITS, ATTENTION, STAGES, FEATURES, TOKEN_GRID})
    capability_notes = {
        TOKEN_SEQUENCE: _NO_SEQUENCE, BLOCK_IO: _NO_SEQUENCE, LRP_LINEARS: _NO_SEQUENCE,
        TOKENS: "each stage embeds the previous stage's grid with an overlapping convolution: tokens cannot be dropped",
        CLASS_LOGITS: "the model outputs per-pixel logits (B, K, h, w), not class logits: explain a "
                      "SegmentationTarget",
        FEATURE_MAPS: "no timm feature_info to read multi-depth features from",
    }

    @staticmethod
    def matches(model: nn.Module) -> bool:
        backbone = getattr(model, "segformer", None)
        return (type(model).__name__ == "SegformerForSemanticSegmentation" and hasattr(model, "config")
                and hasattr(backbone, "stages") and hasattr(model, "decode_head"))

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        cfg = self.model.config
        self.num_classes = int(cfg.num_labels)
        self.in_chans = int(cfg.num_channels)
        self.stages = list(self.model.segformer.stages)
        self.readouts = list(self.model.decode_head.linear_projections)
        classifier = getattr(self.model.decode_head, "classifier", None)
        if not isinstance(classifier, nn.Conv2d) or classifier.kernel_size != (1, 1):
            raise UnsupportedModelError("the SegFormer decode head has no 1x1 classifier convolution")
        self.classifier = classifier
        if len(self.readouts) != len(self.stages):
            raise UnsupportedModelError(
                f"the SegFormer decode head reads {len(self.readouts)} stages, the encoder has {len(self.stages)}"
            )
        for s, stage in enumerate(self.stages):
            conv = getattr(getattr(stage, "patch_embeddings", None), "proj", None)
            if not isinstance(conv, nn.Conv2d) or conv.groups != 1 or isinstance(conv.padding, str):
                raise UnsupportedModelError(f"SegFormer stage {s + 1} has no plain patch-merging convolution")
            for j, layer in enumerate(stage.blocks):
                att = getattr(layer, "attention", None)
                if not (hasattr(layer, "layernorm_after") and isinstance(getattr(att, "v_proj", None), nn.Linear)):
                    raise UnsupportedModelError(f"SegFormer stage {s + 1} block {j} is not a pre-norm block")
                red = self._reduction_conv(layer)
                if red is not None and (red.groups != 1 or red.kernel_size != red.stride or red.padding != (0, 0)):
                    raise UnsupportedModelError(
                        f"SegFormer stage {s + 1} block {j}: the key reduction is not an r×r, stride-r convolution"
                    )

    @staticmethod
    def _reduction_conv(layer: nn.Module) -> nn.Conv2d | None:
        red = getattr(layer.attention, "sequence_reduction", None)
        return None if red is None else red.sequence_reduction

    # -- layout --------------------------------------------------------------------------------------------------
    def stage_grids(self, input_hw: tuple[int, int]) -> list[tuple[int, int]]:
        """Token grid ``(h_s, w_s)`` of every stage for an input of size ``input_hw``."""
        return stage_grids([stage.patch_embeddings.proj for stage in self.stages], input_hw)

    def grid(self, input_hw: tuple[int, int]) -> tuple[int, int]:
        """The finest (stage-1) token grid, where GradSkip's token maps live (``⌈H/4⌉ × ⌈W/4⌉`` for the usual
        7×7, stride-4 stage-1 embedding)."""
        return self.stage_grids(input_hw)[0]

    def blocks(self) -> Sequence[nn.Module]:
        return [layer for stage in self.stages for layer in stage.blocks]

    def feature_layers(self) -> list[nn.Module]:
        """One feature layer (``layer`` 0 or −1): the decode head's final classifier, whose input — the fused
        feature map ``(B, h_1·w_1, C_dec)`` on the stage-1 grid, :meth:`grid` — holds the features. The encoder
        stages are not feature layers (their grids are coarser than :meth:`grid`)."""
        return [self.classifier]

    def check_input(self, x: Tensor) -> None:
        reductions = [self._reduction_conv(stage.blocks[0]) if len(stage.blocks) else None for stage in self.stages]
        check_stage_input(x, self.in_chans, "SegFormer", self.stage_grids(int_pair(x.shape[-2:])), reductions)

    # -- running -------------------------------------------------------------------------------------------------
    def _forward(self, x: Tensor) -> Tensor:
        """Per-pixel logits ``(B, K, h, w)`` (``h, w`` = the stage-1 grid)."""
        return logits_of(self.model(pixel_values=x))

    def _new_recording(self) -> SegformerRecording:
        return SegformerRecording()

    @contextlib.contextmanager
    def _explicit_attention(self) -> Iterator[None]:
        cfg = self.model.config
        with eager_attention((cfg, getattr(self.model.segformer, "config", cfg))):
            yield

    def _install_capture(self, rec: Recording, hooks: list) -> None:
        record = cast(SegformerRecording, rec)  # what _new_recording made (the base types it as Recording)
        for s, stage in enumerate(self.stages):
            srec = StageRecord()
            record.stages.append(srec)

            def grid_hook(module, args, output, srec=srec):
                srec.grid = (int(output[1]), int(output[2]))

            hooks.append(stage.patch_embeddings.register_forward_hook(grid_hook))
            if s > 0:
                hooks.append(stage.patch_embeddings.proj.register_forward_hook(conv_hook(srec, "merge")))
            for j, layer in enumerate(stage.blocks):
                brec = SegformerBlockRecord()
                srec.blocks.append(brec)
                hooks.append(layer.register_forward_pre_hook(residual_input_hook(brec, leaf=(s == 0 and j == 0)),
                                                              with_kwargs=True))

                def h_hook(module, args, brec=brec):
                    brec.h = args[0]

                def attn_hook(module, args, output, brec=brec):
                    probs = output[1] if isinstance(output, tuple) and len(output) > 1 else None
                    if probs is None:
                        raise UnsupportedModelError("SegFormer attention returned no probabilities (eager was set)")
                    brec.attn = probs

                def value_hook(module, args, output, brec=brec, heads=int(layer.attention.num_attention_heads)):
                    b, n, d = output.shape
                    brec.value = output.detach().reshape(b, n, heads, d // heads).permute(0, 2, 1, 3)

                hooks.append(layer.layernorm_after.register_forward_pre_hook(h_hook))
                hooks.append(layer.attention.register_forward_hook(attn_hook))
                hooks.append(layer.attention.v_proj.register_forward_hook(value_hook))
                red = self._reduction_conv(layer)
                if red is not None:
                    hooks.append(red.register_forward_hook(conv_hook(brec, "reduction")))

            def readout_hook(module, args, srec=srec):
                view = args[0].view_as(args[0])  # its own graph node: the gradient here is the decode head's alone
                srec.readout = view
                return (view, *args[1:])

            hooks.append(self.readouts[s].register_forward_pre_hook(readout_hook))

        def feature_hook(module: nn.Module, args: tuple):
            fmap = args[0]  # (B, C, h, w): the fused decode-head features, the classifier's input
            b, c, h, w = fmap.shape
            tokens = fmap.flatten(2).transpose(1, 2)  # (B, h·w, C), a view in the graph
            record.features = [tokens]
            return (tokens.transpose(1, 2).reshape(b, c, h, w), *args[1:])  # the classifier reads the recorded node

        hooks.append(self.classifier.register_forward_pre_hook(feature_hook))

