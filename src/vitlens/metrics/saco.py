"""SaCo, the salience-guided faithfulness coefficient (Wu et al., CVPR 2024, "On the Faithfulness of Vision
Transformer Explanations").

Insertion and deletion perturb cumulatively, so the effect of the top 10 % of the pixels is mixed into every later
step, and they read only the map's ranking. SaCo perturbs ``K`` groups of features *separately* and weighs every pair
of groups by how much more salience the map gives one than the other:

1. rank the features (pixels, or patches scored by the map's mean over them) by salience, descending (stable: ties
   in raster order), and cut the ranking into ``K`` groups of equal size ``G_1 … G_K`` (``G_1`` the most salient);
   ``s(G_k)`` = the sum of the map over the group's features;
2. for each group alone, replace its pixels by the baseline (the paper's: the image's own per-channel mean) and
   record ``Δ_k = p(y|x) − p(y|x with G_k replaced)`` (``score="logit"``: logits);
3. ``F = Σ_{i<j} σ_ij (s(G_i) − s(G_j)) / Σ_{i<j} |s(G_i) − s(G_j)|`` with ``σ_ij = +1`` if ``Δ_i ≥ Δ_j`` (the more
   salient group matters at least as much) and ``−1`` otherwise.

``F ∈ [−1, 1]``, higher is better: ``1`` when every more salient group changes the prediction at least as much as
every less salient one, ``−1`` when the order is reversed throughout. A map whose groups all have the same salience
(a constant map) gives no pair a weight: ``NaN`` (skipped by :meth:`MetricResult.mean`).

Cost: ``K + 1`` forwards per image, batched with the other images (``batch_size`` per call). Protocol and defaults:
``docs/metrics.md`` ("SaCo").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..images import DataConfig
from ..targets import TargetSpec
from ._perturbation_engine import (
    BASELINES,
    MetricInputs,
    PerturbationMetric,
    SharedScores,
    choice,
    feature_ranks,
    granularity_setting,
    pixel_ranks,
    positive_int,
)
from .base import MetricResult, register_metric

__all__ = ["SaCo", "saco_coefficient", "SACO_BASELINES"]

#: the replacement values SaCo offers: the paper's per-image channel mean, or one of the engine's baselines
SACO_BASELINES = ("sample_mean", *BASELINES)


def saco_coefficient(salience: Tensor, delta: Tensor) -> Tensor:
    """``F`` per image from the groups' salience ``s`` ``(B, K)`` (most salient group first) and their effects
    ``Δ`` ``(B, K)``: ``Σ_{i<j} σ_ij (s_i − s_j) / Σ_{i<j} |s_i − s_j|`` (``σ_ij = +1`` if ``Δ_i ≥ Δ_j``, else
    ``−1``); ``NaN`` where every weight is 0."""
    k = salience.shape[1]
    upper = torch.triu(torch.ones(k, k, dtype=torch.bool, device=salience.device), diagonal=1)
    weight = (salience[:, :, None] - salience[:, None, :]).double()
    sign = torch.where(delta[:, :, None] >= delta[:, None, :], 1.0, -1.0).double()
    num = (sign * weight * upper).sum(dim=(1, 2))
    den = (weight.abs() * upper).sum(dim=(1, 2))
    return torch.where(den > 0, num / den.clamp_min(torch.finfo(torch.float64).tiny), float("nan")).float()


@register_metric
class SaCo(PerturbationMetric):
    """Salience-guided faithfulness coefficient (Wu et al., CVPR 2024); see the module docstring.

    Settings: ``groups`` ``K`` (default 10, the paper's); ``granularity`` ``"pixel"`` (default, the paper ranks
    pixels), ``"patch"`` (the model's patch size) or a patch size in pixels; ``baseline`` ``"sample_mean"`` (default:
    each image's per-channel mean, the paper's) or one of the engine's ``black``, ``mean``, ``blur``, ``noise`` (with
    ``mean_color``, ``blur_kernel``, ``blur_sigma``, ``noise_seed``); ``score`` ``"probability"`` (default: the
    softmax probability of the target class, the paper's) or ``"logit"``; ``data_config`` (pixel mean/std of the
    model, for the engine's baselines); ``batch_size`` (forwards per call, a cost knob).

    Output: ``saco`` (higher is better, in ``[−1, 1]``). Curves: ``delta`` (the groups' ``Δ_k``) and ``salience``
    (``s(G_k)``), ``(B, K)``, most salient group first (``curve_x`` = 1..K).
    """

    name = "saco"
    outputs = {"saco": True}

    def __init__(self, groups: int = 10, *, granularity: str | int | Sequence[int] = "pixel",
                 baseline: str = "sample_mean", score: str = "probability", blur_kernel: int = 11,
                 blur_sigma: float = 5.0, mean_color: Sequence[float] | None = None, noise_seed: int = 0,
                 data_config: DataConfig | Mapping[str, Any] | None = None, batch_size: int = 64) -> None:
        settings: dict[str, Any] = {
            "groups": positive_int("groups", groups, minimum=2),
            "granularity": granularity_setting(granularity),
            "baseline": choice("baseline", baseline, SACO_BASELINES),
            "score": choice("score", score, ("probability", "logit"))}
        super().__init__(batch_size, settings, (mean_color, blur_kernel, blur_sigma, noise_seed), data_config)

    def compute(self, maps: Tensor, *, model: nn.Module | None = None, x: Tensor | None = None,
                targets: TargetSpec = None, shared: SharedScores | None = None, **_: Any) -> MetricResult:
        inp = MetricInputs(self, maps, model, x, targets, shared)
        s, b = self.settings, inp.batch
        w, grid, size, hw = inp.features(s["granularity"])
        n = w.shape[1]
        k = min(s["groups"], n)
        ranks = pixel_ranks(feature_ranks(w, descending=True), grid, size, hw)
        bounds = torch.tensor([(g * n) // k for g in range(k + 1)], device=inp.device)
        ordered = torch.sort(w, dim=1, descending=True, stable=True).values.double()
        cum = torch.cat([ordered.new_zeros(b, 1), ordered.cumsum(dim=1)], dim=1)
        salience = (cum[:, bounds[1:]] - cum[:, bounds[:-1]]).float()  # (B, K): s(G_k), most salient first
        if s["baseline"] == "sample_mean":
            sources = torch.cat([inp.x, inp.x.mean(dim=(2, 3), keepdim=True).expand_as(inp.x)])
        else:
            sources = inp.sources([s["baseline"]], s)
        jobs, j_orig, img = inp.jobs_with_originals()
        per = img.repeat_interleave(k)
        group = torch.arange(k, device=inp.device).repeat(b)
        j_grp = jobs.add(row=per, lo=bounds[group], hi=bounds[group + 1], top=per + b, rest=per,
                         target=inp.targets.repeat_interleave(k))
        out = inp.score(sources, ranks, jobs, s["score"], self.batch_size)
        delta = out[j_orig][:, None] - out[j_grp].view(b, k)  # (B, K)
        resolved = {**self._resolved(inp, size, n), "groups_used": k}
        return self._result({"saco": saco_coefficient(salience, delta)}, resolved,
                            curves={"delta": delta, "salience": salience},
                            curve_x=torch.arange(1, k + 1, dtype=torch.float32))
