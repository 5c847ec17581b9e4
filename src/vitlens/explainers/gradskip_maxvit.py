"""GradSkip on MaxViT (timm ``MaxxVit`` of ``MaxxVitBlock``\\ s): MBConv blocks, block attention over windows, grid
attention over a dilated grid.

Called by :class:`~vitlens.explainers.gradskip.GradSkip` when the adapter provides ``partition_attention``; same
options, one forward and one activation-only backward (to every recorded tensor at once). The rules (written out in
``docs/methods/gradskip.md``, "MaxViT"):

1. **Start.** The head pools the last stage's output ``o``: ``y`` is split over its cells in proportion to
   ``⟨o[i], ∂y/∂o[i]⟩⁺`` (GradSkip's pooled-readout rule), so the start relevances sum to ``y``.
2. **Partition attention** (grid, then block, last to first): as a Swin window. The head weights ``ω`` come from all
   partitions of the layer together (each query row of each window or grid group is one row of the layer's
   attention); ``W̃`` is formed per partition (rows sum to 1) with its value norms; the relative position bias is a
   constant added to the logits, so the probabilities the softmax made are all the rule reads. The relevance on the
   layer's output is cut into the layer's partitions exactly as the layer cuts its cells, ``β·R`` goes back through
   ``W̃ᵀ`` inside each, and ``(1 − β)·R`` stays on its cell; the MLP after it is cell-wise and keeps each cell's
   relevance (as on a ViT).
3. **MBConv block** ``out = main(x) + shortcut(x)``: ``β_conv`` is GradSkip's skip gate with the shortcut as the skip
   path (``|⟨out − shortcut, ∇out⟩|`` against ``|⟨shortcut, ∇out⟩|``). The main branch's 1×1 convolutions, batch
   norms, activations and the squeeze-excitation scale act on each cell alone (the excitation gate, a function of
   the pooled map, is held constant as GradSkip holds the attention weights), so ``β_conv·R`` reaches the depthwise
   convolution's output cell by cell, and is handed back to the input cells of each k×k window in proportion to
   their exact first-order contributions through it (``x_j · W_o · ∂y/∂out_k``, summed over channels: the spec's
   rule for reductions); the strided shortcut's average pool hands ``(1 − β_conv)·R`` back to its 2×2 window the
   same way (``x_j · ∂y/∂pool_k``); an identity shortcut leaves it on its cell.

Every step conserves the total, so ``token_maps.sum() == y`` (remainder 0) on the first block's input grid (the
stem's output, half the input size); ``layer_totals`` records it per block.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import InputError
from ..targets import Target
from ._gradskip_rules import head_weights_from_flow, readout_relevance, skip_gate, weighted_attention, wide
from ._gradskip_capture import captured_gradients
from .base import Attribution, Explainer

if TYPE_CHECKING:
    from ..models._partitions import MBConvRecord, PartitionRecord
    from ..models.base import Adapter

__all__ = ["attribute_partitioned", "window_op_contributions", "window_op_handback"]


def _pads(module: nn.Module, hw: tuple[int, int]) -> tuple[int, int, int, int]:
    """``(left, right, top, bottom)`` zero padding ``module`` (a convolution or an average pool) applies to an
    ``hw`` input: its own symmetric sizes, or TensorFlow's "same" rule for timm's ``*Same`` modules (which pad in
    their forward, ``padding=0``)."""
    geo = _geometry(module)
    k, s, d = geo["kernel_size"], geo["stride"], geo["dilation"]
    if type(module).__name__.endswith("Same") or isinstance(getattr(module, "padding", 0), str):
        pad = [max((math.ceil(n / s[i]) - 1) * s[i] + (k[i] - 1) * d[i] + 1 - n, 0) for i, n in enumerate(hw)]
        return pad[1] // 2, pad[1] - pad[1] // 2, pad[0] // 2, pad[0] - pad[0] // 2
    p = _pair(getattr(module, "padding", 0))
    return p[1], p[1], p[0], p[0]


def _pair(v: Any) -> tuple[int, int]:
    return (int(v), int(v)) if isinstance(v, int) else (int(v[0]), int(v[1]))


def _geometry(module: nn.Module) -> dict[str, tuple[int, int]]:
    d = (1, 1) if isinstance(module, nn.AvgPool2d) else _pair(getattr(module, "dilation", 1))
    return {"kernel_size": _pair(getattr(module, "kernel_size")), "dilation": d,
            "stride": _pair(getattr(module, "stride"))}


def _offsets(module: nn.Module, out_hw: tuple[int, int]) -> list[tuple[slice, slice]]:
    """Per kernel offset ``o`` (row-major), the strided slices of the padded input that offset reads for every output
    cell (``x_pad[..., rows, cols]`` is ``(…, h_out, w_out)``)."""
    geo = _geometry(module)
    (kh, kw), (sh, sw), (dh, dw) = geo["kernel_size"], geo["stride"], geo["dilation"]
    h, w = out_hw
    return [(slice(i * dh, i * dh + sh * (h - 1) + 1, sh), slice(j * dw, j * dw + sw * (w - 1) + 1, sw))
            for i in range(kh) for j in range(kw)]


def window_op_contributions(x: Tensor, grad_out: Tensor, module: nn.Module) -> tuple[Tensor, Tensor, tuple]:
    """First-order contribution of every input cell to every output window of a depthwise convolution or an average
    pool ``module``, ``(B, K, k_h·k_w)``, and which window offsets fall inside the image ``(1, K, k_h·k_w)``.

    Depthwise: ``c[b, k, o] = Σ_c x[b, c, p(k, o)] · W[c, o] · ∂y/∂out[b, c, k]``, so ``Σ_o c[b, k, o] =
    ⟨∂y/∂out_k, out_k − bias⟩``. Average pool: ``c[b, k, o] = Σ_c x[b, c, p(k, o)] · ∂y/∂out[b, c, k]`` (the
    pool's weight is the same at every in-image offset of a window, so it leaves the shares unchanged).
    ``p(k, o)`` is the input cell under offset ``o`` of output ``k``; padding holds zeros. Computed offset by offset
    on strided views of the padded input (no unfolded ``(B, C·k_h·k_w, K)`` copy).
    """
    b, c, h, w = x.shape
    pads = _pads(module, (h, w))
    out_hw = (int(grad_out.shape[-2]), int(grad_out.shape[-1]))
    if grad_out.shape[1] != c:
        raise InputError(f"{type(module).__name__} output has {grad_out.shape[1]} channels, its input {c}")
    xp = F.pad(x, pads)
    g = grad_out.to(x.dtype)
    ones = F.pad(torch.ones(1, 1, h, w, dtype=x.dtype, device=x.device), pads)
    weight = module.weight.detach().reshape(c, -1).to(x.dtype) if isinstance(module, nn.Conv2d) else None
    contrib, inside = [], []
    for o, (rows, cols) in enumerate(_offsets(module, out_hw)):
        xs = xp[:, :, rows, cols]
        if xs.shape[-2:] != out_hw:
            raise InputError(f"{type(module).__name__}: the input does not give its {out_hw} output")
        prod = (xs * g).flatten(2)  # (B, C, K); the depthwise weight is folded in by one product over channels
        contrib.append(prod.sum(1) if weight is None else torch.matmul(weight[:, o], prod))
        inside.append(ones[:, 0, rows, cols].flatten(1))
    return torch.stack(contrib, dim=-1), torch.stack(inside, dim=-1), pads


def window_op_handback(relevance: Tensor, x: Tensor, grad_out: Tensor, module: nn.Module) -> Tensor:
    """Hand the relevance of each output cell of ``module`` (depthwise convolution or average pool) back to the input
    cells of its window: ``R_in[j] = Σ_{k ∋ j} R_out[k] · c⁺[k, j] / Σ_{j' ∈ win(k)} c⁺[k, j']`` with
    :func:`window_op_contributions`; a window whose ``c⁺`` are all 0 splits its relevance uniformly over its
    in-image cells. Conserves the total exactly. ``relevance`` ``(B, K)`` row-major on the output grid; returns
    ``(B, H·W)`` on the input grid."""
    h, w = x.shape[-2:]
    contrib, inside, (left, right, top, bottom) = window_op_contributions(x, grad_out, module)
    contrib = contrib.clamp_min_(0).mul_(inside)
    total = contrib.sum(-1, keepdim=True)
    uniform = inside / inside.sum(-1, keepdim=True).clamp_min(1.0)
    share = torch.where(total > 0, contrib / total.clamp_min(torch.finfo(contrib.dtype).tiny), uniform)
    parts = share * relevance[:, :, None].to(share.dtype)  # (B, K, kk)
    out_hw = (int(grad_out.shape[-2]), int(grad_out.shape[-1]))
    back = parts.new_zeros(parts.shape[0], h + top + bottom, w + left + right)
    for o, (rows, cols) in enumerate(_offsets(module, out_hw)):
        back[:, rows, cols] += parts[:, :, o].reshape(-1, *out_hw)
    return back[:, top:top + h, left:left + w].flatten(1)


def _cells(t: Tensor) -> Tensor:
    """``(B, C, H, W)`` → ``(B, H·W, C)``."""
    return t.flatten(2).transpose(1, 2)


def _attention_step(a: PartitionRecord, relevance: Tensor, grad: dict[int, Tensor], o: dict[str, Any],
                    bsz: int) -> tuple[Tensor, Tensor, Tensor]:
    """Relevance ``(B, H·W)`` on a partition attention's output → on its input; with ``ω`` ``(B, heads)`` and
    ``β`` ``(B, H·W)``."""
    from ..models._partitions import from_partitions, to_partitions
    from ..models.base import recorded

    probs, hrec = recorded(a.attn, "partition attention"), recorded(a.h, "post-attention residual")
    attn, vnorm = wide(probs), wide(recorded(a.vnorm, "value norms"))
    n_part, heads, n = attn.shape[0] // bsz, attn.shape[1], attn.shape[2]
    flow = attn * grad[id(probs)]
    per_image = attn.reshape(bsz, n_part, heads, n, n).transpose(1, 2).reshape(bsz, heads, n_part * n, n)
    flow_img = flow.reshape(bsz, n_part, heads, n, n).transpose(1, 2).reshape(bsz, heads, n_part * n, n)
    omega = head_weights_from_flow(per_image, flow_img, o["head_weighting"], float(o["alpha"]),
                                   float(o["grad_threshold"]), o["head_subset"])
    w = weighted_attention(attn, flow, vnorm, omega.repeat_interleave(n_part, dim=0))  # (B·nP, N, N)
    beta = skip_gate(wide(recorded(a.u, "partition attention input")), a.tokens(wide(hrec)),
                     a.tokens(grad[id(hrec)]), o["skip"], float(o["eps"]))
    main = to_partitions((beta * relevance).reshape(bsz, *a.grid), a.kind, a.size)
    back = from_partitions(main[:, None, :].bmm(w)[:, 0], bsz, a.grid, a.kind, a.size)
    return back.reshape(bsz, -1) + (1.0 - beta) * relevance, omega, beta


def _mbconv_step(c: MBConvRecord, relevance: Tensor, grad: dict[int, Tensor], o: dict[str, Any]
                 ) -> tuple[Tensor, Tensor]:
    """Relevance ``(B, h·w)`` on an MBConv block's output → on its input ``(B, H·W)``; with ``β_conv`` ``(B, h·w)``."""
    from ..models.base import recorded

    out, dw = recorded(c.out, "MBConv output"), recorded(c.dw, "depthwise convolution")
    beta = skip_gate(_cells(wide(recorded(c.shortcut, "MBConv shortcut"))), _cells(wide(out)), _cells(grad[id(out)]),
                     o["skip"], float(o["eps"]))
    main = window_op_handback(beta * relevance, wide(dw.input), grad[id(dw.output)], dw.module)
    skip = (1.0 - beta) * relevance
    if c.pool is not None:
        skip = window_op_handback(skip, wide(c.pool.input), grad[id(c.pool.output)], c.pool.module)
    if skip.shape != main.shape:
        raise InputError(f"the MBConv shortcut lands on {skip.shape[1]} cells, its main branch on {main.shape[1]}")
    return main + skip, beta


def _stack_padded(rows: list[Tensor]) -> Tensor:
    """``L`` tensors ``(B, n_l)`` → ``(B, L, max n_l)``, zero-padded."""
    width = max(r.shape[1] for r in rows)
    return torch.stack([F.pad(r, (0, width - r.shape[1])) for r in rows], dim=1)


def attribute_partitioned(method: Explainer, adapter: Adapter, x: Tensor, target: Target
                          ) -> tuple[Attribution, Tensor, Target]:
    """GradSkip for one chunk on MaxViT: token maps on the first block's input grid, remainder 0."""
    from ..models._partitions import PartitionRecording
    from ..models.base import recorded
    from ..models.timm_maxxvit import TimmMaxxVitAdapter

    o = method.options
    ad = cast(TimmMaxxVitAdapter, adapter)
    session_rec, logits, tgt, y, grad = captured_gradients(method, ad, x, target, partitions=True)
    rec = cast(PartitionRecording, session_rec)
    bsz = x.shape[0]
    final = recorded(rec.final, "last stage output")
    gxa = (wide(final) * grad[id(final)]).sum(1).flatten(1)  # (B, h·w)
    relevance = readout_relevance(gxa[..., None], torch.ones_like(gxa[..., None]), y, None, 0)
    totals, omegas, betas, conv_betas = [relevance.sum(-1)], [], [], []
    with torch.no_grad():
        for blk in reversed(rec.blocks):
            for a in reversed(blk.attns):
                relevance, omega, beta = _attention_step(a, relevance, grad, o, bsz)
                omegas.append(omega)
                betas.append(beta)
            relevance, beta = _mbconv_step(blk.conv, relevance, grad, o)
            conv_betas.append(beta)
            totals.append(relevance.sum(-1))
    gh, gw = recorded(rec.start, "first block's input grid")
    if relevance.shape[1] != gh * gw:
        raise InputError(f"{relevance.shape[1]} cells do not fill the first block's {gh}x{gw} input grid")
    extras = {
        "layer_totals": torch.stack(totals[::-1], dim=1),  # (B, L+1): input of block 0 … the readout
        "head_weights": _stack_padded(omegas[::-1]),  # (B, A, max heads): every partition attention, forward order
        "beta_main": _stack_padded(betas[::-1]),  # (B, A, max cells): their skip gates, zero-padded
        "beta_conv": _stack_padded(conv_betas[::-1]),  # (B, L, max cells): the MBConv blocks' gates
    }
    att = Attribution(values=relevance.reshape(bsz, gh, gw), remainder=torch.zeros_like(y), extras=extras)
    return att, logits.detach(), tgt
