"""The backward of a fused attention computed from its recomputed probabilities, which it hands to a consumer.

A recording session with ``recompute=True`` keeps timm's fused ``scaled_dot_product_attention`` in the forward (no
``(B, H, T, T)`` tensor is stored). A consumer that needs every block's probabilities ``A`` and their gradient
``∂y/∂A`` in the backward (GradSkip) would otherwise pay twice for them: once inside the fused kernel's backward,
which recomputes them blockwise and does not expose them, and once more to recompute them itself. When
:attr:`~vitlens.models.base.Recording.on_probabilities` is set before the forward, the attention output ``O``
(before ``attn.norm``) is routed through :class:`ProbabilitiesInBackward`: the forward returns ``O`` itself (the
fused kernel's values, unchanged), and the backward computes, from the block's ``qkv`` output,

- ``A = softmax(q·scale·kᵀ)`` on every query row (timm's explicit path up to rounding: the scale is applied to
  the product),
- ``∂y/∂A = (∂y/∂O)·vᵀ`` and ``F = A ⊙ ∂y/∂A`` on the rows ``O`` holds (all, or the readout rows),
- the softmax backward ``∂y/∂S = F − A·rowsum(F)`` and from it ``∂y/∂q``, ``∂y/∂k``, ``∂y/∂v``, written into one
  ``(B, T, 3·H·d)`` gradient of the ``qkv`` output,

then calls ``on_probabilities(block, A, F, ΣF, ‖v‖)`` with the row sums ``Σ_j F_ij`` that the softmax backward
formed and the value norms (the consumer may overwrite ``A`` and ``F``; handing over the two reductions saves it
a pass over ``F`` and one over the strided values). The fused kernel's own backward never runs (its output reaches
the logits only through the detached copy). Gradients agree with the fused kernel's up to float rounding.

Running this backward image by image in chunks that fit the core's cache was measured and is not done: the
passes over ``A`` and ``F`` do get faster, but a GradSkip map on ViT-Ti (batch 8, one thread, Xeon) took 1.038×
(per-repeat 1.019–1.069) as long as the whole-batch backward.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

__all__ = ["AttentionInBackward", "ProbabilitiesInBackward", "Sink"]

#: ``on_probabilities(block, A (B, H, T, T), F (B, H, T_q, T), Σ_j F_ij (B, H, T_q), ‖v_j‖ (B, H, T))``
Sink = Callable[[int, Tensor, Tensor, Tensor, Tensor], None]


#: bytes of one chunk's ``(rows, T, T)`` tensors in :func:`_attention_backward`: about a core's L2 cache, so the
#: passes over the probabilities, ``F`` and ``∂y/∂S`` of a chunk read what the previous one wrote from cache
CHUNK_BYTES = 1 << 20


def _attention_backward(q: Tensor, k: Tensor, v: Tensor, g: Tensor, scale: float
                        ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The backward of ``O = softmax(q·scale·kᵀ)·v`` from the recomputed probabilities, on ``(n, T, d)`` rows
    (contiguous) and the gradient ``g`` of the first ``T_q`` output rows ``(n, T_q, d)``: returns ``A`` ``(n, T, T)``,
    ``F = A ⊙ ∂y/∂A`` ``(n, T_q, T)``, ``Σ_j F_ij`` ``(n, T_q, 1)`` and the three gradients in one buffer
    ``(3, n, T, d)`` (q, k, v). The scale goes into the products (``baddbmm``'s alpha).

    The ``n`` rows (image × head) are taken a few at a time (:data:`CHUNK_BYTES`): every product is the same
    per-row product as on the whole batch (the same values, bit for bit), but the chunk's scores and ``∂y/∂S``
    stay in cache between the passes: a whole GradSkip map at batch 8, one thread, took 0.983 / 0.984 (EVA02-Ti),
    0.992 (ViT-Ti) and 0.981 (ViT-B) of the time with the whole-batch passes (docs/benchmarks/gradskip_cost.md,
    session 22)."""
    n, t, d = q.shape
    tq = g.shape[1]
    rows_per_chunk = max(1, min(n, CHUNK_BYTES // (t * t * q.element_size())))
    attn = q.new_empty((n, t, t))
    flow = q.new_empty((n, tq, t))
    row_sums = q.new_empty((n, tq, 1))
    parts = q.new_zeros((3, n, t, d)) if tq < t else q.new_empty((3, n, t, d))
    scores = q.new_empty((rows_per_chunk, t, t))
    ds = q.new_empty((rows_per_chunk, tq, t))
    for s in range(0, n, rows_per_chunk):
        e = min(n, s + rows_per_chunk)
        m = e - s
        torch.baddbmm(scores[:m], q[s:e], k[s:e].transpose(-2, -1), beta=0.0, alpha=scale, out=scores[:m])
        a = torch.softmax(scores[:m], dim=-1, out=attn[s:e])
        rows = a[:, :tq]
        f = torch.bmm(g[s:e], v[s:e].transpose(-2, -1), out=flow[s:e]).mul_(rows)  # F = A ⊙ ∂y/∂A
        r = torch.sum(f, dim=-1, keepdim=True, out=row_sums[s:e])
        dsm = torch.addcmul(f, rows, r, value=-1.0, out=ds[:m])  # ∂y/∂S
        torch.baddbmm(parts[0, s:e, :tq], dsm, k[s:e], beta=0.0, alpha=scale, out=parts[0, s:e, :tq])
        torch.baddbmm(parts[1, s:e], dsm.transpose(-2, -1), q[s:e, :tq], beta=0.0, alpha=scale, out=parts[1, s:e])
        torch.bmm(rows.transpose(-2, -1), g[s:e], out=parts[2, s:e])
    return attn, flow, row_sums, parts


class ProbabilitiesInBackward(torch.autograd.Function):
    """``O`` in the forward; in the backward the gradient of the ``qkv`` output from ``A`` (see the module)."""

    @staticmethod
    def forward(ctx: Any, out: Tensor, qkv: Tensor, heads: int, scale: float, block: int,
                sink: Sink) -> Tensor:
        ctx.save_for_backward(qkv)
        ctx.heads, ctx.scale, ctx.block, ctx.sink = heads, scale, block, sink
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        (qkv,) = ctx.saved_tensors
        b, t, three_c = qkv.shape
        heads, tq = ctx.heads, grad.shape[1]
        d = three_c // (3 * heads)
        n = b * heads
        wide = torch.promote_types(qkv.dtype, torch.float32)
        # q, k, v once in (B·H, T, d) rows (one copy; the batched products then run on contiguous operands)
        q, k, v = qkv.detach().to(wide).reshape(b, t, 3, heads, d).permute(2, 0, 3, 1, 4).reshape(3, n, t, d)
        g = grad.to(wide).reshape(b, tq, heads, d).transpose(1, 2).reshape(n, tq, d)
        attn, flow, row_sums, parts = _attention_backward(q, k, v, g, ctx.scale)
        out = parts.view(3, b, heads, t, d).permute(1, 3, 0, 2, 4).reshape(b, t, three_c).to(qkv.dtype)
        attn, flow = attn.view(b, heads, t, t), flow.view(b, heads, tq, t)
        vnorm = torch.linalg.vector_norm(v, dim=-1).view(b, heads, t)  # on the contiguous copy of the values
        ctx.sink(ctx.block, attn, flow, row_sums.view(b, heads, tq), vnorm)
        return None, out, None, None, None, None


class AttentionInBackward(torch.autograd.Function):
    """The same backward for a fused attention called with separate queries, keys and values ``(B, H, T, d)``
    (as ``scaled_dot_product_attention`` receives them, e.g. after rotary embeddings): ``O`` ``(B, H, T, d)`` in the
    forward (the fused kernel's values, computed on detached inputs); in the backward the gradients of ``q``, ``k``
    and ``v`` from the recomputed ``A``, and ``on_probabilities(block, A, F, ΣF, ‖v‖)`` (see the module)."""

    @staticmethod
    def forward(ctx: Any, out: Tensor, q: Tensor, k: Tensor, v: Tensor, scale: float, block: int,
                sink: Sink) -> Tensor:
        ctx.save_for_backward(q, k, v)
        ctx.scale, ctx.block, ctx.sink = scale, block, sink
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v = ctx.saved_tensors
        b, heads, t, d = q.shape
        n, tq = b * heads, grad.shape[2]
        wide = torch.promote_types(q.dtype, torch.float32)
        qf, kf, vf = (z.detach().to(wide).reshape(n, t, d) for z in (q, k, v))
        g = grad.to(wide).reshape(n, tq, d)
        attn, flow, row_sums, parts = _attention_backward(qf, kf, vf, g, ctx.scale)
        grads = parts.view(3, b, heads, t, d).to(q.dtype)
        vnorm = torch.linalg.vector_norm(vf, dim=-1).view(b, heads, t)
        ctx.sink(ctx.block, attn.view(b, heads, t, t), flow.view(b, heads, tq, t), row_sums.view(b, heads, tq), vnorm)
        return None, grads[0], grads[1], grads[2], None, None, None
