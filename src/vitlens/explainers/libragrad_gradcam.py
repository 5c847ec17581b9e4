"""LibraGrad Grad-CAM: :mod:`.gradcam` with LibraGrad's backward rules (:mod:`._libragrad`) in the backward from
the target to the feature layer.

Token-level, one forward and one backward pass (``docs/methods/libragrad.md``).
"""

from __future__ import annotations

from typing import Any

from ..models.capabilities import FEATURES
from ._libragrad import LIBRA_NEEDS, LibraGradMethod
from .registry import register

__all__ = ["LibraGradGradCAM"]


@register
class LibraGradGradCAM(LibraGradMethod):
    """Grad-CAM (ReLU of the channel sum of features weighted by their patch-averaged gradient) with ``∂̃``
    LibraGrad's gradient, ``(B, gh, gw)``. Options: Grad-CAM's ``layer`` (default the last block's input)."""

    name = "libragrad_gradcam"
    base_method = "gradcam"
    value_kind = "nonnegative"
    description = "Grad-CAM under LibraGrad's backward rules"
    display_name = "LibraGrad Grad-CAM"
    level = "token"
    needs = (FEATURES, LIBRA_NEEDS)
    defaults: dict[str, Any] = {"layer": -1}
