"""GradSkip on multiscale pooling attention (timm MViTv2): pooled queries, keys and values, residual pooling and the
max-pooled skip at stage transitions.

Called by :class:`~vitlens.explainers.gradskip.GradSkip` when the adapter provides ``pooling_attention``, with the
same options. One forward and one activation-only backward pass; the equations are in ``docs/methods/gradskip.md``
("MViTv2"). Per block, from the last to the first, with ``R`` the relevance on the block's ``T_q`` output tokens:

1. the MLP sub-layer is token-wise (also its width-changing skip projection): ``R`` stays on its token;
2. the attention residual ``h = s + a`` (``s`` the skip, max-pooled at stage transitions): GradSkip's gate
   ``β = |⟨a, ∇h⟩| / (|⟨a, ∇h⟩| + |⟨s, ∇h⟩| + ε)``; ``(1 − β)·R`` goes down the skip (through the max-pool: see 5);
3. the attention output ``o = A·v + q`` (residual pooling) is split z-rule style by the two terms' first-order
   contributions, ``γ = |⟨A·v, ∇o⟩| / (|⟨A·v, ∇o⟩| + |⟨q, ∇o⟩| + ε)``: ``γ·β·R`` goes through ``W̃`` (queries ×
   keys, GradSkip's head weighting) to the pooled keys, ``(1 − γ)·β·R`` stays on the pooled queries;
4. each pooled key's relevance goes back to the tokens of its key/value pooling window, each pooled query's to the
   tokens of its query pooling window;
5. each max-pooled skip token's relevance goes back to its window.

Every hand-back is :func:`pooled_handback`: per output window, in proportion to the positive part of the exact
first-order contributions (gradient × activation) of the window's input positions, uniformly over its in-image
positions when all are zero (SegFormer's rule, :func:`~.gradskip_segformer.window_handback`, for depthwise
convolutions and for a max-pool, whose contribution sits on the arg-max of each channel). Keys use the sum of the
key and the value pooling's contributions. The CLS token, where there is one, passes every pooling unchanged.
Every step conserves the total, so ``map.sum() + remainder == y`` (``remainder``: what ends on CLS).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import InputError
from ..models.base import Adapter, int_pair, recorded
from ..targets import Target
from ._gradskip_rules import filled, head_weights, readout_relevance, skip_gate, weighted_attention, wide
from ._gradskip_capture import captured_gradients
from .base import Attribution, Explainer

if TYPE_CHECKING:
    from ..models.timm_mvit import PooledBlockRecord

__all__ = ["attribute_pooled", "depthwise_contributions", "maxpool_contributions", "pooled_handback"]


def _geometry(module: Any) -> dict[str, Any]:
    """``F.unfold`` arguments of a convolution or max-pool window (explicit padding sizes only)."""
    if isinstance(getattr(module, "padding", 0), str):
        raise InputError(f"pooling with padding={module.padding!r}: the window hand-back needs explicit sizes")
    return dict(kernel_size=int_pair(module.kernel_size), dilation=int_pair(module.dilation),
                padding=int_pair(module.padding), stride=int_pair(module.stride))


def depthwise_contributions(x: Tensor, grad_out: Tensor, conv: nn.Conv2d) -> Tensor:
    """First-order contribution of every input position to every output window of a depthwise ``conv``,
    ``(N, K, k_h·k_w)``: ``c[n, k, o] = Σ_c x[n, c, p(k, o)] · W[c, o] · ∂y/∂out[n, c, k]`` (0 in the padding);
    ``Σ_o c[n, k, o] = ⟨∂y/∂out_k, out_k⟩`` for the bias-free pooling convolutions.

    Args:
        x: the convolution's input ``(N, C, H, W)``; grad_out: the target's gradient at its output ``(N, C, h, w)``.
    """
    if conv.groups != conv.in_channels or conv.out_channels != conv.in_channels:
        raise InputError("the pooling convolution is not depthwise (one filter per channel)")
    geo = _geometry(conv)
    n, c = x.shape[:2]
    cols = F.unfold(x, **geo).reshape(n, c, -1, grad_out.shape[-2] * grad_out.shape[-1])  # (N, C, kk, K)
    weight = conv.weight.detach().to(x.dtype).reshape(1, c, -1, 1)  # (1, C, kk, 1)
    cols.mul_(grad_out.flatten(2).to(x.dtype)[:, :, None, :]).mul_(weight)  # in place: unfold made a fresh tensor
    return cols.sum(1).transpose(1, 2)


def maxpool_contributions(x: Tensor, grad_out: Tensor, pool: nn.Module) -> Tensor:
    """First-order contribution of every input position to every window of a max-pool, ``(B, K, k_h·k_w)``: per
    channel the window's maximum ``out[c, k]`` is the input at its arg-max, which gets ``out[c, k]·∂y/∂out[c, k]``
    (the first maximum on ties, as the gradient of ``max`` picks one); ``Σ_o c[b, k, o] = ⟨∂y/∂out_k, out_k⟩``."""
    geo = _geometry(pool)
    if bool(getattr(pool, "ceil_mode", False)):
        raise InputError("max-pool with ceil_mode=True: the window hand-back needs floor-mode windows")
    (ph, pw) = geo["padding"]
    padded = F.pad(x, (pw, pw, ph, ph), value=float("-inf"))
    b, c = x.shape[:2]
    k = grad_out.shape[-2] * grad_out.shape[-1]
    cols = F.unfold(padded, **{**geo, "padding": 0}).reshape(b, c, -1, k)  # (B, C, kk, K)
    best, where = cols.max(dim=2)  # (B, C, K)
    gain = best * grad_out.flatten(2).to(x.dtype)
    return x.new_zeros(b, cols.shape[2], k).scatter_add_(1, where, gain).transpose(1, 2)


def pooled_handback(relevance: Tensor, contrib: Tensor, hw: tuple[int, int], module: nn.Module,
                    prefix: int) -> Tensor:
    """Hand the relevance of each output token of a pooling back to the input tokens of its window.

    ``R_in[j] = Σ_{k : j ∈ win(k)} R_out[k] · c⁺[k, j] / Σ_{j' ∈ win(k)} c⁺[k, j']`` with the window contributions
    ``contrib`` ``(B, K, kk)``; a window whose ``c⁺`` are all 0 splits uniformly over its in-image positions. The
    first ``prefix`` tokens (CLS) pass unchanged. Conserves the total exactly.

    Args:
        relevance: ``(B, prefix + K)`` on the output tokens; hw: the input grid; module: the pooling (its window).

    Returns ``(B, prefix + H·W)`` on the input tokens.
    """
    geo = _geometry(module)
    contrib = contrib.clamp_min(0)
    inside = F.unfold(torch.ones(1, 1, *hw, dtype=contrib.dtype, device=contrib.device), **geo).transpose(1, 2)
    contrib = contrib * inside
    total = contrib.sum(-1, keepdim=True)
    uniform = inside / inside.sum(-1, keepdim=True)
    share = torch.where(total > 0, contrib / total.clamp_min(torch.finfo(contrib.dtype).tiny), uniform)
    parts = share * relevance[:, prefix:, None]  # (B, K, kk)
    grid = F.fold(parts.transpose(1, 2), output_size=hw, **geo).flatten(1)
    return torch.cat([relevance[:, :prefix], grid], dim=1)


def _per_head_grid(t: Tensor, heads: int) -> Tensor:
    """A pooling's ``(B·H, d, h, w)`` → ``(B, H, d, h, w)``."""
    return t.reshape(-1, heads, *t.shape[1:])


def _conv_handback(relevance: Tensor, rec: Any, grads: dict[int, Tensor], hw: tuple[int, int], prefix: int,
                   heads: int, others: tuple[Any, ...] = ()) -> Tensor:
    """:func:`pooled_handback` through a per-head pooling convolution ``rec`` (a ``ConvRecord``), its window
    contributions summed over heads and channels (and over ``others``: poolings with the same windows whose
    contributions count too, the value pooling next to the key pooling)."""
    contrib: Tensor | None = None
    for r in (rec, *others):
        c = depthwise_contributions(wide(r.input), grads[id(r.output)], r.conv)  # (B·H, K, kk)
        c = c.reshape(-1, heads, *c.shape[1:]).sum(1)
        contrib = c if contrib is None else contrib + c
    assert contrib is not None
    return pooled_handback(relevance, contrib, hw, rec.conv, prefix)


def _block_step(method: Explainer, blk: PooledBlockRecord, relevance: Tensor, grads: dict[int, Tensor],
                prefix: int) -> tuple[Tensor, dict[str, Tensor]]:
    """One block: relevance on its output tokens → on its input tokens, and the block's propagation terms."""
    from ..models.timm_mvit import attention_probabilities

    o = method.options
    eps = float(o["eps"])
    att = blk.attn
    heads = int(att.num_heads)
    hw = recorded(blk.grid_in, "block input grid")
    h, a = recorded(blk.h, "post-attention residual"), wide(recorded(blk.a, "attention output"))
    grad_h = grads[id(h)]
    skip = wide(h) - a
    beta = skip_gate(skip, wide(h), grad_h, o["skip"], eps)  # skip_gate's main path is h − skip = a
    # the skip: identity, or max-pooled (its output gradient is ∂y/∂h)
    down = (1.0 - beta) * relevance
    if blk.skip_pool is not None:
        s_in = wide(recorded(blk.skip_in, "skip pooling input"))
        g = grad_h[:, prefix:].transpose(1, 2).reshape(s_in.shape[0], s_in.shape[1], -1)
        g = g.reshape(*g.shape[:2], *recorded(blk.q_size, "query grid"))
        down = pooled_handback(down, maxpool_contributions(s_in, g, blk.skip_pool), hw, blk.skip_pool, prefix)
    # the attention output o = A·v + q: split by the two terms' contributions
    out = recorded(blk.o, "attention projection input")
    b, tq = out.shape[:2]
    grad_o = grads[id(out)].reshape(b, tq, heads, -1).transpose(1, 2)  # (B, H, T_q, d): ∂y/∂(A·v)
    q, v = wide(recorded(blk.q, "pooled queries")), wide(recorded(blk.v, "pooled values"))
    if bool(att.residual_pooling):
        av = wide(out).reshape(b, tq, heads, -1).transpose(1, 2) - q
        c_av, c_q = (av * grad_o).sum((1, 3)).abs(), (q * grad_o).sum((1, 3)).abs()
        gamma = c_av / (c_av + c_q + eps)  # as skip_gate: a token without gradient keeps its relevance on q
    else:  # o = A·v: all of it through the attention
        gamma = torch.ones_like(beta)
    # A·v: W̃ (queries × keys) with GradSkip's head weights, then back through the key/value pooling
    attn = attention_probabilities(blk)
    grad_attn = grad_o @ v.transpose(-2, -1)  # ∂y/∂A
    omega = head_weights(attn, grad_attn, o["head_weighting"], float(o["alpha"]), float(o["grad_threshold"]),
                         o["head_subset"])
    wt = weighted_attention(attn, attn * grad_attn, v.norm(dim=-1), omega)  # (B, T_q, T_k)
    keys = (gamma * beta * relevance)[:, None, :].bmm(wt)[:, 0]  # (B, T_k)
    if blk.pool_k is not None and blk.pool_v is not None:
        keys = _conv_handback(keys, blk.pool_k, grads, hw, prefix, heads, others=(blk.pool_v,))
    queries = (1.0 - gamma) * beta * relevance
    if blk.pool_q is not None:
        queries = _conv_handback(queries, blk.pool_q, grads, hw, prefix, heads)
    terms = {"omega": omega, "beta": beta, "gamma": gamma}
    return down + keys + queries, terms


def attribute_pooled(method: Explainer, adapter: Adapter, x: Tensor,
                     target: Target) -> tuple[Attribution, Tensor, Target]:
    """GradSkip for one chunk on a pooling-attention adapter: token maps on the first stage's grid, ``remainder``
    the relevance that ends on the CLS token (0 without one)."""
    rec, logits, tgt, y, grads = captured_gradients(method, adapter, x, target)
    blocks: list[PooledBlockRecord] = list(getattr(rec, "blocks"))
    final = recorded(getattr(rec, "final", None), "final token stream")
    p = adapter.num_prefix_tokens
    relevance = readout_relevance(wide(final), grads[id(final)], y, adapter.readout_tokens, p)
    n = len(blocks)
    totals: list[Tensor | None] = [None] * n
    terms: list[dict[str, Tensor] | None] = [None] * n
    max_heads = max(int(blk.attn.num_heads) for blk in blocks)
    for li in range(n - 1, -1, -1):
        relevance, terms[li] = _block_step(method, blocks[li], relevance, grads, p)
        totals[li] = relevance.sum(-1)
    gh, gw = adapter.grid(int_pair(x.shape[-2:]))
    patch = relevance[:, p:]
    if patch.shape[1] != gh * gw:
        raise InputError(f"{patch.shape[1]} patch tokens do not fill the {gh}x{gw} token grid")
    done = filled(terms)
    extras = {
        "layer_totals": torch.stack(filled(totals), dim=1),  # (B, L): total on each block's input (forward order)
        "head_weights": torch.stack([F.pad(t["omega"], (0, max_heads - t["omega"].shape[1])) for t in done], dim=1),
    }
    for li, t in enumerate(done):  # per block (B, T_q), T_q shrinking at stage transitions
        extras[f"beta_main_block{li}"] = t["beta"]  # the attention path's share at h
        extras[f"gamma_attention_block{li}"] = t["gamma"]  # A·v's share of the attention output (1 − γ: pooled q)
    att = Attribution(values=patch.reshape(-1, gh, gw), remainder=relevance[:, :p].sum(-1), extras=extras)
    return att, logits.detach(), tgt
