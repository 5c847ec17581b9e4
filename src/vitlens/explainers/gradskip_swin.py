"""GradSkip on windowed, hierarchical transformers (timm and HF Swin): shifted windows and patch merging.

Called by :class:`~vitlens.explainers.gradskip.GradSkip` when the adapter declares ``windowed``; same options, one
forward and one activation-only backward. The equations (``docs/methods/gradskip_swin.md``):

1. **Start.** The classifier averages the last stage's tokens: ``y`` is split over them in proportion to
   ``⟨x_L, ∂y/∂x_L⟩⁺`` (GradSkip's pooled-readout rule), so the start relevances sum to ``y``.
2. **A block** (last to first): the head weights ``ω`` are computed per image from all of the block's windows
   together (each query row of each window is one row of the layer's attention: gradient flow and Gini sparsity as
   in the plain ViT); ``W̃`` is formed per window (rows sum to 1) with the window's value norms. The relevance on
   the block's output is cut into the block's windows exactly as the block cuts its tokens (cyclic shift, padding,
   partition), the main part ``β·R`` goes back through ``W̃ᵀ`` inside each window, and is put back on the grid
   (reverse partition, unshift); the skip part ``(1 − β)·R`` stays on its token. Relevance that lands on padding
   tokens (grids that are not a multiple of the window) goes to the remainder.
3. **Patch merging** (between stages): each merged token's relevance goes back to its 2×2 input tokens in
   proportion to the positive part of their gradient × activation at the merge input, uniformly when all four are 0;
   inputs that are padding (odd grids) give theirs to the remainder.

Every step conserves the total: ``token_maps.sum() + remainder == y``, and ``layer_totals`` records it per block.

Cost: each block's ``ω``, ``W̃`` and ``β`` are reduced inside the backward as autograd produces the block's gradients
(tensor hooks, :func:`~._gradskip_rules.block_backward`), so no two blocks' ``(B·nW, H, N, N)`` gradients are held at
once, and the per-image statistics are averaged from the windows' own layout (no transposed copy); the value norms
come from the ``qkv`` output the attention computes anyway (``models/timm_swin.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor

from ..targets import Target
from ..models.timm_swin import SwinBlockRecord, SwinRecording, from_windows, to_windows
from ._gradskip_rules import (block_backward, filled, head_weights_from_scores, positive_flow, probability_gini,
                              readout_relevance, skip_gate, sparsity_needed, stack_padded, weighted_attention, wide)
from ._windows import merge_handback
from .base import Attribution, Explainer

if TYPE_CHECKING:
    from ..models.base import Adapter

__all__ = ["attribute_windowed"]


def attribute_windowed(method: Explainer, adapter: "Adapter", x: Tensor, target: Target
                       ) -> tuple[Attribution, Tensor, Target]:
    from ..models.base import int_pair, recorded

    o = method.options
    with adapter.session(capture=True, conservative=bool(o["conservative"])) as session_rec:
        rec = cast(SwinRecording, session_rec)
        logits = adapter.forward(x)
        tgt = method.resolve_target(target, logits)
        y = tgt(logits)
        steps = _WindowSteps(method, [cast(SwinBlockRecord, b) for b in rec.blocks], x.shape[0])
        merges = {s: m for s, m in enumerate(rec.merges) if m is not None}
        g_merge: dict[int, Tensor] = {}
        for s, m in merges.items():  # the merge inputs' gradients, kept as the backward passes them
            m.register_hook(lambda g, s=s: g_merge.__setitem__(s, g.detach()))
        final_rec = recorded(rec.final, "final residual stream")
        g_final = block_backward(y.sum(), final_rec, steps.saved, steps.attn_step, steps.h_step,
                                 lambda li: steps.w[li] is not None, lambda li: steps.beta[li] is not None)
    blocks = steps.blocks
    y = wide(y)
    final = wide(final_rec)
    relevance = readout_relevance(final, torch.zeros_like(final) if g_final is None else wide(g_final), y, None, 0)
    bsz = x.shape[0]
    lost = torch.zeros_like(y)
    totals = [relevance.sum(-1)]
    ws, betas = filled(steps.w), filled(steps.beta)
    for li in range(len(blocks) - 1, -1, -1):
        b, w, beta = blocks[li], ws[li], betas[li]
        with torch.no_grad():
            gh, gw = b.grid
            main = (beta * relevance).reshape(bsz, gh, gw)
            win, padded = to_windows(main, b.shift, b.window, b.pad_first)
            back = win[:, None, :].bmm(w)[:, 0]  # relevance on each window's keys
            back, fell = from_windows(back, bsz, (gh, gw), padded, b.shift, b.window, b.pad_first)
            relevance = back.reshape(bsz, -1) + (1.0 - beta) * relevance
            lost = lost + fell
        first_of_stage = li == 0 or blocks[li - 1].stage != b.stage
        if first_of_stage and b.stage in merges:
            m = wide(merges[b.stage])
            g = g_merge.get(b.stage)
            relevance, fell = merge_handback(relevance, m, torch.zeros_like(m) if g is None else wide(g))
            lost = lost + fell
        totals.append(relevance.sum(-1) + lost)
    gh, gw = adapter.grid(int_pair(x.shape[-2:]))
    if relevance.shape[1] != gh * gw:
        from ..errors import InputError

        raise InputError(f"{relevance.shape[1]} tokens at the first stage do not fill the {gh}x{gw} token grid")
    extras = {
        # per block, zero-padded: stages differ in heads and tokens
        "head_weights": stack_padded(filled(steps.omega)),  # (B, L, max H_l)
        "beta_main": stack_padded(betas),  # (B, L, max T_l), stage-l token order
        "layer_totals": torch.stack(totals[::-1], dim=1),  # (B, L+1): input of block 0 … readout
    }
    return Attribution(values=relevance.reshape(bsz, gh, gw), remainder=lost, extras=extras), logits.detach(), tgt


class _WindowSteps:
    """Per-block ``ω``, ``W̃`` (per window) and ``β_main``, reduced inside the backward as autograd produces each
    block's gradients (:func:`~._gradskip_rules.block_backward`): the captured probabilities and residuals of a block
    are dropped once it is reduced, and no block's ``(B·nW, H, N, N)`` gradient outlives its step."""

    def __init__(self, method: Explainer, blocks: list[SwinBlockRecord], batch: int) -> None:
        self.method, self.blocks, self.batch = method, blocks, batch
        for li, b in enumerate(blocks):  # the Swin capture fills every block
            if b.attn is None or b.vnorm is None or b.u is None or b.h is None:
                raise AssertionError(f"Swin block {li} was not captured")
        self.saved: list[dict[str, Any]] = [{"attn": b.attn, "vnorm": b.vnorm, "u": b.u, "h": b.h} for b in blocks]
        for b in blocks:
            b.attn = b.vnorm = b.u = b.h = None
        n = len(blocks)
        self.w: list[Tensor | None] = [None] * n
        self.omega: list[Tensor | None] = [None] * n
        self.beta: list[Tensor | None] = [None] * n

    def attn_step(self, li: int, grad: Tensor | None) -> None:
        """``ω`` of block ``li`` from all of its windows together (each query row of each window is one row of the
        layer's attention), ``W̃`` per window. The per-row statistics (flow score, Gini) are taken in the windows'
        own layout and averaged per image: no ``(B, H, nW·N, N)`` copy."""
        o = self.method.options
        cap = self.saved[li]
        with torch.no_grad():
            attn, vnorm = wide(cap.pop("attn")), wide(cap.pop("vnorm"))
            nw = attn.shape[0] // self.batch
            flow_terms = attn * wide(grad) if grad is not None else torch.zeros_like(attn)
            flow = positive_flow(flow_terms).unflatten(0, (self.batch, nw)).mean(dim=1)  # (B, H); clamps in place
            mode, alpha, subset = o["head_weighting"], float(o["alpha"]), o["head_subset"]
            sparsity = probability_gini(attn).unflatten(0, (self.batch, nw)).mean(dim=(1, 3)) \
                if sparsity_needed(mode, alpha, subset) else None
            per_image = attn.unflatten(0, (self.batch, nw)).transpose(1, 2)  # (B, H, nW, N, N): a view
            omega = head_weights_from_scores(per_image, flow, mode, alpha, float(o["grad_threshold"]), subset,
                                             sparsity=sparsity)
            self.w[li] = weighted_attention(attn, flow_terms, vnorm, omega.repeat_interleave(nw, dim=0),
                                            clamped=True)  # (B·nW, N, N)
            self.omega[li] = omega

    def h_step(self, li: int, grad: Tensor | None) -> None:
        o = self.method.options
        cap = self.saved[li]
        with torch.no_grad():
            u, h = wide(cap.pop("u")), wide(cap.pop("h"))
            self.beta[li] = skip_gate(u, h, torch.zeros_like(h) if grad is None else wide(grad), o["skip"],
                                      float(o["eps"]))
