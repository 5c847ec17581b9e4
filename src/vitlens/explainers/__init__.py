"""Explanation methods. Each method is one small file; the shared machinery is in :mod:`.base`."""

from .base import Attribution, Cost, CostMeter, Explainer, Explanation
from .registry import get_method, methods, register
from . import gradients, gradskip  # noqa: F401  (register the built-in methods)

__all__ = ["Attribution", "Cost", "CostMeter", "Explainer", "Explanation", "get_method", "methods", "register"]
