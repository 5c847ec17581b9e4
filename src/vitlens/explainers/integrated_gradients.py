"""Integrated Gradients (Sundararajan, Taly & Yan, ICML 2017).

``IG_c(x) = (x_c − x'_c) · ∫₀¹ ∂y/∂x_c (x' + α(x − x')) dα``, approximated by a quadrature rule with ``n_steps`` nodes
and summed over channels. Settings, cost and the cross-check against Captum: ``docs/methods/gradients.md``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..errors import InputError, VitlensError
from ..models import Adapter
from ..targets import Target
from ..options import any_of, choice, integer, tensor
from ._gradients import clean_forward, input_gradients
from .base import Attribution, Explainer
from .registry import register

__all__ = ["IntegratedGradients", "quadrature", "baseline_for", "QUADRATURES"]

QUADRATURES = ("riemann_left", "riemann_right", "riemann_middle", "riemann_trapezoid", "gausslegendre")


def quadrature(rule: str, n: int) -> tuple[list[float], list[float]]:
    """Nodes ``α_k ∈ [0, 1]`` and weights ``w_k`` (``Σ_k w_k = 1``) of an ``n``-point rule on ``[0, 1]``.

    Riemann rules use ``n`` equal cells of width ``1/n`` with the node at the cell's left end, right end or middle;
    the trapezoid rule uses ``n`` equally spaced nodes including both ends (``n ≥ 2``); Gauss-Legendre maps the
    Legendre nodes from ``[−1, 1]`` to ``[0, 1]`` (exact for polynomials of degree ``2n − 1``).
    """
    if rule not in QUADRATURES:
        raise InputError(f"rule must be one of {QUADRATURES}, got {rule!r}")
    if rule == "riemann_trapezoid":
        if n < 2:
            raise InputError("the trapezoid rule needs n_steps >= 2")
        alphas = [k / (n - 1) for k in range(n)]
        weights = [1.0 / (n - 1)] * n
        weights[0] = weights[-1] = 0.5 / (n - 1)
        return alphas, weights
    if rule == "gausslegendre":
        nodes, w = np.polynomial.legendre.leggauss(n)
        return [float(0.5 * (v + 1.0)) for v in nodes], [float(0.5 * v) for v in w]
    offset = {"riemann_left": 0.0, "riemann_right": 1.0, "riemann_middle": 0.5}[rule]
    return [(k + offset) / n for k in range(n)], [1.0 / n] * n


def baseline_for(adapter: Adapter, x: Tensor, baseline: Any) -> Tensor:
    """The baseline ``x'`` for a batch ``x``, broadcast to ``x``'s shape.

    ``"black"``: a black image in pixel space, i.e. ``(0 − mean) / std`` per channel in the normalised input, with
    mean/std from ``vitlens.images.data_config(model)`` (zeros if the model has no data config). ``"zero"``: a zero
    normalised input. A tensor (or array) broadcastable to ``(C, H, W)``: used as given, for every image.
    """
    c = x.shape[1]
    if isinstance(baseline, str):
        if baseline == "zero":
            return torch.zeros_like(x)
        if baseline == "black":
            from ..images import data_config

            try:
                cfg = data_config(adapter.model)
            except VitlensError:
                return torch.zeros_like(x)
            if c != len(cfg.mean):
                raise InputError(
                    f"baseline='black' uses the model's {len(cfg.mean)}-channel mean/std but the input has {c} "
                    "channels; pass baseline='zero' or a tensor"
                )
            mean = torch.tensor(cfg.mean, dtype=x.dtype, device=x.device)
            std = torch.tensor(cfg.std, dtype=x.dtype, device=x.device)
            return ((0.0 - mean) / std)[None, :, None, None].expand_as(x).clone()
        raise InputError(f"baseline must be 'black', 'zero' or a tensor, got {baseline!r}")
    ref = torch.as_tensor(baseline, dtype=x.dtype, device=x.device)
    try:
        return torch.broadcast_to(ref, x.shape[1:])[None].expand_as(x).clone()
    except RuntimeError:
        raise InputError(
            f"a baseline tensor must broadcast to (C, H, W) = {tuple(x.shape[1:])}; got shape {tuple(ref.shape)}"
        ) from None


@register
class IntegratedGradients(Explainer):
    """Integrated Gradients, summed over channels: ``Σ_c (x_c − x'_c) · Σ_k w_k ∂y/∂x_c (x' + α_k (x − x'))``,
    ``(B, H, W)``.

    By completeness, ``Σ_pixels IG ≈ y(x) − y(x')`` (exact in the limit of many steps). The target class is fixed
    on the clean image (one extra, gradient-free forward that also gives the returned logits).

    Options:
        n_steps: quadrature nodes (default 50). rule: the quadrature, one of :data:`QUADRATURES` (Captum's
            ``method`` names; ``vitlens.explain`` keeps ``method=`` for the method name); default ``riemann_right``,
            the sum the paper writes down (``α_k = k/n``, ``k = 1…n``).
        baseline: ``"black"`` (default), ``"zero"`` or a tensor broadcastable to ``(C, H, W)``; see
            :func:`baseline_for`.
        internal_batch_size: model rows per call (default 64), rounded down to whole steps of ``B`` path points (at
            least one step), as Captum's ``internal_batch_size``; ``None``: all ``B·n_steps`` rows in one call
            (Captum's default: fastest, most memory). Results do not depend on it beyond float rounding.
    """

    readout_logit_only = True  # logits only: the readout fast path applies (base.Explainer)

    name = "integrated_gradients"
    value_kind = "signed"
    description = "integrated gradients from a baseline image"
    display_name = "Integrated Gradients"
    level = "pixel"
    defaults: dict[str, Any] = {
        "n_steps": 50,
        "rule": "riemann_right",
        "baseline": "black",
        "internal_batch_size": 64,
    }
    option_specs = {
        "n_steps": integer(1, 100_000),
        "rule": choice(*QUADRATURES),
        "baseline": any_of(choice("black", "zero"), tensor()),
        "internal_batch_size": integer(1, none=True),
    }
    fast_options: dict[str, Any] = {"n_steps": 4}

    def check_options(self) -> None:
        quadrature(self.options["rule"], self.options["n_steps"])  # the trapezoid rule needs n_steps >= 2

    def declared_cost(self) -> dict[str, float]:
        n = float(self.options["n_steps"])
        return {"forward": n + 1.0, "backward": n}

    def attribute(self, adapter: Adapter, x: Tensor, target: Target) -> tuple[Attribution, Tensor, Target]:
        o = self.options
        n = int(o["n_steps"])
        x = x.detach()
        base = baseline_for(adapter, x, o["baseline"])
        alphas, weights = quadrature(o["rule"], n)
        delta = x - base
        a = torch.tensor(alphas, dtype=x.dtype, device=x.device).view(n, 1, 1, 1, 1)

        def points(i: int, j: int) -> Tensor:  # x − (1 − α)(x − x'): exactly x at α = 1
            return x[None] - (1.0 - a[i:j]) * delta[None]

        with adapter.session(capture=False):
            logits, tgt = clean_forward(adapter, x, target)
            grads = input_gradients(adapter, points, n, x.shape[0], tgt, o["internal_batch_size"])
        w = torch.tensor(weights, dtype=grads.dtype, device=grads.device).view(n, 1, 1, 1, 1)
        avg = (grads * w).sum(dim=0)
        return Attribution(values=(delta * avg).sum(dim=1)), logits, tgt
