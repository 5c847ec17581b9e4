"""GradSkip: relevance propagation with adaptive head weighting and skip-connection-aware gates.

One forward and one (activation-only) backward pass of the model; the propagation itself is ``O(L·H·T²)``.
The equations implemented here are written out in ``docs/methods/gradskip.md``.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator

import torch
from torch import Tensor, nn

from ..errors import InputError
from ..models import Adapter
from ..models._probabilities_backward import hand_over_probabilities
from ..models.base import int_pair, recorded
from ..models.capabilities import (ATTENTION, CLASS_ATTENTION, MASK_UNITS, PARTITION_ATTENTION,
                                   POOLING_ATTENTION,
                                   STAGES, TOKEN_SEQUENCE, WINDOWS)
from ..targets import Target
from ._gradskip_rules import (
    block_backward,
    filled,
    gini,
    head_weights,
    head_weights_from_scores,
    positive_flow,
    readout_relevance,
    skip_gate,
    weighted_attention,
    wide,
)
from ..options import choice, custom, flag, number
from .base import Attribution, Explainer
from .registry import register

__all__ = ["GradSkip", "gini", "head_weights", "readout_relevance"]

_HEAD_MODES = ("adaptive", "uniform", "gradient", "sparsity")
_SKIP_MODES = ("adaptive", "fixed", "none")


def _head_subset(value: Any) -> tuple[str, float] | None:
    """``("top" | "bottom", k)`` with ``0 < k <= 1`` from ``("top", 0.25)`` or ``"top25"``; ``None`` if it is not
    one."""
    if isinstance(value, str):
        side = "top" if value.startswith("top") else "bottom" if value.startswith("bottom") else ""
        try:
            value = (side, float(value[len(side):]) / 100.0) if side else None
        except ValueError:
            return None
    if not (isinstance(value, (tuple, list)) and len(value) == 2 and value[0] in ("top", "bottom")):
        return None
    k = value[1]
    if isinstance(k, bool) or not isinstance(k, (int, float)) or not 0.0 < float(k) <= 1.0:
        return None
    return str(value[0]), float(k)


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
    value_kind = "signed"
    description = "relevance propagation with adaptive head weights and skip-aware gates; conserves relevance"
    needs = (ATTENTION, (TOKEN_SEQUENCE, WINDOWS, CLASS_ATTENTION, STAGES, MASK_UNITS, POOLING_ATTENTION,
                         PARTITION_ATTENTION))
    display_name = "GradSkip"
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
    option_specs = {
        "head_weighting": choice(*_HEAD_MODES),
        "alpha": number(0, 1),
        "grad_threshold": number(0, 1, high_open=True),
        "head_subset": custom(lambda v: _head_subset(v) is not None,
                              "('top' | 'bottom', k) with 0 < k <= 1, or 'top25' / 'bottom25'", none=True,
                              invalid=[("top", 0), ("top", 1.5), ("side", 0.5), "top0", "middle25", 0.5, ("top",)],
                              valid=[("top", 1.0), ("bottom", 0.25), "top25", ["bottom", 0.5]],
                              normalize=_head_subset),
        "skip": choice(*_SKIP_MODES),
        "conservative": flag(),
        # a stabiliser: 0 (or a value that underflows to 0 in float32, where the propagation runs) gives 0/0 gates
        # on tokens without gradient
        "eps": number(1e-30),
        "readout_path": flag(),
    }

    def attribute(self, adapter: Adapter, x: Tensor, target: Target) -> tuple[Attribution, Tensor, Target]:
        if adapter.provides(WINDOWS):  # Swin: docs/methods/gradskip_swin.md
            from .gradskip_swin import attribute_windowed

            return attribute_windowed(self, adapter, x, target)
        if adapter.provides(CLASS_ATTENTION):  # CaiT: docs/methods/gradskip_cait.md
            from .gradskip_cait import attribute_class_attention

            return attribute_class_attention(self, adapter, x, target)
        if adapter.provides(MASK_UNITS):  # Hiera: docs/methods/gradskip.md (Hiera)
            from .gradskip_hiera import attribute_mask_units

            return attribute_mask_units(self, adapter, x, target)
        if adapter.provides(STAGES):  # SegFormer: docs/methods/gradskip_segformer.md
            from .gradskip_segformer import attribute_hierarchical

            return attribute_hierarchical(self, adapter, x, target)
        if adapter.provides(POOLING_ATTENTION):  # MViTv2: docs/methods/gradskip.md, "MViTv2"
            from .gradskip_mvit import attribute_pooled

            return attribute_pooled(self, adapter, x, target)
        if adapter.provides(PARTITION_ATTENTION):  # MaxViT: docs/methods/gradskip.md ("MaxViT")
            from .gradskip_maxvit import attribute_partitioned

            return attribute_partitioned(self, adapter, x, target)
        o = self.options
        fast = adapter.readout_only(all_queries=True) if o["readout_path"] else contextlib.nullcontext(False)
        steps = _BlockSteps(self)  # reduces each block's gradients as the backward produces them
        with adapter.session(capture=True, conservative=bool(o["conservative"]), recompute=True) as rec, fast, \
                steps.value_norms(adapter, rec):
            rec.on_probabilities = steps.probabilities  # fused attention: A and A ⊙ ∂y/∂A from its backward
            logits = adapter.forward(x)
            tgt = self.resolve_target(target, logits)
            y = tgt(logits)
            steps.take(rec)
            final = recorded(rec.final, "final residual stream")
            grad_final = steps.backward(y.sum(), final)
        # the propagation runs in at least float32 (fp16/bf16 models and autocast: docs/methods/gradskip.md)
        y = wide(y)
        t = steps.tokens
        relevance = readout_relevance(wide(final), wide(grad_final), y, adapter.readout_tokens,
                                      adapter.num_prefix_tokens)
        relevance = _pad_tokens(relevance, t)  # readout path: the final stream holds the readout tokens only
        layers = [relevance]
        ws, betas = filled(steps.w), filled(steps.beta)
        for li in range(len(ws) - 1, -1, -1):
            beta, w = betas[li], ws[li]  # w: (B, T_q, T), T_q < T on the readout path's last block (see _reduced)
            relevance = (beta * relevance)[:, None, : w.shape[1]].bmm(w)[:, 0] + (1.0 - beta) * relevance
            layers.append(relevance)
        p = adapter.num_prefix_tokens
        gh, gw = adapter.grid(int_pair(x.shape[-2:]))
        patch = relevance[:, p:]
        if patch.shape[1] != gh * gw:
            raise InputError(f"{patch.shape[1]} patch tokens do not fill the {gh}x{gw} token grid")
        extras = {
            "head_weights": torch.stack(filled(steps.omega), dim=1),  # (B, L, H)
            "beta_main": torch.stack(betas, dim=1),  # (B, L, T)
            "layer_totals": torch.stack([r.sum(-1) for r in layers[::-1]], dim=1),  # (B, L+1): block 0's input … readout
            "layer_relevance": torch.stack(layers[::-1], dim=1),  # (B, L+1, T): the same, token by token
        }
        att = Attribution(values=patch.reshape(-1, gh, gw), remainder=relevance[:, :p].sum(-1), extras=extras)
        return att, logits.detach(), tgt

    _weighted_attention = staticmethod(weighted_attention)  # kept for callers of the old private name

    def _gate(self, u: Tensor, h: Tensor, grad_h: Tensor, mlp: Tensor | None = None) -> Tensor:
        """``β_main`` per token ``(B, T)`` (:func:`~._gradskip_rules.skip_gate` with this method's options)."""
        return skip_gate(u, h, grad_h, self.options["skip"], float(self.options["eps"]), mlp=mlp)


def _pad_tokens(v: Tensor, t: int) -> Tensor:
    """``(B, r)`` → ``(B, t)`` with zeros after the first ``r`` tokens (no copy when ``r == t``)."""
    if v.shape[1] == t:
        return v
    out = v.new_zeros(v.shape[0], t)
    out[:, : v.shape[1]] = v
    return out


def _recomputed(cap: dict[str, Any], grad: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """``A``, ``A ⊙ ∂y/∂A`` and the value norms of one block from its recorded queries, keys, values and the
    gradient of its attention output ``(B, T_q, H·d)`` (on the readout path ``T_q`` is the readout tokens: the rows
    below get zero gradient, as in the explicit path). Pops the block's tensors from ``cap``."""
    q, k, v = wide(cap.pop("query")), wide(cap.pop("key")), wide(cap.pop("value"))
    cap.pop("attn")
    attn = ((q * cap.pop("scale")) @ k.transpose(-2, -1)).softmax(dim=-1)  # as timm's explicit path computes it
    vnorm = v.norm(dim=-1)
    if grad is None:
        return attn, torch.zeros_like(attn), vnorm
    b, tq = grad.shape[:2]
    g = wide(grad).reshape(b, tq, v.shape[1], v.shape[-1]).transpose(1, 2)  # (B, H, T_q, d)
    flow = g @ v.transpose(-2, -1)  # ∂y/∂A on the first T_q rows
    return attn, flow.mul_(attn[:, :, :tq]), vnorm


class _BlockSteps:
    """Per-block propagation terms (``ω``, ``W̃``, ``β_main``), computed inside the backward pass.

    A tensor hook on each block's attention probabilities and on its post-attention residual ``h`` turns the
    gradient into the block's ``(B, T, T)`` weighted attention and ``(B, T)`` gate as soon as autograd produces it,
    and drops the block's captured tensors; the ``(B, H, T, T)`` attention gradients are never held all at once.
    When the model runs fused attention (``Recording.recompute``) the hook sits on the block's attention output
    ``O`` instead: the step recomputes ``A = softmax(q·kᵀ·scale)`` from the recorded queries and keys and
    ``∂y/∂A = (∂y/∂O)·vᵀ``, one block at a time (no ``(B, H, T, T)`` tensor is kept by the forward). Where the
    adapter offers it (``Recording.on_probabilities``, set before the forward), the block's attention backward
    itself computes ``A`` and ``A ⊙ ∂y/∂A`` from the recorded ``qkv`` and hands them to :meth:`probabilities` (they
    are then formed once, not in the fused kernel's backward and again here); only block 0, whose attention
    backward does not run, and blocks the adapter does not reroute keep the hook on ``O``.
    The backward asks only for ``∂y/∂x_L`` and block 0's ``∂y/∂A``, ``∂y/∂h`` (nothing below block 0's attention
    runs). A block whose tensors get no gradient (it cannot reach ``y``) is reduced with zero gradients.
    """

    def __init__(self, explainer: GradSkip) -> None:
        self.explainer = explainer
        self.vnorm: dict[int, Tensor] = {}
        self.saved: list[dict[str, Any]] = []
        self.tokens = 0
        self.batch = 0
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
        if getattr(rec, "recompute", False):  # the values are needed in the backward (∂y/∂A = ∂y/∂O·vᵀ)
            yield
            return

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
        self.batch, self.tokens = recorded(rec.blocks[0].u, "block input").shape[:2]
        if getattr(rec, "recompute", False):  # "attn": the tensor whose gradient the step receives (see the class)
            self.saved = [{"attn": recorded(b.out, "attention output"), "query": recorded(b.query, "queries"),
                           "key": recorded(b.key, "keys"), "value": recorded(b.value, "values"), "scale": b.scale,
                           "u": recorded(b.u, "block input"), "h": recorded(b.h, "post-attention residual"),
                           "mlp": b.mlp, "in_backward": b.probabilities_in_backward}
                          for b in rec.blocks]
        else:
            self.saved = [{"attn": recorded(b.attn, "attention"),
                           "vnorm": recorded(self.vnorm.pop(i, None) if b.value is None else b.value.norm(dim=-1),
                                             "values"),
                           "u": recorded(b.u, "block input"), "h": recorded(b.h, "post-attention residual"),
                           "mlp": b.mlp}
                          for i, b in enumerate(rec.blocks)]
        for b in rec.blocks:
            b.attn = b.value = b.u = b.h = b.query = b.key = b.out = b.mlp = None
        self.w, self.omega, self.beta = [None] * n, [None] * n, [None] * n

    def backward(self, y: Tensor, final: Tensor) -> Tensor:
        """Run the backward from ``y``; returns ``∂y/∂x_L``."""
        g = block_backward(y, final, self.saved, self._attn_step, self._h_step, lambda li: self.w[li] is not None,
                           lambda li: self.beta[li] is not None)
        return torch.zeros_like(final) if g is None else g

    def probabilities(self, li: int, images: slice, attn: Tensor, flow: Tensor, row_sums: Tensor,
                      vnorm: Tensor) -> None:
        """Block ``li``'s ``A`` ``(m, H, T, T)``, ``F = A ⊙ ∂y/∂A`` ``(m, H, T_q, T)``, ``Σ_j F_ij`` ``(m, H, T_q)``
        and value norms ``(m, H, T)`` of the batch's ``images`` from the fused attention's backward
        (``Recording.on_probabilities``, a group of images at a time; all in at least float32; ``A`` and ``F``
        consumed): ``W̃`` and ``ω`` are per image, so each group's are formed here and the backward never holds
        ``A`` or ``F`` for the whole batch."""
        cap = self.saved[li]
        for key in ("attn", "query", "key", "scale", "value"):
            cap.pop(key, None)
        with torch.no_grad():
            w, omega = self._reduced(attn, flow, vnorm, row_sums)
            if images.stop - images.start == self.batch:  # the whole batch in one group: kept as it is
                self.w[li], self.omega[li] = w, omega
                return
            if images.start == 0:
                self.w[li] = w.new_empty((self.batch, *w.shape[1:]))
                self.omega[li] = omega.new_empty((self.batch, *omega.shape[1:]))
            whole_w, whole_omega = self.w[li], self.omega[li]
            assert whole_w is not None and whole_omega is not None  # the first group allocated them
            whole_w[images] = w
            whole_omega[images] = omega

    def _attn_step(self, li: int, grad: Tensor | None) -> None:
        cap = self.saved[li]
        with torch.no_grad():
            if "query" in cap and grad is not None and cap["query"].shape == cap["key"].shape == cap["value"].shape:
                # as the rerouted blocks' backward does it (cache-sized chunks, groups of images), minus ∂q, ∂k, ∂v
                hand_over_probabilities(cap["query"], cap["key"], cap["value"], grad, cap["scale"], li,
                                        self.probabilities)
                return
            if "query" in cap:
                attn, flow_terms, vnorm = _recomputed(cap, grad)
            else:
                attn, vnorm = wide(cap.pop("attn")), wide(cap.pop("vnorm"))
                flow_terms = attn * wide(grad) if grad is not None else torch.zeros_like(attn)
            self.w[li], self.omega[li] = self._reduced(attn, flow_terms, vnorm)

    def _reduced(self, attn: Tensor, flow_terms: Tensor, vnorm: Tensor,
                 row_sums: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``(W̃, ω)`` of one block from ``A``, ``flow_terms`` = ``A ⊙ ∂y/∂A`` (consumed) and the value norms;
        ``row_sums``: ``Σ_j`` of ``flow_terms`` where the caller has it.

        ``flow_terms`` may hold only the first ``T_q`` query rows (the readout path's last block: the other rows
        have zero gradient); ``W̃`` is then formed on those rows only, ``(B, T_q, T)``: the relevance reaching the
        last block is zero on every other token (it starts on the readout tokens), so the rows left out would be
        multiplied by exact zeros in the propagation.
        """
        o = self.explainer.options
        with torch.no_grad():
            flow = positive_flow(flow_terms, attn.shape[2], row_sums)  # flow_terms clamped at 0 in place
            omega = head_weights_from_scores(attn, flow, o["head_weighting"], float(o["alpha"]),
                                             float(o["grad_threshold"]), o["head_subset"])
            return weighted_attention(attn, flow_terms, vnorm, omega, clamped=True), omega

    def _h_step(self, li: int, grad: Tensor | None) -> None:
        cap = self.saved[li]
        u, h, mlp = wide(cap.pop("u")), wide(cap.pop("h")), cap.pop("mlp", None)
        with torch.no_grad():  # mlp: a parallel block's MLP branch (h is then the block output)
            beta = self.explainer._gate(u, h, torch.zeros_like(h) if grad is None else wide(grad),
                                        None if mlp is None else wide(mlp))
            self.beta[li] = _pad_tokens(beta, self.tokens)
