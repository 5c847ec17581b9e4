"""GradSkip on Hiera (timm ``Hiera``, HF ``HieraForImageClassification``): mask-unit attention in the unrolled token
order, query max-pooling and max-pooled, projected skips at stage transitions.

Called by :class:`~vitlens.explainers.gradskip.GradSkip` when the adapter declares ``mask_units``; same options, one
forward and one activation-only backward. The equations (``docs/methods/gradskip.md``, Hiera):

1. **Start.** The head averages the last block's tokens: ``y`` is split over them in proportion to
   ``⟨x_L, ∂y/∂x_L⟩⁺`` (GradSkip's pooled-readout rule), so the start relevances sum to ``y``.
2. **A block** (last to first) works on ``T`` input tokens and ``T' = T / s`` output tokens (``s``: its flattened
   query stride, 1 where it does not pool). The attention ``A = softmax(q̂·kᵀ/√d)`` ``(B, H, nW, T'/nW, T/nW)`` of
   each of its ``nW`` mask units (``nW = 1``: global attention; unit ``w`` holds the tokens ``t ≡ w mod nW`` of the
   unrolled order) is recomputed from the recorded ``qkv`` (``q̂``: the queries max-pooled over the stride) and
   ``∂y/∂A = ∂y/∂O·vᵀ`` from the gradient of the attention output ``O``. Head weights ``ω`` per image over all
   units' query rows; ``W̃`` per unit (queries × keys, rows sum to 1). With the gate ``β`` from ``⟨a, ∂y/∂h⟩`` and
   ``⟨z, ∂y/∂h⟩`` (``a`` = attention branch, ``z`` = the skip, ``h = z + a``), the main part ``β·R`` goes to each
   unit's keys through ``W̃ᵀ``; the skip part ``(1 − β)·R`` stays on its token where the skip is the identity, and at
   a pooling block goes back through the max (:func:`pool_handback`) to the ``s`` input tokens of its stride window.
3. **End.** Block 0's input relevance is put on the patch grid with the model's re-roll (``adapter.patch_order()``).

Every step conserves the total: ``token_maps.sum() == y``, ``remainder == 0``, and ``layer_totals`` records it per
block.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
from torch import Tensor

from ..errors import InputError
from ..targets import Target
from ._gradskip_rules import (head_weights_from_flow, readout_relevance, skip_gate, stack_padded,
                              weighted_attention, wide)
from .base import Attribution, Explainer

if TYPE_CHECKING:
    from ..models.base import Adapter
    from ..models.hiera import HieraBlockRecord

__all__ = ["attribute_mask_units", "pool_contributions", "pool_handback", "POOL_RULES"]

#: how the skip relevance of a pooled token goes back through the max over its stride window: ``gxa`` in proportion
#: to the positive part of each input token's gradient × activation through the max (the default), ``argmax`` in
#: proportion to the number of channels whose maximum the token holds
POOL_RULES = ("gxa", "argmax")


def pool_contributions(z: Tensor, grad: Tensor, stride: int, kind: str, rule: str = "gxa") -> Tensor:
    """Per pooled token, the share-giving score of each of its ``stride`` input tokens, ``(B, stride, T')``.

    ``z``: the pool's input ``(B, T, C)`` (``T = stride·T'``; token ``j·T' + t`` is the ``j``-th of pooled token
    ``t``'s window, as Hiera's unroll lays them out); ``grad``: ``∂y/∂`` the pooled skip ``(B, T', C')``; ``kind``:
    ``"proj"`` (the skip is ``max_j z``, ``C' = C``) or ``"cat"`` (``[max_j z, mean_j z]``, ``C' = 2C``).
    ``rule="gxa"``: ``c[j, t] = Σ_c z[j, t, c]·∂y/∂z[j, t, c]``, the exact first-order contribution of input ``j``
    through the max (its gradient is the pooled gradient where ``j`` holds the maximum, split between ties, 0
    elsewhere), plus the mean's ``Σ_c z·g/stride`` for ``cat``; ``Σ_j c[j, t] = ⟨skip[t], ∂y/∂skip[t]⟩``.
    ``rule="argmax"``: the fraction of channels whose maximum ``j`` holds (ties split; the mean half of ``cat``
    gives every input the same share).
    """
    b, t, c = z.shape
    zw = z.reshape(b, stride, t // stride, c)
    top = (zw == zw.amax(dim=1, keepdim=True)).to(z.dtype)
    route = top / top.sum(dim=1, keepdim=True)  # (B, s, T', C): the max's gradient routing, ties split
    if rule == "argmax":
        share = route.mean(-1)
        return share if kind == "proj" else 0.5 * share + 0.5 / stride
    g = grad[..., :c]
    out = (zw * route * g[:, None]).sum(-1)
    if kind == "cat":
        out = out + (zw * grad[:, None, :, c:]).sum(-1) / stride
    return out


def pool_handback(relevance: Tensor, scores: Tensor) -> Tensor:
    """Hand the relevance of each pooled token ``(B, T')`` back to its ``s`` input tokens in proportion to the
    positive part of ``scores`` ``(B, s, T')`` (uniformly where all are ≤ 0): ``(B, s·T')`` in the pool input's
    token order. Conserves the total exactly."""
    pos = scores.clamp_min(0)
    total = pos.sum(1, keepdim=True)
    share = torch.where(total > 0, pos / total.clamp_min(torch.finfo(pos.dtype).tiny),
                        torch.full_like(pos, 1.0 / pos.shape[1]))
    return (share * relevance[:, None]).reshape(relevance.shape[0], -1)


def _attention(brec: HieraBlockRecord, grad_out: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """``A``, ``A ⊙ ∂y/∂A`` ``(B, H, nW, T'/nW, T/nW)`` and the value norms ``(B, H, nW, T/nW)`` of one block,
    recomputed as Hiera's attention computes them (its explicit path) from the recorded ``qkv``."""
    qkv = wide(cast(Tensor, brec.qkv))
    b, t, c3 = qkv.shape
    heads, nw, s = brec.heads, brec.windows, brec.q_stride
    d = c3 // (3 * heads)
    q, k, v = qkv.reshape(b, t // nw, nw, 3, heads, d).permute(3, 0, 4, 2, 1, 5).unbind(0)  # (B, H, nW, T/nW, d)
    if s > 1:
        q = q.reshape(b, heads, nw, s, t // (nw * s), d).amax(dim=3)
    attn = ((q * d ** -0.5) @ k.transpose(-2, -1)).softmax(dim=-1)
    if grad_out is None:
        return attn, torch.zeros_like(attn), v.norm(dim=-1)
    tq = attn.shape[3]
    g = wide(grad_out).reshape(b, tq, nw, heads, d).permute(0, 3, 2, 1, 4)  # (B, H, nW, T'/nW, d)
    return attn, (g @ v.transpose(-2, -1)).mul_(attn), v.norm(dim=-1)


def _skip(brec: HieraBlockRecord) -> Tensor:
    """The skip path's value on the block's output tokens: ``u``, or the pooled ``max_j z`` (``[max, mean]``)."""
    u = wide(cast(Tensor, brec.u))
    if not brec.skip:
        return u
    z = wide(cast(Tensor, brec.skip_in))
    zw = z.reshape(z.shape[0], brec.q_stride, -1, z.shape[-1])
    pooled = zw.amax(dim=1)
    return pooled if brec.skip == "proj" else torch.cat([pooled, zw.mean(dim=1)], dim=-1)


def _block_step(method: Explainer, brec: HieraBlockRecord, relevance: Tensor, g_out: Tensor | None,
                g_h: Tensor | None, pool_rule: str) -> tuple[Tensor, Tensor, Tensor]:
    """One block, output relevance ``(B, T')`` → input relevance ``(B, T)``; also ``ω`` ``(B, H)`` and ``β``."""
    o = method.options
    attn, flow, vnorm = _attention(brec, g_out)
    b, heads, nw, tq, tk = attn.shape
    # the layer's heads over all of its mask units: (B, H, nW·T'/nW, T/nW)
    omega = head_weights_from_flow(attn.reshape(b, heads, nw * tq, tk), flow.reshape(b, heads, nw * tq, tk),
                                   o["head_weighting"], float(o["alpha"]), float(o["grad_threshold"]),
                                   o["head_subset"])
    unit_attn = attn.transpose(1, 2).reshape(b * nw, heads, tq, tk)
    unit_flow = flow.transpose(1, 2).reshape(b * nw, heads, tq, tk)
    w = weighted_attention(unit_attn, unit_flow, vnorm.transpose(1, 2).reshape(b * nw, heads, tk),
                           omega.repeat_interleave(nw, dim=0))  # (B·nW, T'/nW, T/nW)
    h = wide(cast(Tensor, brec.h))
    grad_h = torch.zeros_like(h) if g_h is None else wide(g_h)
    skip = _skip(brec)
    beta = skip_gate(skip, h, grad_h, o["skip"], float(o["eps"]))
    main = (beta * relevance).reshape(b, tq, nw).transpose(1, 2).reshape(b * nw, 1, tq)  # unit w: tokens ≡ w mod nW
    keys = main.bmm(w).reshape(b, nw, tk).transpose(1, 2).reshape(b, nw * tk)  # back to the input's token order
    rest = (1.0 - beta) * relevance
    if brec.skip:
        scores = pool_contributions(wide(cast(Tensor, brec.skip_in)), grad_h, brec.q_stride, brec.skip, pool_rule)
        rest = pool_handback(rest, scores)
    return keys + rest, omega, beta


def attribute_mask_units(method: Explainer, adapter: "Adapter", x: Tensor, target: Target,
                         pool_rule: str = "gxa") -> tuple[Attribution, Tensor, Target]:
    """GradSkip for one chunk on a Hiera adapter: token maps on the patch grid, remainder 0. ``pool_rule``: how the
    skip relevance goes back through the max of a pooling block (:data:`POOL_RULES`, :func:`pool_contributions`;
    ``explain`` uses ``gxa``, ``argmax`` is kept for the comparison in ``docs/methods/gradskip.md``)."""
    from ..models.base import int_pair, recorded
    from ..models.hiera import HieraBlockRecord, HieraRecording

    if pool_rule not in POOL_RULES:
        raise InputError(f"pool_rule must be one of {', '.join(POOL_RULES)}; got {pool_rule!r}")
    o = method.options
    # recompute: the model's attention runs as built (timm: fused); A is recomputed from the recorded qkv
    with adapter.session(capture=True, conservative=bool(o["conservative"]), recompute=True) as session_rec:
        rec = cast(HieraRecording, session_rec)
        logits = adapter.forward(x)
        tgt = method.resolve_target(target, logits)
        y = tgt(logits)
        blocks = [cast(HieraBlockRecord, b) for b in rec.blocks]
        final_rec = recorded(rec.final, "final residual stream")
        wanted = [final_rec] + [recorded(b.out, "attention output") for b in blocks] + \
            [recorded(b.h, "post-attention residual") for b in blocks]
        grads = torch.autograd.grad(y.sum(), wanted, allow_unused=True)
    n = len(blocks)
    g_final, g_out, g_h = grads[0], grads[1:1 + n], grads[1 + n:]
    y = wide(y)
    final = wide(final_rec)
    relevance = readout_relevance(final, torch.zeros_like(final) if g_final is None else wide(g_final), y, None, 0)
    totals, omegas, betas = [relevance.sum(-1)], [], []
    with torch.no_grad():
        for li in range(n - 1, -1, -1):
            relevance, omega, beta = _block_step(method, blocks[li], relevance, g_out[li], g_h[li], pool_rule)
            totals.append(relevance.sum(-1))
            omegas.append(omega)
            betas.append(beta)
    gh, gw = adapter.grid(int_pair(x.shape[-2:]))
    order = adapter.patch_order().to(relevance.device)  # type: ignore[attr-defined]
    if relevance.shape[1] != gh * gw or order.numel() != gh * gw:
        raise InputError(f"{relevance.shape[1]} tokens at block 0 do not fill the {gh}x{gw} token grid")
    extras = {
        # per block, zero-padded: stages differ in heads and tokens
        "head_weights": stack_padded(omegas[::-1]),  # (B, L, max H_l)
        "beta_main": stack_padded(betas[::-1]),  # (B, L, max T'_l), in the block's unrolled output order
        "layer_totals": torch.stack(totals[::-1], dim=1),  # (B, L+1): input of block 0 … readout
    }
    att = Attribution(values=relevance[:, order].reshape(-1, gh, gw), remainder=torch.zeros_like(y), extras=extras)
    return att, logits.detach(), tgt
