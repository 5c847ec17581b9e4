"""Adapter for timm ``MaxxVit`` (MaxViT, and the CoAtNet models built by the same class): the final feature map for
class-activation maps, the stage outputs for AHA, and, for MaxViT, the block and grid attentions with the MBConv
blocks between them for GradSkip.

A MaxViT block (``MaxxVitBlock``) is an MBConv block (1×1 expansion, a 3×3 depthwise convolution, squeeze-excitation,
1×1 projection; at a stage's first block strided, with a pooled and projected shortcut), then *block* attention over
non-overlapping windows of the feature map and *grid* attention over a dilated grid of it (each a pre-norm attention
with a relative position bias over its partition, then an MLP). The tokens are the cells of a 2-d feature map that
convolutions mix between the attentions: there is no token sequence whose attention matrices chain (what rollout, GAE
and the LRP rules read). A ``session(partitions=True)`` records what GradSkip's MaxViT path needs instead
(:mod:`._partitions`: per block the MBConv output, shortcut, depthwise convolution and shortcut pool, per partition
attention its probabilities, value norms, residual stream and partition); other sessions record the final feature
map as timm's CNNs do (:class:`~vitlens.models.timm_cnn.TimmCNNAdapter`): the input of the global pool is Grad-CAM's
layer, and timm's ``feature_info`` (the stem and every stage, ``(B, C, h, w)`` maps) is AHA's multi-depth input.
CoAtNet (MBConv stages, then transformer blocks whose first block pools its input), ConvNeXt-block MaxxViT and the
parallel-attention blocks (``ParallelMaxxVitBlock``) are read as CNNs only; the capability notes say why.

Input sizes: the window and grid partitions must divide every stage's feature map (timm asserts it), and the strided
blocks' shortcut must give the main branch's size (a 2×2 average pool with explicit padding rounds down where the
strided convolution rounds up); CoAtNet's transformer blocks have relative position tables built for the feature
maps of the model's ``img_size``. A size other than ``img_size`` is tried once, in a forward without gradients in
eval mode, and refused with the model's own words and the stage whose grid does not fit
(:meth:`TimmMaxxVitAdapter.check_input`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import Tensor, nn

from ..errors import InputError, UnsupportedModelError
from ._partitions import MaxVitBlockRecord, PartitionRecord, PartitionRecording, WindowOpRecord
from .base import Recording, conservative_layernorm_hook, int_pair, normalisation_layers, switched
from .capabilities import (ATTENTION, BLOCK_IO, CLASS_ATTENTION, LINEAR_HEAD, LRP_LINEARS, LRP_VARIANT_LINEARS,
                           PARTITION_ATTENTION, PIXEL_LOGITS, STAGES, TOKEN_GRID, TOKEN_SEQUENCE, TOKENS, WINDOWS)
from .timm_cnn import TimmCNNAdapter

__all__ = ["TimmMaxxVitAdapter"]

_MAXVIT = ("MaxViT's blocks are an MBConv convolution block (strided, with a pooled and projected shortcut, at a "
           "stage's first block), then block attention over windows and grid attention over a dilated grid of the "
           "feature map, each with a relative position bias; the tokens are cells of a 2-d feature map that "
           "convolutions mix between the attentions")
#: why a readable MaxViT still lacks the single-sequence capabilities (rollout, GAE, the LRP family read them)
_MAXVIT_SEQUENCE = (_MAXVIT + ", and the partitions regroup them between the two attentions: there is no token "
                    "sequence whose attention matrices chain (as rollout and GAE multiply them), and no declared "
                    "linear maps of plain pre-norm blocks for the LRP rules; GradSkip propagates through the "
                    "partitions and the MBConv blocks instead (docs/methods/gradskip.md, MaxViT)")
_COATNET = ("CoAtNet's stages are MBConv convolution blocks, then transformer blocks with a relative position bias "
            "whose first block pools its input (stride 2) and projects its shortcut; vitlens' relevance rules have no "
            "hand-back through its conv-only stages into the pooled transformer blocks, so no attention is recorded")
_SEQUENCE_CAPS = (ATTENTION, BLOCK_IO, TOKEN_SEQUENCE, LRP_LINEARS, LRP_VARIANT_LINEARS, LINEAR_HEAD, STAGES, WINDOWS,
                  CLASS_ATTENTION)
_AVG_POOLS = ("AvgPool2d", "AvgPool2dSame")
_PARTITION_LAYERS = {"PartitionAttentionCl": "AttentionCl", "PartitionAttention2d": "Attention2d"}


def _partition_problem(model: Any) -> str | None:
    """Why GradSkip's MaxViT path cannot read ``model`` (``None``: it can): every block a ``MaxxVitBlock`` whose
    MBConv block strides in its depthwise convolution (``stride_mode='dw'``) with an average-pool shortcut, then
    block and grid ``PartitionAttention`` layers."""
    for s, st in enumerate(model.stages):
        for j, b in enumerate(st.blocks):
            where = f"stage {s + 1} block {j + 1}"
            if type(b).__name__ != "MaxxVitBlock":
                return f"{where} is a {type(b).__name__}, not a MaxxVitBlock (MBConv, block and grid attention)"
            c = b.conv
            if type(c).__name__ != "MbConvBlock":
                return f"{where}'s convolution block is a {type(c).__name__}, not an MBConv block"
            dw = c.conv2_kxk
            if not isinstance(c.down, nn.Identity) or tuple(c.conv1_1x1.stride) != (1, 1):
                return f"{where}'s MBConv block strides before its depthwise convolution (stride_mode 'pool'/'1x1')"
            if not (isinstance(dw, nn.Conv2d) and dw.groups == dw.in_channels == dw.out_channels):
                return f"{where}'s MBConv k×k convolution is not depthwise"
            sc = c.shortcut
            if not isinstance(sc, nn.Identity) and type(getattr(sc, "pool", None)).__name__ not in _AVG_POOLS:
                return f"{where}'s strided shortcut is not an average pool (pool_type 'avg2'/'avg')"
            for layer in (b.attn_block, b.attn_grid):
                if layer is None:
                    continue
                want = _PARTITION_LAYERS.get(type(layer).__name__)
                if want is None or type(layer.attn).__name__ != want:
                    return f"{where}'s {type(layer).__name__} is not a block/grid partition attention"
    return None


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
        problem = _partition_problem(m) if kinds & {"MaxxVitBlock", "ParallelMaxxVitBlock"} else None
        #: whether GradSkip's MaxViT path reads the model (``session(partitions=True)``)
        self.partitioned = bool(kinds & {"MaxxVitBlock", "ParallelMaxxVitBlock"}) and problem is None
        if self.partitioned:
            why = _MAXVIT_SEQUENCE
            self.capabilities = TimmMaxxVitAdapter.capabilities | {ATTENTION, PARTITION_ATTENTION}
        elif kinds & {"MaxxVitBlock", "ParallelMaxxVitBlock"}:
            why = f"{_MAXVIT}; GradSkip's MaxViT path does not read it: {problem}"
        elif self.transformer:
            why = _COATNET
        else:
            why = "its stages are convolution blocks only (MBConv or ConvNeXt): it has no attention and no tokens"
        self.capability_notes = {c: why for c in _SEQUENCE_CAPS if not (self.partitioned and c == ATTENTION)}
        if not self.partitioned:
            self.capability_notes[PARTITION_ATTENTION] = why
        self.capability_notes.update({
            TOKENS: "its convolution blocks and window/grid partitions need the full feature map: tokens cannot be "
                    "dropped",
            PIXEL_LOGITS: "the model outputs class logits (B, K), not per-pixel logits",
        })
        self._partitions = False  # set for the duration of a session(partitions=True)
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

    # -- GradSkip's recording (docs/methods/gradskip.md, MaxViT) ---------------------------------------------------
    @contextlib.contextmanager
    def session(self, capture: bool = True, conservative: bool = False, recompute: bool = False, *,
                partitions: bool = False) -> Iterator[Any]:
        """:meth:`Adapter.session`; with ``partitions`` (a MaxViT the path reads) it records a
        :class:`~vitlens.models._partitions.PartitionRecording` instead of the final feature map, with explicit
        attention, and ``conservative`` makes every LayerNorm of the model (channels-last and ``LayerNorm2d``) hold
        its standard deviation constant in the backward pass."""
        if partitions and not self.partitioned:
            raise UnsupportedModelError(f"{type(self.model).__name__}: {self.lacking(PARTITION_ATTENTION)}")
        self._partitions = partitions
        hooks: list[Any] = []
        try:
            with super().session(capture=capture, conservative=conservative, recompute=recompute) as rec:
                if partitions and conservative:
                    hooks += [m.register_forward_hook(_conservative_layernorm2d) for m in self._layernorms(True)]
                yield rec
        finally:
            for hnd in hooks:
                hnd.remove()
            self._partitions = False

    def _layernorms(self, two_d: bool) -> list[nn.Module]:
        return [m for m in normalisation_layers(self.model) if _is_layernorm2d(m) == two_d]

    def layernorms(self) -> list[nn.Module]:
        """In a partitions session the channels-last LayerNorms (``LayerNorm2d`` get their own hook); else none."""
        return self._layernorms(False) if self._partitions else []

    def _new_recording(self) -> Any:
        return PartitionRecording() if self._partitions else super()._new_recording()

    @contextlib.contextmanager
    def _explicit_attention(self) -> Iterator[None]:
        attns = [layer.attn for st in self.model.stages for b in st.blocks
                 for layer in (getattr(b, "attn_block", None), getattr(b, "attn_grid", None)) if layer is not None]
        with switched(attns if self._partitions else [], "fused_attn", False):
            yield

    def _install_capture(self, rec: Recording, hooks: list) -> None:
        if not self._partitions:
            super()._install_capture(rec, hooks)
            return
        assert isinstance(rec, PartitionRecording)
        first = True
        for s, st in enumerate(self.model.stages):
            for b in st.blocks:
                brec = MaxVitBlockRecord(stage=s)
                rec.blocks.append(brec)
                if first:
                    hooks.append(b.register_forward_pre_hook(_leaf_input_hook(rec)))
                    first = False
                hooks += _mbconv_hooks(b.conv, brec)
                for kind, layer in (("block", b.attn_block), ("grid", b.attn_grid)):
                    if layer is not None:
                        prec = PartitionRecord(kind=kind, size=int_pair(tuple(layer.partition_size)))
                        brec.attns.append(prec)
                        hooks += _partition_hooks(layer, prec)

        def final_hook(module: nn.Module, args: tuple, out: Tensor) -> None:
            rec.final = out

        hooks.append(self.model.stages[-1].register_forward_hook(final_hook))


def _is_layernorm2d(m: nn.Module) -> bool:
    """timm's channels-first LayerNorms (``LayerNorm2d`` and its float32 variant) normalise dimension 1."""
    return isinstance(m, nn.LayerNorm) and type(m).__name__.startswith("LayerNorm2d")


def _conservative_layernorm2d(module: nn.Module, inputs: tuple, output: Tensor) -> Tensor:
    """:func:`~vitlens.models.base.conservative_layernorm_hook` for a channels-first ``(B, C, H, W)`` LayerNorm."""
    x = inputs[0].permute(0, 2, 3, 1)
    return conservative_layernorm_hook(module, (x,), output.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


def _leaf_input_hook(rec: PartitionRecording) -> Any:
    """The first block's input becomes a leaf that requires grad (the backward stops there); its grid is the maps'."""

    def hook(module: nn.Module, args: tuple) -> tuple:
        u = args[0].detach().requires_grad_(True)
        rec.start = (int(u.shape[-2]), int(u.shape[-1]))
        return (u, *args[1:])

    return hook


def _op_hook(brec: MaxVitBlockRecord, attr: str) -> Any:
    def hook(module: nn.Module, args: tuple, out: Tensor) -> None:
        setattr(brec.conv, attr, WindowOpRecord(module=module, input=args[0].detach(), output=out))

    return hook


def _mbconv_hooks(conv: Any, brec: MaxVitBlockRecord) -> list[Any]:
    """The MBConv block's output and shortcut, its depthwise convolution and its shortcut pool (if strided)."""

    def out_hook(module: nn.Module, args: tuple, out: Tensor) -> None:
        brec.conv.out = out
        if isinstance(conv.shortcut, nn.Identity):
            brec.conv.shortcut = args[0].detach()

    def shortcut_hook(module: nn.Module, args: tuple, out: Tensor) -> None:
        brec.conv.shortcut = out.detach()

    hooks = [conv.register_forward_hook(out_hook), conv.conv2_kxk.register_forward_hook(_op_hook(brec, "dw"))]
    if not isinstance(conv.shortcut, nn.Identity):
        hooks += [conv.shortcut.register_forward_hook(shortcut_hook),
                  conv.shortcut.pool.register_forward_hook(_op_hook(brec, "pool"))]
    return hooks


def _partition_hooks(layer: Any, prec: PartitionRecord) -> list[Any]:
    """A block/grid partition attention: its input ``u``, the stream after the attention residual ``h`` (the MLP
    norm's input), the probabilities (the attention dropout's output) and the value norms (from the ``qkv``
    output), all as ``(B, H·W, C)`` / ``(B·nP, heads, N[, N])``."""
    attn = layer.attn
    heads, dh, head_first = int(attn.num_heads), int(attn.dim_head), bool(attn.head_first)
    channels_last = type(layer).__name__ == "PartitionAttentionCl"

    def tokens(t: Tensor) -> Tensor:
        return t.reshape(t.shape[0], -1, t.shape[-1]) if channels_last else t.flatten(2).transpose(1, 2)

    def u_hook(module: nn.Module, args: tuple) -> None:
        u = args[0]
        prec.grid = (int(u.shape[1]), int(u.shape[2])) if channels_last else (int(u.shape[2]), int(u.shape[3]))
        prec.u = tokens(u.detach())
        prec.channels_last = channels_last

    def h_hook(module: nn.Module, args: tuple) -> None:
        prec.h = args[0]  # as the block holds it (its gradient is the whole stream's: MLP branch and residual)

    def attn_hook(module: nn.Module, args: tuple, out: Tensor) -> None:
        prec.attn = out

    def qkv_hook(module: nn.Module, args: tuple, out: Tensor) -> None:
        with torch.no_grad():
            n = out.shape[0]
            if channels_last:  # (B·nP, p, q, 3·heads·dh)
                t = out.detach().reshape(n, -1, heads, 3 * dh) if head_first else \
                    out.detach().reshape(n, -1, 3, heads, dh)[:, :, 2]
                v = t[..., 2 * dh:] if head_first else t
                prec.vnorm = v.norm(dim=-1).transpose(1, 2)  # (B·nP, heads, N)
            else:  # (B·nP, 3·heads·dh, p, q)
                t = out.detach().reshape(n, heads, 3 * dh, -1)[:, :, 2 * dh:] if head_first else \
                    out.detach().reshape(n, 3, heads, dh, -1)[:, 2]
                prec.vnorm = t.norm(dim=2)

    return [layer.register_forward_pre_hook(u_hook), layer.norm2.register_forward_pre_hook(h_hook),
            attn.attn_drop.register_forward_hook(attn_hook), attn.qkv.register_forward_hook(qkv_hook)]
