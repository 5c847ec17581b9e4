"""AttnLRP (Achtibat et al., ICML 2024) and CP-LRP (Ali et al., ICML 2022) in gradient × input form.

Both are one forward and one (activation-only) backward pass. During the forward pass, hooks replace the inputs of
two linear maps per block by tensors with the *same value* whose backward follows the LRP rules:

- the output projection's input ``ctx = softmax(q·kᵀ/√d)·v`` is recomputed from the captured ``q, k, v`` with the
  rule's gradient path (``ctx' = stop(ctx) + (f(q, k, v) − stop(f(q, k, v)))``, value unchanged);
- the second MLP map's input ``z = act(p)`` becomes ``stop(z) + stop(z/p)·(p − stop(p))`` (identity rule);
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
from ..models.capabilities import ATTENTION, BLOCK_IO, LRP_LINEARS, TOKEN_SEQUENCE
from ..targets import Target
from ._attention import token_map
from ._lrp import BlockLinears, LinearTaps
from .base import Attribution, Explainer, check_choices
from .registry import register

__all__ = ["AttnLRP", "CPLRP", "scale_grad", "identity_rule", "attention_rule"]

_ACTIVATION_RULES = ("identity", "gradient")
#: stabiliser of the identity rule's ratio ``act(p) / p`` (LXT uses 1e-10).
RATIO_EPS = 1e-10


class _Rerouted(torch.autograd.Function):
    """Value of ``value`` (no gradient), gradient ``factor · g`` to ``t`` (``factor``: a number or a tensor of
    ``t``'s shape; ``None``: ``g`` itself). One autograd node instead of the detach arithmetic
    ``d + factor·(t − d)``, which costs three elementwise passes in the forward and three nodes in the backward;
    the value is the same (``t − d`` is exactly zero) and so is the gradient."""

    @staticmethod
    def forward(ctx: Any, value: Tensor, t: Tensor, factor: Any) -> Tensor:
        ctx.factor = factor
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[None, Tensor, None]:
        return None, g if ctx.factor is None else g * ctx.factor, None


def scale_grad(t: Tensor, factor: float) -> Tensor:
    """``t`` in the forward pass; its gradient is multiplied by ``factor`` in the backward pass."""
    return _Rerouted.apply(t.detach(), t, float(factor))


def identity_rule(p: Tensor, z: Tensor, eps: float = RATIO_EPS) -> Tensor:
    """Value ``z = act(p)``; backward ``∂/∂p = (z / p)·grad`` — relevance ``z·grad`` passes unchanged to ``p``."""
    pd = p.detach()
    signed_eps = torch.where(pd >= 0, pd.new_tensor(eps), pd.new_tensor(-eps))  # eps · sign(p), sign(0) = +1
    ratio = torch.where(pd == 0, pd.new_zeros(()), z.detach() / (pd + signed_eps))
    return _Rerouted.apply(z.detach(), p, ratio)


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
        scale = v.shape[-1] ** -0.5
        if mode == "attnlrp":
            attn = ((scale_grad(q, 0.5) * scale) @ scale_grad(k, 0.5).transpose(-2, -1)).softmax(dim=-1)
            out = scale_grad(attn, 0.5) @ scale_grad(v, 0.5)
        else:
            with torch.no_grad():  # constants: the probabilities without gradient
                attn = ((q * scale) @ k.transpose(-2, -1)).softmax(dim=-1)
            out = attn @ v
        out = out.transpose(1, 2).reshape(ctx.shape)
        return _Rerouted.apply(ctx.detach(), out, None)

    return rewrite


class _GradientInputLRP(Explainer):
    """Shared driver of AttnLRP and CP-LRP (subclasses set ``name`` and ``mode``)."""

    needs = (ATTENTION, LRP_LINEARS, BLOCK_IO, TOKEN_SEQUENCE)

    level = "token"
    mode = "attnlrp"
    defaults: dict[str, Any] = {"activation_rule": "identity"}

    def check_options(self) -> None:
        check_choices(self.options, activation_rule=_ACTIVATION_RULES)

    def attribute(self, adapter: Adapter, x: Tensor, target: Target) -> tuple[Attribution, Tensor, Target]:
        act = identity_rule if self.options["activation_rule"] == "identity" else None
        # recompute: the model's own attention keeps its fused kernel (only its value is used; the rule path
        # computes the gradient) and no attention probabilities are recorded
        with adapter.session(capture=True, conservative=True, recompute=True) as rec:
            taps = LinearTaps(adapter, rec, rewrite_ctx=attention_rule(self.mode), rewrite_act=act)
            with taps.installed():
                logits = adapter.forward(x)
            tgt = self.resolve_target(target, logits)
            u0 = rec.blocks[0].u  # a fresh leaf made by the adapter: the backward stops there
            # backward(inputs=…) rather than autograd.grad: the latter refuses leaf inputs that carry module-tracker
            # hooks (e.g. under torch.utils.flop_counter.FlopCounterMode); only u0.grad is written
            torch.autograd.backward(tgt(logits).sum(), inputs=[u0])
        relevance = (u0.detach() * u0.grad).sum(dim=-1)  # (B, T)
        values, remainder = token_map(adapter, relevance, x)
        return Attribution(values=values, remainder=remainder), logits.detach(), tgt


@register
class AttnLRP(_GradientInputLRP):
    """AttnLRP (Achtibat et al., ICML 2024) as gradient × input: ε-rule (plain gradient) for linear maps and
    residual additions, identity rule for the MLP activation and LayerNorm's scaling, softmax rule (plain softmax
    gradient), uniform rule for the bilinear ``q·kᵀ`` and ``A·v`` products. Relevance at the first block's input,
    summed over channels; what lands on prefix tokens is the ``remainder``.

    Options:
        activation_rule: ``identity`` (the paper) | ``gradient`` (plain gradient through the activation; ablation).
    """

    name = "attnlrp"
    description = "AttnLRP relevance as gradient x input"
    display_name = "AttnLRP"
    mode = "attnlrp"


@register
class CPLRP(_GradientInputLRP):
    """CP-LRP (Ali et al., ICML 2022) as gradient × input: attention probabilities and LayerNorm's standard deviation
    are constants in the backward pass; plain gradient elsewhere, with the identity rule for the MLP activation by
    default (as LXT's CP-LRP map for vision transformers does). With the identity rule the relevance is exactly
    conservative: ``token_maps.sum() + remainder = y − (bias contributions)``.

    Options:
        activation_rule: ``identity`` (default) | ``gradient`` (plain gradient through the activation).
    """

    name = "cplrp"
    description = "CP-LRP relevance as gradient x input"
    display_name = "CP-LRP"
    mode = "cplrp"
