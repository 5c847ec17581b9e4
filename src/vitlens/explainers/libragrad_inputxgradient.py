"""LibraGrad input × gradient: :mod:`.inputxgradient` with LibraGrad's backward rules (:mod:`._libragrad`).

Pixel-level, one forward and one backward pass. FullGrad-complete for a class logit: the map's sum plus the bias terms
equals the logit (``docs/methods/libragrad.md``).
"""

from __future__ import annotations

from typing import Any

from ._libragrad import LIBRA_NEEDS, LibraGradMethod
from .registry import register

__all__ = ["LibraGradInputXGradient"]


@register
class LibraGradInputXGradient(LibraGradMethod):
    """``Σ_c x_c · ∂̃y/∂x_c`` with ``∂̃`` LibraGrad's gradient (attention probabilities, normalisation scales and
    activation gates constant in the backward pass), ``(B, H, W)``."""

    name = "libragrad_inputxgradient"
    base_method = "inputxgradient"
    value_kind = "signed"
    description = "input x gradient under LibraGrad's backward rules (FullGrad-complete)"
    display_name = "LibraGrad Input × Gradient"
    level = "pixel"
    needs = (LIBRA_NEEDS,)
    defaults: dict[str, Any] = {}
