"""Perturbation metrics: change the input where the map points and measure what the model does.

* :class:`InsertionDeletion` — Petsiuk et al., RISE (BMVC 2018); presets ``rise``, ``aha``, ``aha_authors``,
  ``mutex``.
* :class:`PositiveNegativePerturbation` — Chefer et al. (CVPR 2021).
* :class:`FaithfulnessViolation` — Liu et al. (ICML 2022), with the top-k variant.

All three share one engine. Features (pixels, or patches whose score is the mean of the map over the patch)
are ranked once per image; every perturbed input of a curve is then ``where(lo <= rank < hi, top, rest)`` — a mask
computed from the ranks, no Python loop over pixels — between two source images (the image and a baseline); the
steps of one image are built by one broadcast comparison into a reused input buffer. The perturbed inputs of all
steps *and* all images are batched (at most ``batch_size`` per forward) under :func:`torch.no_grad`, on the maps'
device, with the model in eval mode (its modes are restored afterwards).

**Ranking and ties.** Features are sorted by score, descending (ascending for "least relevant first") with a
*stable* sort, so features with equal scores keep their raster order: the feature with the lower flat index
(row-major, top-left first) ranks first. A constant map therefore perturbs the image in raster order, top-left
first — a deterministic result that says nothing about the map (see ``docs/metrics.md``).

**Baselines** are built in pixel space with the model's data config (:func:`vitlens.images.data_config`) and then
normalised: ``black`` = pixel 0, i.e. ``(0 - mean) / std`` in the model's input; ``mean`` = the colour
``mean_color`` (default: the config's mean, i.e. 0 after normalisation); ``blur`` = the image (pixel space) blurred
by a separable Gaussian of ``blur_kernel`` taps (odd) and standard deviation ``blur_sigma`` pixels, weights
normalised to sum 1, edges replicated; ``noise`` = uniform ``[0, 1)`` pixels drawn from a CPU generator seeded with
``noise_seed`` — one noise image shared by every image of the batch, the same on every device, so a batch gives
the results of one-by-one calls.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import InputError
from ..images import DataConfig
from ..targets import TargetSpec
from ._perturbation_engine import (
    BASELINES,
    BLUR_PADDINGS,
    MetricInputs,
    PerturbationMetric,
    SharedScores,
    choice,
    feature_ranks,
    feature_scores,
    gaussian_blur,
    granularity_setting,
    make_baseline,
    pixel_ranks,
    positive_int,
    trapezoid,
)
from .base import MetricResult, register_metric

__all__ = [
    "InsertionDeletion",
    "PositiveNegativePerturbation",
    "FaithfulnessViolation",
    "SharedScores",
    "BASELINES",
    "make_baseline",
    "gaussian_blur",
    "feature_scores",
    "feature_ranks",
]

#: the kinds of :func:`vitlens.targets.class_score` each metric offers.
_SCORES_ID = ("probability", "logit")
_SCORES_PN = ("accuracy", "probability")


# --------------------------------------------------------------------------------------------------------------------
# Insertion / deletion
# --------------------------------------------------------------------------------------------------------------------

_ID_DEFAULTS: dict[str, Any] = {
    "steps": 224, "granularity": "pixel", "deletion_baseline": "black", "insertion_baseline": "blur",
    "score": "probability", "blur_kernel": 11, "blur_sigma": 5.0, "mean_color": None, "noise_seed": 0,
    "blur_padding": "replicate", "insertion": "restore", "abscissa": "perturbed",
}

#: how :class:`InsertionDeletion` builds its insertion curve: ``restore`` (the top-ranked features put back onto the
#: insertion baseline) or ``least_first`` (the AHA authors' "ascending" deletion: the *least* important features
#: replaced by the deletion baseline first, ranked by a stable ascending sort)
INSERTIONS = ("restore", "least_first")
#: the abscissa of the curves: the ``perturbed`` fraction ``k_i / N`` or the ``nominal`` one ``i / steps`` (the AHA
#: authors' trapezoid; the two differ by the rounding of ``k_i``, below ``1 / (2N)``)
ABSCISSAS = ("perturbed", "nominal")

#: presets of :class:`InsertionDeletion` (settings not listed take the defaults above).
ID_PRESETS: dict[str, dict[str, Any]] = {
    # Petsiuk et al.: 224 steps of 224 pixels at 224 px; deletion → black, insertion → blur (k=11, σ=5).
    "rise": {"steps": 224, "granularity": "pixel", "deletion_baseline": "black", "insertion_baseline": "blur",
             "blur_kernel": 11, "blur_sigma": 5.0, "score": "probability"},
    # AHA: 21 points (20 steps of 5 %), pixel level, the dataset-mean colour as reference for both curves.
    "aha": {"steps": 20, "granularity": "pixel", "deletion_baseline": "mean", "insertion_baseline": "mean",
            "score": "probability"},
    # The AHA authors' evaluation code (GitHub dschinagl/AHA, scripts/eval.py with PixelAUCMetric): 21 points, pixel
    # ranking, their constant ImageNet mean colour (black and their 37-tap σ 37 reflect-padded blur by
    # deletion_baseline=), deletion most-important-first ("auc_desc") and least-important-first ("auc_asc").
    "aha_authors": {"steps": 20, "granularity": "pixel", "deletion_baseline": "mean", "insertion_baseline": "mean",
                    "score": "probability", "mean_color": (0.485, 0.456, 0.406), "blur_kernel": 37,
                    "blur_sigma": 37.0, "blur_padding": "reflect", "insertion": "least_first",
                    "abscissa": "nominal"},
    # MUTEX-style harnesses: 0 % then 10 %, 20 %, …, 100 % of the model's patches, black for both curves.
    "mutex": {"steps": 10, "granularity": "patch", "deletion_baseline": "black", "insertion_baseline": "black",
              "score": "probability"},
}


@register_metric
class InsertionDeletion(PerturbationMetric):
    """Insertion and deletion curves and their areas (Petsiuk et al., BMVC 2018).

    Features (pixels, or ``granularity``-sized patches scored by the mean of the map) are ranked by the map,
    descending, ties by raster index. Step ``i`` of ``steps`` perturbs the ``k_i = round(i·N/steps)`` top-ranked of
    the ``N`` features (``round`` half up; ``k_0 = 0``, ``k_steps = N``). Deletion starts from the image and replaces
    them by ``deletion_baseline``; insertion starts from ``insertion_baseline`` and restores them from the image. The
    score at each point is the softmax probability (``score="probability"``) or logit (``"logit"``) of the target
    class; the areas are trapezoids over the fraction ``k_i / N`` in ``[0, 1]``.

    Outputs: ``insertion`` (higher is better), ``deletion`` (lower is better), ``ins_minus_del`` (higher is better).
    Curves ``(B, steps + 1)`` under ``curves["insertion"]`` / ``["deletion"]``, abscissa ``curve_x`` = ``k_i / N``.

    Cost: ``2·steps + 1`` forward passes per image (``2·steps`` when both curves use the same baseline, whose
    all-baseline input is then shared), at most ``batch_size`` images per forward.

    ``insertion="least_first"`` (the ``aha_authors`` preset): the insertion curve is the deletion of the *least*
    important features first (a stable ascending sort; ties by raster index), towards ``deletion_baseline`` — the
    AHA authors' ``auc_asc``, higher is better. ``insertion`` is its area, ``curves["least_first"]`` its curve
    (from the image to the baseline) and ``curves["insertion"]`` the same read backwards. Without ties in the map
    it equals ``restore`` with the same baseline; with ties the two order the tied features differently.
    ``deletion`` is then their ``auc_desc``.

    Args:
        preset: ``"rise"``, ``"aha"`` or ``"mutex"`` (see :data:`ID_PRESETS`); explicit arguments override it, and
            the overridden keys are listed in the protocol under ``preset_overrides``.
        steps: number of steps (the curves have ``steps + 1`` points).
        granularity: ``"pixel"``, ``"patch"`` (the model's patch size) or a patch size in pixels.
        deletion_baseline, insertion_baseline: one of :data:`BASELINES`.
        score: ``"probability"`` or ``"logit"``.
        blur_kernel, blur_sigma: the ``blur`` baseline's Gaussian; blur_padding: ``"replicate"`` or ``"reflect"``
            edges. mean_color: RGB pixel values of the ``mean`` baseline (default: the data config's mean).
            noise_seed: seed of the ``noise`` baseline. insertion: ``"restore"`` or ``"least_first"`` (above).
            abscissa: ``"perturbed"`` (``k_i / N``) or ``"nominal"`` (``i / steps``). ``blur_padding``,
            ``insertion`` and ``abscissa`` appear in the protocol only when not the default.
        data_config: the pixel mean/std to use (default: derived from the model).
        batch_size: most images per forward (cost knob; results do not depend on it).
    """

    name = "insertion_deletion"
    outputs = {"insertion": True, "deletion": False, "ins_minus_del": True}

    def __init__(self, preset: str | None = None, *, steps: int | None = None,
                 granularity: str | int | Sequence[int] | None = None, deletion_baseline: str | None = None,
                 insertion_baseline: str | None = None, score: str | None = None, blur_kernel: int | None = None,
                 blur_sigma: float | None = None, mean_color: Sequence[float] | None = None,
                 noise_seed: int | None = None, data_config: DataConfig | Mapping[str, Any] | None = None,
                 batch_size: int = 64, blur_padding: str | None = None, insertion: str | None = None,
                 abscissa: str | None = None) -> None:
        given = {"steps": steps, "granularity": granularity, "deletion_baseline": deletion_baseline,
                 "insertion_baseline": insertion_baseline, "score": score, "blur_kernel": blur_kernel,
                 "blur_sigma": blur_sigma, "mean_color": mean_color, "noise_seed": noise_seed,
                 "blur_padding": blur_padding, "insertion": insertion, "abscissa": abscissa}
        given = {k: v for k, v in given.items() if v is not None}
        base = dict(_ID_DEFAULTS)
        overrides: list[str] = []
        if preset is not None:
            if not isinstance(preset, str) or preset not in ID_PRESETS:
                raise InputError(f"unknown preset {preset!r}; available: {', '.join(sorted(ID_PRESETS))}")
            base.update(ID_PRESETS[preset])
            plain = lambda v: list(v) if isinstance(v, tuple) else v  # noqa: E731 (a colour as tuple or list)
            overrides = sorted(k for k, v in given.items() if plain(base.get(k)) != plain(v))
        base.update(given)
        settings: dict[str, Any] = {"preset": preset}
        if preset is not None:
            settings["preset_overrides"] = overrides
        settings["steps"] = positive_int("steps", base["steps"])
        settings["granularity"] = granularity_setting(base["granularity"])
        settings["deletion_baseline"] = choice("deletion_baseline", base["deletion_baseline"], BASELINES)
        settings["insertion_baseline"] = choice("insertion_baseline", base["insertion_baseline"], BASELINES)
        settings["score"] = choice("score", base["score"], _SCORES_ID)
        for key, options in (("blur_padding", BLUR_PADDINGS), ("insertion", INSERTIONS), ("abscissa", ABSCISSAS)):
            if choice(key, base[key], options) != _ID_DEFAULTS[key]:  # earlier protocols stay as they were
                settings[key] = base[key]
        super().__init__(batch_size, settings, (base["mean_color"], base["blur_kernel"], base["blur_sigma"],
                                                base["noise_seed"]), data_config)

    @classmethod
    def presets(cls) -> dict[str, dict[str, Any]]:
        """The presets' settings (copies)."""
        return {k: dict(v) for k, v in ID_PRESETS.items()}

    def compute(self, maps: Tensor, *, model: nn.Module | None = None, x: Tensor | None = None,
                targets: TargetSpec = None, shared: SharedScores | None = None, **_: Any) -> MetricResult:
        inp = MetricInputs(self, maps, model, x, targets, shared)
        s, b = self.settings, inp.batch
        scores, grid, size, hw = inp.features(s["granularity"])
        n = grid[0] * grid[1]
        ranks = pixel_ranks(feature_ranks(scores), grid, size, hw)
        steps = s["steps"]
        ks = (2 * torch.arange(steps + 1, device=inp.device) * n + steps) // (2 * steps)  # round half up
        if s.get("insertion") == "least_first":
            return self._least_first(inp, scores, grid, size, hw, ranks, ks)
        same = s["deletion_baseline"] == s["insertion_baseline"]
        kinds = [s["deletion_baseline"]] + ([] if same else [s["insertion_baseline"]])
        src = inp.sources(kinds, s)
        ins_off = b if same else 2 * b
        tgt = inp.targets
        zero = torch.zeros(1, device=inp.device)
        jobs, j_orig, img = inp.jobs_with_originals()
        # the points that differ from the image, one row per (image, step), image-major (one segment per image)
        per = img.repeat_interleave(steps)
        j_del = jobs.add(row=per, lo=zero, hi=ks[1:].repeat(b), top=per + b, rest=per,
                         target=tgt.repeat_interleave(steps))
        first_ins = 1 if same else 0  # with a shared baseline, insertion's first point is deletion's last
        reps = steps - first_ins
        per = img.repeat_interleave(reps)
        j_ins = jobs.add(row=per, lo=zero, hi=ks[first_ins:steps].repeat(b), top=per, rest=per + ins_off,
                         target=tgt.repeat_interleave(reps)) if reps else None
        out = inp.score(src, ranks, jobs, s["score"], self.batch_size)
        orig = out[j_orig]
        deletion = torch.cat([orig[:, None], out[j_del].view(b, steps)], dim=1)
        ins_pts = out[j_ins].view(b, reps) if j_ins is not None else orig.new_zeros(b, 0)
        if same:
            ins_pts = torch.cat([deletion[:, -1:], ins_pts], dim=1)
        insertion = torch.cat([ins_pts, orig[:, None]], dim=1)
        xs = self._abscissa(ks, n)
        ins_auc, del_auc = trapezoid(insertion, xs), trapezoid(deletion, xs)
        resolved = self._resolved(inp, size, n)
        return self._result({"insertion": ins_auc, "deletion": del_auc, "ins_minus_del": ins_auc - del_auc},
                            resolved, curves={"insertion": insertion, "deletion": deletion},
                            curve_x=xs.float())


    def _abscissa(self, ks: Tensor, n: int) -> Tensor:
        """The curves' abscissa ``(steps + 1,)`` float64: ``k_i / N``, or ``i / steps`` when ``nominal``."""
        if self.settings.get("abscissa") == "nominal":
            return torch.arange(ks.numel(), device=ks.device, dtype=torch.float64) / (ks.numel() - 1)
        return ks.double() / n

    def _least_first(self, inp: MetricInputs, scores: Tensor, grid: tuple[int, int], size: tuple[int, int],
                     hw: tuple[int, int], desc: Tensor, ks: Tensor) -> MetricResult:
        """Deletion most-important-first and least-important-first, both towards ``deletion_baseline``."""
        s, b = self.settings, inp.batch
        n = grid[0] * grid[1]
        steps = s["steps"]
        ranks = torch.cat([desc, pixel_ranks(feature_ranks(scores, descending=False), grid, size, hw)])
        src = inp.sources([s["deletion_baseline"]], s)
        zero = torch.zeros(1, device=inp.device)
        jobs, j_orig, img = inp.jobs_with_originals()
        per, kk, tg = img.repeat_interleave(steps), ks[1:].repeat(b), inp.targets.repeat_interleave(steps)
        j_del = jobs.add(row=per, lo=zero, hi=kk, top=per + b, rest=per, target=tg)
        j_asc = jobs.add(row=per + b, lo=zero, hi=kk, top=per + b, rest=per, target=tg)
        out = inp.score(src, ranks, jobs, s["score"], self.batch_size)
        orig = out[j_orig][:, None]
        deletion = torch.cat([orig, out[j_del].view(b, steps)], dim=1)
        least = torch.cat([orig, out[j_asc].view(b, steps)], dim=1)
        xs = self._abscissa(ks, n)
        del_auc, asc_auc = trapezoid(deletion, xs), trapezoid(least, xs)
        return self._result({"insertion": asc_auc, "deletion": del_auc, "ins_minus_del": asc_auc - del_auc},
                            self._resolved(inp, size, n), curves={"insertion": least.flip(1), "deletion": deletion,
                                                                   "least_first": least}, curve_x=xs.float())


# --------------------------------------------------------------------------------------------------------------------
# Positive / negative perturbation
# --------------------------------------------------------------------------------------------------------------------


@register_metric
class PositiveNegativePerturbation(PerturbationMetric):
    """Positive and negative perturbation (Chefer et al., CVPR 2021).

    Features (pixels by default) are ranked by the map: most relevant first for the *positive* curve, least relevant
    first for the *negative* one (stable sorts, so ties go by raster index in both — a constant map gives equal
    curves). For each fraction ``f`` in ``fractions`` (default 0.1, 0.2, …, 0.9) the ``k = floor(f·N)`` first
    features are replaced by ``baseline`` (default ``black``, pixel 0 before normalisation). The score is top-1
    accuracy w.r.t. the target class (1 if the model's argmax — lowest index on ties — is the target, else 0;
    ``score="probability"``: its softmax probability). The curves start with the unperturbed image at ``x = 0`` and
    have abscissa ``k / N``; the areas are trapezoids over that abscissa, **not rescaled** (so with the default
    fractions a model that keeps its prediction throughout scores 0.9; divide by 0.9 for a mean accuracy).

    Outputs: ``pos_auc`` (lower is better), ``neg_auc`` (higher is better), ``neg_minus_pos`` (higher is better).
    Curves ``curves["positive"]`` / ``["negative"]`` ``(B, len(fractions) + 1)``.

    Cost: ``2·len(fractions) + 1`` forward passes per image, batched.
    """

    name = "pos_neg_perturbation"
    outputs = {"pos_auc": False, "neg_auc": True, "neg_minus_pos": True}

    def __init__(self, fractions: Sequence[float] = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9), *,
                 score: str = "accuracy", baseline: str = "black", granularity: str | int | Sequence[int] = "pixel",
                 blur_kernel: int = 11, blur_sigma: float = 5.0, mean_color: Sequence[float] | None = None,
                 noise_seed: int = 0, data_config: DataConfig | Mapping[str, Any] | None = None,
                 batch_size: int = 64) -> None:
        try:
            fr = [float(f) for f in fractions]
        except (TypeError, ValueError):
            fr = []
        if not fr or not all(0 < f <= 1 for f in fr) or any(b <= a for a, b in zip(fr, fr[1:])):
            raise InputError(f"fractions must be increasing numbers in (0, 1]; got {fractions!r}")
        settings: dict[str, Any] = {"fractions": fr, "score": choice("score", score, _SCORES_PN),
                                    "baseline": choice("baseline", baseline, BASELINES),
                                    "granularity": granularity_setting(granularity)}
        super().__init__(batch_size, settings, (mean_color, blur_kernel, blur_sigma, noise_seed), data_config)

    def compute(self, maps: Tensor, *, model: nn.Module | None = None, x: Tensor | None = None,
                targets: TargetSpec = None, shared: SharedScores | None = None, **_: Any) -> MetricResult:
        inp = MetricInputs(self, maps, model, x, targets, shared)
        s, b = self.settings, inp.batch
        scores, grid, size, hw = inp.features(s["granularity"])
        n = scores.shape[1]
        pos = pixel_ranks(feature_ranks(scores, descending=True), grid, size, hw)
        neg = pixel_ranks(feature_ranks(scores, descending=False), grid, size, hw)
        ranks = torch.cat([pos, neg])
        ks = torch.tensor([0] + [math.floor(f * n + 1e-9) for f in s["fractions"]], device=inp.device)
        m = len(s["fractions"])
        src = inp.sources([s["baseline"]], s)
        zero = torch.zeros(1, device=inp.device)
        jobs, j_orig, img = inp.jobs_with_originals()
        kk, per, tg = ks[1:].repeat(b), img.repeat_interleave(m), inp.targets.repeat_interleave(m)
        j_pos = jobs.add(row=per, lo=zero, hi=kk, top=per + b, rest=per, target=tg)
        j_neg = jobs.add(row=per + b, lo=zero, hi=kk, top=per + b, rest=per, target=tg)
        out = inp.score(src, ranks, jobs, s["score"], self.batch_size)
        orig = out[j_orig][:, None]
        positive = torch.cat([orig, out[j_pos].view(b, m)], dim=1)
        negative = torch.cat([orig, out[j_neg].view(b, m)], dim=1)
        xs = ks.double() / n
        pos_auc, neg_auc = trapezoid(positive, xs), trapezoid(negative, xs)
        return self._result({"pos_auc": pos_auc, "neg_auc": neg_auc, "neg_minus_pos": neg_auc - pos_auc},
                            self._resolved(inp, size, n), curves={"positive": positive, "negative": negative},
                            curve_x=xs.float())


# --------------------------------------------------------------------------------------------------------------------
# Faithfulness violation
# --------------------------------------------------------------------------------------------------------------------


@register_metric
class FaithfulnessViolation(PerturbationMetric):
    """Faithfulness violation test (Liu et al., ICML 2022), with the top-k variant.

    Features are patches of ``patch_size`` pixels (default: the model's patch size; 1 = pixels) with weight
    ``w`` = the mean of the map over the patch, sign kept, ordered by ``|w|`` descending (stable: ties by raster
    index). For each of the ``k`` strongest features *separately* (default ``k = 1``: the top feature only), that
    one feature is replaced by ``baseline`` (default ``black``) and ``Δ = s(x) − s(x without the feature)`` with
    ``s`` the softmax probability of the target class (``score="logit"``: its logit). The feature violates if
    ``w·Δ < 0`` — the map's sign disagrees with the measured effect. Per image, ``violation`` = violating features /
    counted features; features with ``w = 0`` carry no sign and are not counted, and an image with no counted
    feature (an all-zero map) gets NaN (skipped by :meth:`MetricResult.mean`). With ``k = 1`` the mean over images
    is the paper's violation ratio. Pass the predicted class as ``targets`` to follow the paper (``ŷ``).

    Output: ``violation`` (lower is better). Curves ``curves["delta"]`` and ``curves["weight"]`` ``(B, k)`` by
    feature rank (``curve_x`` = 1..k).

    Cost: ``k + 1`` forward passes per image, batched.
    """

    name = "faithfulness_violation"
    outputs = {"violation": False}

    def __init__(self, k: int = 1, *, patch_size: int | Sequence[int] | None = None, score: str = "probability",
                 baseline: str = "black", blur_kernel: int = 11, blur_sigma: float = 5.0,
                 mean_color: Sequence[float] | None = None, noise_seed: int = 0,
                 data_config: DataConfig | Mapping[str, Any] | None = None, batch_size: int = 64) -> None:
        settings: dict[str, Any] = {
            "k": positive_int("k", k),
            "patch_size": "patch" if patch_size is None else granularity_setting(patch_size),
            "score": choice("score", score, _SCORES_ID), "baseline": choice("baseline", baseline, BASELINES)}
        if settings["patch_size"] == "pixel":
            settings["patch_size"] = 1
        super().__init__(batch_size, settings, (mean_color, blur_kernel, blur_sigma, noise_seed), data_config)

    def compute(self, maps: Tensor, *, model: nn.Module | None = None, x: Tensor | None = None,
                targets: TargetSpec = None, shared: SharedScores | None = None, **_: Any) -> MetricResult:
        inp = MetricInputs(self, maps, model, x, targets, shared)
        s, b = self.settings, inp.batch
        w, grid, size, hw = inp.features(s["patch_size"])
        n = w.shape[1]
        k = min(s["k"], n)
        order_ranks = feature_ranks(w.abs(), descending=True)
        ranks = pixel_ranks(order_ranks, grid, size, hw)
        order = torch.sort(w.abs(), dim=1, descending=True, stable=True).indices[:, :k]
        w_top = w.gather(1, order)  # (B, k), signed
        src = inp.sources([s["baseline"]], s)
        jobs, j_orig, img = inp.jobs_with_originals()
        lo = torch.arange(k, device=inp.device).repeat(b)
        per = img.repeat_interleave(k)
        j_rm = jobs.add(row=per, lo=lo, hi=lo + 1, top=per + b, rest=per, target=inp.targets.repeat_interleave(k))
        out = inp.score(src, ranks, jobs, s["score"], self.batch_size)
        delta = out[j_orig][:, None] - out[j_rm].view(b, k)  # (B, k)
        wt = w_top.to(delta.dtype)
        counted = wt != 0
        violated = (wt * delta < 0) & counted
        n_counted = counted.sum(dim=1)
        ratio = violated.sum(dim=1).float() / n_counted.clamp_min(1).float()
        ratio = torch.where(n_counted > 0, ratio, torch.full_like(ratio, float("nan")))
        resolved = {**self._resolved(inp, size, n), "k_used": k}
        return self._result({"violation": ratio}, resolved, curves={"delta": delta, "weight": wt},
                            curve_x=torch.arange(1, k + 1, dtype=torch.float32))
