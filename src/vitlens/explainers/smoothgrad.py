"""SmoothGrad (Smilkov et al., 2017): the input gradient averaged over noisy copies of the input.

Pixel-level, model-agnostic (any model mapping ``(B, C, H, W)`` to logits); reads only the gradient of the target
score with respect to the preprocessed input. Settings, cost and sources: ``docs/methods/gradients.md``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from ..models import Adapter
from ..targets import Target
from ..options import choice, integer, number, seed
from ._gradients import REDUCTIONS, clean_forward, input_gradients, reduce_channels
from ._random import image_seed
from .base import Attribution, Explainer
from .registry import register

__all__ = ["SmoothGrad"]


@register
class SmoothGrad(Explainer):
    """SmoothGrad (Smilkov et al., 2017): the gradient averaged over ``n`` noisy copies of the input, ``(B, H, W)``.

    ``M = reduce_c (1/n) Σ_k ∂y/∂x_c (x + ε_k)``, ``ε_k ~ N(0, σ²)``, ``σ = noise · (max(x) − min(x))`` per image (the
    paper's noise level as a fraction of the input range; it recommends 10–20 % and n ≈ 50). The target class is
    fixed on the clean image (one extra, gradient-free forward) and kept for every noisy copy.

    Each image's noise comes from its own generator, seeded by ``seed`` and a hash of the image's values, so the maps
    are deterministic and a batch gives the same maps as one-by-one calls.

    Options:
        n: number of noisy samples (≥ 1). noise: σ as a fraction of the per-image value range (≥ 0).
        seed: int. reduce: channel reduction of the averaged gradient (as for ``gradient``).
        internal_batch_size: model rows per call, rounded down to whole sets of ``B`` noisy copies (at least one set);
            ``None``: all ``n·B`` at once. Memory knob only.
    """

    readout_logit_only = True  # logits only: the readout fast path applies (base.Explainer)

    name = "smoothgrad"
    value_kind = "nonnegative"

    @classmethod
    def value_kind_for(cls, options: Any) -> str:
        """Non-negative for the magnitude reductions (default ``max_abs``), signed for ``reduce='sum'``."""
        return "signed" if options.get("reduce", cls.defaults["reduce"]) == "sum" else cls.value_kind

    description = "gradient averaged over noisy copies of the input"
    display_name = "SmoothGrad"
    level = "pixel"
    defaults: dict[str, Any] = {"n": 50, "noise": 0.15, "seed": 0, "reduce": "max_abs", "internal_batch_size": 64}
    option_specs = {"n": integer(1), "noise": number(0), "seed": seed(), "reduce": choice(*REDUCTIONS),
                    "internal_batch_size": integer(1, none=True)}
    fast_options: dict[str, Any] = {"n": 4}

    def declared_cost(self) -> dict[str, float]:
        n = float(self.options["n"])
        return {"forward": n + 1.0, "backward": n}

    def _noise_source(self, x: Tensor) -> Callable[[int, int], Tensor]:
        """``draw(start, stop)`` → noise samples ``start … stop − 1``, ``(stop − start, B, C, H, W)``.

        One CPU generator per image, seeded by ``seed`` and a hash of the image; samples are drawn one at a time in
        order, so the noise does not depend on how the draws are chunked.
        """
        level, seed = float(self.options["noise"]), int(self.options["seed"])
        gens = [torch.Generator().manual_seed(image_seed(xi, seed)) for xi in x]
        sigmas = [level * float(xi.max() - xi.min()) for xi in x]
        shape = tuple(x.shape[1:])

        def draw(start: int, stop: int) -> Tensor:
            out = torch.stack([
                torch.stack([torch.randn(shape, generator=g, dtype=torch.float32) * sd for g, sd in zip(gens, sigmas)])
                for _ in range(start, stop)
            ])
            return out.to(device=x.device, dtype=x.dtype)

        return draw

    def noise(self, x: Tensor) -> Tensor:
        """The ``(n, B, C, H, W)`` noise this method adds to ``x``."""
        return self._noise_source(x)(0, int(self.options["n"]))

    def attribute(self, adapter: Adapter, x: Tensor, target: Target) -> tuple[Attribution, Tensor, Target]:
        n = int(self.options["n"])
        x = x.detach()
        draw = self._noise_source(x)
        with adapter.session(capture=False):
            logits, tgt = clean_forward(adapter, x, target)
            grads = input_gradients(adapter, lambda i, j: x[None] + draw(i, j), n, x.shape[0], tgt,
                                    self.options["internal_batch_size"])
        mean_grad = grads.mean(dim=0)
        return Attribution(values=reduce_channels(mean_grad, self.options["reduce"])), logits, tgt
