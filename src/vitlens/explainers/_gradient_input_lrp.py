"""What AttnLRP (Achtibat et al., ICML 2024) and CP-LRP (Ali et al., ICML 2022) share: LRP in gradient × input form.

Package-internal; the methods are :mod:`.attnlrp` and :mod:`.cplrp`.

Both are one forward and one (activation-only) backward pass. During the forward pass, hooks replace the outputs
of the query/key/value projection(s) and the input of the second MLP map by tensors with the *same value* whose
backward follows the LRP rules:

- the attention rule: the projected ``q``, ``k``, ``v`` pass their gradient scaled by :data:`QKV_GRADIENT`, so the
  model's own attention (fused, as the model runs it) back-propagates the rule's gradient (AttnLRP's uniform rule:
  ``q, k`` ¼, ``v`` ½; CP-LRP: constant probabilities, ``v`` only). :func:`attention_rule` is the same rule written
  as an explicit recomputation of ``softmax(q·kᵀ/√d)·v`` at the output projection's input (kept for callers; it
  costs a second attention per block);
- the second MLP map's input ``z = act(p)`` keeps its value and passes ``(z/p)·grad`` to ``p`` (identity rule);
- every LayerNorm divides by a constant standard deviation in the backward (the adapter's conservative mode).

Relevance is then gradient × input at the first block's input (patch embeddings with position embeddings), summed
over channels. Nothing is patched globally; all hooks are removed on exit. Equations and cross-check results:
``docs/methods/attention_methods.md``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from ..models import Adapter
from ..models.base import recorded
from ..models.capabilities import ATTENTION, BLOCK_IO, LRP_LINEARS, LRP_VARIANT_LINEARS, TOKEN_SEQUENCE
from ..targets import Target
from ._attention import token_map
from ._lrp import BlockLinears, LinearTaps, Rerouted
from ._lrp_variants import GATE_SHARE, VariantRules
from ..options import choice
from .base import Attribution, Explainer

__all__ = ["GradientInputLRP", "QKV_GRADIENT", "RATIO_EPS", "attention_rule", "identity_rule", "scale_grad"]

_ACTIVATION_RULES = ("identity", "gradient")
#: stabiliser of the identity rule's ratio ``act(p) / p`` (LXT uses 1e-10).
RATIO_EPS = 1e-10


def scale_grad(t: Tensor, factor: float) -> Tensor:
    """``t`` in the forward pass; its gradient is multiplied by ``factor`` in the backward pass."""
    return Rerouted.apply(t.detach(), t, float(factor))


def identity_rule(p: Tensor, z: Tensor, eps: float = RATIO_EPS) -> Tensor:
    """Value ``z = act(p)``; backward ``∂/∂p = (z / p)·grad`` — relevance ``z·grad`` passes unchanged to ``p``."""
    pd = p.detach()
    # p + eps·sign(p): p ± eps where p ≠ 0 (|p ± eps| ≥ eps, so the ratio is finite), 0 where p = 0, whose ratio
    # z / 0 is non-finite and set to 0 (the rule's value there) by nan_to_num — four passes over one (B, T, 4D)
    # buffer instead of six and a mask for the same values (``copysign``, then ``masked_fill`` where ``p == 0``)
    ratio = pd.sign()
    torch.add(pd, ratio, alpha=eps, out=ratio)  # in place: one (B, T, 4D) buffer, no temporary
    ratio = torch.div(z.detach(), ratio, out=ratio).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    return Rerouted.apply(z.detach(), p, ratio)


def attention_rule(mode: str) -> Callable[[BlockLinears, Tensor], Tensor]:
    """The rewrite of the output projection's input ``ctx`` ``(B, T, H·d)`` from the block's ``q, k, v``
    ``(B, H, T, d)``.

    ``attnlrp``: uniform rule on both bilinear products — the gradient is halved into each factor of ``A·v`` and of
    ``q·kᵀ`` (so ``q`` and ``k`` get ¼, ``v`` ½, as in LXT), softmax with its plain gradient (AttnLRP's softmax rule in
    gradient × input form). ``cplrp``: the attention probabilities are constants; the gradient flows through ``v`` only.
    The value stays the model's own ``ctx``; only its gradient takes the rule's path.
    """

    def rewrite(lin: BlockLinears, ctx: Tensor) -> Tensor:
        q, k, v = lin.q, lin.k, lin.v
        assert q is not None and k is not None and v is not None  # LinearTaps resolved them just before this call
        scale = v.shape[-1] ** -0.5
        if mode == "attnlrp":
            attn = ((scale_grad(q, 0.5) * scale) @ scale_grad(k, 0.5).transpose(-2, -1)).softmax(dim=-1)
            out = scale_grad(attn, 0.5) @ scale_grad(v, 0.5)
        else:
            with torch.no_grad():  # constants: the probabilities without gradient
                attn = ((q * scale) @ k.transpose(-2, -1)).softmax(dim=-1)
            out = attn @ v
        out = out.transpose(1, 2).reshape(ctx.shape)
        return Rerouted.apply(ctx.detach(), out, None)

    return rewrite


#: gradient factors of the projected (query, key, value) under each attention rule. AttnLRP: the uniform rule halves
#: the gradient into each factor of ``A·v`` and of ``q·kᵀ``; ``A``'s half reaches ``q·kᵀ`` through the (plain)
#: softmax gradient, which is linear, so ``q`` and ``k`` get ¼ of their gradient and ``v`` ½. CP-LRP: ``A`` is a
#: constant, so ``q`` and ``k`` get none and ``v`` all. Same gradients as :func:`attention_rule`'s rewrite, which
#: recomputes the attention explicitly; here the model's own attention backward computes them.
QKV_GRADIENT = {"attnlrp": (0.25, 0.25, 0.5), "cplrp": (0.0, 0.0, 1.0)}


class GradientInputLRP(Explainer):
    """Shared driver of AttnLRP and CP-LRP (subclasses set ``name`` and ``mode``)."""

    # the plain block, or its variants (q/k norms, scale norms, gated MLPs: the rules of :mod:`._lrp_variants`)
    needs = (ATTENTION, (LRP_LINEARS, LRP_VARIANT_LINEARS), BLOCK_IO, TOKEN_SEQUENCE)

    level = "token"
    mode = "attnlrp"
    defaults: dict[str, Any] = {"activation_rule": "identity"}
    option_specs = {"activation_rule": choice(*_ACTIVATION_RULES)}

    def attribute(self, adapter: Adapter, x: Tensor, target: Target) -> tuple[Attribution, Tensor, Target]:
        act = identity_rule if self.options["activation_rule"] == "identity" else None
        # recompute: the model's own attention keeps its fused kernel (only its value is used; the rule path
        # computes the gradient) and no attention probabilities are recorded
        with adapter.session(capture=True, conservative=True, recompute=True) as rec:
            # the rule's attention gradient is the model's own attention gradient with the projected q, k, v
            # scaled (QKV_GRADIENT): the model's attention (fused, as it runs) carries it, nothing is recomputed
            taps = LinearTaps(adapter, rec, rewrite_act=act, keep=False, qkv_grad=QKV_GRADIENT[self.mode],
                              variants=VariantRules(GATE_SHARE[self.mode], act))
            with taps.installed():
                logits = adapter.forward(x)
            for blk in rec.blocks:  # the model's own attention outputs (and graph): the rules replaced them
                blk.out = blk.query = blk.key = blk.value = blk.attn = None
            tgt = self.resolve_target(target, logits)
            u0 = recorded(rec.blocks[0].u, "block input")  # a fresh leaf made by the adapter: the backward stops there
            # backward(inputs=…) rather than autograd.grad: the latter refuses leaf inputs that carry module-tracker
            # hooks (e.g. under torch.utils.flop_counter.FlopCounterMode); only u0.grad is written
            torch.autograd.backward(tgt(logits).sum(), inputs=[u0])
        grad = u0.grad  # None if the score does not depend on the tokens: zero relevance
        relevance = (u0.detach() * grad).sum(dim=-1) if grad is not None else u0.detach().new_zeros(u0.shape[:2])
        values, remainder = token_map(adapter, relevance, x)
        return Attribution(values=values, remainder=remainder), logits.detach(), tgt
