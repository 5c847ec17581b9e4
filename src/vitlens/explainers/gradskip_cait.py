"""GradSkip on CaiT: class-attention blocks on CLS, then talking-heads self-attention blocks on the patch tokens.

Called by :class:`~vitlens.explainers.gradskip.GradSkip` when the adapter declares ``class_attention``; same options,
one forward and one activation-only backward. Equations (``docs/methods/gradskip_cait.md``):

1. **Start** on the final stream ``[CLS, patches]`` (``1 + N`` tokens, before the final norm): all of ``y`` on CLS for
   the token readout, GradSkip's pooled rule (``⟨x_L, ∂y/∂x_L⟩⁺``) for the average readout.
2. **A class-attention block** (last to first) updates CLS only: with the gate ``β`` of the CLS stream (``u``: CLS
   entering the block, ``h``: CLS after the attention residual) and the block's weighted attention row ``W̃``
   ``(1, 1 + N)`` (rows sum to 1), ``R_CLS ← (1 − β)·R_CLS + β·R_CLS·W̃[CLS]`` and ``R_j ← R_j + β·R_CLS·W̃[j]`` for
   the patch tokens, whose own relevance passes through unchanged (the block does not update them).
3. After the class-attention stage the relevance left on CLS is the **remainder** (CLS enters as a learned token).
4. **A self-attention block** (last to first) as in the plain ViT, on the patch tokens, with the talking-heads mixing
   tensor ``A' = proj_w(softmax(proj_l(q·kᵀ)))`` that multiplies the values: flow ``A' ⊙ ∂y/∂A'`` (its positive part
   weighted by ``‖v‖`` forms ``W̃``), head sparsity = Gini of ``|A'|`` rows, and the fallback for a row without
   positive flow is ``Σ_q ω_q · rownorm(|A'_q|)`` (so every row of ``W̃`` sums to 1 also where ``A'`` is negative).

``token_maps.sum() + remainder == y``; ``layer_totals`` records the total after every block. As on the plain path, each
block's terms are computed inside the backward pass (tensor hooks on its mixing tensor and on ``h``), so the
``(B, H, T, T)`` gradients of all blocks are never held at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..targets import Target
from ._class_attention import magnitude_rows
from ._gradskip_rules import (
    wide,
    block_backward,
    head_weights_from_flow,
    readout_relevance,
    skip_gate,
    weighted_attention,
)
from .base import Attribution, Explainer

if TYPE_CHECKING:
    from ..models.base import Adapter

__all__ = ["attribute_class_attention"]


class _Steps:
    """Per-block terms ``ω``, ``W̃`` (from the mixing tensor and its gradient) and ``β`` (from ``u``, ``h`` and
    ``∂y/∂h``), computed as the backward produces each gradient; the block's captures are dropped once used."""

    def __init__(self, method: Explainer, rec: Any) -> None:
        self.method = method
        self.saved: list[dict[str, Any]] = []
        for b in rec.blocks:
            assert b.attn is not None and b.value is not None and b.u is not None and b.h is not None
            with torch.no_grad():
                vnorm = b.value.norm(dim=-1)  # (B, H, T_k); the values are a view of the qkv / v output
            self.saved.append({"attn": b.attn, "vnorm": vnorm, "u": b.u, "h": b.h})
            b.attn = b.value = b.u = b.h = None
        n = len(self.saved)
        self.omega: list[Tensor | None] = [None] * n
        self.w: list[Tensor | None] = [None] * n
        self.beta: list[Tensor | None] = [None] * n

    def backward(self, y: Tensor, final: Tensor) -> Tensor | None:
        """Run the backward from ``y``; returns ``∂y/∂final`` (``None`` if ``y`` does not depend on it). Blocks the
        gradient never reaches (CA blocks of an avg readout) are reduced with zero gradients."""
        return block_backward(y, final, self.saved, self._attn_step, self._h_step, lambda li: self.w[li] is not None,
                              lambda li: self.beta[li] is not None)

    def _attn_step(self, li: int, grad: Tensor | None) -> None:
        o = self.method.options
        cap = self.saved[li]
        attn, vnorm = wide(cap.pop("attn")), wide(cap.pop("vnorm"))
        with torch.no_grad():
            rows = magnitude_rows(attn)  # Gini and the fallback on |A'|; a softmax stays itself
            flow = attn * wide(grad) if grad is not None else torch.zeros_like(attn)
            omega = head_weights_from_flow(rows, flow, o["head_weighting"], float(o["alpha"]),
                                           float(o["grad_threshold"]), o["head_subset"])
            self.w[li] = weighted_attention(rows, flow, vnorm, omega)
            self.omega[li] = omega

    def _h_step(self, li: int, grad: Tensor | None) -> None:
        o = self.method.options
        cap = self.saved[li]
        u, h = wide(cap.pop("u")), wide(cap.pop("h"))
        with torch.no_grad():
            self.beta[li] = skip_gate(u, h, torch.zeros_like(h) if grad is None else wide(grad), o["skip"],
                                      float(o["eps"]))


def attribute_class_attention(method: Explainer, adapter: "Adapter", x: Tensor, target: Target
                              ) -> tuple[Attribution, Tensor, Target]:
    from ..errors import InputError
    from ..models.base import int_pair

    o = method.options
    with adapter.session(capture=True, conservative=bool(o["conservative"])) as rec:
        logits = adapter.forward(x)
        tgt = method.resolve_target(target, logits)
        y = tgt(logits)
        n_sa = int(getattr(rec, "self_attention"))
        final = rec.final
        assert final is not None
        steps = _Steps(method, rec)
        grad_final = steps.backward(y.sum(), final)
    n = len(steps.saved)
    y = wide(y)
    final = wide(final)
    g_final = torch.zeros_like(final) if grad_final is None else wide(grad_final)
    relevance = readout_relevance(final, g_final, y, adapter.readout_tokens, 1)  # (B, 1 + N) on [CLS, patches]
    bsz, t = relevance.shape
    totals = [relevance.sum(-1)]
    betas: list[Tensor] = [relevance.new_zeros(0)] * n
    for li in range(n - 1, n_sa - 1, -1):  # class-attention blocks: only CLS is updated
        w, beta = steps.w[li], steps.beta[li]
        assert w is not None and beta is not None
        main = beta[:, 0] * relevance[:, 0]  # (B,)
        relevance = torch.cat([(relevance[:, :1] - main[:, None]), relevance[:, 1:]], dim=1) + main[:, None] * w[:, 0]
        betas[li] = torch.cat([beta, beta.new_zeros(bsz, t - 1)], dim=1)
        totals.append(relevance.sum(-1))
    remainder = relevance[:, 0]  # left on the learned CLS token
    relevance = relevance[:, 1:]
    for li in range(n_sa - 1, -1, -1):  # self-attention blocks on the patch tokens, as in the plain ViT
        w, beta = steps.w[li], steps.beta[li]
        assert w is not None and beta is not None
        relevance = (beta * relevance)[:, None, :].bmm(w)[:, 0] + (1.0 - beta) * relevance
        betas[li] = torch.cat([beta.new_zeros(bsz, 1), beta], dim=1)
        totals.append(relevance.sum(-1) + remainder)
    gh, gw = adapter.grid(int_pair(x.shape[-2:]))
    if relevance.shape[1] != gh * gw:
        raise InputError(f"{relevance.shape[1]} patch tokens do not fill the {gh}x{gw} token grid")
    extras = {
        "head_weights": torch.stack([w for w in steps.omega if w is not None], dim=1),  # (B, L, H): SA, then CA
        "beta_main": torch.stack(betas, dim=1),  # (B, L, 1 + N) on [CLS, patches]; 0 where the block keeps the token
        "layer_totals": torch.stack(totals[::-1], dim=1),  # (B, L+1): input of block 0 … readout
    }
    return Attribution(values=relevance.reshape(bsz, gh, gw), remainder=remainder, extras=extras), logits.detach(), tgt
