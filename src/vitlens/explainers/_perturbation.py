"""Helpers shared by the perturbation methods (RISE, MDA, TIS, MUTEX, ViT-CX): option checks, the resolved target,
and the score of a target on model outputs that all belong to one image. Package-internal.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..errors import InputError, TargetError
from ..models.capabilities import CLASS_LOGITS
from ..models import Adapter
from ..targets import Target, class_score
from .base import Explainer, check_choices

__all__ = ["SCORE_KINDS", "score_needs",
           "check_positive_int", "check_score", "resolve", "target_scores", "score_token_subsets",
           "coverage_average"]

#: what a perturbation method scores: the softmax probability of the target class (the papers' choice) or the
#: target object's own score (e.g. the logit, or a contrast ``y_c − γ·y_d``).
SCORE_KINDS = ("probability", "target")


def check_positive_int(options: dict[str, Any], *names: str) -> None:
    """Raise :class:`InputError` unless each named option is an int ≥ 1."""
    for name in names:
        v = options[name]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InputError(f"{name} must be a positive integer, got {v!r}")


def check_score(options: dict[str, Any]) -> None:
    """Raise :class:`InputError` unless ``options["score"]`` is one of :data:`SCORE_KINDS`."""
    check_choices(options, score=SCORE_KINDS)


def resolve(target: Target, logits: Tensor) -> Target:
    """The target resolved against ``logits`` (and called once, so a bad target fails before any sampling)."""
    tgt = Explainer.resolve_target(target, logits)
    tgt(logits)
    return tgt


def target_scores(logits: Tensor, target: Target, index: int, kind: str) -> Tensor:
    """Scores ``(n,)`` of ``n`` model outputs that all belong to image ``index`` of the (resolved) ``target``.

    ``kind="probability"``: softmax probability of the image's target class; ``kind="target"``: the target's own
    score (``target.select`` restricted to that image, repeated over the rows).
    """
    if kind == "probability":
        if logits.ndim != 2:
            raise TargetError(f"score='probability' needs classifier logits (B, K), got shape {tuple(logits.shape)}; "
                              "use score='target' (e.g. with a SegmentationTarget)")
        cls = torch.full((logits.shape[0],), int(target.resolved_classes()[index]), dtype=torch.long,
                         device=logits.device)
        return class_score(logits, cls, "probability")
    rows = torch.full((logits.shape[0],), index, dtype=torch.long, device=target.resolved_classes().device)
    return target.select(rows)(logits).float()


def score_token_subsets(adapter: Adapter, image: Tensor, keep: Tensor, target: Target, index: int, kind: str,
                        batch_size: int) -> Tensor:
    """Scores ``(M,)`` of the model run on ``M`` subsets of the patch tokens of one image.

    ``keep``: ``(M, k)`` long indices of the kept patch tokens (row-major on the token grid). At most ``batch_size``
    subsets per forward call; each call runs the image repeated once per subset under :meth:`Adapter.keep_tokens`.
    """
    out = []
    for start in range(0, keep.shape[0], batch_size):
        rows = keep[start:start + batch_size]
        with adapter.keep_tokens(rows):
            logits = adapter.forward(image[None].expand(rows.shape[0], *image.shape))
        out.append(target_scores(logits, target, index, kind))
    return torch.cat(out)


def coverage_average(masks: Tensor, scores: Tensor) -> Tensor:
    """``Σ_m scores_m · masks_m / Σ_m masks_m`` per token, ``(N,)``; tokens that no mask covers get 0."""
    coverage = masks.sum(dim=0)
    raw = scores.to(masks.dtype) @ masks
    return torch.where(coverage > 0, raw / coverage.clamp_min(1e-12), torch.zeros_like(raw))


def score_needs(score: str) -> tuple[str, ...]:
    """What a perturbation method's ``score`` option needs of the model: ``'probability'`` (a softmax over classes)
    needs class logits ``(B, K)``; the other scores read the target's own score."""
    return (CLASS_LOGITS,) if score == "probability" else ()
