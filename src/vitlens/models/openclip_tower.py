"""Adapter for open_clip's own ``VisionTransformer`` (the image tower of open_clip's ``ViT-*`` CLIP models; its
SigLIP models use timm towers, read by the timm adapters).

Its blocks (``ResidualAttentionBlock``: ``ln_1``, ``attn`` = ``torch.nn.MultiheadAttention``, ``ln_2``, ``mlp``)
call the attention with ``need_weights=False`` (the fused path, no probabilities). For a capture session each
attention module gets, on this instance only, a pre-hook that asks for the per-head probabilities and a hook that
recomputes the attention output from them, ``out_proj(A · v)`` with ``v`` the value projection of the block's
input: the block then mixes its values with the probability tensor the capture records (same output up to float
rounding), so gradients reach it. Both hooks are removed when the session ends, also after an exception.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import UnsupportedModelError
from ._sequence import BlockParts, SequenceAdapter
from .base import LRPLinears, int_pair
from .capabilities import LRP_LINEARS, STREAM_HEAD

__all__ = ["OpenClipTowerAdapter"]


def _is_open_clip_vit(model: nn.Module) -> bool:
    return type(model).__name__ == "VisionTransformer" and type(model).__module__.startswith("open_clip") \
        and hasattr(getattr(model, "transformer", None), "resblocks")


def _explicit_hooks(mha: nn.MultiheadAttention) -> tuple[Any, Any]:
    """The pre-hook (ask for per-head probabilities) and the hook (recompute the output from them) of one module."""

    def pre(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return args, {**kwargs, "need_weights": True, "average_attn_weights": False}

    def post(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        probs = output[1]  # (B, H, T_q, T_k), part of the graph through q and k
        value = args[2] if len(args) > 2 else kwargs.get("value", args[0])
        if not mha.batch_first:
            value = value.transpose(0, 1)
        b, t, d = value.shape
        h = mha.num_heads
        w = mha.in_proj_weight[2 * d:] if mha.in_proj_weight is not None else mha.v_proj_weight
        bias = mha.in_proj_bias[2 * d:] if mha.in_proj_bias is not None else None
        v = F.linear(value, w, bias).reshape(b, t, h, d // h).transpose(1, 2)  # (B, H, T, d)
        out = (probs @ v).transpose(1, 2).reshape(b, probs.shape[2], d)
        out = mha.out_proj(out)
        if not mha.batch_first:
            out = out.transpose(0, 1)
        return out, probs

    return pre, post


_PACKED = ("open_clip's blocks compute queries, keys and values in one packed in_proj inside "
           "torch.nn.MultiheadAttention: there are no nn.Linear q/k/v modules for the LRP rules")


class OpenClipTowerAdapter(SequenceAdapter):
    """open_clip ``VisionTransformer`` (CLS token or a pooled readout; no attention-pool head)."""

    family = "open_clip-vit"
    model: Any

    @staticmethod
    def matches(model: nn.Module) -> bool:
        return _is_open_clip_vit(model)

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        if getattr(model, "attn_pool", None) is not None:
            raise UnsupportedModelError("open_clip VisionTransformer with an attentional pooler (CoCa) is not read")
        pool = str(getattr(model, "pool_type", "tok"))
        self.num_prefix_tokens = 1
        self.readout_tokens = (0,) if pool == "tok" else None
        self.patch_size = int_pair(model.patch_size)
        self.default_size = int_pair(model.image_size)
        self.any_size = False
        self.in_chans = int(model.conv1.in_channels)
        self.num_classes = int(model.output_dim)
        self.capability_notes = {LRP_LINEARS: _PACKED}
        if callable(getattr(model, "_pool", None)) and getattr(model.transformer, "batch_first", True):
            self.capabilities = self.capabilities | {STREAM_HEAD}
        else:
            self.capability_notes[STREAM_HEAD] = ("this open_clip version's VisionTransformer has no _pool(tokens) "
                                                  "(or runs its blocks sequence-first): its readout is not read from a "
                                                  "block's tokens")
        self._parts = []
        for i, blk in enumerate(model.transformer.resblocks):
            mha = getattr(blk, "attn", None)
            if not isinstance(mha, nn.MultiheadAttention) or mha.in_proj_weight is None or \
                    not isinstance(getattr(blk, "ln_2", None), nn.Module):
                raise UnsupportedModelError(f"open_clip block {i} ({type(blk).__name__}) is not a pre-norm block "
                                            "with torch's MultiheadAttention (packed in_proj) and ln_2")
            d = mha.embed_dim
            bias = None if mha.in_proj_bias is None else mha.in_proj_bias[2 * d:]
            self._parts.append(BlockParts(block=blk, attention=mha, probs_at=mha, probs_index=1, norm2=blk.ln_2,
                                          value=(mha.in_proj_weight[2 * d:], bias), heads=int(mha.num_heads)))

    def parts(self) -> list[BlockParts]:
        return self._parts

    def grid(self, input_hw: tuple[int, int]) -> tuple[int, int]:
        ph, pw = int_pair(self.model.patch_size)
        return input_hw[0] // ph, input_hw[1] // pw

    def stream_logits(self, tokens: Tensor) -> Tensor:
        """The tower's output ``(B, D)`` from the residual stream ``tokens`` ``(B, T, D)`` after any block, as its
        forward ends: ``_pool`` (``ln_post`` and the CLS token or token mean, in the model's order), then ``proj``."""
        if STREAM_HEAD not in self.capabilities:
            raise UnsupportedModelError(f"{type(self.model).__name__}: {self.capability_notes[STREAM_HEAD]}")
        pooled, _ = self.model._pool(tokens)
        return pooled if self.model.proj is None else pooled @ self.model.proj

    def lrp_linears(self) -> list[LRPLinears]:
        raise UnsupportedModelError(_PACKED)

    @contextlib.contextmanager
    def _explicit_attention(self) -> Iterator[None]:
        handles = []
        try:
            for p in self._parts:
                pre, post = _explicit_hooks(p.attention)  # type: ignore[arg-type]
                handles.append(p.attention.register_forward_pre_hook(pre, with_kwargs=True))
                handles.append(p.attention.register_forward_hook(post, with_kwargs=True))
            yield
        finally:
            for h in handles:
                h.remove()
