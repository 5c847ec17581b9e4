"""LibraGrad Integrated Gradients: :mod:`.integrated_gradients` with LibraGrad's backward rules
(:mod:`._libragrad`) at every path point.

Pixel-level; ``n_steps + 1`` forwards and ``n_steps`` backwards, as Integrated Gradients
(``docs/methods/libragrad.md``).
"""

from __future__ import annotations

from typing import Any

from ._libragrad import LIBRA_NEEDS, LibraGradMethod
from .registry import register

__all__ = ["LibraGradIG"]


@register
class LibraGradIG(LibraGradMethod):
    """``Σ_c (x_c − x'_c) · Σ_k w_k ∂̃y/∂x_c (x' + α_k (x − x'))`` with ``∂̃`` LibraGrad's gradient, ``(B, H, W)``.

    Options: those of ``integrated_gradients`` (``n_steps``, ``rule``, ``baseline``, ``internal_batch_size``), with
    its defaults.
    """

    name = "libragrad_ig"
    base_method = "integrated_gradients"
    value_kind = "signed"
    description = "integrated gradients under LibraGrad's backward rules"
    display_name = "LibraGrad IG"
    level = "pixel"
    needs = (LIBRA_NEEDS,)
    defaults: dict[str, Any] = {"n_steps": 50, "rule": "riemann_right", "baseline": "black",
                                "internal_batch_size": 64}
    fast_options: dict[str, Any] = {"n_steps": 4}
