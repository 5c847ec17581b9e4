"""The propagation rules of GradSkip, shared by the plain-sequence path (:mod:`.gradskip`) and the hierarchical one
(:mod:`.gradskip_segformer`): head weights (gradient flow + Gini sparsity), the readout's start relevance, the
head-weighted attention ``W̃`` and the skip gate ``β_main``. Equations: ``docs/methods/gradskip.md``.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence, TypeVar

import numpy as np
import torch
from torch import Tensor

from ..runtime import gini

__all__ = ["stack_padded", "block_backward", "filled", "gini", "probability_gini", "wide", "head_weights", "head_weights_from_flow",
           "head_weights_from_scores", "positive_flow", "readout_relevance", "skip_gate", "sparsity_needed",
           "weighted_attention"]


def wide(t: Tensor) -> Tensor:
    """``t`` detached, in float32 if it is a half-precision tensor (float64 stays float64): the propagation runs in
    at least float32 whatever the model's dtype."""
    return t.detach().to(torch.promote_types(t.dtype, torch.float32))


_T = TypeVar("_T")


def filled(items: Sequence[_T | None]) -> list[_T]:
    """``items``, a per-block list that the backward filled in (:func:`block_backward` reduces every block, also
    those the gradient never reached), as a list without ``None``."""
    out = [v for v in items if v is not None]
    assert len(out) == len(items), "a block was not reduced"
    return out


def _normalise_heads(v: Tensor) -> Tensor:
    """Normalise ``(B, H)`` scores to sum to 1 over heads; all-zero rows become uniform."""
    s = v.sum(dim=-1, keepdim=True)
    uniform = torch.full_like(v, 1.0 / v.shape[-1])
    return torch.where(s > 0, v / s.clamp_min(torch.finfo(v.dtype).tiny), uniform)


def head_weights(attn: Tensor, grad: Tensor, mode: str = "adaptive", alpha: float = 0.5,
                 grad_threshold: float = 0.1, head_subset: tuple[str, float] | None = None) -> Tensor:
    """Per-image head weights ``ω`` of one layer, ``(B, H)``, summing to 1 over heads.

    Args:
        attn: attention probabilities ``(B, H, T, T_k)``; grad: their gradient, same shape.
        mode: ``adaptive`` (α·g̃ + (1−α)·s̃), ``uniform`` (1/H), ``gradient`` (α = 1), ``sparsity`` (α = 0).
        grad_threshold: heads with flow score below this fraction of the layer's maximum get flow 0.
        head_subset: ``("top"|"bottom", k)`` keeps only the ⌈k·H⌉ most (least) sparse heads by Gini.
    """
    return head_weights_from_flow(attn, attn * grad, mode, alpha, grad_threshold, head_subset)


def head_weights_from_flow(attn: Tensor, flow_terms: Tensor, mode: str, alpha: float, grad_threshold: float,
                  head_subset: tuple[str, float] | None) -> Tensor:
    """:func:`head_weights` from ``A ⊙ ∇A`` (``flow_terms``), which the caller computes once for both uses."""
    flow = flow_terms.abs().sum(dim=-1).mean(dim=-1) if mode != "uniform" else None  # (B, H)
    return head_weights_from_scores(attn, flow, mode, alpha, grad_threshold, head_subset)


def positive_flow(flow_terms: Tensor, rows: int | None = None, row_sums: Tensor | None = None) -> Tensor:
    """The flow score ``mean_i Σ_j |A ⊙ ∇A|_ij`` per head ``(B, H)``, leaving ``flow_terms`` clamped at 0 in place.

    ``Σ_j |f_ij| = 2·Σ_j f⁺_ij − Σ_j f_ij``: two row sums around the clamp that :func:`weighted_attention` needs
    anyway, instead of a separate ``|f|`` tensor (the same sum of non-negative parts, up to float rounding).
    ``rows``: the layer's number of query rows when ``flow_terms`` holds only the first of them (the others have
    zero gradient: the readout path's last block); the mean is over all ``rows``. ``row_sums``: ``Σ_j f_ij``
    ``(B, H, T_q)`` where the caller already has it (the attention backward's softmax step forms it).
    """
    total = flow_terms.sum(dim=-1) if row_sums is None else row_sums
    pos = flow_terms.clamp_min_(0).sum(dim=-1)
    per_row = (2.0 * pos - total).clamp_min_(0)
    if rows is None or rows == per_row.shape[-1]:
        return per_row.mean(dim=-1)
    return per_row.sum(dim=-1) / rows


#: the integer type with the bit layout of each float type: non-negative floats sort like their bit patterns
_SAME_ORDER_INTS = {torch.float32: np.int32, torch.float64: np.int64}


#: bytes of the rows :func:`probability_gini` takes at a time: the sort, the weighted sum and the plain sum of a
#: block read what the previous pass left in cache (on EVA02-Ti's (8, 3, 257, 257) probabilities, one thread: 0.82
#: of the whole-array time at 2 MiB, 0.88 at 1 MiB, 0.93 at 4 MiB, 1.00 at 16 MiB; smaller blocks pay per block)
GINI_BLOCK_BYTES = 2 << 20


def probability_gini(p: Tensor) -> Tensor:
    """:func:`~vitlens.runtime.gini` over the last dimension of *non-negative* values (attention probabilities),
    the same values up to float rounding, cheaper on a CPU: the rows are sorted as the integers with the same bits
    (the order of non-negative IEEE floats; NumPy's integer sort is the faster one) and the coefficient is taken as
    ``Σ_i (2i − n − 1)·p(i) / (n·Σ_i p(i))`` (the same formula rearranged): the weighted sum as a matrix-vector
    product over the sorted rows, the plain sum over the unsorted ones (a two-column matrix product for both took
    11× the matrix-vector product's time on a CPU: docs/benchmarks/gradskip_cost.md).

    The rows go through in blocks of :data:`GINI_BLOCK_BYTES` with one sort buffer from torch's allocator: the passes
    over a block (copy, sort, weighted sum, sum) read it from cache, and no array of the input's size is allocated
    (NumPy backs a large array with huge pages that are faulted in afresh on every call).

    Rows of ``2^k + 1`` values (a class token and a square power-of-two grid: EVA02 at 224 px, patch 14) are sorted
    without their largest value, whose rank is known to be the last (:func:`_sorted_weighted_sum`): NumPy's SIMD sort
    handles up to a power of two of values in one sorting network, so 257 values cost as much as 512 and 256 half
    that."""
    ints = _SAME_ORDER_INTS.get(p.dtype)
    if p.device.type != "cpu" or p.requires_grad or ints is None:
        return gini(p)
    n = p.shape[-1]
    rows = p.contiguous().view(-1, n)
    weights = torch.arange(1 - n, n + 1, 2, dtype=p.dtype)
    ws = rows.new_empty(rows.shape[0])
    total = rows.new_empty(rows.shape[0])
    step = max(1, GINI_BLOCK_BYTES // (n * rows.element_size()))
    buf = rows.new_empty((min(step, rows.shape[0]), n)).numpy().view(ints)
    values = rows.numpy()
    for s in range(0, rows.shape[0], step):
        e = min(rows.shape[0], s + step)
        _sorted_weighted_sum(values[s:e], ints, weights, buf[:e - s], ws[s:e])
        torch.sum(rows[s:e], dim=-1, out=total[s:e])
    ws, total = ws.view(p.shape[:-1]), total.view(p.shape[:-1])
    g = ws / (n * total.clamp_min(torch.finfo(p.dtype).tiny))
    return torch.where(total > 0, g, torch.zeros_like(g))


def _sorted_weighted_sum(values: np.ndarray, ints: type, weights: Tensor, buf: np.ndarray, out: Tensor) -> None:
    """``out`` ← ``Σ_i weights[i]·p(i)`` per row of the non-negative floats ``values`` ``(R, n)``, ``p(i)`` the row
    sorted ascending (as the integers ``ints`` with the same bits, in ``buf`` ``(R, n)`` of ``ints``); a row of
    ``2^k + 1`` values (k ≥ 6) is sorted without its largest value, which takes the last weight (ties between equal
    values do not change the sum)."""
    rows, n = values.shape
    bits: np.ndarray = values.view(ints)
    set_aside = bool(rows) and n > 64 and (n - 1) & (n - 2) == 0  # 2^k + 1 values: the largest one set aside
    cols = n - 1 if set_aside else n
    rest = buf[:, :cols]
    np.copyto(rest, bits[:, :cols])
    if set_aside:
        top = bits.argmax(axis=-1)
        moved = np.flatnonzero(top < cols)  # the last column's value takes the largest value's place
        rest[moved, top[moved]] = bits[moved, cols]
    rest.sort(axis=-1)
    torch.mv(torch.from_numpy(rest.view(values.dtype)), weights[:cols], out=out)
    if set_aside:
        out.add_(torch.from_numpy(values[np.arange(rows), top]), alpha=float(weights[-1]))


def sparsity_needed(mode: str, alpha: float, head_subset: tuple[str, float] | None) -> bool:
    """Whether the head weights of these options use the Gini sparsity of the probabilities."""
    return head_subset is not None or mode == "sparsity" or (mode == "adaptive" and alpha < 1.0)


def head_weights_from_scores(attn: Tensor, flow: Tensor | None, mode: str, alpha: float, grad_threshold: float,
                             head_subset: tuple[str, float] | None, sparsity: Tensor | None = None) -> Tensor:
    """:func:`head_weights` from the flow score per head ``(B, H)`` (``mean_i Σ_j |A ⊙ ∇A|_ij``; unused in
    ``uniform`` mode). ``sparsity``: the mean Gini per head ``(B, H)`` where the caller took it (windows: over all
    windows of the image, :func:`sparsity_needed` says when); else it is taken here from ``attn``."""
    b, h = attn.shape[:2]
    needs_sparsity = sparsity_needed(mode, alpha, head_subset)
    if sparsity is None and needs_sparsity:
        sparsity = probability_gini(attn).mean(dim=-1)  # (B, H): per query row, then mean over rows
    if mode == "uniform" or flow is None:
        w = torch.full((b, h), 1.0 / h, device=attn.device, dtype=attn.dtype)
    else:
        a = {"gradient": 1.0, "sparsity": 0.0}.get(mode, alpha)
        flow = torch.where(flow < grad_threshold * flow.amax(dim=-1, keepdim=True), torch.zeros_like(flow), flow)
        w = a * _normalise_heads(flow)
        if sparsity is not None and a < 1.0:
            w = w + (1.0 - a) * _normalise_heads(sparsity)
    if head_subset is not None:
        side, frac = head_subset
        k = max(1, min(h, int(round(frac * h))))
        assert sparsity is not None  # needs_sparsity holds whenever head_subset is set
        order = sparsity.argsort(dim=-1, descending=(side == "top"))
        keep = torch.zeros_like(w).scatter_(1, order[:, :k], 1.0)
        w = _normalise_heads(w * keep)
        w = torch.where(w.sum(-1, keepdim=True) > 0, w, keep / k)
    return w


def readout_relevance(final: Tensor, grad_final: Tensor, y: Tensor, readout: tuple[int, ...] | None,
                      num_prefix: int) -> Tensor:
    """Start relevance ``R_L`` ``(B, T)`` with ``R_L.sum(-1) == y``.

    Single readout token: all of ``y`` on it. Several (CLS + DIST): in proportion to ``|⟨x_L, ∇x_L⟩|`` on them.
    Pooled readout: in proportion to ``⟨x_L, ∇x_L⟩⁺`` over all tokens (falling back to ``|·|``, then to uniform over
    patch tokens).
    """
    b, t, _ = final.shape
    gxa = (final * grad_final).sum(dim=-1)  # (B, T)
    w = torch.zeros(b, t, device=final.device, dtype=final.dtype)
    if readout is not None and len(readout) == 1:
        w[:, readout[0]] = 1.0
    else:
        if readout is not None:
            scores = torch.zeros_like(gxa)
            idx = list(readout)
            scores[:, idx] = gxa[:, idx].abs()
            fallback = torch.zeros_like(gxa)
            fallback[:, idx] = 1.0
        else:
            scores = gxa.clamp_min(0)
            scores = torch.where(scores.sum(-1, keepdim=True) > 0, scores, gxa.abs())
            fallback = torch.zeros_like(gxa)
            fallback[:, num_prefix:] = 1.0
        scores = torch.where(scores.sum(-1, keepdim=True) > 0, scores, fallback)
        w = scores / scores.sum(dim=-1, keepdim=True)
    return w * y[:, None]


def weighted_attention(attn: Tensor, flow_terms: Tensor, vnorm: Tensor, omega: Tensor,
                       clamped: bool = False) -> Tensor:
    """``W̃ = rownorm(Σ_q ω_q · (A_q ⊙ ∇A_q)⁺ ⊙ ‖v_q,j‖)``, zero rows falling back to ``Σ_q ω_q A_q``.

    ``flow_terms`` is ``A ⊙ ∇A`` ``(B, H, T, T_k)`` (``clamped``: already clamped at 0, see :func:`positive_flow`);
    it is consumed (clamped and scaled in place). ``vnorm``: the value norms ``‖v_q,j‖`` ``(B, H, T_k)``.
    ``flow_terms`` may hold only the first ``T_q < T`` rows (the readout path's last block, whose other rows carry
    no relevance): the result is then ``W̃``'s first ``T_q`` rows ``(B, T_q, T_k)``.
    """
    scale = omega[:, :, None] * vnorm  # (B, H, T_k): ω_q · ‖v_q,j‖
    pos = flow_terms if clamped else flow_terms.clamp_min_(0)
    m = pos[:, 0] * scale[:, 0, None, :]  # (B, T, T_k); head by head: one pass over each head's entries
    for q in range(1, pos.shape[1]):
        m.addcmul_(pos[:, q], scale[:, q, None, :])
    rows = m.sum(dim=-1, keepdim=True)
    w = m.div_(rows.clamp_min(torch.finfo(m.dtype).tiny))
    empty = rows[..., 0] <= 0
    if bool(empty.any()):  # rows without positive flow: the head-weighted attention itself
        b, h, t, tk = pos.shape
        fallback = omega[:, None, :].bmm(attn[:, :, :t].reshape(b, h, t * tk)).reshape(b, t, tk)
        w = torch.where(empty[..., None], fallback, w)
    return w


def skip_gate(u: Tensor, h: Tensor, grad_h: Tensor, mode: str = "adaptive", eps: float = 1e-12,
              mlp: Tensor | None = None) -> Tensor:
    """``β_main`` per token ``(B, T)`` from gradient-weighted magnitudes of the attention and skip paths.

    ``mlp``: a parallel block's MLP branch (``h`` is then the block output ``u + a + m``): ``c_skip`` is
    ``|⟨u, ∇h⟩| + |⟨m, ∇h⟩|`` and ``c_main = |⟨a, ∇h⟩|`` with ``a = h − u − m``.
    On the readout path the last block's ``h`` holds the first ``r`` tokens only; every other token has zero
    gradient there, so its adaptive gate is ``0 / (0 + 0 + eps) = 0``, as in the full computation.
    """
    if mode == "fixed":
        return torch.full(u.shape[:2], 0.5, device=u.device, dtype=u.dtype)
    if mode == "none":
        return torch.ones(u.shape[:2], device=u.device, dtype=u.dtype)
    u = u[:, : h.shape[1]]
    main = h - u
    c_skip = (u * grad_h).sum(-1).abs()
    if mlp is not None:  # parallel block, h = u + a + m: the token-wise MLP branch keeps its share on the token
        mlp = mlp[:, : h.shape[1]]
        main = main - mlp
        c_skip = c_skip + (mlp * grad_h).sum(-1).abs()
    c_main = (main * grad_h).sum(-1).abs()
    return c_main / (c_main + c_skip + float(eps))


def block_backward(y: Tensor, final: Tensor, saved: Sequence[dict[str, Any]],
                   attn_step: Callable[[int, Tensor | None], None], h_step: Callable[[int, Tensor | None], None],
                   attn_done: Callable[[int], bool], h_done: Callable[[int], bool]) -> Tensor | None:
    """The backward that reduces each block's gradients as autograd produces them.

    Tensor hooks on every block's captured attention (``saved[l]["attn"]``) and post-attention residual
    (``saved[l]["h"]``) call ``attn_step(l, grad)`` / ``h_step(l, grad)`` (no attention hook where
    ``saved[l]["in_backward"]``: that block's attention backward hands its probabilities over itself); the backward itself asks only for
    ``∂y/∂final`` and block 0's two gradients (nothing below block 0's attention runs). Blocks the gradient never
    reached are reduced with ``None``. Returns ``∂y/∂final`` (``None`` if ``y`` does not depend on it).
    """
    first = saved[0]
    for li, cap in enumerate(saved[1:], start=1):
        if not cap.get("in_backward", False):  # else the attention's own backward reduces the block
            cap["attn"].register_hook(lambda g, li=li: attn_step(li, g))
        cap["h"].register_hook(lambda g, li=li: h_step(li, g))
    grads = torch.autograd.grad(y, [final, first["attn"], first["h"]], allow_unused=True)
    attn_step(0, grads[1])
    h_step(0, grads[2])
    for li in range(1, len(saved)):
        if not attn_done(li):
            attn_step(li, None)
        if not h_done(li):
            h_step(li, None)
    return grads[0]


def stack_padded(rows: list[Tensor]) -> Tensor:
    """``L`` tensors ``(B, n_l)`` → ``(B, L, max n_l)``, zero-padded."""
    width = max(r.shape[1] for r in rows)
    out = rows[0].new_zeros(rows[0].shape[0], len(rows), width)
    for i, r in enumerate(rows):
        out[:, i, : r.shape[1]] = r
    return out
