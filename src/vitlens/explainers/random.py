"""A random map: the floor every method must beat (a baseline, never marked best)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..models import Adapter
from ..targets import Target
from ..options import seed
from ._random import image_seed
from .base import Attribution, Explainer, image_size
from .registry import register

__all__ = ["RandomMap"]


@register
class RandomMap(Explainer):
    """Uniform random values in [0, 1) on the token grid (pixel grid for models without tokens): the floor every
    method must beat. Each image's map is drawn from a generator seeded by ``seed`` and a hash of the image's values,
    so maps are deterministic and a batch equals one-by-one calls."""

    name = "random"
    value_kind = "nonnegative"
    description = "uniform random map: the floor every method should beat"
    display_name = "Random"
    baseline = True
    level = "token"
    defaults: dict[str, Any] = {"seed": 0}
    option_specs = {"seed": seed()}

    def declared_cost(self) -> dict[str, float]:
        return {"forward": 1.0, "backward": 0.0}

    def attribute(self, adapter: Adapter, x: Tensor, target: Target) -> tuple[Attribution, Tensor, Target]:
        with adapter.session(capture=False), torch.no_grad():
            logits = adapter.forward(x)
        tgt = self.resolve_target(target, logits)
        gh, gw = adapter.grid(image_size(x))
        values = torch.stack([
            torch.rand(gh, gw, generator=torch.Generator().manual_seed(image_seed(xi, int(self.options["seed"]))))
            for xi in x
        ]).to(x.device)
        return Attribution(values=values), logits, tgt
