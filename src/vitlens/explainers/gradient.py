"""Vanilla gradient saliency (Simonyan, Vedaldi & Zisserman, ICLR workshop 2014).

Pixel-level, model-agnostic (any model mapping ``(B, C, H, W)`` to logits): the gradient of the target score with
respect to the preprocessed input, reduced over channels. Settings, cost and sources: ``docs/methods/gradients.md``.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ..models import Adapter
from ..targets import Target
from ..options import choice
from ._gradients import REDUCTIONS, input_gradient, input_gradients, reduce_channels
from .base import Attribution, Explainer
from .registry import register

__all__ = ["Gradient", "reduce_channels", "input_gradients", "REDUCTIONS"]


@register
class Gradient(Explainer):
    """Vanilla gradient saliency (Simonyan, Vedaldi & Zisserman, ICLR workshop 2014), ``(B, H, W)``.

    ``M = reduce_c ∂y/∂x_c`` on the preprocessed input. Default channel reduction ``max_abs``: the maximum over
    channels of the absolute gradient, as the paper does for colour images.

    Options:
        reduce: ``max_abs`` | ``sum_abs`` | ``sum`` (see :func:`reduce_channels`).
    """

    readout_logit_only = True  # logits only: the readout fast path applies (base.Explainer)

    name = "gradient"
    value_kind = "nonnegative"

    @classmethod
    def value_kind_for(cls, options: Any) -> str:
        """Non-negative for the magnitude reductions (default ``max_abs``), signed for ``reduce='sum'``."""
        return "signed" if options.get("reduce", cls.defaults["reduce"]) == "sum" else cls.value_kind

    description = "vanilla gradient of the class score (magnitude)"
    display_name = "Gradient"
    level = "pixel"
    defaults: dict[str, Any] = {"reduce": "max_abs"}
    option_specs = {"reduce": choice(*REDUCTIONS)}

    def attribute(self, adapter: Adapter, x: Tensor, target: Target) -> tuple[Attribution, Tensor, Target]:
        _, grad, logits, tgt = input_gradient(adapter, x, target)
        return Attribution(values=reduce_channels(grad, self.options["reduce"])), logits, tgt
