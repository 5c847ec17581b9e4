"""GradSkip: relevance propagation with adaptive head weighting and skip-connection-aware gates.

One forward and one (activation-only) backward pass of the model; the propagation itself is ``O(L·H·T²)``.
The equations implemented here are written out in ``docs/methods/gradskip.md``.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator

import numpy as np
import torch
from torch import Tensor, nn

from ..errors import InputError
from ..models import Adapter
from ..models._readout import readout_only
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
    out_dtype = p.dtype
    if p.dtype in (torch.float16, torch.bfloat16):  # ranks up to n and their weighted sum need float32
        p = p.float()
    if p.device.type == "cpu" and not p.requires_grad:
        # numpy's sort is ~20x faster than torch.sort on CPU for many short rows (same values; measured in
        # docs/benchmarks/gradskip_cost.md); the Gini values do not need gradients.
        srt = torch.from_numpy(np.sort(p.contiguous().numpy(), axis=-1))
    else:
        srt = p.sort(dim=-1).values
    ranks = torch.arange(1, n + 1, device=p.device, dtype=p.dtype)
    total = srt.sum(dim=-1)
    g = 2.0 * (srt @ ranks) / (n * total.clamp_min(torch.finfo(p.dtype).tiny)) - (n + 1) / n
    return torch.where(total > 0, g, torch.zeros_like(g)).to(out_dtype)


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
    return _head_weights(attn, attn * grad, mode, alpha, grad_threshold, head_subset)


def _head_weights(attn: Tensor, flow_terms: Tensor, mode: str, alpha: float, grad_threshold: float,
                  head_subset: tuple[str, float] | None) -> Tensor:
    """:func:`head_weights` from ``A ⊙ ∇A`` (``flow_terms``), which the caller computes once for both uses."""
    b, h = attn.shape[:2]
    needs_sparsity = head_subset is not None or mode == "sparsity" or (mode == "adaptive" and alpha < 1.0)
    sparsity = gini(attn).mean(dim=-1) if needs_sparsity else None  # (B, H): per query row, then mean over rows
    if mode == "uniform":
        w = torch.full((b, h), 1.0 / h, device=attn.device, dtype=attn.dtype)
    else:
        a = {"gradient": 1.0, "sparsity": 0.0}.get(mode, alpha)
        flow = flow_terms.abs().sum(dim=-1).mean(dim=-1)  # (B, H)
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
        readout_path: for single-token readouts (CLS, CLS + DIST) run the last block's attention output, MLP and
            final norm on the readout token(s) only (``vitlens.models._readout``); same maps up to float rounding.
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
        "readout_path": True,
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
        fast = readout_only(adapter, all_queries=True) if o["readout_path"] else contextlib.nullcontext(False)
        steps = _BlockSteps(self)  # reduces each block's gradients as the backward produces them
        with adapter.session(capture=True, conservative=bool(o["conservative"])) as rec, fast, \
                steps.value_norms(adapter, rec):
            logits = adapter.forward(x)
            tgt = self.resolve_target(target, logits)
            y = tgt(logits)
            steps.take(rec)
            grad_final = steps.backward(y.sum(), rec.final)
        # the propagation runs in at least float32 (fp16/bf16 models and autocast: docs/methods/gradskip.md)
        y = _wide(y)
        t = steps.tokens
        relevance = readout_relevance(_wide(rec.final), _wide(grad_final), y, adapter.readout_tokens,
                                      adapter.num_prefix_tokens)
        relevance = _pad_tokens(relevance, t)  # readout path: the final stream holds the readout tokens only
        totals = [relevance.sum(-1)]
        for li in range(len(steps.w) - 1, -1, -1):
            beta = steps.beta[li]
            relevance = (beta * relevance)[:, None, :].bmm(steps.w[li])[:, 0] + (1.0 - beta) * relevance
            totals.append(relevance.sum(-1))
        p = adapter.num_prefix_tokens
        gh, gw = adapter.grid(tuple(x.shape[-2:]))
        patch = relevance[:, p:]
        if patch.shape[1] != gh * gw:
            raise InputError(f"{patch.shape[1]} patch tokens do not fill the {gh}x{gw} token grid")
        extras = {
            "head_weights": torch.stack(steps.omega, dim=1),  # (B, L, H)
            "beta_main": torch.stack(steps.beta, dim=1),  # (B, L, T)
            "layer_totals": torch.stack(totals[::-1], dim=1),  # (B, L+1): input of block 0 … readout
        }
        att = Attribution(values=patch.reshape(-1, gh, gw), remainder=relevance[:, :p].sum(-1), extras=extras)
        return att, logits.detach(), tgt

    @staticmethod
    def _weighted_attention(attn: Tensor, flow_terms: Tensor, vnorm: Tensor, omega: Tensor) -> Tensor:
        """``W̃ = rownorm(Σ_q ω_q · (A_q ⊙ ∇A_q)⁺ ⊙ ‖v_q,j‖)``, zero rows falling back to ``Σ_q ω_q A_q``.

        ``flow_terms`` is ``A ⊙ ∇A`` ``(B, H, T, T_k)``; it is consumed (clamped and scaled in place). ``vnorm``:
        the value norms ``‖v_q,j‖`` ``(B, H, T_k)``.
        """
        scale = omega[:, :, None] * vnorm  # (B, H, T_k): ω_q · ‖v_q,j‖
        m = flow_terms.clamp_min_(0).mul_(scale[:, :, None, :]).sum(dim=1)  # (B, T, T_k)
        rows = m.sum(dim=-1, keepdim=True)
        w = m.div_(rows.clamp_min(torch.finfo(m.dtype).tiny))
        empty = rows[..., 0] <= 0
        if bool(empty.any()):  # rows without positive flow: the head-weighted attention itself
            b, h, t, tk = attn.shape
            fallback = omega[:, None, :].bmm(attn.reshape(b, h, t * tk)).reshape(b, t, tk)
            w = torch.where(empty[..., None], fallback, w)
        return w

    def _gate(self, u: Tensor, h: Tensor, grad_h: Tensor) -> Tensor:
        """``β_main`` per token ``(B, T)`` from gradient-weighted magnitudes of the attention and skip paths.

        On the readout path the last block's ``h`` holds the first ``r`` tokens only; every other token has zero
        gradient there, so its adaptive gate is ``0 / (0 + 0 + eps) = 0``, as in the full computation.
        """
        mode = self.options["skip"]
        if mode == "fixed":
            return torch.full(u.shape[:2], 0.5, device=u.device, dtype=u.dtype)
        if mode == "none":
            return torch.ones(u.shape[:2], device=u.device, dtype=u.dtype)
        u = u[:, : h.shape[1]]
        c_main = ((h - u) * grad_h).sum(-1).abs()
        c_skip = (u * grad_h).sum(-1).abs()
        return c_main / (c_main + c_skip + float(self.options["eps"]))


def _wide(t: Tensor) -> Tensor:
    """``t`` detached, in float32 if it is a half-precision tensor (float64 stays float64)."""
    return t.detach().to(torch.promote_types(t.dtype, torch.float32))


def _pad_tokens(v: Tensor, t: int) -> Tensor:
    """``(B, r)`` → ``(B, t)`` with zeros after the first ``r`` tokens (no copy when ``r == t``)."""
    if v.shape[1] == t:
        return v
    out = v.new_zeros(v.shape[0], t)
    out[:, : v.shape[1]] = v
    return out


class _BlockSteps:
    """Per-block propagation terms (``ω``, ``W̃``, ``β_main``), computed inside the backward pass.

    A tensor hook on each block's attention probabilities and on its post-attention residual ``h`` turns the
    gradient into the block's ``(B, T, T)`` weighted attention and ``(B, T)`` gate as soon as autograd produces it,
    and drops the block's captured tensors; the ``(B, H, T, T)`` attention gradients are never held all at once.
    The backward asks only for ``∂y/∂x_L`` and block 0's ``∂y/∂A``, ``∂y/∂h`` (nothing below block 0's attention
    runs). A block whose tensors get no gradient (it cannot reach ``y``) is reduced with zero gradients.
    """

    def __init__(self, explainer: GradSkip) -> None:
        self.explainer = explainer
        self.vnorm: dict[int, Tensor] = {}
        self.saved: list[dict[str, Any]] = []
        self.tokens = 0
        self.w: list[Tensor | None] = []
        self.omega: list[Tensor | None] = []
        self.beta: list[Tensor | None] = []

    @contextlib.contextmanager
    def value_norms(self, adapter: Adapter, rec: Any) -> Iterator[None]:
        """Replace each block's captured values by their norms ``(B, H, T_k)`` as soon as the block has run.

        The values are a view into the block's ``qkv`` output, which autograd does not keep (it saves its own
        copies of keys and values); holding the view would keep a ``(B, T, 3D)`` tensor per block alive.
        """
        hooks = []

        def hook(module: nn.Module, args: tuple, out: Any, i: int) -> None:
            v = rec.blocks[i].value
            if v is not None:
                with torch.no_grad():
                    self.vnorm[i] = v.norm(dim=-1)
                rec.blocks[i].value = None

        try:
            for i, blk in enumerate(adapter.blocks()):
                hooks.append(blk.register_forward_hook(functools.partial(hook, i=i)))
            yield
        finally:
            for hnd in hooks:
                hnd.remove()

    def take(self, rec: Any) -> None:
        """Own the forward's captures from here on (they are freed block by block during the backward)."""
        n = len(rec.blocks)
        self.tokens = int(rec.blocks[0].u.shape[1])
        self.saved = [{"attn": b.attn, "vnorm": self.vnorm.pop(i, None) if b.value is None else b.value.norm(dim=-1),
                       "u": b.u, "h": b.h} for i, b in enumerate(rec.blocks)]
        for b in rec.blocks:
            b.attn = b.value = b.u = b.h = None
        self.w, self.omega, self.beta = [None] * n, [None] * n, [None] * n

    def backward(self, y: Tensor, final: Tensor) -> Tensor:
        """Run the backward from ``y``; returns ``∂y/∂x_L``."""
        first = self.saved[0]
        for li, cap in enumerate(self.saved[1:], start=1):
            cap["attn"].register_hook(lambda g, li=li: self._attn_step(li, g))
            cap["h"].register_hook(lambda g, li=li: self._h_step(li, g))
        grads = torch.autograd.grad(y, [final, first["attn"], first["h"]], allow_unused=True)
        self._attn_step(0, grads[1])
        self._h_step(0, grads[2])
        for li in range(1, len(self.saved)):  # blocks the gradient never reached
            if self.w[li] is None:
                self._attn_step(li, None)
            if self.beta[li] is None:
                self._h_step(li, None)
        return torch.zeros_like(final) if grads[0] is None else grads[0]

    def _attn_step(self, li: int, grad: Tensor | None) -> None:
        o = self.explainer.options
        cap = self.saved[li]
        attn, vnorm = _wide(cap.pop("attn")), _wide(cap.pop("vnorm"))
        with torch.no_grad():
            flow_terms = attn * _wide(grad) if grad is not None else torch.zeros_like(attn)
            omega = _head_weights(attn, flow_terms, o["head_weighting"], float(o["alpha"]),
                                  float(o["grad_threshold"]), o["head_subset"])
            self.w[li] = self.explainer._weighted_attention(attn, flow_terms, vnorm, omega)
            self.omega[li] = omega

    def _h_step(self, li: int, grad: Tensor | None) -> None:
        cap = self.saved[li]
        u, h = _wide(cap.pop("u")), _wide(cap.pop("h"))
        with torch.no_grad():
            beta = self.explainer._gate(u, h, torch.zeros_like(h) if grad is None else _wide(grad))
            self.beta[li] = _pad_tokens(beta, self.tokens)
