"""Adapter for timm ``MultiScaleVit`` (MViTv2): its pooling attention, recorded for the pooled GradSkip path
(``docs/methods/gradskip.md``, "MViTv2"), and its final token features for class-activation maps.

An MViTv2 block pools inside its attention: the queries by a 3×3 depthwise convolution (strided at the first block of
a stage, so the block's output has fewer tokens than its input), the keys and values by strided depthwise
convolutions (each followed by a LayerNorm over the head dimension); it adds the pooled queries to the attention
output (residual pooling), adds a decomposed relative position bias to the logits, and max-pools (and, where the width
changes, projects) its residual path at stage transitions. A capture session records all of it per block in a
:class:`PooledRecording` (capability ``pooling_attention``): the block input ``u`` (a fresh leaf at the first block),
the attention output ``a`` and the stream after the attention residual ``h`` (so the skip is ``h − a``), the
max-pool's input, the pooled, normed queries, keys and values, each pooling convolution's input and output
(:class:`~._stages.ConvRecord`) and the input ``o = A·v + q`` of the output projection. The model has no module
whose output is the attention matrix, so :func:`attention_probabilities` recomputes it from the recorded queries and
keys with the model's own relative-position term (equal to the forward's up to float rounding, a test checks
``o − q = A·v``). The attention rows map a block's ``T_q`` pooled queries onto its ``T_k`` pooled keys and the skip
changes the token grid, so there is no single token sequence: rollout, GAE and the LRP rules stay refused.

Features: the last stage's output tokens ``(B, [CLS +] h·w, C)``, the input of the final norm (the counterpart
of a CNN's final feature map), on the last stage's grid.

Input sizes: the model's relative position tables are built for its ``img_size``; smaller inputs run (the tables
are indexed for the smaller grid), larger ones index past them, so :meth:`TimmMViTAdapter.check_input` refuses a
token grid larger than the one the model was built for (and, with absolute position embeddings, any other size).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import InputError, UnsupportedModelError
from ._stages import ConvRecord, StageBlockRecord, conv_hook, conv_output_size, residual_input_hook
from .base import Adapter, Recording, int_pair
from .capabilities import (ATTENTION, BLOCK_IO, CLASS_ATTENTION, CLASS_LOGITS, FEATURE_MAPS, FEATURES, LRP_LINEARS,
                           PIXEL_LOGITS, POOLING_ATTENTION, STAGES, TOKEN_GRID, TOKEN_SEQUENCE, TOKENS, WINDOWS)
from .feature_maps import feature_maps_reason

__all__ = ["PooledBlockRecord", "PooledRecording", "TimmMViTAdapter", "attention_probabilities"]

_POOLING = ("MViTv2's pooling attention maps each block's pooled queries (a 3×3 depthwise convolution, strided at "
            "stage transitions, so a block's output has fewer tokens than its input) onto pooled keys and values "
            "(strided depthwise convolutions), adds the pooled queries to the attention output (residual pooling) and "
            "max-pools the residual path at stage transitions: its attention matrices are not square and successive "
            "blocks do not share their tokens, so there is no single token sequence to multiply attention along or "
            "to declare plain-block linear maps on")
#: why class-activation maps are refused on a class-token readout
_CLS_READOUT = ("the classifier reads the class token alone (global_pool='token'), so at the last stage's output the "
                "patch tokens carry no gradient and a class-activation map there would be all zero; the class token "
                "gathers them inside the last block's attention (GradSkip follows that path)")
_NOTES = {
    BLOCK_IO: _POOLING, TOKEN_SEQUENCE: _POOLING, LRP_LINEARS: _POOLING,
    STAGES: "its stages are recorded as pooling attention, not as SegFormer-style stages with one key reduction",
    WINDOWS: "its attention is global over pooled keys, not windowed",
    CLASS_ATTENTION: "it has no class-attention blocks",
    TOKENS: "its query pooling and relative position tables are built for the full token grid: tokens cannot be "
            "dropped",
    PIXEL_LOGITS: "the model outputs class logits (B, K), not per-pixel logits",
}
_UNREAD = ("the attention pools before its q/k/v maps (pool_first=True) or pools with unshared convolutions; the "
           "pooled relevance path reads per-head depthwise pooling after the q/k/v map")


@dataclass
class PooledBlockRecord:
    """One MViTv2 block as a capture session saw it (shapes: ``B`` images, ``T_in`` input tokens on the grid
    ``grid_in``, ``T_q`` pooled queries = output tokens on ``q_size``, ``T_k`` pooled keys on ``k_size``, ``H``
    heads of width ``d``; the CLS token, where the model has one, is token 0 of every sequence and passes every
    pooling unpooled).

    ``u`` ``(B, T_in, C_in)``: the block input (a leaf at the first block); ``a`` ``(B, T_q, C)``: the attention
    output (after its projection, detached); ``h`` ``(B, T_q, C)``: the stream after the attention residual (in the
    graph), so the skip is ``h − a``; ``skip_pool``/``skip_in``: the skip's ``nn.MaxPool2d`` and its input
    ``(B, C, h, w)`` (detached; ``None`` when the block does not pool its skip); ``q`` ``(B, H, T_q, d)``, ``k``,
    ``v`` ``(B, H, T_k, d)``: the pooled, normed queries, keys and values (detached); ``pool_q``/``pool_k``/``pool_v``:
    the pooling convolutions as :class:`ConvRecord` (input ``(B·H, d, h_in, w_in)`` detached, output in the graph;
    ``None`` where the block does not pool); ``o`` ``(B, T_q, H·d)``: the input of the output projection,
    ``A·v + q`` (in the graph; its gradient is ``∂y/∂(A·v)``); ``attn``: the attention module (scale, relative
    position tables, ``residual_pooling``)."""

    u: Tensor | None = None
    grid_in: tuple[int, int] | None = None
    a: Tensor | None = None
    h: Tensor | None = None
    skip_pool: nn.Module | None = None
    skip_in: Tensor | None = None
    q: Tensor | None = None
    k: Tensor | None = None
    v: Tensor | None = None
    pool_q: ConvRecord | None = None
    pool_k: ConvRecord | None = None
    pool_v: ConvRecord | None = None
    o: Tensor | None = None
    q_size: tuple[int, int] | None = None
    k_size: tuple[int, int] | None = None
    attn: Any = None


class PooledRecording:
    """What a capture session of MViTv2 records: ``blocks`` (:class:`PooledBlockRecord`, forward order), ``final``
    (the input of the final norm, in the graph) and ``features`` (``[final]``: the one feature layer)."""

    def __init__(self) -> None:
        self.blocks: list[PooledBlockRecord] = []
        self.final: Tensor | None = None
        self.features: list[Tensor] = []
        self.recompute = False

    def graph_tensors(self) -> list[Tensor]:
        """The captured tensors the pooled relevance path differentiates: ``final``, then per block ``h``, ``o`` and
        the pooling convolutions' outputs."""
        out = [] if self.final is None else [self.final]
        for b in self.blocks:
            out += [t for t in (b.h, b.o) if t is not None]
            out += [c.output for c in (b.pool_q, b.pool_k, b.pool_v) if c is not None]
        return out


def attention_probabilities(brec: PooledBlockRecord) -> Tensor:
    """The block's attention probabilities ``(B, H, T_q, T_k)``, recomputed without grad from the recorded queries
    and keys as the model computes them: ``softmax(q·scale·kᵀ + rel_h + rel_w)`` with timm's decomposed
    relative-position term (``cal_rel_pos_type``) where the model has it. In at least float32."""
    from timm.models.mvitv2 import cal_rel_pos_type

    att = brec.attn
    q, k = brec.q, brec.k
    if q is None or k is None or brec.q_size is None or brec.k_size is None:
        raise UnsupportedModelError("the model's recording has no pooled queries or keys: its capture hooks did not "
                                    "fill them")
    dtype = torch.promote_types(q.dtype, torch.float32)
    q, k = q.to(dtype), k.to(dtype)
    with torch.no_grad():
        logits = (q * att.scale) @ k.transpose(-2, -1)
        if att.rel_pos_type == "spatial":
            logits = cal_rel_pos_type(logits, q, att.has_cls_token, list(brec.q_size), list(brec.k_size),
                                      att.rel_pos_h.to(dtype), att.rel_pos_w.to(dtype))
        return logits.softmax(dim=-1)


class TimmMViTAdapter(Adapter):
    """timm ``MultiScaleVit`` (MViTv2): class logits, its pooling attention and one feature layer, the last
    stage's tokens."""

    #: the wrapped model; typed ``Any`` because the family's submodules are reached by attribute
    model: Any

    family = "timm-mvitv2"
    capabilities = frozenset({CLASS_LOGITS, ATTENTION, POOLING_ATTENTION, FEATURES, TOKEN_GRID})
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
        self.any_size = False  # the built size, or smaller without absolute position embeddings (check_input)
        self._maps_reason = feature_maps_reason(m, self.size)
        blocks: list[Any] = self.blocks()
        if not all(type(b.attn).__name__ == "MultiScaleAttention" and not b.attn.unshared for b in blocks):
            self.capabilities = self.capabilities - {ATTENTION, POOLING_ATTENTION}
            self.capability_notes = {**_NOTES, ATTENTION: _UNREAD, POOLING_ATTENTION: _UNREAD}
        if m.global_pool == "token":  # the classifier reads the class token alone
            self.capabilities = self.capabilities - {FEATURES}
            self.capability_notes = {**self.capability_notes, FEATURES: _CLS_READOUT}

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

    def _new_recording(self) -> PooledRecording:
        return PooledRecording()

    def _install_capture(self, rec: Recording, hooks: list) -> None:
        record: Any = rec  # a PooledRecording (what _new_recording made; the base types it as Recording)
        pooled = self.provides(POOLING_ATTENTION)
        for i, blk in enumerate(self.blocks() if pooled else []):
            brec = PooledBlockRecord(attn=blk.attn)
            record.blocks.append(brec)
            self._capture_block(blk, brec, leaf=(i == 0), hooks=hooks)

        def final_hook(module: nn.Module, args: tuple) -> Any:
            # without the pooled capture the final norm's input is the leaf (only the norm and head are differentiated)
            u = args[0] if pooled else args[0].detach().requires_grad_(True)
            record.final = u
            record.features = [u]
            return None if pooled else (u, *args[1:])

        hooks.append(self.model.norm.register_forward_pre_hook(final_hook))

    def _capture_block(self, blk: Any, brec: PooledBlockRecord, leaf: bool, hooks: list) -> None:
        att, heads = blk.attn, int(blk.attn.num_heads)
        first = residual_input_hook(StageBlockRecord(), leaf)  # the first block's input becomes a leaf

        def block_hook(module: nn.Module, args: tuple, kwargs: dict) -> Any:
            out = first(module, args, kwargs)
            brec.u = (out[0] if out is not None else args)[0]
            brec.grid_in = int_pair(tuple((out[0] if out is not None else args)[1]))
            return out

        def qkv_hook(module: nn.Module, args: tuple, out: Tensor) -> None:
            b, n = out.shape[:2]
            q, k, v = out.detach().reshape(b, n, 3, heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
            brec.q, brec.k, brec.v = q, k, v  # replaced by the pooled, normed ones where the block pools
            brec.q_size = brec.k_size = brec.grid_in

        def setter(name: str):
            def hook(module: nn.Module, args: tuple, out: Tensor) -> None:
                setattr(brec, name, out.detach())
            return hook

        def pool_hook(name: str):
            keep = conv_hook(brec, f"pool_{name}")

            def hook(module: nn.Module, args: tuple, out: Tensor) -> None:
                keep(module, args, out)
                if name != "v":
                    setattr(brec, f"{name}_size", (int(out.shape[-2]), int(out.shape[-1])))
            return hook

        def attn_hook(module: nn.Module, args: tuple, out: Any) -> None:
            brec.a = out[0].detach()

        def skip_hook(module: nn.Module, args: tuple, out: Tensor) -> None:
            brec.skip_pool, brec.skip_in = module, args[0].detach()

        def o_hook(module: nn.Module, args: tuple) -> None:
            brec.o = args[0]

        def h_hook(module: nn.Module, args: tuple) -> None:
            brec.h = args[0]

        hooks.append(blk.register_forward_pre_hook(block_hook, with_kwargs=True))
        hooks.append(att.qkv.register_forward_hook(qkv_hook))
        for name in ("q", "k", "v"):
            if getattr(att, f"pool_{name}") is not None:
                hooks.append(getattr(att, f"pool_{name}").register_forward_hook(pool_hook(name)))
            if getattr(att, f"norm_{name}") is not None:
                hooks.append(getattr(att, f"norm_{name}").register_forward_hook(setter(name)))
        hooks.append(att.register_forward_hook(attn_hook))
        hooks.append(att.proj.register_forward_pre_hook(o_hook))
        hooks.append(blk.norm2.register_forward_pre_hook(h_hook))
        if blk.shortcut_pool_attn is not None:
            hooks.append(blk.shortcut_pool_attn.register_forward_hook(skip_hook))

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
