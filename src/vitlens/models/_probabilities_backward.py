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

then calls ``on_probabilities(block, images, A, F, ΣF, ‖v‖)`` for a group of whole images at a time (``images``:
their ``slice`` of the batch; :data:`CONSUME_BYTES`) with the row sums ``Σ_j F_ij`` that the softmax backward formed
and the value norms. The consumer reduces each group (GradSkip's head weights and ``W̃`` are per image), so the
backward's extra memory is bounded whatever the batch: no ``(B, H, T, T)`` tensor is formed for the whole batch. The
tensors are buffers reused for the next group: the consumer may overwrite them and must copy what it keeps. The fused
kernel's own backward never runs (its output reaches the logits only through the detached copy). Gradients agree
with the fused kernel's up to float rounding.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

__all__ = ["AttentionInBackward", "ProbabilitiesInBackward", "Sink", "hand_over_probabilities"]

#: ``on_probabilities(block, images, A (m, H, T, T), F (m, H, T_q, T), Σ_j F_ij (m, H, T_q), ‖v_j‖ (m, H, T))``,
#: called for consecutive slices ``images`` of the batch (``m`` images each) that together cover it
Sink = Callable[[int, slice, Tensor, Tensor, Tensor, Tensor], None]


#: bytes of one chunk's ``(rows, T, T)`` tensors in :func:`_attention_backward`: about a core's L2 cache, so the
#: passes over the probabilities, ``F`` and ``∂y/∂S`` of a chunk read what the previous one wrote from cache
CHUNK_BYTES = 1 << 20

#: bytes of ``A`` handed to the consumer at once (whole images, at least one): the buffers for ``A`` and ``F`` are
#: this size whatever the batch. One image a call (1 MiB) was measured no faster on EVA02-Ti at batch 8 than the
#: whole batch at once (paired medians 0.978 vs 0.981 of the old code) and costs the consumer's per-call overhead.
CONSUME_BYTES = 8 << 20


#: ``consume(images, A, F, Σ_j F_ij)`` of :func:`_attention_backward`
_Consume = Callable[[slice, Tensor, Tensor, Tensor], None]


def _attention_backward(q: Tensor, k: Tensor, v: Tensor, g: Tensor, scale: float, heads: int,
                        consume: _Consume, gradients: bool = True) -> Tensor | None:
    """The backward of ``O = softmax(q·scale·kᵀ)·v`` from the recomputed probabilities, on ``(n, T, d)`` rows
    (``n`` = images × ``heads``, contiguous) and the gradient ``g`` of the first ``T_q`` output rows
    ``(n, T_q, d)``: returns the three gradients in one buffer ``(3, n, T, d)`` (q, k, v) and calls
    ``consume(images, A (m·heads, T, T), F = A ⊙ ∂y/∂A (m·heads, T_q, T), Σ_j F_ij (m·heads, T_q, 1))`` for each
    group of whole images once its products are done (the tensors are reused for the next group; ``consume`` may
    overwrite them). The scale goes into the products (``baddbmm``'s alpha). ``gradients=False``: only ``A``,
    ``F`` and the row sums are formed and handed over (the block's attention backward does not run: GradSkip's
    block 0); returns ``None``.

    The rows are taken a few at a time (:data:`CHUNK_BYTES`): every product is the same per-row product as on the
    whole batch (the same values, bit for bit), but the chunk's scores and ``∂y/∂S`` stay in cache between the
    passes: a whole GradSkip map at batch 8, one thread, took 0.983 / 0.984 (EVA02-Ti), 0.992 (ViT-Ti) and 0.981
    (ViT-B) of the time with the whole-batch passes (docs/benchmarks/gradskip_cost.md, session 22). The consumer
    gets as many whole images as :data:`CONSUME_BYTES` of ``A`` hold (at least one)."""
    n, t, d = q.shape
    tq = g.shape[1]
    group = min(n, max(1, CONSUME_BYTES // (heads * t * t * q.element_size())) * heads)  # rows of whole images
    rows_per_chunk = max(1, min(group, CHUNK_BYTES // (t * t * q.element_size())))
    attn = q.new_empty((group, t, t))
    flow = q.new_empty((group, tq, t))
    row_sums = q.new_empty((group, tq, 1))
    parts = None if not gradients else q.new_zeros((3, n, t, d)) if tq < t else q.new_empty((3, n, t, d))
    scores = q.new_empty((rows_per_chunk, t, t))
    ds = q.new_empty((rows_per_chunk, tq, t)) if gradients else scores
    for i0 in range(0, n, group):
        i1 = min(n, i0 + group)
        for s in range(i0, i1, rows_per_chunk):
            e = min(i1, s + rows_per_chunk)
            m, o = e - s, s - i0
            torch.baddbmm(scores[:m], q[s:e], k[s:e].transpose(-2, -1), beta=0.0, alpha=scale, out=scores[:m])
            a = torch.softmax(scores[:m], dim=-1, out=attn[o:o + m])
            rows = a[:, :tq]
            f = torch.bmm(g[s:e], v[s:e].transpose(-2, -1), out=flow[o:o + m]).mul_(rows)  # F = A ⊙ ∂y/∂A
            r = torch.sum(f, dim=-1, keepdim=True, out=row_sums[o:o + m])
            if parts is None:
                continue
            dsm = torch.addcmul(f, rows, r, value=-1.0, out=ds[:m])  # ∂y/∂S
            torch.baddbmm(parts[0, s:e, :tq], dsm, k[s:e], beta=0.0, alpha=scale, out=parts[0, s:e, :tq])
            torch.baddbmm(parts[1, s:e], dsm.transpose(-2, -1), q[s:e, :tq], beta=0.0, alpha=scale,
                          out=parts[1, s:e])
            torch.bmm(rows.transpose(-2, -1), g[s:e], out=parts[2, s:e])
        w = i1 - i0
        consume(slice(i0 // heads, i1 // heads), attn[:w], flow[:w], row_sums[:w])
    return parts


def _handing_over(sink: Sink, block: int, heads: int, t: int, tq: int, vnorm: Tensor) -> _Consume:
    """The ``consume`` of :func:`_attention_backward` that hands each group of images to ``sink`` in
    ``(m, H, …)`` shapes with those images' value norms (``vnorm`` ``(B, H, T)``)."""

    def consume(images: slice, attn: Tensor, flow: Tensor, row_sums: Tensor) -> None:
        m = images.stop - images.start
        sink(block, images, attn.view(m, heads, t, t), flow.view(m, heads, tq, t), row_sums.view(m, heads, tq),
             vnorm[images])

    return consume


def _per_head_backward(q: Tensor, k: Tensor, v: Tensor, g: Tensor, scale: float, block: int, sink: Sink,
                       gradients: bool = True) -> Tensor | None:
    """:func:`_attention_backward` on queries, keys and values ``(B, H, T, d)`` (any dtype: taken in at least
    float32) and the output gradient in ``(B·H, T_q, d)`` rows, handing each group to ``sink``."""
    b, heads, t, d = q.shape
    wide = torch.promote_types(q.dtype, torch.float32)
    qf, kf, vf = (z.detach().to(wide).reshape(b * heads, t, d) for z in (q, k, v))
    consume = _handing_over(sink, block, heads, t, g.shape[1],
                            torch.linalg.vector_norm(vf, dim=-1).view(b, heads, t))
    return _attention_backward(qf, kf, vf, g.to(wide), scale, heads, consume, gradients)


def hand_over_probabilities(q: Tensor, k: Tensor, v: Tensor, grad: Tensor, scale: float, block: int,
                            sink: Sink) -> None:
    """``sink(block, images, A, F, ΣF, ‖v‖)`` (as the fused attention's backward calls it) for a block whose
    attention backward does not run, from its recorded queries, keys and values ``(B, H, T, d)`` and the gradient
    of its attention output ``(B, T_q, H·d)`` (heads concatenated, ``T_q ≤ T`` rows): the same chunked products as
    :class:`AttentionInBackward`, without the three gradient products."""
    b, heads, _, d = q.shape
    g = grad.detach().reshape(b, grad.shape[1], heads, d).transpose(1, 2).reshape(b * heads, grad.shape[1], d)
    _per_head_backward(q, k, v, g, scale, block, sink, gradients=False)


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
        consume = _handing_over(ctx.sink, ctx.block, heads, t, tq,
                                torch.linalg.vector_norm(v, dim=-1).view(b, heads, t))
        parts = _attention_backward(q, k, v, g, ctx.scale, heads, consume)
        assert parts is not None
        out = parts.view(3, b, heads, t, d).permute(1, 3, 0, 2, 4).reshape(b, t, three_c).to(qkv.dtype)
        return None, out, None, None, None, None


class AttentionInBackward(torch.autograd.Function):
    """The same backward for a fused attention called with separate queries, keys and values ``(B, H, T, d)``
    (as ``scaled_dot_product_attention`` receives them, e.g. after rotary embeddings): ``O`` ``(B, H, T, d)`` in the
    forward (the fused kernel's values, computed on detached inputs); in the backward the gradients of ``q``, ``k``
    and ``v`` from the recomputed ``A``, and ``on_probabilities(block, images, A, F, ΣF, ‖v‖)`` (see the module)."""

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
        parts = _per_head_backward(q, k, v, grad.reshape(b * heads, grad.shape[2], d), ctx.scale, ctx.block,
                                   ctx.sink)
        assert parts is not None
        grads = parts.view(3, b, heads, t, d).to(q.dtype)
        return None, grads[0], grads[1], grads[2], None, None, None
