"""GradSkip: relevance propagation with adaptive head weighting and skip-connection-aware gates.

One forward and one (activation-only) backward pass of the model; the propagation itself is ``O(L·H·T²)``.
The equations implemented here are written out in ``docs/methods/gradskip.md``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..errors import InputError
from ..models import Adapter
from ..targets import Target
from .base import Attribution, Explainer
from .registry import register

__all__ = ["GradSkip", "gini", "head_weights", "readout_relevance"]

_HEAD_MODES = ("adaptive", "uniform", "gradient", "sparsity")
_SKIP_MODES = ("adaptive", "fixed", "none")


def gini(p: Tensor) -> Tensor:
    """Gini coefficient over the last dimension of non-negative values: 0 for uniform, → 1 for a single spike.

    For values sorted ascending ``p(1) ≤ … ≤ p(n)``: ``G = 2·Σ_i i·p(i) / (n·Σ_i p(i)) − (n+1)/n``.
    A row that sums to zero gets ``G = 0``.
    """
    n = p.shape[-1]
    if p.device.type == "cpu" and not p.requires_grad and p.dtype != torch.bfloat16:  # numpy has no bfloat16
        # numpy's sort is ~20x faster than torch.sort on CPU for many short rows (same values; measured in
        # docs/benchmarks/gradskip_cost.md); the Gini values do not need gradients.
        srt = torch.from_numpy(np.sort(p.contiguous().numpy(), axis=-1))
    else:
        srt = p.sort(dim=-1).values
    ranks = torch.arange(1, n + 1, device=p.device, dtype=p.dtype)
    total = srt.sum(dim=-1)
    g = 2.0 * (srt * ranks).sum(dim=-1) / (n * total.clamp_min(torch.finfo(p.dtype).tiny)) - (n + 1) / n
    return torch.where(total > 0, g, torch.zeros_like(g))


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
    b, h = attn.shape[:2]
    needs_sparsity = head_subset is not None or mode == "sparsity" or (mode == "adaptive" and alpha < 1.0)
    sparsity = gini(attn).mean(dim=-1) if needs_sparsity else None  # (B, H): per query row, then mean over rows
    if mode == "uniform":
        w = torch.full((b, h), 1.0 / h, device=attn.device, dtype=attn.dtype)
    else:
        a = {"gradient": 1.0, "sparsity": 0.0}.get(mode, alpha)
        flow = (attn * grad).abs().sum(dim=-1).mean(dim=-1)  # (B, H)
        flow = torch.where(flow < grad_threshold * flow.amax(dim=-1, keepdim=True), torch.zeros_like(flow), flow)
        w = a * _normalise_heads(flow)
        if sparsity is not None and a < 1.0:
            w = w + (1.0 - a) * _normalise_heads(sparsity)
    if head_subset is not None:
        side, frac = head_subset
        k = max(1, min(h, int(round(frac * h))))
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


def _wide(t: Tensor) -> Tensor:
    """``t`` detached, in float32 if it is a half-precision tensor (float64 stays float64)."""
    return t.detach().to(torch.promote_types(t.dtype, torch.float32))


@register
class GradSkip(Explainer):
    """GradSkip relevance propagation (adaptive head weighting + skip-connection-aware gates).

    Options (see ``docs/methods/gradskip.md``):
        head_weighting: ``adaptive`` | ``uniform`` | ``gradient`` (α=1) | ``sparsity`` (α=0).
        alpha: weight of the gradient-flow score in ``adaptive`` mode, in [0, 1].
        grad_threshold: flow-score noise filter, fraction of the layer maximum, in [0, 1).
        head_subset: ``None`` or ``("top" | "bottom", k)`` with k in (0, 1]: keep the k most/least sparse heads.
        skip: ``adaptive`` (gradient-weighted gates) | ``fixed`` (β = 0.5) | ``none`` (β_main = 1).
        conservative: treat LayerNorm's standard deviation as constant in the backward pass.
        eps: stabiliser of the skip gates.
    """

    name = "gradskip"
    requires = "attention"
    level = "token"
    defaults: dict[str, Any] = {
        "head_weighting": "adaptive",
        "alpha": 0.5,
        "grad_threshold": 0.1,
        "head_subset": None,
        "skip": "adaptive",
        "conservative": True,
        "eps": 1e-12,
    }

    def check_options(self) -> None:
        o = self.options
        if o["head_weighting"] not in _HEAD_MODES:
            raise InputError(f"head_weighting must be one of {_HEAD_MODES}, got {o['head_weighting']!r}")
        if o["skip"] not in _SKIP_MODES:
            raise InputError(f"skip must be one of {_SKIP_MODES}, got {o['skip']!r}")
        if not 0.0 <= float(o["alpha"]) <= 1.0:
            raise InputError(f"alpha must be in [0, 1], got {o['alpha']}")
        if not 0.0 <= float(o["grad_threshold"]) < 1.0:
            raise InputError(f"grad_threshold must be in [0, 1), got {o['grad_threshold']}")
        hs = o["head_subset"]
        if hs is not None:
            if isinstance(hs, str):  # "top25" / "bottom25"
                side = "top" if hs.startswith("top") else "bottom" if hs.startswith("bottom") else ""
                try:
                    hs = (side, float(hs[len(side):]) / 100.0) if side else None
                except ValueError:
                    hs = None
            ok = isinstance(hs, (tuple, list)) and len(hs) == 2 and hs[0] in ("top", "bottom")
            if not ok or not 0.0 < float(hs[1]) <= 1.0:
                raise InputError(f"head_subset must be None, ('top'|'bottom', k) with 0 < k <= 1, or 'top25'; got {o['head_subset']!r}")
            o["head_subset"] = (hs[0], float(hs[1]))

    def attribute(self, adapter: Adapter, x: Tensor, target: Target) -> tuple[Attribution, Tensor, Target]:
        if adapter.hierarchical:  # SegFormer: docs/methods/gradskip_segformer.md
            from .gradskip_segformer import attribute_hierarchical

            return attribute_hierarchical(self, adapter, x, target)
        o = self.options
        with adapter.session(capture=True, conservative=bool(o["conservative"])) as rec:
            logits = adapter.forward(x)
            tgt = target if target.classes is not None else target.resolve(logits)
            y = tgt(logits)
            wanted = [t for blk in rec.blocks for t in (blk.attn, blk.h)] + [rec.final]
            grads = torch.autograd.grad(y.sum(), wanted, allow_unused=True)
        # the propagation runs in at least float32 (fp16/bf16 models and autocast: docs/methods/gradskip.md)
        grads = [_wide(torch.zeros_like(w) if g is None else g) for w, g in zip(wanted, grads)]
        y = _wide(y)
        final = _wide(rec.final)
        relevance = readout_relevance(final, grads[-1], y, adapter.readout_tokens, adapter.num_prefix_tokens)
        totals = [relevance.sum(-1)]
        omegas, gates = [], []
        for li in range(len(rec.blocks) - 1, -1, -1):
            blk = rec.blocks[li]
            attn, grad_attn = _wide(blk.attn), grads[2 * li]
            grad_h = grads[2 * li + 1]
            omega = head_weights(attn, grad_attn, o["head_weighting"], float(o["alpha"]),
                                 float(o["grad_threshold"]), o["head_subset"])
            w = self._weighted_attention(attn, grad_attn, _wide(blk.value), omega)
            beta = self._gate(_wide(blk.u), _wide(blk.h), grad_h)
            relevance = (beta * relevance)[:, None, :].bmm(w)[:, 0] + (1.0 - beta) * relevance
            totals.append(relevance.sum(-1))
            omegas.append(omega)
            gates.append(beta)
        p = adapter.num_prefix_tokens
        gh, gw = adapter.grid(tuple(x.shape[-2:]))
        patch = relevance[:, p:]
        if patch.shape[1] != gh * gw:
            raise InputError(f"{patch.shape[1]} patch tokens do not fill the {gh}x{gw} token grid")
        extras = {
            "head_weights": torch.stack(omegas[::-1], dim=1),  # (B, L, H)
            "beta_main": torch.stack(gates[::-1], dim=1),  # (B, L, T)
            "layer_totals": torch.stack(totals[::-1], dim=1),  # (B, L+1): input of block 0 … readout
        }
        att = Attribution(values=patch.reshape(-1, gh, gw), remainder=relevance[:, :p].sum(-1), extras=extras)
        return att, logits.detach(), tgt

    @staticmethod
    def _weighted_attention(attn: Tensor, grad_attn: Tensor, value: Tensor, omega: Tensor) -> Tensor:
        """``W̃ = rownorm(Σ_q ω_q · (A_q ⊙ ∇A_q)⁺ ⊙ ‖v_q,j‖)``, zero rows falling back to ``Σ_q ω_q A_q``."""
        vnorm = value.norm(dim=-1)  # (B, H, T_k)
        m = torch.einsum("bh,bhij,bhj->bij", omega, (attn * grad_attn).clamp_min(0), vnorm)
        rows = m.sum(dim=-1, keepdim=True)
        fallback = torch.einsum("bh,bhij->bij", omega, attn)
        return torch.where(rows > 0, m / rows.clamp_min(torch.finfo(m.dtype).tiny), fallback)

    def _gate(self, u: Tensor, h: Tensor, grad_h: Tensor) -> Tensor:
        """``β_main`` per token ``(B, T)`` from gradient-weighted magnitudes of the attention and skip paths."""
        mode = self.options["skip"]
        if mode == "fixed":
            return torch.full(u.shape[:2], 0.5, device=u.device, dtype=u.dtype)
        if mode == "none":
            return torch.ones(u.shape[:2], device=u.device, dtype=u.dtype)
        c_main = ((h - u) * grad_h).sum(-1).abs()
        c_skip = (u * grad_h).sum(-1).abs()
        return c_main / (c_main + c_skip + float(self.options["eps"]))
