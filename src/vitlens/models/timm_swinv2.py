"""Adapter for timm's Swin Transformer V2 (``SwinTransformerV2``): the windows, shifts and patch merging of Swin v1
(:mod:`.timm_swin`, whose recording and GradSkip/rollout/GAE paths it shares), with three differences that change
where the tensors are, not how relevance moves between tokens:

- **scaled-cosine attention**: ``softmax(τ_h · cos(q, k) + B)`` with a learned per-head temperature ``τ_h``
  (``logit_scale``, clamped at ``log 100``) instead of ``q·kᵀ/√d``;
- **log-spaced continuous position bias**: ``B = 16·σ(MLP(log-spaced relative coordinates))`` (``cpb_mlp``) instead
  of a learned table;
- **residual post-norm**: ``h = u + norm1(attention(u))``, ``out = h + norm2(mlp(h))`` — the norms sit on the branch
  outputs, so ``h`` is read at the MLP's input, not at ``norm2``'s.

The temperature, the bias and the masks all enter *before* the softmax: the probabilities the ``softmax`` module
returns are the row-stochastic matrix the block mixes values with, and token mixing happens only there (``norm1``,
``proj``, the MLP and ``norm2`` are token-wise), so GradSkip's windowed rules, rollout and GAE read it unchanged
(``docs/methods/gradskip_swin.md``, section "Swin V2"). The value vectors use the separate ``v_bias``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from torch import Tensor, nn

from ..errors import UnsupportedModelError
from .timm_swin import TimmSwinAdapter

__all__ = ["TimmSwinV2Adapter"]


class TimmSwinV2Adapter(TimmSwinAdapter):
    """timm ``SwinTransformerV2``: GradSkip, rollout and GAE through windows and merges, Grad-CAM/Finer-CAM on the
    last stage, as for Swin v1."""

    family = "timm-swinv2"

    @staticmethod
    def matches(model: nn.Module) -> bool:
        return type(model).__name__ == "SwinTransformerV2" and type(model).__module__.startswith("timm.")

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        for s, stage in enumerate(self.stages):
            for j, blk in enumerate(stage.blocks):
                att = blk.attn
                if not (isinstance(getattr(blk, "mlp", None), nn.Module) and hasattr(att, "logit_scale")
                        and hasattr(att, "cpb_mlp")):
                    raise UnsupportedModelError(f"SwinV2 stage {s} block {j} ({type(blk).__name__}) is not a timm "
                                                "SwinTransformerV2Block with scaled-cosine WindowAttention")

    def _h_site(self, blk: Any) -> nn.Module:
        return blk.mlp  # post-norm: the MLP reads h itself (norm2 normalises the MLP's output)

    def _value_of(self, attn: Any) -> tuple[Tensor, Tensor | None]:
        weight, bias = super()._value_of(attn)
        v_bias = getattr(attn, "v_bias", None)  # q/v biases are separate parameters (k has none)
        return weight, v_bias if v_bias is not None else bias

    @contextlib.contextmanager
    def _explicit_attention(self) -> Iterator[None]:
        yield  # SwinV2's window attention has no fused path: the softmax module always runs
