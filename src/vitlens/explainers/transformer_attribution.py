"""Transformer attribution (Chefer et al., CVPR 2021): LRP relevance of every attention map, gradient-weighted and
rolled out.

One forward, one (activation-only) backward for ``∇A``, and one explicit LRP relevance sweep over tensors captured in
the forward pass (no autograd, no patching). The equations implemented here are written out in
``docs/methods/attention_methods.md``.

The hooks that find each block's linear maps (:class:`LinearTaps`) live in :mod:`._lrp`, shared with :mod:`.attnlrp` and :mod:`.cplrp`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..errors import UnsupportedModelError
from ..models import Adapter
from ..models.base import Recording, recorded
from ..models.capabilities import ATTENTION, BLOCK_IO, LINEAR_HEAD, LRP_LINEARS, LRP_VARIANT_LINEARS, TOKEN_SEQUENCE
from ..targets import Target
from ._attention import rollout_row, token_map
from ._lrp import BlockLinears, LinearTaps
from ._lrp_variants import VariantRules, gate_value_weights, normed
from ..options import number
from .base import Attribution, Explainer
from .registry import register

__all__ = [
    "TransformerAttribution",
    "LinearTaps",
    "BlockLinears",
    "safe_divide",
    "lrp_linear_alpha_beta",
    "lrp_add",
    "lrp_matmul",
]

#: stabiliser of every LRP division (Chefer et al. use 1e-9 too).
EPS = 1e-9


# -- LRP rules (Chefer et al.'s, written out explicitly) -----------------------------------------------------------
def safe_divide(a: Tensor, b: Tensor, eps: float = EPS) -> Tensor:
    """``a / (b + eps·sign(b))``, and 0 where ``b == 0``."""
    sign = torch.where(b >= 0, torch.ones_like(b), -torch.ones_like(b))
    out = a / (b + eps * sign)
    return torch.where(b == 0, torch.zeros_like(out), out)


def lrp_linear_alpha_beta(x: Tensor, weight: Tensor, relevance: Tensor, alpha: float = 1.0) -> Tensor:
    """LRP-αβ (β = α − 1) through ``y = x·Wᵀ + b``: relevance of the input, same shape as ``x``.

    Positive contributions are ``x⁺·W⁺ + x⁻·W⁻``, negative ones ``x⁺·W⁻ + x⁻·W⁺``; the bias takes no part. With
    α = 1 (β = 0), ``R_in = x⁺ ⊙ (S·W⁺) + x⁻ ⊙ (S·W⁻)`` with ``S = R_out / (x⁺·W⁺ᵀ + x⁻·W⁻ᵀ)``.
    """
    dtype = torch.promote_types(torch.promote_types(x.dtype, weight.dtype), relevance.dtype)  # autocast captures
    x, weight, relevance = x.to(dtype), weight.to(dtype), relevance.to(dtype)
    xp, xn = x.clamp(min=0), x.clamp(max=0)
    wp, wn = weight.clamp(min=0), weight.clamp(max=0)

    def share(w1: Tensor, w2: Tensor) -> Tensor:
        s = safe_divide(relevance, xp @ w1.t() + xn @ w2.t())
        return xp * (s @ w1) + xn * (s @ w2)

    out = share(wp, wn)
    if alpha != 1.0:
        out = alpha * out - (alpha - 1.0) * share(wn, wp)
    return out


def lrp_add(x1: Tensor, x2: Tensor, relevance: Tensor) -> tuple[Tensor, Tensor]:
    """Chefer et al.'s relevance-normalised rule for ``z = x1 + x2``, per image (first dimension).

    First the z-rule ``a = x1 ⊙ R/z``, ``b = x2 ⊙ R/z``; then each part is rescaled so that the two totals are
    ``|Σa| / (|Σa| + |Σb|) · ΣR`` and ``|Σb| / (|Σa| + |Σb|) · ΣR`` (sums over everything but the batch).
    """
    s = safe_divide(relevance, x1 + x2)
    a, b = x1 * s, x2 * s
    dims = tuple(range(1, relevance.ndim))
    shape = (-1,) + (1,) * (relevance.ndim - 1)
    a_sum, b_sum, r_sum = a.sum(dims), b.sum(dims), relevance.sum(dims)
    total = a_sum.abs() + b_sum.abs()
    a_fact = safe_divide(a_sum.abs(), total) * r_sum
    b_fact = safe_divide(b_sum.abs(), total) * r_sum
    return a * safe_divide(a_fact, a_sum).reshape(shape), b * safe_divide(b_fact, b_sum).reshape(shape)


def lrp_matmul(x1: Tensor, x2: Tensor, relevance: Tensor) -> tuple[Tensor, Tensor]:
    """z-rule through ``z = x1 @ x2`` (batched), halved between the two factors (Chefer et al.'s ``/2``).

    ``R1 = ½·x1 ⊙ (S·x2ᵀ)``, ``R2 = ½·x2 ⊙ (x1ᵀ·S)`` with ``S = R / z``.
    """
    dtype = torch.promote_types(torch.promote_types(x1.dtype, x2.dtype), relevance.dtype)  # autocast captures
    x1, x2, relevance = x1.to(dtype), x2.to(dtype), relevance.to(dtype)
    s = safe_divide(relevance, x1 @ x2)
    return 0.5 * x1 * (s @ x2.transpose(-2, -1)), 0.5 * x2 * (x1.transpose(-2, -1) @ s)


def _readout_relevance(adapter: Adapter, taps: LinearTaps, logits: Tensor, r_logits: Tensor, final: Tensor,
                       alpha: float) -> Tensor:
    """Relevance at the last block's output ``(B, T, D)`` from the relevance of the logits, through the head(s).

    The final LayerNorm passes relevance unchanged (Chefer et al.'s LayerNorm rule). One head on one readout token:
    αβ-rule into that token. Two heads averaged (distilled DeiT): the logits' relevance is split by :func:`lrp_add`
    over the two head outputs (halved), then each head's αβ-rule goes to its token (heads in call order: CLS, DIST).
    Pooled readout: the head input's relevance is spread uniformly over the patch tokens (the average pool's weights).
    """
    readout = adapter.readout_tokens
    heads = taps.heads
    n_heads = 1 if readout is None else len(readout)
    if len(heads) != n_heads:
        raise UnsupportedModelError(
            f"expected {n_heads} linear classifier head(s) after the last block, found {len(heads)} linear layers "
            "(attention pooling and MLP heads are not supported by this method)")
    declared = {id(m) for m in adapter.classifier_modules()}
    if any(id(mod) not in declared for mod, _, _ in heads):
        raise UnsupportedModelError("a linear map called after the last block is not one of the model's classifier "
                                    "heads (Adapter.classifier_modules()); this method supports linear heads only")
    outs = [h[2] for h in heads]
    combined = outs[0] if n_heads == 1 else torch.stack(outs).sum(dim=0) / n_heads  # only compared below
    if combined.shape != logits.shape or not torch.allclose(combined, logits.detach(), rtol=1e-4, atol=1e-5):
        raise UnsupportedModelError("the model's logits are not the output(s) of its linear head(s)")
    if n_heads == 1:
        parts = [r_logits]
    else:
        parts = list(lrp_add(outs[0] / 2, outs[1] / 2, r_logits))
    relevance = torch.zeros_like(final)
    for j, ((mod, inp, _), r) in enumerate(zip(heads, parts)):
        r_in = lrp_linear_alpha_beta(inp, mod.weight, r, alpha)
        if r_in.shape != (final.shape[0], final.shape[-1]):
            raise UnsupportedModelError(f"the classifier head reads features of shape {tuple(inp.shape)}")
        if readout is None:
            p = adapter.num_prefix_tokens
            relevance[:, p:] += r_in[:, None, :] / (final.shape[1] - p)
        else:
            relevance[:, readout[j]] += r_in
    return relevance


@register
class TransformerAttribution(Explainer):
    """Chefer et al. (CVPR 2021): ``Ā_l = I + mean_h((∇A_l ⊙ R_{A_l})⁺)``, ``C = Ā_L ⋯ Ā_1``, readout row of ``C``.

    ``R_A`` is the LRP relevance of each block's attention probabilities from one explicit relevance sweep: αβ-rule
    (α = 1, β = 0) for every linear map, relevance passed unchanged through LayerNorm, GELU, softmax and dropout,
    relevance-normalised residual additions (:func:`lrp_add`), z-rule through both attention matmuls with the relevance
    halved between the factors (:func:`lrp_matmul`). The sweep starts from the relevance of the logits
    ``∂y/∂logits`` (a one-hot vector for a class logit, as in the paper). ``∇A`` is the plain gradient of ``y``.

    Options:
        alpha: α of the αβ-rule (β = α − 1), ≥ 1; the paper uses 1.
    """

    name = "transformer_attribution"
    value_kind = "nonnegative"
    description = "LRP relevance of the attention, rolled out (Chefer et al. 2021a)"
    needs = (ATTENTION, (LRP_LINEARS, LRP_VARIANT_LINEARS), BLOCK_IO, TOKEN_SEQUENCE, LINEAR_HEAD)
    display_name = "Transformer Attribution"
    level = "token"
    defaults: dict[str, Any] = {"alpha": 1.0}
    option_specs = {"alpha": number(1)}  # beta = alpha - 1 >= 0

    def check_options(self) -> None:
        self.options["alpha"] = float(self.options["alpha"])

    def declared_cost(self) -> dict[str, float]:
        # the relevance sweep is explicit tensor algebra on captured activations, not a pass of the model
        return {"forward": 1.0, "backward": 1.0, "relevance_sweep": 1.0}

    def attribute(self, adapter: Adapter, x: Tensor, target: Target) -> tuple[Attribution, Tensor, Target]:
        alpha = float(self.options["alpha"])
        with adapter.session(capture=True, conservative=False) as rec:
            # variant blocks: only the check that a gated MLP computes act(g)·x (the sweep applies the rules)
            taps = LinearTaps(adapter, rec, variants=VariantRules(0.5, None, check_only=True))
            with taps.installed():
                logits = adapter.forward(x)
            tgt = self.resolve_target(target, logits)
            grads = self.gradients(tgt(logits), [recorded(blk.attn, "attention") for blk in rec.blocks] + [logits])
        with torch.no_grad():
            cams, totals = self._sweep(adapter, rec, taps, logits.detach(), grads[-1], grads[:-1], alpha)
            row = rollout_row(cams, adapter.readout_tokens, adapter.num_prefix_tokens)
        values, _ = token_map(adapter, row, x)
        extras = {"lrp_totals": totals}
        return Attribution(values=values, extras=extras), logits.detach(), tgt

    @staticmethod
    def _sweep(adapter: Adapter, rec: Recording, taps: LinearTaps, logits: Tensor, r_logits: Tensor,
               grad_attn: list[Tensor], alpha: float) -> tuple[list[Tensor], Tensor]:
        """The relevance sweep from the logits down to the first block's input.

        Returns the per-block maps ``mean_h((∇A ⊙ R_A)⁺)`` (first block first) and the total relevance at every block
        input and at the last block's output, ``(B, L+1)`` (conserved up to the stabilisers and dropped bias terms).
        """
        final = recorded(rec.final, "final residual stream").detach()
        relevance = _readout_relevance(adapter, taps, logits, r_logits, final, alpha)
        totals = [relevance.sum(dim=(1, 2))]
        cams: list[Tensor] = []
        n = len(rec.blocks)
        for i in range(n - 1, -1, -1):
            blk, lin = rec.blocks[i], taps.blocks[i]
            if lin.fc2 is None:
                raise UnsupportedModelError(f"block {i}: found no two-layer MLP after the attention")
            # LinearTaps enforces the call order q/k/v → proj → fc1 → fc2: a block that reached fc2 has them all
            assert lin.fc2_in is not None and lin.fc1 is not None and lin.fc1_in is not None and lin.proj is not None
            assert lin.ctx is not None and lin.n1 is not None and lin.qkv_weights is not None
            assert lin.q is not None and lin.k is not None and lin.v is not None
            u, h = recorded(blk.u, "block input").detach(), recorded(blk.h, "post-attention residual").detach()
            out = final if i == n - 1 else recorded(rec.blocks[i + 1].u, "block input").detach()
            # MLP sub-layer: out = h + m
            r_h, r_m = lrp_add(h, out - h, relevance)
            r_act = lrp_linear_alpha_beta(lin.fc2_in, lin.fc2.weight, r_m, alpha)  # GELU, hidden norm: identity
            variant = taps.variant(i)
            if variant is not None and variant.gated:  # act(g)·x: half to each factor (as lrp_matmul), act: identity
                for w in gate_value_weights(variant):
                    r_h = r_h + lrp_linear_alpha_beta(lin.fc1_in, w, r_act / 2, alpha)
            else:
                r_h = r_h + lrp_linear_alpha_beta(lin.fc1_in, lin.fc1.weight, r_act, alpha)  # LN₂: identity
            # attention sub-layer: h = u + a
            r_u, r_a = lrp_add(u, h - u, relevance=r_h)
            r_ctx = lrp_linear_alpha_beta(lin.ctx, lin.proj.weight, r_a, alpha)
            attn = recorded(blk.attn, "attention").detach()
            b, heads, t, dh = lin.v.shape
            r_ctx = r_ctx.reshape(b, t, heads, dh).transpose(1, 2)
            r_attn, r_v = lrp_matmul(attn, lin.v.detach(), r_ctx)  # a norm before proj: identity
            cams.append((grad_attn[i] * r_attn).clamp_min(0).mean(dim=1))
            q, k = lin.q.detach(), lin.k.detach()
            if variant is not None:  # q/k norms: the matmul's factors are the normed q̂, k̂; the norms: identity
                q, k = normed(variant.q_norm, q), normed(variant.k_norm, k)
            r_q, r_k = lrp_matmul(q, k.transpose(-2, -1), r_attn)  # softmax: identity
            r_k = r_k.transpose(-2, -1)
            r_n1 = sum(
                lrp_linear_alpha_beta(lin.n1.detach(), w, r.transpose(1, 2).reshape(b, t, heads * dh), alpha)
                for w, r in zip(lin.qkv_weights, (r_q, r_k, r_v))
            )
            relevance = r_u + r_n1  # LN₁: identity
            totals.append(relevance.sum(dim=(1, 2)))
        return cams[::-1], torch.stack(totals[::-1], dim=1)
