"""Transformer attribution (Chefer et al., CVPR 2021): LRP relevance of every attention map, gradient-weighted and
rolled out.

One forward, one (activation-only) backward for ``∇A``, and one explicit LRP relevance sweep over tensors captured in
the forward pass (no autograd, no patching). The equations implemented here are written out in
``docs/methods/attention_methods.md``.

This module also holds :class:`LinearTaps`, the hooks that find the linear maps of each pre-norm block by their call
order (query/key/value projection(s), output projection, MLP in, MLP out) and the classifier head(s) after the last
block; :mod:`.attnlrp` uses them too.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import Tensor, nn

from ..errors import InputError, UnsupportedModelError
from ..models import Adapter
from ..models.base import Recording
from ..targets import Target
from .base import Attribution, Explainer
from .gae import relevance_rollout
from .registry import register
from .rollout import readout_row, token_map

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


# -- the hooks that find a block's linear maps ------------------------------------------------------------------
@dataclass
class BlockLinears:
    """The linear maps of one pre-norm block, found by call order, and what they saw in the forward pass.

    ``q``, ``k``, ``v`` are ``(B, heads, T, d_head)`` and stay in the autograd graph; ``qkv_weights`` holds the rows
    of the projection weight(s) that produce ``q``, ``k`` and ``v`` (in that order).
    """

    stage: str = "start"
    n1: Tensor | None = None  # input of the query/key/value projection(s) (the LN₁ output)
    group: list[nn.Linear] = field(default_factory=list)
    group_out: list[Tensor] = field(default_factory=list)
    q: Tensor | None = None
    k: Tensor | None = None
    v: Tensor | None = None
    qkv_weights: tuple[Tensor, Tensor, Tensor] | None = None
    attn: Tensor | None = None  # softmax(q·kᵀ/√d) recomputed without gradient when q/k/v were identified
    proj: nn.Linear | None = None
    ctx: Tensor | None = None  # input of the output projection, (B, T, heads·d_head)
    fc1: nn.Linear | None = None
    fc1_in: Tensor | None = None
    fc1_out: Tensor | None = None
    fc2: nn.Linear | None = None
    fc2_in: Tensor | None = None


class LinearTaps:
    """Hooks that record the ``nn.Linear`` calls of every block of a pre-norm ViT and of the head(s) after it.

    Inside a block the roles follow from the call order: the first linear call(s) sharing one input tensor are the
    query/key/value projection(s) (one fused ``qkv`` or three separate ones); the next call is the output projection;
    then the MLP's first and second linear maps. Which projection output is query, key and value is checked
    numerically: value is the tensor the adapter captured as the values, and query/key are the assignment for which
    ``softmax(q·kᵀ/√d)·v`` reproduces the output projection's input. Anything else (gates, q/k norms, more linear
    maps) raises :class:`UnsupportedModelError`.

    ``rewrite_ctx(block_linears, ctx) -> ctx'`` and ``rewrite_act(fc1_out, fc2_in) -> fc2_in'`` may replace the
    inputs of the output projection and of the second MLP map (used by :mod:`.attnlrp` to impose LRP rules on the
    backward pass).
    Linear calls outside the blocks that happen after the last block are the classifier head(s): ``heads`` holds
    ``(module, input, output)`` for each, detached.
    """

    def __init__(self, adapter: Adapter, rec: Recording,
                 rewrite_ctx: Callable[["BlockLinears", Tensor], Tensor] | None = None,
                 rewrite_act: Callable[[Tensor, Tensor], Tensor] | None = None) -> None:
        self.adapter = adapter
        self.rec = rec
        self.rewrite_ctx = rewrite_ctx
        self.rewrite_act = rewrite_act
        self.blocks: list[BlockLinears] = []
        self.heads: list[tuple[nn.Linear, Tensor, Tensor]] = []
        self._after_blocks = False

    @contextlib.contextmanager
    def installed(self) -> Iterator["LinearTaps"]:
        """Register the hooks for the duration of the context (removed on exit, also after an exception)."""
        handles: list[Any] = []
        try:
            blocks = list(self.adapter.blocks())
            inside: set[int] = set()
            self.blocks = [BlockLinears() for _ in blocks]
            for i, blk in enumerate(blocks):
                for mod in blk.modules():
                    inside.add(id(mod))
                    if isinstance(mod, nn.Linear):
                        handles.append(mod.register_forward_pre_hook(self._pre_hook(i)))
                        handles.append(mod.register_forward_hook(self._post_hook(i)))
            for mod in self.adapter.model.modules():
                if isinstance(mod, nn.Linear) and id(mod) not in inside:
                    handles.append(mod.register_forward_hook(self._head_hook))
            handles.append(blocks[0].register_forward_pre_hook(self._reset))
            handles.append(blocks[-1].register_forward_hook(self._last_block_done))
            yield self
        finally:
            for h in handles:
                h.remove()

    # -- hooks ---------------------------------------------------------------------------------------------------
    def _reset(self, module: nn.Module, args: tuple) -> None:
        self._after_blocks = False
        self.heads = []
        self.blocks = [BlockLinears() for _ in self.blocks]

    def _last_block_done(self, module: nn.Module, args: tuple, output: Any) -> None:
        self._after_blocks = True

    def _head_hook(self, module: nn.Module, args: tuple, output: Tensor) -> None:
        if self._after_blocks:
            self.heads.append((module, args[0].detach(), output.detach()))

    def _pre_hook(self, index: int) -> Callable:
        def hook(module: nn.Module, args: tuple):
            st = self.blocks[index]
            x = args[0]
            if st.stage == "start":
                st.stage, st.n1 = "group", x
                st.group.append(module)
                return None
            if st.stage == "group" and x is st.n1:
                st.group.append(module)
                return None
            if st.stage == "group":
                st.stage, st.proj, st.ctx = "proj", module, x.detach()
                self._resolve_qkv(index, st)
                if self.rewrite_ctx is not None:
                    return (self.rewrite_ctx(st, x), *args[1:])
                return None
            if st.stage == "proj":
                st.stage, st.fc1, st.fc1_in = "fc1", module, x.detach()
                return None
            if st.stage == "fc1":
                st.stage, st.fc2, st.fc2_in = "fc2", module, x.detach()
                if st.fc1_out is None or st.fc1_out.shape != x.shape:
                    raise UnsupportedModelError(
                        f"block {index}: the second MLP map's input is not an elementwise function of the first's "
                        "output (gated MLPs are not supported); vitlens supports pre-norm blocks with a two-layer MLP")
                if self.rewrite_act is not None:
                    return (self.rewrite_act(st.fc1_out, x), *args[1:])
                return None
            raise UnsupportedModelError(
                f"block {index} calls more linear layers than a pre-norm ViT block (q/k/v, output projection, two MLP "
                "maps); vitlens cannot apply LRP rules to it")

        return hook

    def _post_hook(self, index: int) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Tensor) -> None:
            st = self.blocks[index]
            if st.stage == "group":
                st.group_out.append(output)
            elif st.stage == "fc1" and module is st.fc1:
                st.fc1_out = output

        return hook

    def _resolve_qkv(self, index: int, st: BlockLinears) -> None:
        value = self.rec.blocks[index].value if index < len(self.rec.blocks) else None
        if value is None:
            raise UnsupportedModelError(f"block {index}: the adapter captured no value vectors")
        b, heads, t, dh = value.shape
        width = heads * dh
        parts: list[tuple[Tensor, Tensor]] = []  # (tensor (B, H, T, dh), weight rows (width, D))
        for mod, out in zip(st.group, st.group_out):
            if out.shape[-1] % width:
                raise UnsupportedModelError(
                    f"block {index}: a projection with {out.shape[-1]} outputs does not fit {heads} heads of {dh}")
            m = out.shape[-1] // width
            split = out.reshape(b, t, m, heads, dh)
            for j in range(m):
                parts.append((split[:, :, j].transpose(1, 2), mod.weight[j * width:(j + 1) * width]))
        if len(parts) != 3:
            raise UnsupportedModelError(
                f"block {index}: expected query, key and value projections, found {len(parts)} projected tensors")
        vi = [i for i, (p, _) in enumerate(parts) if p.shape == value.shape and torch.equal(p.detach(), value)]
        if len(vi) != 1:
            raise UnsupportedModelError(f"block {index}: cannot tell which projection gives the values")
        rest = [i for i in range(3) if i != vi[0]]
        ctx = st.ctx
        scale = dh ** -0.5
        v = parts[vi[0]][0]
        exact = 1e-5 * float(ctx.abs().max()) + 1e-7
        loose = 1e-3 * float(ctx.abs().max()) + 1e-6
        tried: list[tuple[float, tuple[int, int], Tensor]] = []
        with torch.no_grad():
            for qi, ki in (rest, rest[::-1]):  # call order first; the swap only if that is not exact
                attn = ((parts[qi][0] * scale) @ parts[ki][0].transpose(-2, -1)).softmax(dim=-1)
                err = float(((attn @ v).transpose(1, 2).reshape(ctx.shape) - ctx).abs().max())
                tried.append((err, (qi, ki), attn))
                if err <= exact:
                    break
        err, (qi, ki), attn = min(tried, key=lambda e: e[0])
        if err > loose:
            raise UnsupportedModelError(
                f"block {index}: softmax(q·kᵀ/√d)·v does not reproduce the attention output (max error "
                f"{err:.2e}); attention variants (q/k norms, gates, biases) are not supported")
        st.q, st.k, st.v, st.attn = parts[qi][0], parts[ki][0], v, attn
        st.qkv_weights = (parts[qi][1], parts[ki][1], parts[vi[0]][1])


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
    outs = [h[2] for h in heads]
    combined = outs[0] if n_heads == 1 else sum(outs) / n_heads
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
    requires = "attention"
    level = "token"
    defaults: dict[str, Any] = {"alpha": 1.0}

    def check_options(self) -> None:
        try:
            alpha = float(self.options["alpha"])
        except (TypeError, ValueError):
            raise InputError(f"alpha must be a number >= 1, got {self.options['alpha']!r}") from None
        if not alpha >= 1.0:
            raise InputError(f"alpha must be >= 1 (beta = alpha - 1 >= 0), got {self.options['alpha']}")
        self.options["alpha"] = alpha

    def declared_cost(self) -> dict[str, float]:
        # the relevance sweep is explicit tensor algebra on captured activations, not a pass of the model
        return {"forward": 1.0, "backward": 1.0, "relevance_sweep": 1.0}

    def attribute(self, adapter: Adapter, x: Tensor, target: Target) -> tuple[Attribution, Tensor, Target]:
        alpha = float(self.options["alpha"])
        with adapter.session(capture=True, conservative=False) as rec:
            taps = LinearTaps(adapter, rec)
            with taps.installed():
                logits = adapter.forward(x)
            tgt = target if target.classes is not None else target.resolve(logits)
            attns = [blk.attn for blk in rec.blocks]
            grads = torch.autograd.grad(tgt(logits).sum(), attns + [logits], allow_unused=True)
        grads = [torch.zeros_like(w) if g is None else g for w, g in zip(attns + [logits], grads)]
        with torch.no_grad():
            cams, totals = self._sweep(adapter, rec, taps, logits.detach(), grads[-1], grads[:-1], alpha)
            row = readout_row(relevance_rollout(cams), adapter.readout_tokens, adapter.num_prefix_tokens)
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
        final = rec.final.detach()
        relevance = _readout_relevance(adapter, taps, logits, r_logits, final, alpha)
        totals = [relevance.sum(dim=(1, 2))]
        cams: list[Tensor] = []
        n = len(rec.blocks)
        for i in range(n - 1, -1, -1):
            blk, lin = rec.blocks[i], taps.blocks[i]
            if lin.fc2 is None:
                raise UnsupportedModelError(f"block {i}: found no two-layer MLP after the attention")
            u, h = blk.u.detach(), blk.h.detach()
            out = final if i == n - 1 else rec.blocks[i + 1].u.detach()
            # MLP sub-layer: out = h + m
            r_h, r_m = lrp_add(h, out - h, relevance)
            r_act = lrp_linear_alpha_beta(lin.fc2_in, lin.fc2.weight, r_m, alpha)  # GELU: identity
            r_h = r_h + lrp_linear_alpha_beta(lin.fc1_in, lin.fc1.weight, r_act, alpha)  # LN₂: identity
            # attention sub-layer: h = u + a
            r_u, r_a = lrp_add(u, h - u, relevance=r_h)
            r_ctx = lrp_linear_alpha_beta(lin.ctx, lin.proj.weight, r_a, alpha)
            attn = blk.attn.detach()
            b, heads, t, dh = lin.v.shape
            r_ctx = r_ctx.reshape(b, t, heads, dh).transpose(1, 2)
            r_attn, r_v = lrp_matmul(attn, lin.v.detach(), r_ctx)
            cams.append((grad_attn[i] * r_attn).clamp_min(0).mean(dim=1))
            r_q, r_k = lrp_matmul(lin.q.detach(), lin.k.detach().transpose(-2, -1), r_attn)  # softmax: identity
            r_k = r_k.transpose(-2, -1)
            r_n1 = sum(
                lrp_linear_alpha_beta(lin.n1.detach(), w, r.transpose(1, 2).reshape(b, t, heads * dh), alpha)
                for w, r in zip(lin.qkv_weights, (r_q, r_k, r_v))
            )
            relevance = r_u + r_n1  # LN₁: identity
            totals.append(relevance.sum(dim=(1, 2)))
        return cams[::-1], torch.stack(totals[::-1], dim=1)
