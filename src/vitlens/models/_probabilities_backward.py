"""The backward of a fused attention computed from its recomputed probabilities, which it hands to a consumer.

A recording session with ``recompute=True`` keeps timm's fused ``scaled_dot_product_attention`` in the forward (no
``(B, H, T, T)`` tensor is stored). A consumer that needs every block's probabilities ``A`` and their gradient
``∂y/∂A`` in the backward (GradSkip) would otherwise pay twice for them: once inside the fused kernel's backward,
which recomputes them blockwise and does not expose them, and once more to recompute them itself. When
:attr:`~vitlens.models.base.Recording.on_probabilities` is set before the forward, the attention output ``O``
(before ``attn.norm``) is routed through :class:`ProbabilitiesInBackward`: the forward returns ``O`` itself (the
fused kernel's values, unchanged), and the backward computes, from the block's ``qkv`` output,

- ``A = softmax(q·scale·kᵀ)`` on every query row (as timm's explicit path computes it),
- ``∂y/∂A = (∂y/∂O)·vᵀ`` and ``F = A ⊙ ∂y/∂A`` on the rows ``O`` holds (all, or the readout rows),
- the softmax backward ``∂y/∂S = F − A·rowsum(F)`` and from it ``∂y/∂q``, ``∂y/∂k``, ``∂y/∂v``, written into one
  ``(B, T, 3·H·d)`` gradient of the ``qkv`` output,

then calls ``on_probabilities(block, A, F)`` (the consumer may overwrite ``A`` and ``F``). The fused kernel's own
backward never runs (its output reaches the logits only through the detached copy). Gradients agree with the fused
kernel's up to float rounding.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

__all__ = ["ProbabilitiesInBackward", "Sink"]

#: ``on_probabilities(block, A (B, H, T, T), F (B, H, T_q, T))``
Sink = Callable[[int, Tensor, Tensor], None]


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
        wide = torch.promote_types(qkv.dtype, torch.float32)
        q, k, v = qkv.detach().to(wide).reshape(b, t, 3, heads, d).permute(2, 0, 3, 1, 4).unbind(0)
        g = grad.to(wide).reshape(b, tq, heads, d).transpose(1, 2)  # (B, H, T_q, d)
        attn = ((q * ctx.scale) @ k.transpose(-2, -1)).softmax(dim=-1)  # (B, H, T, T)
        rows = attn[:, :, :tq]
        flow = (g @ v.transpose(-2, -1)).mul_(rows)  # F = A ⊙ ∂y/∂A on the rows O holds
        scores = torch.addcmul(flow, rows, flow.sum(dim=-1, keepdim=True), value=-1.0)  # ∂y/∂S
        out = qkv.new_zeros(b, t, 3, heads, d) if tq < t else qkv.new_empty(b, t, 3, heads, d)
        out[:, :tq, 0] = (scores @ k).mul_(ctx.scale).transpose(1, 2)
        out[:, :, 1] = (scores.transpose(-2, -1) @ q[:, :, :tq]).mul_(ctx.scale).transpose(1, 2)
        out[:, :, 2] = (rows.transpose(-2, -1) @ g).transpose(1, 2)
        del scores
        ctx.sink(ctx.block, attn, flow)
        return None, out.reshape(b, t, three_c), None, None, None, None
