"""Adapter for timm convolutional classifiers (EfficientNet, ResNet, ConvNeXt, ...): the final feature map as features.

CNNs have no attention and no tokens, so relevance propagation and token-dropping methods do not apply. What a CNN
does offer is the feature map the classifier pools: Grad-CAM's classic target layer (the output of the last
convolutional stage, e.g. ``bn2`` of EfficientNet). This adapter exposes it with the ``"features"`` capability in the
same layout as a ViT's tokens — ``(B, h·w, C)``, row-major on the feature grid, no prefix tokens — so Grad-CAM and
Finer-CAM run unchanged on both families.
"""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor, nn

from ..errors import UnsupportedModelError
from .base import Adapter, BlockRecord, Recording
from .capabilities import ATTENTION, BLOCK_IO, CLASS_LOGITS, FEATURE_MAPS, FEATURES, TOKEN_SEQUENCE, TOKENS

__all__ = ["TimmCNNAdapter"]


def _pool_module(model: nn.Module) -> nn.Module | None:
    pool = getattr(model, "global_pool", None)
    if not isinstance(pool, nn.Module):
        pool = getattr(getattr(model, "head", None), "global_pool", None)
    return pool if isinstance(pool, nn.Module) else None


def _attention_inside(model: nn.Module) -> str | None:
    """The class name of the first token-mixing attention module inside a convolutional model (MobileViT's,
    Visformer's and FastViT's ``Attention``, DaViT's ``WindowAttention``, GC ViT's ``WindowAttentionGlobal``, Next-ViT's
    ``EfficientAttention``), or ``None`` for a plain CNN (channel gates such as squeeze-and-excitation do not count)."""
    for m in model.modules():
        name = type(m).__name__
        if isinstance(m, nn.MultiheadAttention) or "Attention" in name or isinstance(getattr(m, "qkv", None),
                                                                                   (nn.Linear, nn.Conv2d)):
            return name
    return None


class TimmCNNAdapter(Adapter):
    """timm CNN classifiers with a global-pool head (features: the pooled feature map)."""

    #: the wrapped model; typed ``Any`` because the family's submodules and config are reached by attribute
    #: (``nn.Module.__getattr__`` types them loosely), after :meth:`matches` and ``__init__`` checked the layout
    model: Any

    family = "timm-cnn"
    capabilities = frozenset({CLASS_LOGITS, FEATURES, FEATURE_MAPS})
    capability_notes = {c: "a CNN has no attention and no tokens" for c in (ATTENTION, BLOCK_IO, TOKEN_SEQUENCE, TOKENS)}

    @staticmethod
    def matches(model: nn.Module) -> bool:
        info = getattr(model, "feature_info", None)
        return (
            hasattr(model, "forward_features")
            and hasattr(model, "forward_head")
            and not hasattr(model, "patch_embed")
            and _pool_module(model) is not None
            and bool(info)
        )

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.num_classes = int(getattr(model, "num_classes", 0) or 0)
        last = self.model.feature_info[-1]
        self.reduction = int(last["reduction"] if isinstance(last, dict) else last.reduction)
        pool = _pool_module(model)
        if pool is None:
            raise UnsupportedModelError(f"{type(model).__name__}: no global-pool module (model.global_pool or "
                                        "model.head.global_pool)")
        self.pool = pool
        self.in_chans = None
        first = getattr(model, "pretrained_cfg", {}).get("first_conv") if hasattr(model, "pretrained_cfg") else None
        if isinstance(first, (tuple, list)):  # FastViT names its stem's parallel branches
            first = first[0] if first else None
        if isinstance(first, str) and first:
            try:
                mod = self.model.get_submodule(first)
            except AttributeError:  # a config that names no module of this model: the channels stay unknown
                mod = None
            self.in_chans = getattr(mod, "in_channels", None)
        attention = _attention_inside(model)
        if attention is not None:  # a hybrid: attention in its stages, which no adapter of vitlens reads
            why = (f"vitlens has no adapter that reads {type(model).__name__}'s attention ({attention} in its "
                   "stages): it is read like a CNN, through its last feature map only")
            self.capability_notes = {**self.capability_notes, **{c: why for c in self.capability_notes}}

    def feature_layers(self) -> list[nn.Module]:
        """One feature layer: the final feature map (the input of the global pool). ``blocks()`` is not defined:
        a CNN has no transformer blocks (the sanity check walks its own stage container instead)."""
        return [self.pool]

    def grid(self, input_hw: tuple[int, int]) -> tuple[int, int]:
        """The final feature map's size: the input size divided by the network's total stride, rounded up."""
        return math.ceil(input_hw[0] / self.reduction), math.ceil(input_hw[1] / self.reduction)

    def check_input(self, x: Tensor) -> None:
        from ..errors import InputError

        if self.in_chans is not None and x.shape[1] != self.in_chans:
            raise InputError(f"model expects {self.in_chans} input channels; got a batch with {x.shape[1]}")

    def layernorms(self) -> list[nn.Module]:
        return []

    def _install_capture(self, rec: Recording, hooks: list) -> None:
        rec.blocks.append(BlockRecord())

        def hook(module: nn.Module, args: tuple):
            fmap = args[0]  # (B, C, h, w)
            b, c, h, w = fmap.shape
            # a leaf in token layout: the backward stops here (only the classifier head is differentiated)
            u = fmap.detach().flatten(2).transpose(1, 2).requires_grad_(True)
            rec.blocks[0].u = u
            return (u.transpose(1, 2).reshape(b, c, h, w), *args[1:])

        hooks.append(self.pool.register_forward_pre_hook(hook))
