"""Generic Attention-model Explainability, GAE (Chefer et al., ICCV 2021): gradient-weighted attention rollout.

One forward and one (activation-only) backward pass. The equations implemented here are written out in
``docs/methods/attention_methods.md``.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from ..models import Adapter
from ..targets import Target
from .base import Attribution, Explainer
from .registry import register
from .rollout import readout_row, token_map

__all__ = ["GAE", "relevance_rollout"]


def relevance_rollout(maps: Sequence[Tensor]) -> Tensor:
    """``R = (I + M_L) ⋯ (I + M_1)`` for per-layer token-mixing maps ``M_l`` ``(B, T, T)`` (first layer first).

    This is Chefer et al.'s update ``R ← R + M_l·R`` from ``R = I``, block by block (no row normalisation).
    """
    r = None
    for m in maps:
        r = m + torch.eye(m.shape[-1], device=m.device, dtype=m.dtype) if r is None else r + m.bmm(r)
    return r


@register
class GAE(Explainer):
    """GAE: per block ``Ā = mean_h((∇A ⊙ A)⁺)``, ``R = Π_l (I + Ā_l)`` (last block leftmost), readout row of ``R``.

    ``∇A`` is the plain gradient of the target score (by default the class logit) with respect to the attention
    probabilities of every block. No options: the paper has none for ViTs.
    """

    name = "gae"
    requires = "attention"
    level = "token"
    defaults: dict[str, Any] = {}

    def attribute(self, adapter: Adapter, x: Tensor, target: Target) -> tuple[Attribution, Tensor, Target]:
        with adapter.session(capture=True, conservative=False) as rec:
            logits = adapter.forward(x)
            tgt = target if target.classes is not None else target.resolve(logits)
            attns = [blk.attn for blk in rec.blocks]
            grads = torch.autograd.grad(tgt(logits).sum(), attns, allow_unused=True)
        maps = []
        for attn, grad in zip(attns, grads):
            grad = torch.zeros_like(attn) if grad is None else grad
            maps.append((grad * attn.detach()).clamp_min(0).mean(dim=1))
        row = readout_row(relevance_rollout(maps), adapter.readout_tokens, adapter.num_prefix_tokens)
        values, _ = token_map(adapter, row, x)
        return Attribution(values=values), logits.detach(), tgt
