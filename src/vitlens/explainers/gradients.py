"""Simple model-agnostic references: input × gradient, and a random map (the floor every method must beat)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..models import Adapter
from ..targets import Target
from ._gradients import input_gradient
from ._random import image_seed
from .base import Attribution, Explainer, image_size
from .registry import register

__all__ = ["InputXGradient", "RandomMap"]


@register
class InputXGradient(Explainer):
    """Input × gradient summed over channels, ``Σ_c x_c · ∂y/∂x_c`` (on the preprocessed input), ``(B, H, W)``."""

    readout_logit_only = True  # logits only: the readout fast path applies (base.Explainer)

    name = "inputxgradient"
    description = "input x gradient, signed"
    display_name = "Input × Gradient"
    level = "pixel"
    defaults: dict[str, Any] = {}

    def attribute(self, adapter: Adapter, x: Tensor, target: Target) -> tuple[Attribution, Tensor, Target]:
        xd, grad, logits, tgt = input_gradient(adapter, x, target)
        return Attribution(values=(xd * grad).sum(dim=1)), logits, tgt


@register
class RandomMap(Explainer):
    """Uniform random values in [0, 1) on the token grid (pixel grid for models without tokens): the floor every
    method must beat. Each image's map is drawn from a generator seeded by ``seed`` and a hash of the image's values,
    so maps are deterministic and a batch equals one-by-one calls."""

    name = "random"
    description = "uniform random map: the floor every method should beat"
    display_name = "Random"
    baseline = True
    level = "token"
    defaults: dict[str, Any] = {"seed": 0}

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
