"""Adapter for timm's Swin Transformer (``SwinTransformer``): windowed and shifted-window attention, patch merging.

Swin is hierarchical like SegFormer, and its attention is *windowed*: block ``l`` of stage ``s`` works on the stage's
token grid ``(H_s, W_s)`` (NHWC), cyclically shifts it by ``shift_size`` (every other block), pads it to a multiple of
the window, cuts it into ``nW`` windows of ``N = w_h·w_w`` tokens and runs multi-head attention inside each window
(with a relative position bias, and a mask across the wrap-around of the shift). Between stages a patch merging layer
concatenates each 2×2 group of tokens (``4C`` channels), normalises them and maps them to ``2C``. The classifier
averages the last stage's tokens after the final norm.

What a session records (``SwinRecording``), per block in forward order: ``attn`` ``(B·nW, heads, N, N)`` (the
softmax output, explicit attention), ``vnorm`` ``(B·nW, heads, N)`` (value norms), ``u`` ``(B, H_s·W_s, C)`` (block
input), ``h`` ``(B, H_s·W_s, C)`` (after the attention residual), and the layout (grid, shift, window); per stage
the patch merging input ``(B, H, W, C)`` (``None`` for the first stage); ``final``: the last stage's output before the
final norm, ``(B, L, C)``. How GradSkip propagates through windows and merges: ``docs/methods/gradskip_swin.md``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import InputError, UnsupportedModelError
from .base import Adapter, BlockRecord, Recording, int_pair, switched
from .capabilities import (ATTENTION, BLOCK_IO, CLASS_LOGITS, FEATURE_MAPS, FEATURES, LRP_LINEARS, STAGES, TOKEN_GRID,
                           TOKEN_SEQUENCE, TOKENS, WINDOWS)

__all__ = ["SwinAdapter", "TimmSwinAdapter", "SwinBlockRecord", "SwinRecording", "to_windows", "from_windows",
           "SWIN_CAPABILITY_NOTES"]

_WHY = "Swin's attention is windowed (shifted windows) and patch merging changes the token set between stages"
#: what every Swin adapter (timm, HuggingFace) lacks, and why
SWIN_CAPABILITY_NOTES = {TOKEN_SEQUENCE: _WHY, LRP_LINEARS: _WHY,
                         TOKENS: "Swin's windows are built over the full token grid: tokens cannot be dropped"}


@dataclass
class SwinBlockRecord(BlockRecord):
    """One Swin block: :class:`BlockRecord` fields plus the value norms and the window layout."""

    vnorm: Tensor | None = None
    grid: tuple[int, int] = (0, 0)
    shift: tuple[int, int] = (0, 0)
    window: tuple[int, int] = (0, 0)
    stage: int = 0
    pad_first: bool = False  # the grid is padded before the cyclic shift (HuggingFace), not after (timm)


@dataclass
class SwinRecording(Recording):
    """Blocks in forward order, the patch-merging inputs per stage and the last stage's output."""

    merges: list[Tensor | None] = field(default_factory=list)
    features: list[Tensor] = field(default_factory=list)

    def graph_tensors(self) -> list[Tensor]:
        out = super().graph_tensors()
        return out + [m for m in self.merges if m is not None]


def to_windows(r: Tensor, shift: tuple[int, int], window: tuple[int, int], pad_first: bool = False
               ) -> tuple[Tensor, tuple[int, int]]:
    """Per-token values ``(B, H, W)`` → ``(B·nW, N)`` in the order a Swin block's attention sees its tokens: cyclic
    shift by ``-shift`` and zero padding at the bottom/right to a multiple of the window (timm shifts, then pads;
    HuggingFace pads, then shifts the padded grid: ``pad_first``), then windows row-major per image.
    Returns the windows and the padded size ``(Hp, Wp)``."""
    b, h, w = r.shape
    wh, ww = window
    ph, pw = (wh - h % wh) % wh, (ww - w % ww) % ww
    if pad_first:
        r = F.pad(r, (0, pw, 0, ph))
    if any(shift):
        r = torch.roll(r, shifts=(-shift[0], -shift[1]), dims=(1, 2))
    if not pad_first:
        r = F.pad(r, (0, pw, 0, ph))
    hp, wp = h + ph, w + pw
    r = r.reshape(b, hp // wh, wh, wp // ww, ww).permute(0, 1, 3, 2, 4).reshape(-1, wh * ww)
    return r, (hp, wp)


def from_windows(rw: Tensor, batch: int, size: tuple[int, int], padded: tuple[int, int], shift: tuple[int, int],
                 window: tuple[int, int], pad_first: bool = False) -> tuple[Tensor, Tensor]:
    """Inverse of :func:`to_windows`: ``(B·nW, N)`` → ``(B, H, W)``, and the total that fell on padding ``(B,)``."""
    wh, ww = window
    hp, wp = padded
    r = rw.reshape(batch, hp // wh, wp // ww, wh, ww).permute(0, 1, 3, 2, 4).reshape(batch, hp, wp)
    h, w = size
    if pad_first and any(shift):
        r = torch.roll(r, shifts=shift, dims=(1, 2))
    lost = r.sum((1, 2)) - r[:, :h, :w].sum((1, 2))
    r = r[:, :h, :w]
    if not pad_first and any(shift):
        r = torch.roll(r, shifts=shift, dims=(1, 2))
    return r, lost


class SwinAdapter(Adapter):
    """What the timm and HF Swin adapters share: the capabilities and limits of windowed attention and the
    recording type; each family fills in where its parts are."""

    model: Any  # a Swin classifier: its parts are read by attribute after __init__ checked the layout
    patch_size: tuple[int, int]  # set by each family's __init__ from its patch embedding: never None
    capabilities = frozenset({CLASS_LOGITS, ATTENTION, BLOCK_IO, WINDOWS, STAGES, FEATURES, TOKEN_GRID})
    capability_notes = {**SWIN_CAPABILITY_NOTES, FEATURE_MAPS: "the model has no timm feature_info to read "
                        "multi-depth feature maps from"}

    def _new_recording(self) -> SwinRecording:
        return SwinRecording()


class TimmSwinAdapter(SwinAdapter):
    """timm ``SwinTransformer`` (v1): GradSkip, rollout and GAE through windows and merges, Grad-CAM/Finer-CAM on
    the last stage."""

    family = "timm-swin"
    capabilities = SwinAdapter.capabilities | {FEATURE_MAPS}

    @staticmethod
    def matches(model: nn.Module) -> bool:
        return type(model).__name__ == "SwinTransformer" and type(model).__module__.startswith("timm.")

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.num_classes = int(getattr(model, "num_classes", 0) or 0)
        pe = self.model.patch_embed
        self.patch_size = int_pair(pe.patch_size)
        self.in_chans = int(pe.proj.in_channels)
        self.default_size = int_pair(pe.img_size) if getattr(pe, "img_size", None) is not None else None
        # relative position bias and shift masks are built for the configured resolution, unless the model was
        # created with strict_img_size=False (timm then builds the shift masks for the input's grid)
        self.any_size = not bool(getattr(pe, "strict_img_size", True)) and all(
            bool(getattr(blk, "dynamic_mask", False)) for stage in self.model.layers for blk in stage.blocks)
        self.stages: list[Any] = list(self.model.layers)
        for s, stage in enumerate(self.stages):
            for j, blk in enumerate(stage.blocks):
                att = getattr(blk, "attn", None)
                if not (isinstance(getattr(att, "qkv", None), nn.Linear) and isinstance(getattr(att, "softmax", None),
                                                                                        nn.Module)
                        and hasattr(blk, "norm2") and hasattr(blk, "shift_size")):
                    raise UnsupportedModelError(f"Swin stage {s} block {j} ({type(blk).__name__}) is not a timm "
                                                "SwinTransformerBlock with WindowAttention")
            ds = stage.downsample
            if not isinstance(ds, nn.Identity) and type(ds).__name__ != "PatchMerging":
                raise UnsupportedModelError(f"Swin stage {s}: downsampling {type(ds).__name__} is not PatchMerging")
        if getattr(self.model, "global_pool", "avg") not in ("avg",):
            raise UnsupportedModelError(f"Swin with global_pool={self.model.global_pool!r}: only the average-pool "
                                        "classifier is supported")

    # -- layout ----------------------------------------------------------------------------------------------------
    def grid(self, input_hw: tuple[int, int]) -> tuple[int, int]:
        """The first stage's token grid (``H / patch × W / patch``), where GradSkip's maps live."""
        return input_hw[0] // self.patch_size[0], input_hw[1] // self.patch_size[1]

    def feature_grid(self, input_hw: tuple[int, int]) -> tuple[int, int]:
        """The last stage's grid (each merge halves it, rounding up), where Grad-CAM's features live."""
        h, w = self.grid(input_hw)
        for stage in self.stages[1:]:
            if not isinstance(stage.downsample, nn.Identity):
                h, w = (h + 1) // 2, (w + 1) // 2
        return h, w

    def blocks(self) -> Sequence[nn.Module]:
        return [blk for stage in self.stages for blk in stage.blocks]

    def feature_layers(self) -> list[nn.Module]:
        """One feature layer: the final norm, whose input is the last stage's output (what the classifier pools)."""
        return [self.model.norm]

    def check_input(self, x: Tensor) -> None:
        super().check_input(x)
        hw = tuple(x.shape[-2:])
        if not self.any_size and self.default_size is not None and hw != tuple(self.default_size):
            raise InputError(f"SwinTransformer expects {self.default_size[0]}x{self.default_size[1]} inputs; got "
                             f"{hw[0]}x{hw[1]} (its shift masks are built for that size; create it with "
                             "strict_img_size=False to explain other sizes)")
        ph, pw = self.patch_size
        if self.any_size and (hw[0] % ph or hw[1] % pw):
            raise InputError(f"input size {hw[0]}x{hw[1]} is not a multiple of the patch size {ph}x{pw}")

    def classifier_modules(self) -> list[nn.Module]:
        fc = getattr(self.model.head, "fc", None)
        if isinstance(fc, nn.Module) and any(True for _ in fc.parameters()):
            return [fc]
        return super().classifier_modules()

    # -- capture ---------------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _explicit_attention(self) -> Iterator[None]:
        with switched([blk.attn for stage in self.stages for blk in stage.blocks], "fused_attn", False):
            yield

    def _install_capture(self, rec: Recording, hooks: list) -> None:
        assert isinstance(rec, SwinRecording)
        index = 0
        for s, stage in enumerate(self.stages):
            rec.merges.append(None)
            if not isinstance(stage.downsample, nn.Identity):
                def merge_hook(module: nn.Module, args: tuple, s: int = s) -> None:
                    rec.merges[s] = args[0]

                hooks.append(stage.downsample.register_forward_pre_hook(merge_hook))
            for blk in stage.blocks:
                rec.blocks.append(SwinBlockRecord(stage=s, shift=int_pair(blk.shift_size), window=int_pair(blk.window_size)))
                hooks.append(blk.register_forward_pre_hook(self._swin_u_hook(rec, index), with_kwargs=True))
                hooks.append(self._h_site(blk).register_forward_pre_hook(self._record_h_hook(rec, index)))
                hooks.append(blk.attn.softmax.register_forward_hook(_attn_hook(rec, index)))
                pre, from_qkv, post = _vnorm_hooks(rec, index, int(blk.attn.num_heads), self._value_of(blk.attn))
                hooks.append(blk.attn.register_forward_pre_hook(pre))
                if getattr(blk.attn, "q_bias", None) is None and getattr(blk.attn, "v_bias", None) is None:
                    hooks.append(blk.attn.qkv.register_forward_hook(from_qkv))  # its output is q, k, v as used
                hooks.append(blk.attn.register_forward_hook(post))
                index += 1

        def final_hook(module: nn.Module, args: tuple) -> tuple:
            f = args[0]  # (B, H, W, C); the token view is put on the forward path so it receives gradients
            tokens = f.reshape(f.shape[0], -1, f.shape[-1])
            rec.final = tokens
            rec.features = [tokens]
            return (tokens.reshape(f.shape), *args[1:])

        hooks.append(self.model.norm.register_forward_pre_hook(final_hook))

    def _h_site(self, blk: Any) -> nn.Module:
        """The module whose input is the residual stream after the attention residual, ``h`` (v1: ``norm2``, the
        pre-norm of the MLP branch)."""
        return blk.norm2

    def _value_of(self, attn: Any) -> tuple[Tensor, Tensor | None]:
        """``(W_v, b_v)`` of a window attention: the value third of its fused ``qkv`` (and of its bias)."""
        qkv = attn.qkv
        d = qkv.out_features // 3
        return qkv.weight[2 * d:], None if qkv.bias is None else qkv.bias[2 * d:]

    def _swin_u_hook(self, rec: SwinRecording, index: int) -> Any:
        leaf = self._leaf_first_block_hook(rec, index)

        def hook(module: nn.Module, args: tuple, kwargs: dict) -> Any:
            out = leaf(module, args, kwargs)
            brec = rec.blocks[index]
            u = brec.u
            assert isinstance(brec, SwinBlockRecord) and u is not None
            brec.grid = (int(u.shape[1]), int(u.shape[2]))
            brec.u = u.reshape(u.shape[0], -1, u.shape[-1])  # token layout; block 0's leaf stays the block's input
            return out

        return hook


def _attn_hook(rec: SwinRecording, index: int) -> Any:
    def hook(module: nn.Module, args: tuple, output: Tensor) -> None:
        rec.blocks[index].attn = output

    return hook


def _vnorm_hooks(rec: SwinRecording, index: int, heads: int, value: tuple[Tensor, Tensor | None]
                 ) -> tuple[Any, Any, Any]:
    """The hooks that record a window attention's value norms ``(B·nW, heads, N)``: ``from_qkv`` reads them from the
    value third of the ``qkv`` module's output (registered where that output is what the attention uses: v1;
    SwinV2 with q/v biases adds them through ``F.linear`` or in place after the module, and is not hooked there);
    if it did not run, ``post`` recomputes the values from the attention's input with ``value``."""
    weight, bias = value
    pending: list[Tensor] = []  # the attention's input while it runs and no norms were read

    def norms(v: Tensor) -> None:
        b, n, d = v.shape
        brec = rec.blocks[index]
        assert isinstance(brec, SwinBlockRecord)
        brec.vnorm = v.reshape(b, n, heads, d // heads).norm(dim=-1).permute(0, 2, 1)
        pending.clear()

    def pre(module: nn.Module, args: tuple) -> None:
        pending[:] = [args[0]]
        brec = rec.blocks[index]
        assert isinstance(brec, SwinBlockRecord)
        brec.vnorm = None

    def from_qkv(module: nn.Module, args: tuple, out: Tensor) -> None:
        if pending and out.shape[-1] == 3 * weight.shape[0]:
            with torch.no_grad():
                norms(out.detach()[..., 2 * weight.shape[0]:])

    def post(module: nn.Module, args: tuple, out: Any) -> None:
        if pending:  # the qkv module did not run: recompute the values
            with torch.no_grad():
                norms(F.linear(pending[0].detach(), weight, bias))

    return pre, from_qkv, post
