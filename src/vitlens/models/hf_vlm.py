"""Adapter for the vision transformers of transformers' ``CLIPModel``, ``SiglipModel`` and ``Siglip2Model`` (their
``vision_model``): pre-norm layers (``self_attn`` with ``q/k/v/out_proj``, ``layer_norm2``, ``mlp.fc1/fc2``) read
through the shared capture of :mod:`._sequence`, eager attention switched on through the configs for a session.

Readout: CLIP's image embedding is the projection of the normalised CLS token; SigLIP's and SigLIP2's is the
attention-pool head over all tokens (a pooled readout; GradSkip starts in proportion to gradient × input there).
SigLIP2 takes patches cut from the image (:func:`vitlens.models.vlm.VisionLanguageModel` cuts them) with its position
embeddings resized to the image's grid, so any multiple of the patch size runs.

CLIP and SigLIP towers on transformers' SDPA attention (the default) also offer ``session(recompute=True)``: the model
keeps its fused attention and the capture records, at each ``scaled_dot_product_attention`` call, the queries, keys,
values and scale, and the input of ``out_proj`` (:mod:`._fused_calls`); GradSkip then gets each block's probabilities
from the attention's own backward, as on timm's fused ViTs.

CLIP's readout path (:meth:`HFVisionTowerAdapter.readout_only`, as :mod:`._readout` for timm): the image embedding
reads the CLS token only, so within the context the last layer computes its keys and values (and, for GradSkip, its
queries) for every token but its attention output, output projection, residual adds and MLP for CLS only; the
post-layernorm and projection then read that row. Only the last layer's instance ``forward`` is set, and removed in
``finally``; it applies outside capture sessions and in ``recompute`` sessions (it records the last block's queries,
keys and values itself), not in explicit-attention sessions.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import UnsupportedModelError
from ._fused_calls import install
from ._hf import eager_attention
from ._sequence import BlockParts, SequenceAdapter
from .base import BlockRecord, LRPLinears, Recording, int_pair, linears_at
from .capabilities import LRP_LINEARS, STREAM_HEAD, TOKENS
from .timm_naflexvit import ATTENTION_POOL, LRP_THROUGH_HEAD

__all__ = ["HFVisionTowerAdapter"]


def _model_type(model: nn.Module) -> str:
    return str(getattr(getattr(model, "config", None), "model_type", "") or "")


class HFVisionTowerAdapter(SequenceAdapter):
    """The ``vision_model`` of a transformers CLIP, SigLIP or SigLIP2 model."""

    family = "hf-vision-tower"
    fused_call_records_values = True  # a recompute session reads the values where the fused kernel receives them

    @staticmethod
    def matches(model: nn.Module) -> bool:
        kind = _model_type(model)
        return (kind.startswith(("clip", "siglip")) and hasattr(model, "embeddings")
                and isinstance(getattr(getattr(model, "encoder", None), "layers", None), nn.ModuleList))

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        cfg: Any = model.config
        kind = _model_type(model)
        self.siglip2 = kind.startswith("siglip2")
        self.family = "hf-siglip2-tower" if self.siglip2 else "hf-siglip-tower" if kind.startswith("siglip") \
            else "hf-clip-tower"
        clip = self.family == "hf-clip-tower"
        self.num_prefix_tokens = 1 if clip else 0
        self.readout_tokens = (0,) if clip else None
        if not clip and getattr(model, "head", None) is None:  # SigLIP without its head: the token mean
            self.readout_tokens = None
        self.patch_size = int_pair(cfg.patch_size)
        if self.siglip2:
            side = int(round(int(cfg.num_patches) ** 0.5)) * self.patch_size[0]
            self.default_size = (side, side)
            self.any_size = True
        else:
            self.default_size = int_pair(cfg.image_size)
            self.any_size = False
        self.in_chans = int(getattr(cfg, "num_channels", 3))
        self.num_classes = int(getattr(cfg, "projection_dim", 0) or cfg.hidden_size)
        pooled_head = not clip and getattr(model, "head", None) is not None  # SigLIP's attention-pool head
        self.capabilities = self.capabilities | (frozenset() if pooled_head else {LRP_LINEARS}) | \
            (frozenset() if self.siglip2 else {TOKENS})
        self.capability_notes = dict(self.capability_notes)
        if pooled_head:
            self.capability_notes[LRP_LINEARS] = ATTENTION_POOL + LRP_THROUGH_HEAD
        if self.siglip2:
            self.capability_notes[TOKENS] = "SigLIP2's attention mask and position embeddings are built for the full " \
                                            "patch set"
        if clip or pooled_head:
            self.capabilities = self.capabilities | {STREAM_HEAD}
        else:
            self.capability_notes[STREAM_HEAD] = "this SigLIP tower has no attention-pool head (vision_use_head=False)" \
                                                 ": its output has no pooled embedding to read"
        heads = int(cfg.num_attention_heads)
        self._live: Recording | None = None  # the recording of the session that is open, if any
        self._parts = []
        for i, layer in enumerate(model.encoder.layers):
            att, norm2 = getattr(layer, "self_attn", None), getattr(layer, "layer_norm2", None)
            v = getattr(att, "v_proj", None)
            if not isinstance(att, nn.Module) or not isinstance(v, nn.Linear) or not isinstance(norm2, nn.Module):
                raise UnsupportedModelError(f"{type(model).__name__} layer {i} ({type(layer).__name__}) is not a "
                                            "pre-norm layer with self_attn.v_proj and layer_norm2")
            self._parts.append(BlockParts(block=layer, attention=att, probs_at=att, probs_index=1, norm2=norm2,
                                          value=(v.weight, v.bias), heads=heads))

    def parts(self) -> list[BlockParts]:
        return self._parts

    def stream_logits(self, tokens: Tensor) -> Tensor:
        """The tower's pooled output ``(B, D)`` from the residual stream ``tokens`` ``(B, T, D)`` after any layer, as
        its forward ends: CLIP ``post_layernorm(tokens[:, 0])`` (the CLS token, then the norm); SigLIP
        ``head(post_layernorm(tokens))`` (the norm on every token, then the attention-pool head; SigLIP2's head with
        every patch valid, as :func:`~vitlens.models.vlm.naflex_inputs` cuts them)."""
        if STREAM_HEAD not in self.capabilities:
            raise UnsupportedModelError(f"{type(self.model).__name__}: {self.capability_notes[STREAM_HEAD]}")
        if self.family == "hf-clip-tower":
            return self.model.post_layernorm(tokens[:, 0])
        seq = self.model.post_layernorm(tokens)
        if self.siglip2:
            return self.model.head(seq, torch.ones(seq.shape[:2], dtype=torch.long, device=seq.device))
        return self.model.head(seq)

    def lrp_linears(self) -> list[LRPLinears]:
        return [linears_at(p.block, i, qkv=[("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")],
                           proj=("self_attn.out_proj",), fc1=("mlp.fc1",), fc2=("mlp.fc2",))
                for i, p in enumerate(self._parts)]

    def _install_capture_live(self, rec: Recording, hooks: list) -> None:
        """Remember the session's recording while it lasts (the readout path records the last block into it)."""
        self._live = rec
        hooks.append(_Forget(self))

    @contextlib.contextmanager
    def readout_only(self, all_queries: bool = True) -> Iterator[bool]:
        layer: Any = self._parts[-1].block
        live = getattr(self, "_live", None)
        if self.readout_tokens != (0,) or self.model.training or "forward" in vars(layer) or \
                (live is not None and not live.recompute) or not isinstance(layer.self_attn.q_proj, nn.Linear):
            yield False
            return
        layer.forward = _readout_forward(self, layer, all_queries)
        try:
            yield True
        finally:
            del layer.forward

    def recomputes_attention(self) -> bool:
        """CLIP and SigLIP towers whose attention runs transformers' SDPA (no mask: every token is valid)."""
        return not self.siglip2 and getattr(self.model.config, "_attn_implementation", None) == "sdpa"

    def _install_capture(self, rec: Recording, hooks: list) -> None:
        self._install_capture_live(rec, hooks)
        if not rec.recompute:
            super()._install_capture(rec, hooks)
            return
        parts = self.parts()
        rec.blocks.extend(BlockRecord() for _ in parts)
        for i, p in enumerate(parts):
            hooks.append(p.block.register_forward_pre_hook(self._leaf_first_block_hook(rec, i), with_kwargs=True))
            hooks.append(p.norm2.register_forward_pre_hook(self._record_h_hook(rec, i)))

        def final_hook(module: nn.Module, args: tuple, output: Any) -> None:
            rec.final = output[0] if isinstance(output, (tuple, list)) else output

        hooks.append(parts[-1].block.register_forward_hook(final_hook))
        install(rec, [p.attention for p in parts], [p.attention.get_submodule("out_proj") for p in parts], hooks)

    def _embedding_module(self) -> nn.Module:
        if TOKENS not in self.capabilities:
            return super()._embedding_module()
        return self.model.embeddings

    @contextlib.contextmanager
    def _explicit_attention(self) -> Iterator[None]:
        configs = [c for c in [self.model.config] + [getattr(m, "config", None) for m in self.model.modules()]
                   if c is not None and hasattr(c, "_attn_implementation")]
        with eager_attention(configs):
            yield


class _Forget:
    """A hook-like handle (``remove()``, called when the session ends) that forgets the adapter's live recording."""

    def __init__(self, adapter: HFVisionTowerAdapter) -> None:
        self.adapter = adapter

    def remove(self) -> None:
        self.adapter._live = None


def _readout_forward(adapter: HFVisionTowerAdapter, layer: Any, all_queries: bool) -> Any:
    """The last CLIP encoder layer on the CLS row only (see the module docstring)."""
    full = type(layer).forward
    attn = layer.self_attn

    def forward(hidden_states: Tensor, attention_mask: Tensor | None = None, *args: Any, **kwargs: Any) -> Tensor:
        live = getattr(adapter, "_live", None)
        if attention_mask is not None or args or (live is not None and not live.recompute):
            return full(layer, hidden_states, attention_mask, *args, **kwargs)  # an explicit capture: every row
        x = hidden_states
        y = layer.layer_norm1(x)
        b, t, d = y.shape
        heads = int(attn.num_heads)
        k = attn.k_proj(y).view(b, t, heads, d // heads).transpose(1, 2)
        v = attn.v_proj(y).view(b, t, heads, d // heads).transpose(1, 2)
        q = attn.q_proj(y if all_queries else y[:, :1]).view(b, -1, heads, d // heads).transpose(1, 2)
        if live is not None and live.blocks:  # a recompute session: the block's record, as the fused capture makes it
            blk = live.blocks[-1]
            blk.query, blk.key, blk.value, blk.scale = q.detach(), k.detach(), v.detach(), float(attn.scale)
        o = F.scaled_dot_product_attention(q[:, :, :1], k, v, scale=float(attn.scale))
        o = attn.out_proj(o.transpose(1, 2).reshape(b, 1, d))
        h = x[:, :1] + o
        return h + layer.mlp(layer.layer_norm2(h))

    return forward
