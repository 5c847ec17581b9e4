"""Test-time refinement of an AHA map (our design; the seed only says "a few gradient steps, e.g. T = 3"; the
explainer's default is T = 6 at half the step, chosen on validation images: docs/methods/aha.md §5).

For one image and class, start from the explainer's map logits ``S₀`` and take ``T`` Adam steps on the soft AHA loss
(no Gumbel noise, a fixed grid, a fixed reference, fixed curve fractions), optimising the map logits themselves, not
the network. The logits are parametrised as ``S = S₀ + range(S₀)·Δ`` with ``Δ₀ = 0`` and ``range(S₀) = max − min``
per image, so the step size ``lr`` is a fraction of the map's own range (the network's output scale is arbitrary;
the sorter only sees min–max scaled scores). Each step evaluates the ``m − 2`` inner curve points for deletion and for
insertion: ``2·(m − 2)`` forward + backward passes of the target per image; the endpoints (nothing / everything
deleted) do not depend on ``S`` and are computed once.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from ..models.base import int_pair
from .soft_metrics import RegionGrid, aha_loss, curve_fractions, soft_curves

__all__ = ["refine_maps"]


def refine_maps(prob_fn: Callable[[Tensor, Tensor], Tensor], x: Tensor, maps0: Tensor, classes: Tensor,
                ref: Tensor | Sequence[Tensor], endpoints: tuple[Tensor, Tensor] | Sequence[tuple[Tensor, Tensor]],
                steps: int = 3, lr: float = 0.05,
                grid: int | tuple[int, int] = 8, tau: float = 0.03, m: int = 16, n_iters: int = 30,
                w_del: float = 1.0, w_ins: float = 1.0, w_peak: float = 0.0025, peak_kernel: int = 15,
                mask_sigma: float = 1.0, betas: tuple[float, float] = (0.9, 0.999), rel_eps: float = 1e-2) -> Tensor:
    """Refined maps ``(B, H, W)`` after ``steps`` Adam steps (``steps = 0`` returns ``maps0`` itself).

    Args:
        prob_fn: ``(images, classes) → probabilities`` of the target model (differentiable). It is called with
            images in ``x``'s dtype (the model's: a float16/bfloat16 model gets half images), while the map logits,
            masks, sorter and Adam state are float32 whatever that dtype is.
        x, ref: images and the reference ``(B, C, H, W)`` (normalised). endpoints: ``(prob(x), prob(ref))`` ``(B,)``.
            With a list of references (and one endpoint pair each), step ``t`` uses reference ``(t − 1) mod k``:
            the refinement then follows no single deletion protocol, at the cost of one reference per step.
        maps0: the explainer's map logits ``(B, H, W)``. classes: ``(B,)``.
        betas, rel_eps: Adam's moment decays and its ε, *relative* to the RMS of each image's second-moment
            estimate (``ε_b = rel_eps·sqrt(mean(v̂_b))``) instead of torch's absolute 1e-8: the update is then
            independent of the loss scale, and pixels whose gradient is at rounding-noise level (a region's pooled
            gradient nearly cancelling the peak penalty's) get a negligible step instead of a full ``±lr``, which
            makes the map stable under batching. The loss is the sum over images of the per-image soft loss, so
            every image's update depends only on itself.
    """
    if steps <= 0:
        return maps0
    refs = [ref] if isinstance(ref, Tensor) else list(ref)
    ends: list[Any] = [endpoints] if isinstance(endpoints[0], Tensor) else list(endpoints)
    if len(refs) != len(ends) or not refs:
        raise ValueError(f"{len(refs)} references need as many endpoint pairs, got {len(ends)}")
    in_dtype = x.dtype
    if in_dtype != torch.float32:  # half / double models: blend and optimise in float32, feed the model its dtype
        x = x.float()
        refs = [r.float() for r in refs]
        inner_fn = prob_fn

        def prob_fn(images: Tensor, cls: Tensor) -> Tensor:
            return inner_fn(images.to(in_dtype), cls).float()
    hw = int_pair(maps0.shape[-2:])
    regions = RegionGrid(hw, grid, device=maps0.device)
    fractions = curve_fractions(m, "fixed")
    out_dtype = maps0.dtype
    maps0 = maps0.detach().float()
    span = (maps0.amax(dim=(1, 2)) - maps0.amin(dim=(1, 2))).clamp_min(1e-12)[:, None, None]
    delta = torch.zeros_like(maps0)
    m1 = torch.zeros_like(maps0)
    m2 = torch.zeros_like(maps0)
    b1, b2 = betas
    with torch.enable_grad():
        for t in range(1, int(steps) + 1):
            d = delta.detach().requires_grad_(True)
            s = maps0 + span * d
            k = (t - 1) % len(refs)
            curves = soft_curves(prob_fn, x, refs[k], s, classes, regions, fractions, tau, n_iters, noise=None,
                                 endpoints=ends[k], mask_sigma=mask_sigma)
            loss, _ = aha_loss(curves, s, w_del, w_ins, w_peak, peak_kernel)
            (g,) = torch.autograd.grad(loss.sum(), [d])
            with torch.no_grad():
                m1.mul_(b1).add_(g, alpha=1 - b1)
                m2.mul_(b2).addcmul_(g, g, value=1 - b2)
                mh = m1 / (1 - b1 ** t)
                vh = m2 / (1 - b2 ** t)
                eps = rel_eps * vh.mean(dim=(1, 2), keepdim=True).sqrt() + 1e-30
                delta = delta - lr * mh / (vh.sqrt() + eps)
    return (maps0 + span * delta).detach().to(out_dtype)
