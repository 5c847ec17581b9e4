"""Simple model-agnostic references: input × gradient, and a random map (the floor every method must beat)."""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import Tensor

from ..models import Adapter
from ..targets import Target
from .base import Attribution, Explainer
from .registry import register

__all__ = ["InputXGradient", "RandomMap"]


def input_gradient(adapter: Adapter, x: Tensor, target: Target) -> tuple[Tensor, Tensor, Tensor, Target]:
    """One forward and one backward: returns ``(x, ∇x y, logits, resolved target)``."""
    with adapter.session(capture=False) as _:
        xg = x.detach().clone().requires_grad_(True)
        logits = adapter.forward(xg)
        tgt = target if target.classes is not None else target.resolve(logits)
        (grad,) = torch.autograd.grad(tgt(logits).sum(), [xg])
    return xg.detach(), grad, logits.detach(), tgt


@register
class InputXGradient(Explainer):
    """Input × gradient summed over channels, ``Σ_c x_c · ∂y/∂x_c`` (on the preprocessed input), ``(B, H, W)``."""

    readout_logit_only = True  # logits only: the readout fast path applies (base.Explainer)

    name = "inputxgradient"
    level = "pixel"
    defaults: dict[str, Any] = {}

    def attribute(self, adapter: Adapter, x: Tensor, target: Target) -> tuple[Attribution, Tensor, Target]:
        xd, grad, logits, tgt = input_gradient(adapter, x, target)
        return Attribution(values=(xd * grad).sum(dim=1)), logits, tgt


def _image_seed(image: Tensor, seed: int) -> int:
    digest = hashlib.blake2b(image.detach().cpu().contiguous().numpy().tobytes(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") ^ (seed * 0x9E3779B97F4A7C15)) % (2**63)


@register
class RandomMap(Explainer):
    """Uniform random values in [0, 1) on the token grid (pixel grid for models without tokens): the floor every
    method must beat. Each image's map is drawn from a generator seeded by ``seed`` and a hash of the image's values,
    so maps are deterministic and a batch equals one-by-one calls."""

    name = "random"
    level = "token"
    defaults: dict[str, Any] = {"seed": 0}

    def declared_cost(self) -> dict[str, float]:
        return {"forward": 1.0, "backward": 0.0}

    def attribute(self, adapter: Adapter, x: Tensor, target: Target) -> tuple[Attribution, Tensor, Target]:
        with adapter.session(capture=False), torch.no_grad():
            logits = adapter.forward(x)
        tgt = target if target.classes is not None else target.resolve(logits)
        gh, gw = adapter.grid(tuple(x.shape[-2:]))
        values = torch.stack([
            torch.rand(gh, gw, generator=torch.Generator().manual_seed(_image_seed(xi, int(self.options["seed"]))))
            for xi in x
        ]).to(x.device)
        return Attribution(values=values), logits, tgt
