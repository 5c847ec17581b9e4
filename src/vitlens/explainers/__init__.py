"""Explanation methods. Each method is one small file in this package; the shared machinery is in :mod:`.base`.

Every module of this package is imported here, so a new file with a ``@register``-ed :class:`Explainer` subclass is
available by name without editing this file.
"""

import importlib
import pkgutil

from .base import Attribution, Cost, CostMeter, Explainer, Explanation
from .registry import display_label, display_parts, get_method, methods, register

for _info in pkgutil.iter_modules(__path__):
    if _info.name not in ("base", "registry"):
        importlib.import_module(f"{__name__}.{_info.name}")

__all__ = ["Attribution", "Cost", "CostMeter", "Explainer", "Explanation", "display_label", "display_parts", "get_method", "methods", "register"]
