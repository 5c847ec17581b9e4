"""Input × gradient: a simple model-agnostic reference.

Pixel-level, one forward and one backward pass: the preprocessed input times the gradient of the target score,
summed over channels.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ..models import Adapter
from ..targets import Target
from ._gradients import input_gradient
from .base import Attribution, Explainer
from .registry import register

__all__ = ["InputXGradient"]


@register
class InputXGradient(Explainer):
    """Input × gradient summed over channels, ``Σ_c x_c · ∂y/∂x_c`` (on the preprocessed input), ``(B, H, W)``."""

    readout_logit_only = True  # logits only: the readout fast path applies (base.Explainer)

    name = "inputxgradient"
    value_kind = "signed"
    description = "input x gradient, signed"
    display_name = "Input × Gradient"
    level = "pixel"
    defaults: dict[str, Any] = {}

    def attribute(self, adapter: Adapter, x: Tensor, target: Target) -> tuple[Attribution, Tensor, Target]:
        xd, grad, logits, tgt = input_gradient(adapter, x, target)
        return Attribution(values=(xd * grad).sum(dim=1)), logits, tgt
