"""Adapter for the vision transformers of transformers' ``CLIPModel``, ``SiglipModel`` and ``Siglip2Model`` (their
``vision_model``): pre-norm layers (``self_attn`` with ``q/k/v/out_proj``, ``layer_norm2``, ``mlp.fc1/fc2``) read
through the shared capture of :mod:`._sequence`, eager attention switched on through the configs for a session.

Readout: CLIP's image embedding is the projection of the normalised CLS token; SigLIP's and SigLIP2's is the
attention-pool head over all tokens (a pooled readout; GradSkip starts in proportion to gradient × input there).
SigLIP2 takes patches cut from the image (:func:`vitlens.models.vlm.VisionLanguageModel` cuts them) with its position
embeddings resized to the image's grid, so any multiple of the patch size runs.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from torch import nn

from ..errors import UnsupportedModelError
from ._hf import eager_attention
from ._sequence import BlockParts, SequenceAdapter
from .base import LRPLinears, int_pair, linears_at
from .capabilities import LRP_LINEARS, TOKENS

__all__ = ["HFVisionTowerAdapter"]


def _model_type(model: nn.Module) -> str:
    return str(getattr(getattr(model, "config", None), "model_type", "") or "")


class HFVisionTowerAdapter(SequenceAdapter):
    """The ``vision_model`` of a transformers CLIP, SigLIP or SigLIP2 model."""

    family = "hf-vision-tower"

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
        self.capabilities = self.capabilities | {LRP_LINEARS} | (frozenset() if self.siglip2 else {TOKENS})
        self.capability_notes = dict(self.capability_notes)
        if self.siglip2:
            self.capability_notes[TOKENS] = "SigLIP2's attention mask and position embeddings are built for the full " \
                                            "patch set"
        heads = int(cfg.num_attention_heads)
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

    def lrp_linears(self) -> list[LRPLinears]:
        return [linears_at(p.block, i, qkv=[("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")],
                           proj=("self_attn.out_proj",), fc1=("mlp.fc1",), fc2=("mlp.fc2",))
                for i, p in enumerate(self._parts)]

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
