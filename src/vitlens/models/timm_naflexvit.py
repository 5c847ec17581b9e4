"""Adapter for timm's ``NaFlexVit`` (the family of timm's SigLIP2 image towers, ``naflexvit_*_siglip``): the blocks are
timm's pre-norm ``Block`` with the standard ``Attention``, read as :class:`~.timm_vit.TimmViTAdapter` reads them; only
the embedding differs (``embeds``: patches cut and projected by a linear map, position embeddings resized to the
image's grid, so any size that is a multiple of the patch size runs).

Images ``(B, C, H, W)`` run in timm's standard 2-d mode (one grid for the batch, no attention mask). The readout is
the attention-pool head (``global_pool='map'``, SigLIP) or the token mean over all tokens (pooled), or the class token
(``'token'``).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from ..errors import InputError
from .base import Adapter, int_pair, normalisation_layers
from .capabilities import (ATTENTION, BLOCK_IO, CLASS_LOGITS, FEATURE_MAPS, FEATURES, LINEAR_HEAD, LRP_LINEARS,
                           LRP_VARIANT_LINEARS, STREAM_HEAD, TOKEN_GRID, TOKEN_SEQUENCE, TOKENS)
from .timm_vit import TimmViTAdapter

__all__ = ["TimmNaFlexVitAdapter", "ATTENTION_POOL", "LRP_THROUGH_HEAD"]

#: why a tower with SigLIP's attention-pool head has no linear head (and no LRP linears: see below)
ATTENTION_POOL = "the attention-pool head (a latent query's softmax attention over the tokens, then an MLP) reads " \
                 "the tokens after the blocks, not a linear head"
LRP_THROUGH_HEAD = "; the LRP rules conserve relevance from the score to the tokens only through a linear head"


def _is_naflexvit(model: nn.Module) -> bool:
    try:
        from timm.models.naflexvit import NaFlexVit
    except ImportError:  # pragma: no cover - timm is an optional extra, NaFlexVit since timm 1.0.16
        return False
    return isinstance(model, NaFlexVit)


class TimmNaFlexVitAdapter(TimmViTAdapter):
    """timm ``NaFlexVit`` with ``Block``/``Attention`` blocks (not the RoPE variants, whose blocks are ``EvaBlock``).

    ``stream_logits`` is the timm ViT's ``forward_head(norm(tokens))``: every patch is valid (vitlens passes dense
    images, no ``patch_valid`` mask), so the pooling reads all tokens as the model's forward does."""

    model: Any
    family = "timm-naflexvit"
    capabilities = frozenset({CLASS_LOGITS, ATTENTION, BLOCK_IO, TOKEN_SEQUENCE, LRP_LINEARS, LRP_VARIANT_LINEARS,
                              LINEAR_HEAD, STREAM_HEAD, FEATURES, FEATURE_MAPS, TOKEN_GRID})
    capability_notes = {TOKENS: "NaFlexVit's embedding returns (tokens, grid) and builds the attention mask for the "
                                "full patch set; vitlens does not drop tokens there"}

    @staticmethod
    def matches(model: nn.Module) -> bool:
        return _is_naflexvit(model)

    def __init__(self, model: nn.Module) -> None:
        Adapter.__init__(self, model)
        self._check_blocks()
        self.num_prefix_tokens = int(getattr(model, "num_prefix_tokens", 0))
        self.num_classes = int(self.model.num_classes)
        pool = getattr(model, "global_pool", "map")
        self.readout_tokens = (0,) if pool == "token" and bool(getattr(model, "has_class_token", False)) else None
        embeds = self.model.embeds
        self.patch_size = int_pair(embeds.patch_size)
        self.dynamic = True
        cfg = getattr(model, "pretrained_cfg", None) or {}
        size = cfg.get("input_size") if isinstance(cfg, dict) else None
        self.default_size = (int(size[1]), int(size[2])) if isinstance(size, (tuple, list)) and len(size) == 3 \
            else None
        self.in_chans = int(getattr(model, "in_chans", 3))
        self.any_size = True
        self._declare_lrp()
        if getattr(model, "attn_pool", None) is not None:  # SigLIP's attention-pool (MAP) head after the blocks
            self.capabilities = self.capabilities - {LINEAR_HEAD, LRP_LINEARS, LRP_VARIANT_LINEARS}
            self.capability_notes = {**self.capability_notes, LINEAR_HEAD: ATTENTION_POOL,
                                     LRP_LINEARS: ATTENTION_POOL + LRP_THROUGH_HEAD,
                                     LRP_VARIANT_LINEARS: ATTENTION_POOL + LRP_THROUGH_HEAD}

    def grid(self, input_hw: tuple[int, int]) -> tuple[int, int]:
        return int_pair(self.model.embeds.dynamic_feat_size(tuple(input_hw)))

    def check_input(self, x: Tensor) -> None:
        if x.shape[1] != self.in_chans:
            raise InputError(f"model expects {self.in_chans} input channels; got a batch with {x.shape[1]}")
        ph, pw = self.patch_size
        hw = tuple(x.shape[-2:])
        if not getattr(self.model.embeds, "dynamic_img_pad", False) and (hw[0] % ph or hw[1] % pw):
            raise InputError(f"input size {hw[0]}x{hw[1]} is not a multiple of the patch size {ph}x{pw}")

    def layernorms(self) -> list[nn.Module]:
        """The normalisations after the embedding (the embedding's own norms run before block 0's leaf)."""
        stem = set(self.model.embeds.modules())
        return [m for m in normalisation_layers(self.model) if m not in stem]

    def _embedding_module(self) -> nn.Module:
        return Adapter._embedding_module(self)
