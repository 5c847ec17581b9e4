"""GradSkip on hierarchical transformers with spatial-reduction attention (HF SegFormer, timm / HF PVTv2): stages,
reduced keys, patch merging, one or several readouts.

Called by :class:`~vitlens.explainers.gradskip.GradSkip` when the adapter is hierarchical, with the same options.
One forward and one activation-only backward pass; the equations are written out in
``docs/methods/gradskip_segformer.md``:

1. **Start.** SegFormer's decode head reads every stage's output ``o_s``, PVTv2's classifier the mean of the last
   one. ``y`` is split over all tokens of the stages the head reads in proportion to ``⟨o_s[i], ∂y/∂o_s[i]⟩⁺`` with
   the head's *direct* gradient (GradSkip's pooled-readout rule over the union of the readouts), so the start
   relevances sum to ``y``.
2. **Stage ``s``**, from the last to the first: relevance on the stage output = its readout share + what patch
   merging handed down from stage ``s+1``; through each block (last to first) with GradSkip's gate and
   ``W̃`` of shape queries × reduced keys; each key's relevance goes back to the tokens of its ``r×r`` window.
3. **Patch merging** into stage ``s`` hands each output token's relevance back to the input positions of its
   (overlapping) kernel window.

Both hand-backs use :func:`window_handback`: per output window, in proportion to the positive part of the window's
exact first-order contributions (gradient × activation through that window), uniformly over the window's in-image
positions when all are zero. Every step conserves the total, so ``token_maps.sum() == y`` and the remainder is 0.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import InputError
from ..models.base import Adapter, recorded
from ..targets import Target
from ._gradskip_rules import filled, head_weights, readout_relevance, skip_gate, weighted_attention, wide
from ._gradskip_capture import captured_gradients
from .base import Attribution, Explainer

if TYPE_CHECKING:
    from ..models._stages import StageRecord, StageRecording

__all__ = ["attribute_hierarchical", "window_contributions", "window_handback"]


def _padding(conv: nn.Conv2d) -> tuple[int, ...]:
    """The explicit padding sizes of ``conv`` (SegFormer's patch-merging and key-reduction convolutions have them)."""
    if isinstance(conv.padding, str):
        raise InputError(f"convolution with padding={conv.padding!r}: the window hand-back needs explicit sizes")
    return conv.padding


def window_contributions(x: Tensor, grad_out: Tensor, conv: nn.Conv2d) -> Tensor:
    """First-order contribution of every input position to every output window of ``conv``, ``(B, K, k_h·k_w)``.

    ``c[b, k, o] = Σ_{c_in} x[b, c_in, p(k, o)] · Σ_{c_out} ∂y/∂out[b, c_out, k] · W[c_out, c_in, o]`` for output
    position ``k`` (row-major) and kernel offset ``o``, where ``p(k, o)`` is the input position under offset ``o``
    (0 where it falls in the zero padding). ``Σ_o c[b, k, o] = ⟨∂y/∂out_k, out_k − bias⟩``.

    Args:
        x: the convolution's input ``(B, C_in, H, W)``; grad_out: the target's gradient at its output
            ``(B, C_out, h, w)``; conv: the (ungrouped) ``nn.Conv2d``.
    """
    b, c_in = x.shape[:2]
    kh, kw = conv.kernel_size
    cols = F.unfold(x, (kh, kw), dilation=conv.dilation, padding=_padding(conv), stride=conv.stride)  # (B, C_in·kk, K)
    k = cols.shape[-1]
    if grad_out.shape[-2] * grad_out.shape[-1] != k:
        raise InputError(f"conv output has {grad_out.shape[-2:]} positions, its unfolded input {k}")
    weight = conv.weight.detach().reshape(conv.out_channels, -1).to(grad_out.dtype)
    gw = grad_out.flatten(2).transpose(1, 2) @ weight  # (B, K, C_in·kk): ∂y/∂(input under each window offset)
    return torch.einsum("bcok,bkco->bko", cols.reshape(b, c_in, kh * kw, k), gw.reshape(b, k, c_in, kh * kw))


def window_handback(relevance: Tensor, x: Tensor, grad_out: Tensor, conv: nn.Conv2d) -> Tensor:
    """Hand the relevance of each output position of ``conv`` back to the input positions of its window.

    ``R_in[j] = Σ_{k : j ∈ win(k)} R_out[k] · c⁺[k, j] / Σ_{j' ∈ win(k)} c⁺[k, j']`` with the contributions ``c`` of
    :func:`window_contributions`; a window whose ``c⁺`` are all 0 splits its relevance uniformly over its in-image
    positions (padding excluded). Conserves the total exactly: ``R_in.sum(-1) == R_out.sum(-1)``.

    Args:
        relevance: ``(B, K)`` on the output grid (row-major); x, grad_out, conv: as in :func:`window_contributions`.

    Returns ``(B, H·W)`` relevance on the input grid (row-major). Input positions in no window get 0.
    """
    h, w = x.shape[-2:]
    kh, kw = conv.kernel_size
    unfold = dict(kernel_size=(kh, kw), dilation=conv.dilation, padding=_padding(conv), stride=conv.stride)
    contrib = window_contributions(x, grad_out, conv).clamp_min(0)
    inside = F.unfold(torch.ones(1, 1, h, w, dtype=contrib.dtype, device=contrib.device), **unfold).transpose(1, 2)
    contrib = contrib * inside  # (padding holds x = 0, so this only guards against -0.0/NaN-free edge cases)
    total = contrib.sum(-1, keepdim=True)
    uniform = inside / inside.sum(-1, keepdim=True)
    share = torch.where(total > 0, contrib / total.clamp_min(torch.finfo(contrib.dtype).tiny), uniform)
    parts = share * relevance[:, :, None]  # (B, K, kk)
    return F.fold(parts.transpose(1, 2), output_size=(h, w), **unfold).flatten(1)


def _gxa(t: Tensor, g: Tensor) -> Tensor:
    """Gradient × activation per token: ``(B, C, h, w)`` or ``(B, T, C)`` → ``(B, T)``."""
    return (t * g).sum(1).flatten(1) if t.ndim == 4 else (t * g).sum(-1)


def _start_scores(stage: StageRecord, grad: dict[int, Tensor]) -> Tensor:
    """Gradient × activation ``(B, T_s)`` of a stage output the head reads; zeros for a stage it does not read
    (PVTv2's head reads the last stage only: the others start with nothing)."""
    if stage.readout is not None:
        return _gxa(wide(stage.readout), grad[id(stage.readout)])
    h = recorded(stage.blocks[-1].h if stage.blocks else None, "post-attention residual")
    return wide(h).new_zeros(h.shape[:2])


def attribute_hierarchical(method: Explainer, adapter: Adapter, x: Tensor, target: Target,
                           start: str = "readouts") -> tuple[Attribution, Tensor, Target]:
    """GradSkip for one chunk on a hierarchical adapter: token maps on the stage-1 grid, remainder 0.

    ``start="readouts"`` (what ``explain`` uses) splits ``y`` over every stage output the decode head reads;
    ``start="last"`` puts all of ``y`` on the last stage's output (the spec's literal pooled-readout start, kept for
    the comparison in ``benchmarks/segformer_segmentation.py``).
    """
    if start not in ("readouts", "last"):
        raise InputError(f"start must be 'readouts' or 'last', got {start!r}")
    o = method.options
    rec, logits, tgt, y, grad = captured_gradients(method, adapter, x, target)
    stages = cast("StageRecording", rec).stages  # a hierarchical adapter's session records stages

    # 1. start: y over the tokens of every readout, in proportion to the direct gradient × activation
    if all(st.readout is None for st in stages):
        recorded(None, "stage output the head reads")
    gxa = [_start_scores(st, grad) for st in stages]
    if start == "last":
        gxa = [torch.zeros_like(g) for g in gxa[:-1]] + gxa[-1:]
    sizes = [g.shape[1] for g in gxa]
    flat = torch.cat(gxa, dim=1)
    starts = readout_relevance(flat[..., None], torch.ones_like(flat[..., None]), y, None, 0).split(sizes, dim=1)

    n_blocks = sum(len(st.blocks) for st in stages)
    max_heads = max(recorded(blk.attn, "attention").shape[1] for st in stages for blk in st.blocks)
    b = x.shape[0]
    layer_totals: list[Tensor | None] = [None] * n_blocks  # filled in backward order
    omegas: list[Tensor | None] = [None] * n_blocks
    gates: dict[str, Tensor] = {}
    stage_totals, carried = [], None
    index = n_blocks
    for s in range(len(stages) - 1, -1, -1):
        st = stages[s]
        relevance = starts[s] if carried is None else starts[s] + carried
        stage_totals.append(relevance.sum(-1))
        betas = []
        for blk in reversed(st.blocks):
            index -= 1
            probs = recorded(blk.attn, "attention")
            attn, grad_attn = wide(probs), grad[id(probs)]
            omega = head_weights(attn, grad_attn, o["head_weighting"], float(o["alpha"]),
                                 float(o["grad_threshold"]), o["head_subset"])
            value, u = wide(recorded(blk.value, "value vectors")), wide(recorded(blk.u, "block input"))
            h = recorded(blk.h, "post-attention residual")
            wt = weighted_attention(attn, attn * grad_attn, value.norm(dim=-1), omega)  # (B, T, T_k)
            beta = skip_gate(u, wide(h), grad[id(h)], method.options["skip"],
                             float(method.options["eps"]))
            keys = (beta * relevance)[:, None, :].bmm(wt)[:, 0]  # (B, T_k)
            red = blk.reduction
            if red is not None:
                keys = window_handback(keys, wide(red.input), grad[id(red.output)], red.conv)
            relevance = keys + (1.0 - beta) * relevance
            layer_totals[index] = relevance.sum(-1)
            omegas[index] = F.pad(omega, (0, max_heads - omega.shape[1]))
            betas.append(beta)
        gates[f"beta_main_stage{s + 1}"] = torch.stack(betas[::-1], dim=1)
        if s > 0:
            merge = recorded(st.merge, f"patch merging into stage {s + 1}")
            carried = window_handback(relevance, wide(merge.input), grad[id(merge.output)], merge.conv)
    gh, gw = recorded(stages[0].grid, "stage-1 token grid")
    if relevance.shape[1] != gh * gw:
        raise InputError(f"{relevance.shape[1]} stage-1 tokens do not fill the {gh}x{gw} token grid")
    extras = {
        "readout_shares": torch.stack([r.sum(-1) for r in starts], dim=1),  # (B, S): y injected at each stage output
        "stage_totals": torch.stack(stage_totals[::-1], dim=1),  # (B, S): total on each stage's output
        "layer_totals": torch.stack(filled(layer_totals), dim=1),  # (B, L): total entering each block (forward order)
        "head_weights": torch.stack(filled(omegas), dim=1),  # (B, L, max heads), zero-padded for stages with fewer heads
        **gates,  # beta_main_stage{s}: (B, L_s, T_s)
    }
    att = Attribution(values=relevance.reshape(b, gh, gw), remainder=torch.zeros_like(y), extras=extras)
    return att, logits.detach(), tgt
