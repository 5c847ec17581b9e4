"""Finer-CAM (Zhang et al., CVPR 2025): Grad-CAM of the contrast between the target class and its most similar classes.

Token-level, one forward and one activation-only backward pass (Grad-CAM is linear in the gradient before its ReLU,
so one backward of the combined score serves all comparisons); the machinery is Grad-CAM's (:mod:`._cam`). Settings,
sources and cross-checks: ``docs/methods/cams.md``.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor

from ..errors import TargetError
from ..models import Adapter
from ..models.capabilities import CLASS_LOGITS, FEATURES, PIXEL_LOGITS
from ..targets import Target
from ._cam import OneLayerCAM, features_at, token_gradcam
from ..options import choice, integer, number
from .base import Attribution, image_size
from .registry import register

__all__ = ["FinerCAM", "FinerContrast", "similar_classes", "class_scores"]

_WEIGHTINGS = ("mean", "probability")


def similar_classes(logits: Tensor, classes: Tensor, k: int) -> Tensor:
    """The ``k`` classes (≠ the target class) whose logits are closest to the target's, ``(B, k)`` long, closest
    first. For the predicted class these are the runner-ups. ``logits``: ``(B, K)`` per-class scores (for a
    segmentation target, :func:`class_scores`)."""
    diff = (logits.detach() - logits.detach().gather(1, classes[:, None])).abs()
    diff.scatter_(1, classes[:, None], float("inf"))
    return diff.argsort(dim=1, stable=True)[:, :k]


def _with_classes(target: Target, classes: Tensor) -> Target:
    """A copy of a resolved target that scores ``classes`` ``(B,)`` by the same rule (a segmentation target keeps its
    region)."""
    t = copy.copy(target)
    t.classes = classes
    return t


def class_scores(target: Target, logits: Tensor) -> Tensor:
    """Every class's score under a resolved target's rule, ``(B, K)``: the logits for classifier logits ``(B, K)``;
    for per-pixel logits ``(B, K, h, w)`` and a :class:`~vitlens.targets.SegmentationTarget`, each class's logits
    summed over the target's region (the region of the target class, fixed at resolution)."""
    if logits.ndim == 2:
        return logits
    b, k = logits.shape[:2]
    return torch.stack([_with_classes(target, torch.full((b,), c, dtype=torch.long, device=logits.device))(logits)
                        for c in range(k)], dim=1)


class FinerContrast(Target):
    """Finer-CAM's target: a target's score against the logits of ``k`` reference classes ``d``.

    ``score = s − γ · Σ_d ω_d y_d`` with ``s`` the wrapped target's score (the logit ``y_c`` for the default
    :class:`~vitlens.targets.ClassLogit`) and ``Σ_d ω_d = 1``: ``weighting="mean"`` gives ``ω_d = 1/k``, i.e. the
    average of the ``k`` differences ``y_c − γ·y_d``; ``weighting="probability"`` gives ``ω_d = p_d / Σ_d' p_d'`` with
    ``p = softmax(y)`` (the weights are part of the graph), pytorch-grad-cam's ``FinerWeightedTarget``.

    Per-pixel logits ``(B, K, h, w)`` with a :class:`~vitlens.targets.SegmentationTarget` ``base``: each ``y_d`` is
    class ``d``'s logits summed over the base target's region (the same pixels as ``s``), so the score is
    ``Σ_{p∈Ω} (z_c[p] − γ · mean_d z_d[p])``, the target class's margin over its references on the region. Only
    ``weighting="mean"`` (a softmax over classes is defined per pixel, not for region sums).
    """

    def __init__(self, base: Target, versus: Tensor, gamma: float, weighting: str) -> None:
        self.base = base
        self.classes = base.classes
        self.versus = versus
        self.gamma = float(gamma)
        self.weighting = weighting

    def resolve(self, logits: Tensor) -> "FinerContrast":
        return self

    def __call__(self, logits: Tensor) -> Tensor:
        if self.versus.shape[0] != logits.shape[0]:
            raise TargetError(
                f"target was resolved for a batch of {self.versus.shape[0]}, got logits for {logits.shape[0]}"
            )
        return self.score(logits)

    def score(self, logits: Tensor) -> Tensor:
        s = self.base(logits)  # the base target checks the logits' shape (classifier or per-pixel)
        versus = self.versus.to(logits.device)
        if logits.ndim != 2:  # per-pixel logits: each reference scored over the base target's region
            if self.weighting != "mean":
                raise TargetError(
                    f"Finer-CAM weighting={self.weighting!r} needs classifier logits (B, K); with per-pixel logits "
                    "(SegmentationTarget) use weighting='mean'"
                )
            ref = torch.stack([_with_classes(self.base, versus[:, j])(logits) for j in range(versus.shape[1])], 1)
            return s - self.gamma * ref.mean(dim=1)
        yd = logits.gather(1, versus)  # (B, k)
        if self.weighting == "mean":
            ref = yd.mean(dim=1)
        else:
            p = logits.softmax(dim=-1).gather(1, versus)
            ref = (p * yd).sum(dim=1) / p.sum(dim=1).clamp_min(torch.finfo(p.dtype).tiny)
        return s - self.gamma * ref

    def select(self, index: Tensor | slice) -> "FinerContrast":
        return FinerContrast(self.base.select(index), self.versus[index], self.gamma, self.weighting)

    def describe(self) -> dict:
        return {"kind": "FinerContrast", "base": self.base.describe(), "versus": self.versus.tolist(),
                "gamma": self.gamma, "weighting": self.weighting}


@register
class FinerCAM(OneLayerCAM):
    """Finer-CAM (Zhang et al., CVPR 2025): Grad-CAM of the contrast between the target class and its most similar
    classes, ``(B, gh, gw)``.

    The target class ``c`` is the one the given target resolves to (the predicted class by default); the references
    ``d`` are the ``references`` classes whose logits are closest to ``y_c`` (the runner-ups when ``c`` is predicted).
    The explained score is the :class:`FinerContrast` of the given target (``y_c`` by default) against them: the
    ``k`` differences ``y_c − γ·y_d`` averaged (default) or softmax-weighted. Grad-CAM is linear in the gradient
    before its ReLU, so one backward pass of the combined score serves all comparisons. Everything else is
    :class:`GradCAM`; ``γ = 0`` gives Grad-CAM. With a :class:`~vitlens.targets.SegmentationTarget` every class is
    scored over the target's region (its logits summed there), the references are the classes closest to the target
    class by that score, and only ``weighting="mean"`` applies (see :class:`FinerContrast`).

    Options:
        references: number of similar classes compared against (default 3; capped at ``K − 1``).
        gamma: comparison strength γ (default 1). weighting: ``mean`` | ``probability`` (see :class:`FinerContrast`).
        layer: feature layer, as for :class:`GradCAM` (default the last).

    ``extras["references"]``: ``(B, k)`` the reference classes per image.
    """

    name = "finercam"
    value_kind = "nonnegative"
    description = "Grad-CAM of the target class against its closest competitor"
    needs = (FEATURES, (CLASS_LOGITS, PIXEL_LOGITS))  # its reference classes are other classes' logits
    display_name = "Finer-CAM"
    defaults: dict[str, Any] = {"references": 3, "gamma": 1.0, "weighting": "mean", "layer": -1}
    option_specs = {**OneLayerCAM.option_specs, "references": integer(1, unit="capped at K - 1"),
                    "gamma": number(0), "weighting": choice(*_WEIGHTINGS)}

    def _retarget(self, tgt: Target, logits: Tensor) -> FinerContrast:
        n_classes = logits.shape[1]
        if n_classes < 2:
            raise TargetError("Finer-CAM needs a model with at least 2 classes")
        k = min(int(self.options["references"]), n_classes - 1)
        versus = similar_classes(class_scores(tgt, logits.detach()), tgt.resolved_classes().to(logits.device), k)
        return FinerContrast(tgt, versus, float(self.options["gamma"]), self.options["weighting"])

    def attribute(self, adapter: Adapter, x: Tensor, target: Target) -> tuple[Attribution, Tensor, Target]:
        i = self.layer_index(adapter)
        logits, tgt, (u,), (g,) = self.forward_and_gradients(adapter, x, target, lambda rec: [features_at(rec, i)],
                                                             retarget=self._retarget)
        cam = token_gradcam(u, g, adapter.feature_prefix_tokens())
        assert isinstance(tgt, FinerContrast)  # what self._retarget made
        att = Attribution(values=self.on_grid(adapter, cam, image_size(x), features=True), extras={"references": tgt.versus})
        return att, logits, tgt
