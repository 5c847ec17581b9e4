"""Adapter for HuggingFace's Swin Transformer (``SwinForImageClassification``, transformers 5.x): windowed and
shifted-window attention, patch merging. It records what :class:`~vitlens.models.timm_swin.TimmSwinAdapter` records
(a :class:`~vitlens.models.timm_swin.SwinRecording`), so GradSkip, rollout, GAE, Grad-CAM and Finer-CAM run through
the same windowed code (``docs/methods/gradskip_swin.md``).

How HF's layout differs from timm's, and what the adapter does about it:

- Tokens travel as ``(B, H·W, C)`` with the grid passed alongside (``input_dimensions``); ``u``/``h`` are recorded as
  they are, the grid from that argument.
- A ``SwinLayer`` pads its ``(B, H, W, C)`` grid to a multiple of the window *before* the cyclic shift (timm shifts,
  then pads): the blocks are recorded with ``pad_first=True`` and :func:`~vitlens.models.timm_swin.to_windows`
  partitions the same way (tested against HF's ``window_partition``).
- ``set_shift_and_window_size`` sets a layer's shift to 0 (and would shrink its window) at run time, and keeps the
  change, when the stage's grid is not larger than the window: shift and window are read from the layer while it
  runs. A grid *smaller* than the window would shrink the window below the relative position table (HF then fails,
  and the layer stays broken): :meth:`HFSwinAdapter.check_input` refuses such inputs before any forward.
- Patch merging is the last module of a stage (timm: the first of the next); its input ``(B, H·W, C)`` is recorded
  as the merge input ``(B, H, W, C)`` of the next stage, the view put on the forward path so it gets gradients. HF
  concatenates each 2×2 group in the order (0,0), (1,0), (0,1), (1,1) (timm: the same); the relevance hand-back
  reads gradient × activation per input token, so it does not depend on that order.
- The classifier is ``layernorm`` → ``AdaptiveAvgPool1d`` over tokens → ``classifier``: ``final`` (and the one
  feature layer) is the last stage's output, the input of ``layernorm``.
- Eager attention (the path that returns the probabilities) is switched on through the configs'
  ``_attn_implementation`` for the session and restored in ``finally``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import Tensor, nn

from ..errors import InputError, UnsupportedModelError
from ._hf import eager_attention
from .base import Recording, int_pair, logits_of
from .timm_swin import SwinAdapter, SwinBlockRecord, SwinRecording

__all__ = ["HFSwinAdapter"]


def _arg(args: tuple, kwargs: dict, pos: int, name: str) -> Any:
    """Argument ``name`` of a forward call, given at position ``pos`` or by keyword."""
    return args[pos] if len(args) > pos else kwargs[name]


class HFSwinAdapter(SwinAdapter):
    """HuggingFace ``SwinForImageClassification``: GradSkip, rollout and GAE through windows and merges,
    Grad-CAM/Finer-CAM on the last stage."""

    family = "hf-swin"

    @staticmethod
    def matches(model: nn.Module) -> bool:
        return (type(model).__name__ == "SwinForImageClassification" and type(model).__module__.startswith("transformers.")
                and hasattr(model, "config"))

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        cfg = self.model.config
        self.backbone = getattr(self.model, self._backbone_name)
        self.num_classes = int(cfg.num_labels)
        self.patch_size = int_pair(cfg.patch_size)
        self.in_chans = int(cfg.num_channels)
        self.default_size = int_pair(cfg.image_size)
        self.any_size = True  # no absolute position embeddings by default; with them, the forward interpolates
        self.stages: list[Any] = list(self.backbone.encoder.layers)
        for s, stage in enumerate(self.stages):
            for j, blk in enumerate(stage.blocks):
                self._check_block(s, j, blk)
            ds = stage.downsample
            if ds is not None and type(ds).__name__ != self._merging:
                raise UnsupportedModelError(f"HF Swin stage {s}: downsampling {type(ds).__name__} is not "
                                            f"{self._merging}")
        if not isinstance(getattr(self.backbone, "pooler", None), nn.AdaptiveAvgPool1d):
            raise UnsupportedModelError("HF Swin without its average-pool classifier (add_pooling_layer=False) is not "
                                        "supported")

    #: the model's backbone attribute and the class name of its patch merging
    _backbone_name = "swin"
    _merging = "SwinPatchMerging"

    def _check_block(self, s: int, j: int, blk: Any) -> None:
        """Raise :class:`UnsupportedModelError` if block ``j`` of stage ``s`` is not the layer this adapter reads."""
        att = getattr(blk, "attention", None)
        if not (isinstance(getattr(att, "v_proj", None), nn.Linear)
                and hasattr(att, "relative_position_bias") and hasattr(blk, "layernorm_after")
                and hasattr(blk, "shift_size") and hasattr(blk, "window_size")):
            raise UnsupportedModelError(
                f"HF Swin stage {s} block {j} ({type(blk).__name__}) is not a transformers 5.x SwinLayer with "
                "a SwinAttention (v_proj, relative_position_bias)")

    def _h_site(self, blk: Any) -> nn.Module:
        """The module whose input is ``h``, the residual stream after the attention residual (v1: the MLP's
        pre-norm ``layernorm_after``)."""
        return blk.layernorm_after

    def _value_of(self, blk: Any) -> tuple[nn.Module, int, int]:
        """The value projection of a layer's attention, its number of heads and the head width."""
        att = blk.attention
        return att.v_proj, int(att.num_attention_heads), int(att.head_dim)

    # -- layout ----------------------------------------------------------------------------------------------------
    def grid(self, input_hw: tuple[int, int]) -> tuple[int, int]:
        """The first stage's token grid (``H / patch × W / patch``), where GradSkip's maps live."""
        return input_hw[0] // self.patch_size[0], input_hw[1] // self.patch_size[1]

    def stage_grids(self, input_hw: tuple[int, int]) -> list[tuple[int, int]]:
        """The token grid of every stage (each patch merging halves it, rounding up)."""
        h, w = self.grid(input_hw)
        out = []
        for stage in self.stages:
            out.append((h, w))
            if stage.downsample is not None:
                h, w = (h + 1) // 2, (w + 1) // 2
        return out

    def feature_grid(self, input_hw: tuple[int, int]) -> tuple[int, int]:
        """The last stage's grid, where Grad-CAM's features live."""
        return self.stage_grids(input_hw)[-1]

    def blocks(self) -> Sequence[nn.Module]:
        return [blk for stage in self.stages for blk in stage.blocks]

    def feature_layers(self) -> list[nn.Module]:
        """One feature layer: the final layernorm, whose input is the last stage's output (what the pooler averages
        after the norm)."""
        return [self.backbone.layernorm]

    def check_input(self, x: Tensor) -> None:
        super().check_input(x)
        h, w = int_pair(x.shape[-2:])
        ph, pw = self.patch_size
        if h % ph or w % pw:
            raise InputError(f"input size {h}x{w} is not a multiple of the patch size {ph}x{pw}")
        for s, (stage, (gh, gw)) in enumerate(zip(self.stages, self.stage_grids((h, w)))):
            for blk in stage.blocks:
                table = int_pair(blk.attention.relative_position_bias.window_size)
                if min(gh, gw) < table[0]:
                    raise InputError(
                        f"input size {h}x{w} gives stage {s} a {gh}x{gw} token grid, smaller than its {table[0]}x"
                        f"{table[1]} window: HF Swin would shrink the window below its relative position table (and "
                        f"keep it so); use at least {self._min_size()}")

    def _min_size(self) -> str:
        """The smallest square input every stage's window fits in, as ``'NxN'``."""
        side = max(self.patch_size)
        while True:
            grids = self.stage_grids((side, side))
            if all(min(g) >= int_pair(b.attention.relative_position_bias.window_size)[0]
                   for st, g in zip(self.stages, grids) for b in st.blocks):
                return f"{side}x{side}"
            side += max(self.patch_size)

    def classifier_modules(self) -> list[nn.Module]:
        return [self.model.classifier] if any(True for _ in self.model.classifier.parameters()) else \
            super().classifier_modules()

    def _forward(self, x: Tensor) -> Tensor:
        kwargs = {}
        if tuple(x.shape[-2:]) != self.default_size and self.model.config.use_absolute_embeddings:
            kwargs["interpolate_pos_encoding"] = True
        return logits_of(self.model(pixel_values=x, **kwargs))

    # -- capture ---------------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _explicit_attention(self) -> Iterator[None]:
        configs = [self.model.config] + [m.config for m in self.model.modules()
                                         if hasattr(getattr(m, "config", None), "_attn_implementation")]
        with eager_attention(configs):
            yield

    def _install_capture(self, rec: Recording, hooks: list) -> None:
        assert isinstance(rec, SwinRecording)
        rec.merges.extend(None for _ in self.stages)
        index = 0
        for s, stage in enumerate(self.stages):
            for blk in stage.blocks:
                rec.blocks.append(SwinBlockRecord(stage=s, pad_first=True))
                hooks.append(blk.register_forward_pre_hook(self._layer_hook(rec, index), with_kwargs=True))
                hooks.append(self._h_site(blk).register_forward_pre_hook(self._record_h_hook(rec, index)))
                hooks.append(blk.attention.register_forward_pre_hook(_window_hook(rec, index, blk, self._value_of(blk)),
                                                                     with_kwargs=True))
                hooks.append(blk.attention.register_forward_hook(_attn_hook(rec, index)))
                index += 1
            if stage.downsample is not None and s + 1 < len(self.stages):
                hooks.append(stage.downsample.register_forward_pre_hook(_merge_hook(rec, s + 1), with_kwargs=True))

        def final_hook(module: nn.Module, args: tuple) -> None:
            rec.final = args[0]  # (B, L, C): the last stage's output, on the forward path
            rec.features = [args[0]]

        hooks.append(self.backbone.layernorm.register_forward_pre_hook(final_hook))

    def _layer_hook(self, rec: SwinRecording, index: int) -> Callable:
        leaf = self._leaf_first_block_hook(rec, index)

        def hook(module: nn.Module, args: tuple, kwargs: dict) -> Any:
            brec = rec.blocks[index]
            assert isinstance(brec, SwinBlockRecord)
            brec.grid = int_pair(_arg(args, kwargs, 1, "input_dimensions"))
            return leaf(module, args, kwargs)  # u: (B, H·W, C) as it comes; block 0's a leaf

        return hook


def _window_hook(rec: SwinRecording, index: int, layer: Any, value: tuple[nn.Module, int, int]) -> Callable:
    """Pre-hook on a layer's attention: the shift and window the layer uses now (``set_shift_and_window_size`` has
    run) and the value norms ``(B·nW, heads, N)`` of its windows ``(B·nW, N, C)``."""
    v_proj, heads, d = value

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        brec = rec.blocks[index]
        assert isinstance(brec, SwinBlockRecord)
        brec.shift, brec.window = int_pair(layer.shift_size), int_pair(layer.window_size)
        x = _arg(args, kwargs, 0, "hidden_states").detach()
        with torch.no_grad():
            v = v_proj(x)
            b, n, _ = v.shape
            brec.vnorm = v.reshape(b, n, heads, d).norm(dim=-1).permute(0, 2, 1)

    return hook


def _attn_hook(rec: SwinRecording, index: int) -> Callable:
    def hook(module: nn.Module, args: tuple, output: Any) -> None:
        probs = output[1] if isinstance(output, tuple) and len(output) > 1 else None
        if probs is None:
            raise UnsupportedModelError("HF Swin attention returned no probabilities although eager attention was set")
        rec.blocks[index].attn = probs  # (B·nW, heads, N, N), the softmax output the values are mixed with

    return hook


def _merge_hook(rec: SwinRecording, stage: int) -> Callable:
    """Pre-hook on a stage's patch merging: its input ``(B, H·W, C)`` as the next stage's merge input
    ``(B, H, W, C)``, that view put on the forward path."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple:
        x = _arg(args, kwargs, 0, "input_feature")
        h, w = int_pair(_arg(args, kwargs, 1, "input_dimensions"))
        grid = x.reshape(x.shape[0], h, w, x.shape[-1])
        rec.merges[stage] = grid
        rest = {k: v for k, v in kwargs.items() if k not in ("input_feature", "input_dimensions")}
        return (grid.reshape(x.shape), (h, w)), rest

    return hook
