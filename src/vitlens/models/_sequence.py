"""Shared capture for single-sequence, pre-norm transformer families (the adapters in ``timm_families`` and
``hf_families`` describe their blocks; this module records them).

A block of such a family computes ``h = u + f(attention(norm1(u)))`` then ``out = h + g(mlp(norm2(h)))`` where
``f``, ``g`` are token-wise (layer scale, drop path in eval mode, an inner norm or gate): the residual stream ``u`` is
read at the block's input, ``h`` at ``norm2``'s input. The attention probabilities are the output of one module of
the explicit (non-fused) attention path, *after* everything that enters the softmax (relative position bias, RoPE on
queries and keys, masks): relevance methods see the row-stochastic matrix the block really mixes values with.
The value vectors are recomputed, detached, from the attention module's input with the block's own value weights
(several families add the value bias with ``F.linear`` instead of calling a ``Linear`` module).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import InputError, UnsupportedModelError
from .capabilities import (ATTENTION, BLOCK_IO, CLASS_LOGITS, FEATURE_MAPS, FEATURES, LRP_LINEARS, TOKEN_GRID,
                           TOKEN_SEQUENCE)
from .base import Adapter, BlockRecord, Recording, switched

__all__ = ["BlockParts", "SequenceAdapter", "not_plain", "value_weights"]

_PLAIN = "LRP rules are written for the plain ViT block (qkv, proj, fc1, fc2 as nn.Linear calls, softmax(q·kᵀ/√d))"


def not_plain(why: str) -> str:
    """Why a family lacks :data:`~.capabilities.LRP_LINEARS`: ``why`` (what it adds to the plain ViT block)."""
    return f"{why}; {_PLAIN}"


@dataclass
class BlockParts:
    """Where one block's tensors are. ``probs_at``: the module whose output (or ``output[probs_index]``) is the
    attention probabilities ``(B, heads, T, T)``; ``attention``: the module whose first input is the normalised
    residual stream; ``norm2``: the module whose input is ``h``; ``value``: ``(weight, bias)`` of the value
    projection; ``heads``: number of heads; ``qkv_view_at``: see the field."""

    block: nn.Module
    attention: nn.Module
    probs_at: nn.Module
    probs_index: int | None
    norm2: nn.Module
    value: tuple[Tensor, Tensor | None]
    heads: int
    #: a module inside the attention whose first input is the queries ``(B, heads, T, d)`` as a view of the fused
    #: ``qkv`` output ``(B, T, 3·heads·d)`` (timm EVA: ``q_norm``): the values are then read from that output
    #: instead of recomputed (see :func:`_value_hooks`)
    qkv_view_at: nn.Module | None = None


def value_weights(attn: nn.Module) -> tuple[Tensor, Tensor | None]:
    """``(W_v, b_v)`` of a timm attention module: a separate ``v_proj``, or the value third of a fused ``qkv``
    with its bias from ``v_bias`` (BEiT, EVA: added through ``F.linear``) or from ``qkv.bias``."""
    v_proj = getattr(attn, "v_proj", None)
    if isinstance(v_proj, nn.Linear):
        return v_proj.weight, v_proj.bias
    qkv = getattr(attn, "qkv", None)
    if not isinstance(qkv, nn.Linear) or qkv.out_features % 3:
        raise UnsupportedModelError(f"{type(attn).__name__} has no value projection vitlens can read")
    d = qkv.out_features // 3
    bias = getattr(attn, "v_bias", None)
    if bias is None and qkv.bias is not None:
        bias = qkv.bias[2 * d:]
    return qkv.weight[2 * d:], bias


class SequenceAdapter(Adapter):
    """Base of the single-sequence families: subclasses set the layout and implement :meth:`parts` (and
    :meth:`_explicit_attention` when the family has a fused path)."""

    #: the wrapped model; typed ``Any`` because the family's submodules and config are reached by attribute
    #: (``nn.Module.__getattr__`` types them loosely), after :meth:`matches` and ``__init__`` checked the layout
    model: Any

    capabilities = frozenset({CLASS_LOGITS, ATTENTION, BLOCK_IO, TOKEN_SEQUENCE, FEATURES, FEATURE_MAPS, TOKEN_GRID})
    capability_notes = {LRP_LINEARS: not_plain("this family's blocks are not the plain ViT block")}
    #: a ``recompute`` session of this family records the values where the fused kernel receives them
    #: (:mod:`._fused_calls`): no value hooks then (they would read or recompute the same tensor again)
    fused_call_records_values = False

    def parts(self) -> list[BlockParts]:
        """The blocks, input side first."""
        raise NotImplementedError(f"{type(self).__name__} does not describe its blocks")

    def blocks(self) -> Sequence[nn.Module]:
        return [p.block for p in self.parts()]

    def check_input(self, x: Tensor) -> None:
        super().check_input(x)
        hw = tuple(x.shape[-2:])
        if not self.any_size and self.default_size is not None and hw != tuple(self.default_size):
            raise InputError(
                f"{type(self.model).__name__} expects {self.default_size[0]}x{self.default_size[1]} inputs; "
                f"got {hw[0]}x{hw[1]}"
            )
        if self.patch_size is not None and (hw[0] % self.patch_size[0] or hw[1] % self.patch_size[1]):
            raise InputError(f"input size {hw[0]}x{hw[1]} is not a multiple of the patch size "
                             f"{self.patch_size[0]}x{self.patch_size[1]}")

    def grid(self, input_hw: tuple[int, int]) -> tuple[int, int]:
        if self.patch_size is None:
            raise UnsupportedModelError(f"{type(self.model).__name__} has no patch size")
        return input_hw[0] // self.patch_size[0], input_hw[1] // self.patch_size[1]

    _flags = staticmethod(switched)  # set an attribute of several modules for a context (restored on exit)

    def _install_capture(self, rec: Recording, hooks: list) -> None:
        parts = self.parts()
        rec.blocks.extend(BlockRecord() for _ in parts)
        for i, p in enumerate(parts):
            hooks.append(p.block.register_forward_pre_hook(self._leaf_first_block_hook(rec, i), with_kwargs=True))
            hooks.append(p.norm2.register_forward_pre_hook(self._record_h_hook(rec, i)))
            hooks.append(p.probs_at.register_forward_hook(_probs_hook(rec, i, p.probs_index)))
            if rec.recompute and self.fused_call_records_values:
                continue
            if p.qkv_view_at is None:
                hooks.append(p.attention.register_forward_pre_hook(_value_hook(rec, i, p), with_kwargs=True))
            else:
                pre, at_view, post = _value_hooks(rec, i, p)
                hooks.append(p.attention.register_forward_pre_hook(pre, with_kwargs=True))
                hooks.append(p.qkv_view_at.register_forward_pre_hook(at_view))
                hooks.append(p.attention.register_forward_hook(post))

        def final_hook(module, args, output):
            rec.final = output[0] if isinstance(output, (tuple, list)) else output

        hooks.append(parts[-1].block.register_forward_hook(final_hook))


def _probs_hook(rec: Recording, index: int, at: int | None) -> Callable:
    def hook(module: nn.Module, args: tuple, output) -> None:
        probs = output if at is None else (output[at] if isinstance(output, (tuple, list)) else None)
        if not isinstance(probs, Tensor) or probs.ndim != 4:
            raise UnsupportedModelError(
                f"block {index}: the attention module returned no probabilities (is the eager path switched on?)"
            )
        rec.blocks[index].attn = probs

    return hook


def _attention_input(index: int, args: tuple, kwargs: dict) -> Tensor:
    x = args[0] if args else kwargs.get("hidden_states", kwargs.get("x"))
    if x is None:
        raise UnsupportedModelError(f"block {index}: the attention module was called without its input (no "
                                    "positional argument, hidden_states or x)")
    return x


def _recomputed_values(x: Tensor, parts: BlockParts) -> Tensor:
    weight, bias = parts.value
    with torch.no_grad():
        v = F.linear(x.detach(), weight, bias)
    b, n, d = v.shape
    return v.reshape(b, n, parts.heads, d // parts.heads).permute(0, 2, 1, 3)


def _value_hook(rec: Recording, index: int, parts: BlockParts) -> Callable:
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        rec.blocks[index].value = _recomputed_values(_attention_input(index, args, kwargs), parts)

    return hook


def _values_of_fused_qkv(q: Tensor) -> Tensor | None:
    """The values ``(B, heads, T, d)`` next to the queries ``q`` in the fused ``qkv`` output ``q`` is a view of
    (``qkv.reshape(B, T, 3, heads, d).permute(2, 0, 3, 1, 4)[0]``), or ``None`` if ``q`` is not such a view."""
    base = q._base
    if q.ndim != 4 or base is None:
        return None
    b, h, n, d = q.shape
    c = h * d
    if base.shape[-1] != 3 * c or base.numel() != b * n * 3 * c or not base.is_contiguous() \
            or q.data_ptr() != base.data_ptr() or tuple(q.stride()) != (n * 3 * c, d, 3 * c, 1):
        return None  # (F.linear may return its output as a view of a (B·T, 3·heads·d) product)
    return base.detach().reshape(b, n, 3 * c)[..., 2 * c:].reshape(b, n, h, d).permute(0, 2, 1, 3)


def _value_hooks(rec: Recording, index: int, parts: BlockParts) -> tuple[Callable, Callable, Callable]:
    """The values read from the fused ``qkv`` output at ``parts.qkv_view_at`` (no second projection); ``post``
    recomputes them from the attention's input if that module did not run or got no such view."""
    pending: list[Tensor] = []  # the attention's input while it runs and no values were read

    def pre(module: nn.Module, args: tuple, kwargs: dict) -> None:
        pending[:] = [_attention_input(index, args, kwargs)]
        rec.blocks[index].value = None

    def at_view(module: nn.Module, args: tuple) -> None:
        v = _values_of_fused_qkv(args[0]) if pending and args and isinstance(args[0], Tensor) else None
        if v is not None and v.shape[1] == parts.heads:
            rec.blocks[index].value = v
            pending.clear()

    def post(module: nn.Module, args: tuple, out: object) -> None:
        if pending:
            rec.blocks[index].value = _recomputed_values(pending.pop(), parts)

    return pre, at_view, post
