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
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
from torch import Tensor

from ..targets import Target
from ._gradskip_rules import head_weights_from_flow, readout_relevance, skip_gate, weighted_attention, wide
from ._windows import merge_handback
from .base import Attribution, Explainer

if TYPE_CHECKING:
    from ..models.base import Adapter

__all__ = ["attribute_windowed"]


def _stack_padded(rows: list[Tensor]) -> Tensor:
    """``L`` tensors ``(B, n_l)`` → ``(B, L, max n_l)``, zero-padded."""
    width = max(r.shape[1] for r in rows)
    out = rows[0].new_zeros(rows[0].shape[0], len(rows), width)
    for i, r in enumerate(rows):
        out[:, i, : r.shape[1]] = r
    return out


def attribute_windowed(method: Explainer, adapter: "Adapter", x: Tensor, target: Target
                       ) -> tuple[Attribution, Tensor, Target]:
    from ..models.base import int_pair, recorded
    from ..models.timm_swin import SwinBlockRecord, SwinRecording, from_windows, to_windows

    o = method.options
    with adapter.session(capture=True, conservative=bool(o["conservative"])) as session_rec:
        rec = cast(SwinRecording, session_rec)
        logits = adapter.forward(x)
        tgt = method.resolve_target(target, logits)
        y = tgt(logits)
        blocks = [cast(SwinBlockRecord, b) for b in rec.blocks]
        merges = [(s, m) for s, m in enumerate(rec.merges) if m is not None]
        final_rec = recorded(rec.final, "final residual stream")
        wanted = [final_rec] + [recorded(b.attn, "attention") for b in blocks] + \
            [recorded(b.h, "post-attention residual") for b in blocks] + [m for _, m in merges]
        grads = torch.autograd.grad(y.sum(), wanted, allow_unused=True)
    n = len(blocks)
    g_final = grads[0]
    g_attn, g_h, g_merge = grads[1:1 + n], grads[1 + n:1 + 2 * n], dict(zip([s for s, _ in merges], grads[1 + 2 * n:]))
    y = wide(y)
    final = wide(final_rec)
    relevance = readout_relevance(final, torch.zeros_like(final) if g_final is None else wide(g_final), y, None, 0)
    bsz = x.shape[0]
    lost = torch.zeros_like(y)
    totals = [relevance.sum(-1)]
    omegas, betas = [], []
    for li in range(n - 1, -1, -1):
        b = blocks[li]
        assert isinstance(b, SwinBlockRecord) and b.attn is not None and b.vnorm is not None
        assert b.u is not None and b.h is not None  # the Swin capture fills every block
        attn, vnorm = wide(b.attn), wide(b.vnorm)
        nw = attn.shape[0] // bsz
        heads, tok = attn.shape[1], attn.shape[2]
        with torch.no_grad():
            flow = attn * wide(g_attn[li]) if g_attn[li] is not None else torch.zeros_like(attn)
            # the layer's heads over all of its windows: (B, H, nW·N, N)
            per_image = attn.reshape(bsz, nw, heads, tok, tok).transpose(1, 2).reshape(bsz, heads, nw * tok, tok)
            flow_img = flow.reshape(bsz, nw, heads, tok, tok).transpose(1, 2).reshape(bsz, heads, nw * tok, tok)
            omega = head_weights_from_flow(per_image, flow_img, o["head_weighting"], float(o["alpha"]),
                                           float(o["grad_threshold"]), o["head_subset"])
            w = weighted_attention(attn, flow, vnorm, omega.repeat_interleave(nw, dim=0))  # (B·nW, N, N)
            u, h = wide(b.u), wide(b.h)
            beta = skip_gate(u, h, torch.zeros_like(h) if g_h[li] is None else wide(g_h[li]), o["skip"],
                             float(o["eps"]))
            gh, gw = b.grid
            main = (beta * relevance).reshape(bsz, gh, gw)
            win, padded = to_windows(main, b.shift, b.window, b.pad_first)
            back = win[:, None, :].bmm(w)[:, 0]  # relevance on each window's keys
            back, fell = from_windows(back, bsz, (gh, gw), padded, b.shift, b.window, b.pad_first)
            relevance = back.reshape(bsz, -1) + (1.0 - beta) * relevance
            lost = lost + fell
        omegas.append(omega)
        betas.append(beta)
        first_of_stage = li == 0 or blocks[li - 1].stage != b.stage
        if first_of_stage and b.stage in g_merge:
            m = rec.merges[b.stage]
            assert m is not None
            g = g_merge[b.stage]
            relevance, fell = merge_handback(relevance, wide(m), torch.zeros_like(wide(m)) if g is None else
                                             wide(g))
            lost = lost + fell
        totals.append(relevance.sum(-1) + lost)
    gh, gw = adapter.grid(int_pair(x.shape[-2:]))
    if relevance.shape[1] != gh * gw:
        from ..errors import InputError

        raise InputError(f"{relevance.shape[1]} tokens at the first stage do not fill the {gh}x{gw} token grid")
    extras = {
        # per block, zero-padded: stages differ in heads and tokens
        "head_weights": _stack_padded(omegas[::-1]),  # (B, L, max H_l)
        "beta_main": _stack_padded(betas[::-1]),  # (B, L, max T_l), stage-l token order
        "layer_totals": torch.stack(totals[::-1], dim=1),  # (B, L+1): input of block 0 … readout
    }
    return Attribution(values=relevance.reshape(bsz, gh, gw), remainder=lost, extras=extras), logits.detach(), tgt
