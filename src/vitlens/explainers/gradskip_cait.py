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

``token_maps.sum() + remainder == y``; ``layer_totals`` records the total after every block.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..targets import Target
from ._class_attention import magnitude_rows
from ._gradskip_rules import head_weights_from_flow, readout_relevance, skip_gate, weighted_attention
from .base import Attribution, Explainer

if TYPE_CHECKING:
    from ..models.base import Adapter

__all__ = ["attribute_class_attention"]


def _wide(t: Tensor) -> Tensor:
    return t.detach().to(torch.promote_types(t.dtype, torch.float32))


def _block_terms(method: Explainer, attn: Tensor, grad: Tensor | None, value: Tensor, u: Tensor, h: Tensor,
                 grad_h: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """``(ω (B, H), W̃ (B, T, T_k), β (B, T))`` of one block from its mixing tensor and gradients."""
    o = method.options
    attn, vnorm = _wide(attn), _wide(value).norm(dim=-1)
    rows = magnitude_rows(attn)
    with torch.no_grad():
        flow = attn * _wide(grad) if grad is not None else torch.zeros_like(attn)
        omega = head_weights_from_flow(rows, flow, o["head_weighting"], float(o["alpha"]), float(o["grad_threshold"]),
                                       o["head_subset"])
        w = weighted_attention(rows, flow, vnorm, omega)
        u, h = _wide(u), _wide(h)
        beta = skip_gate(u, h, torch.zeros_like(h) if grad_h is None else _wide(grad_h), o["skip"], float(o["eps"]))
    return omega, w, beta


def attribute_class_attention(method: Explainer, adapter: "Adapter", x: Tensor, target: Target
                              ) -> tuple[Attribution, Tensor, Target]:
    from ..errors import InputError
    from ..models.base import int_pair

    o = method.options
    with adapter.session(capture=True, conservative=bool(o["conservative"])) as rec:
        logits = adapter.forward(x)
        tgt = method.resolve_target(target, logits)
        y = tgt(logits)
        blocks = list(rec.blocks)
        n_sa = int(getattr(rec, "self_attention"))
        assert rec.final is not None and all(b.attn is not None and b.h is not None for b in blocks)
        wanted = [rec.final] + [b.attn for b in blocks] + [b.h for b in blocks]
        grads = torch.autograd.grad(y.sum(), wanted, allow_unused=True)
    n = len(blocks)
    g_attn, g_h = grads[1:1 + n], grads[1 + n:]
    y = _wide(y)
    final = _wide(rec.final)
    g_final = torch.zeros_like(final) if grads[0] is None else _wide(grads[0])
    relevance = readout_relevance(final, g_final, y, adapter.readout_tokens, 1)  # (B, 1 + N) on [CLS, patches]
    bsz, t = relevance.shape
    totals = [relevance.sum(-1)]
    omegas: list[Tensor] = [relevance.new_zeros(0)] * n
    betas: list[Tensor] = [relevance.new_zeros(0)] * n
    for li in range(n - 1, n_sa - 1, -1):  # class-attention blocks: only CLS is updated
        b = blocks[li]
        assert b.attn is not None and b.value is not None and b.u is not None and b.h is not None
        omega, w, beta = _block_terms(method, b.attn, g_attn[li], b.value, b.u, b.h, g_h[li])
        main = beta[:, 0] * relevance[:, 0]  # (B,)
        relevance = torch.cat([(relevance[:, :1] - main[:, None]), relevance[:, 1:]], dim=1) + main[:, None] * w[:, 0]
        omegas[li], betas[li] = omega, torch.cat([beta, beta.new_zeros(bsz, t - 1)], dim=1)
        totals.append(relevance.sum(-1))
    remainder = relevance[:, 0]  # left on the learned CLS token
    relevance = relevance[:, 1:]
    for li in range(n_sa - 1, -1, -1):  # self-attention blocks on the patch tokens, as in the plain ViT
        b = blocks[li]
        assert b.attn is not None and b.value is not None and b.u is not None and b.h is not None
        omega, w, beta = _block_terms(method, b.attn, g_attn[li], b.value, b.u, b.h, g_h[li])
        relevance = (beta * relevance)[:, None, :].bmm(w)[:, 0] + (1.0 - beta) * relevance
        omegas[li], betas[li] = omega, torch.cat([beta.new_zeros(bsz, 1), beta], dim=1)
        totals.append(relevance.sum(-1) + remainder)
    gh, gw = adapter.grid(int_pair(x.shape[-2:]))
    if relevance.shape[1] != gh * gw:
        raise InputError(f"{relevance.shape[1]} patch tokens do not fill the {gh}x{gw} token grid")
    extras = {
        "head_weights": torch.stack(omegas, dim=1),  # (B, L, H): SA blocks, then CA blocks
        "beta_main": torch.stack(betas, dim=1),  # (B, L, 1 + N) on [CLS, patches]; 0 where the block keeps the token
        "layer_totals": torch.stack(totals[::-1], dim=1),  # (B, L+1): input of block 0 … readout
    }
    return Attribution(values=relevance.reshape(bsz, gh, gw), remainder=remainder, extras=extras), logits.detach(), tgt
