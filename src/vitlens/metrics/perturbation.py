"""Perturbation metrics: change the input where the map points and measure what the model does.

* :class:`InsertionDeletion` — Petsiuk et al., RISE (BMVC 2018); presets ``rise``, ``aha``, ``mutex``.
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
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import InputError, TargetError, VitlensError
from ..images import DataConfig, data_config
from ..models import Adapter, get_adapter
from ..targets import Target, TargetSpec, class_score
from .base import Metric, MetricResult, check_maps, register_metric

__all__ = [
    "InsertionDeletion",
    "PositiveNegativePerturbation",
    "FaithfulnessViolation",
    "BASELINES",
    "make_baseline",
    "gaussian_blur",
    "feature_scores",
    "feature_ranks",
]

#: baseline kinds understood by every perturbation metric.
BASELINES = ("black", "mean", "blur", "noise")
#: the kinds of :func:`vitlens.targets.class_score` each metric offers.
_SCORES_ID = ("probability", "logit")
_SCORES_PN = ("accuracy", "probability")


class _TargetRangeError(TargetError, InputError):
    """A target class outside the model's output (both a :class:`TargetError` and an :class:`InputError`)."""


# --------------------------------------------------------------------------------------------------------------------
# Baselines (pixel space, then normalised)
# --------------------------------------------------------------------------------------------------------------------


def gaussian_blur(images: Tensor, kernel: int, sigma: float) -> Tensor:
    """Separable Gaussian blur of ``(B, C, H, W)`` images: ``kernel`` taps (odd), ``sigma`` in pixels.

    Tap weights ``exp(-d² / 2σ²)`` for ``d = -(kernel//2) .. kernel//2``, normalised to sum 1; borders are extended
    by replicating the edge pixels. Same shape, dtype and device out.
    """
    r = kernel // 2
    d = torch.arange(-r, r + 1, dtype=torch.float64)
    w = torch.exp(-(d**2) / (2.0 * float(sigma) ** 2))
    w = (w / w.sum()).to(device=images.device, dtype=images.dtype)
    c = images.shape[1]
    out = F.pad(images, (r, r, r, r), mode="replicate")
    out = F.conv2d(out, w.view(1, 1, 1, -1).expand(c, 1, 1, -1), groups=c)
    return F.conv2d(out, w.view(1, 1, -1, 1).expand(c, 1, -1, 1), groups=c)


def make_baseline(kind: str, x: Tensor, cfg: DataConfig, *, mean_color: Sequence[float] | None = None,
                  blur_kernel: int = 11, blur_sigma: float = 5.0, noise_seed: int = 0) -> Tensor:
    """The baseline ``(B, 3, H, W)`` for the normalised batch ``x``, in the model's input space.

    ``kind`` is one of :data:`BASELINES` (see the module doc for each). ``cfg`` gives the ``mean``/``std`` used to go
    to pixel space and back.
    """
    mean = torch.tensor(cfg.mean, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
    std = torch.tensor(cfg.std, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
    if kind == "black":
        pixels = torch.zeros_like(x)
    elif kind == "mean":
        colour = cfg.mean if mean_color is None else tuple(mean_color)
        pixels = torch.tensor(colour, dtype=x.dtype, device=x.device).view(1, 3, 1, 1).expand_as(x)
    elif kind == "blur":
        pixels = gaussian_blur(x * std + mean, blur_kernel, blur_sigma)
    elif kind == "noise":
        gen = torch.Generator().manual_seed(int(noise_seed))
        pixels = torch.rand((1, *x.shape[1:]), generator=gen, dtype=torch.float32).to(device=x.device, dtype=x.dtype)
        pixels = pixels.expand_as(x)
    else:  # validated in the constructors
        raise InputError(f"unknown baseline {kind!r}; expected one of {', '.join(BASELINES)}")
    return ((pixels - mean) / std).contiguous()


# --------------------------------------------------------------------------------------------------------------------
# Features and ranks
# --------------------------------------------------------------------------------------------------------------------


def feature_scores(maps: Tensor, size: tuple[int, int]) -> Tensor:
    """Mean of the maps ``(B, H, W)`` over ``size = (ph, pw)`` patches → ``(B, ceil(H/ph), ceil(W/pw))``.

    Patches tile the image from the top-left corner; a partial patch on the right/bottom edge averages the pixels it
    has. ``size = (1, 1)`` returns the maps unchanged.
    """
    ph, pw = size
    if (ph, pw) == (1, 1):
        return maps
    h, w = maps.shape[-2:]
    gh, gw = -(-h // ph), -(-w // pw)
    pad = (0, gw * pw - w, 0, gh * ph - h)
    total = F.pad(maps, pad).view(-1, gh, ph, gw, pw).sum(dim=(2, 4))
    ones = F.pad(torch.ones(1, h, w, dtype=maps.dtype, device=maps.device), pad)
    count = ones.view(1, gh, ph, gw, pw).sum(dim=(2, 4))
    return total / count


def feature_ranks(scores: Tensor, descending: bool = True) -> Tensor:
    """Rank of every feature, ``(B, F)`` long, 0 = first to be perturbed.

    Stable sort: equal scores keep their flat (raster) order, the lower index ranking first, in both directions.
    """
    order = torch.sort(scores, dim=1, descending=descending, stable=True).indices
    ranks = torch.empty_like(order)
    ranks.scatter_(1, order, torch.arange(order.shape[1], device=order.device).expand_as(order).contiguous())
    return ranks


def _pixel_ranks(ranks: Tensor, grid: tuple[int, int], size: tuple[int, int], hw: tuple[int, int]) -> Tensor:
    """Feature ranks ``(B, gh*gw)`` → the rank of each pixel's feature, ``(B, H*W)`` int32."""
    gh, gw = grid
    ph, pw = size
    r = ranks.view(-1, gh, gw)
    if (ph, pw) != (1, 1):
        r = r.repeat_interleave(ph, dim=1).repeat_interleave(pw, dim=2)[:, : hw[0], : hw[1]]
    return r.reshape(r.shape[0], -1).to(torch.int32).contiguous()


# --------------------------------------------------------------------------------------------------------------------
# The engine
# --------------------------------------------------------------------------------------------------------------------


class _Jobs:
    """Perturbed inputs to score, one row per input: pixels with ``lo <= rank[row] < hi`` come from source ``top``,
    the others from source ``rest``; the score is read for class ``target``."""

    def __init__(self) -> None:
        self.cols: dict[str, list[Tensor]] = {k: [] for k in ("row", "lo", "hi", "top", "rest", "target")}

    def add(self, **cols: Tensor) -> slice:
        n = self.count
        sizes = {int(v.numel()) for v in cols.values()}
        length = max(sizes)
        for k, v in cols.items():
            self.cols[k].append(v.reshape(-1).long().expand(length) if v.numel() == 1 else v.reshape(-1).long())
        return slice(n, n + length)

    @property
    def count(self) -> int:
        return sum(int(t.numel()) for t in self.cols["row"])

    def tensors(self) -> dict[str, Tensor]:
        return {k: torch.cat(v) for k, v in self.cols.items()}


def _run(adapter: Adapter, sources: Tensor, pixel_ranks: Tensor, jobs: dict[str, Tensor], kind: str,
         batch_size: int, targets: Tensor) -> Tensor:
    """Scores ``(J,)`` of all jobs, at most ``batch_size`` images per forward.

    Consecutive jobs that share their ranks row and sources form a segment, built by one broadcast
    ``where(lo <= rank < hi, top, rest)`` straight into a reused input buffer (no per-job gather of the sources).
    The first forward's output size is used to check ``targets`` (all of them) before any score is read.
    """
    _, c, h, w = sources.shape
    n = jobs["row"].numel()
    keys = list(zip(jobs["row"].tolist(), jobs["top"].tolist(), jobs["rest"].tolist()))
    lo_all, hi_all = jobs["lo"].tolist(), jobs["hi"].tolist()
    lo_t = jobs["lo"].to(pixel_ranks.dtype)[:, None]
    hi_t = jobs["hi"].to(pixel_ranks.dtype)[:, None]
    out = torch.empty(n, dtype=torch.float32, device=sources.device)
    buf = torch.empty((min(batch_size, n), c, h, w), dtype=sources.dtype, device=sources.device)
    for start in range(0, n, batch_size):
        stop = min(n, start + batch_size)
        inputs = buf[: stop - start]
        i = start
        while i < stop:
            j = i + 1
            while j < stop and keys[j] == keys[i]:
                j += 1
            row, top, rest = keys[i]
            dst = inputs[i - start : j - start]
            if top == rest:
                dst.copy_(sources[top].expand_as(dst))
            else:
                rank = pixel_ranks[row][None]
                mask = rank < hi_t[i:j]
                if any(v != 0 for v in lo_all[i:j]):
                    mask &= rank >= lo_t[i:j]
                elif all(v == 0 for v in hi_all[i:j]):
                    dst.copy_(sources[rest].expand_as(dst))
                    i = j
                    continue
                torch.where(mask.view(-1, 1, h, w), sources[top], sources[rest], out=dst)
            i = j
        logits = adapter.forward(inputs)
        if logits.ndim != 2 or logits.shape[0] != inputs.shape[0]:
            raise InputError(f"the model must return logits (B, K); got shape {tuple(logits.shape)}")
        if start == 0:
            _check_target_range(targets, int(logits.shape[1]))
        out[start:stop] = class_score(logits, jobs["target"][start:stop], kind)
    return out


def _targets(targets: Any, b: int, device: torch.device, adapter: Adapter, x: Tensor) -> Tensor:
    """Class indices ``(B,)`` from ints (one, a sequence or a tensor) or a :class:`~vitlens.targets.Target`.

    A target object gives the class it explains per image (resolved on one forward of the clean batch when it is not
    resolved yet, e.g. ``ClassLogit(None)`` = the predicted classes); the metric's own score is then read for that
    class. Only classifier targets apply (the metrics score classes of ``(B, K)`` logits).
    """
    if isinstance(targets, Target):
        if targets.classes is None:
            with torch.no_grad(), adapter.session(capture=False):
                logits = adapter.forward(x)
            if logits.ndim != 2:
                raise _TargetRangeError(f"the model must return logits (B, K); got shape {tuple(logits.shape)}")
            targets = targets.resolve(logits)
        if targets.classes is None or targets.classes.shape[0] != b:
            raise _TargetRangeError(f"the target was resolved for a batch of {len(targets.classes)}, not {b} images")
        targets = targets.classes
    if isinstance(targets, bool):
        raise _TargetRangeError("targets must be class indices (int), got a bool")
    try:
        t = torch.as_tensor(targets, device=device)
    except (TypeError, ValueError, RuntimeError) as e:
        raise _TargetRangeError(f"cannot read targets as class indices: {e}") from None
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise _TargetRangeError(f"targets must be integer class indices, got dtype {t.dtype}")
    t = t.reshape(-1).long()
    if t.numel() == 1 and b != 1:
        t = t.expand(b).clone()
    if t.numel() != b:
        raise _TargetRangeError(f"{t.numel()} targets given for a batch of {b} images")
    if bool((t < 0).any()):
        raise _TargetRangeError(f"target class {int(t[t < 0][0])} is negative")
    return t


def _check_target_range(t: Tensor, k: int) -> None:
    bad = t >= k
    if bool(bad.any()):
        raise _TargetRangeError(
            f"target class {int(t[bad][0])} is out of range for a model with {k} classes (valid: 0..{k - 1})"
        )


class _Inputs:
    """Validated inputs of one metric call (maps, x, targets, adapter, data config) on the maps' device."""

    def __init__(self, metric: _PerturbationMetric, maps: Tensor, model: Any, x: Any, targets: Any) -> None:
        if not isinstance(x, Tensor) or x.ndim != 4 or x.shape[1] != 3:
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise InputError(f"x must be the normalised model input (B, 3, H, W); got {shape}")
        if not x.is_floating_point():
            raise InputError(f"x must be floating point (the normalised model input), got {x.dtype}")
        if x.shape[0] == 0:
            raise InputError("x is an empty batch")
        self.maps = check_maps(maps, batch=x.shape[0], size=tuple(x.shape[-2:]))
        self.device = self.maps.device
        self.x = x.detach().to(self.device)
        if not bool(torch.isfinite(self.x).all()):
            raise InputError("x contains NaN or inf values")
        if not isinstance(model, nn.Module) and not isinstance(model, Adapter):
            raise InputError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.adapter = get_adapter(model)
        self.adapter.check_input(self.x)
        self.targets = _targets(targets, x.shape[0], self.device, self.adapter, self.x)
        cfg_setting = metric.settings.get("data_config")
        try:
            self.cfg = data_config(self.adapter.model if cfg_setting is None else cfg_setting)
        except VitlensError:
            raise InputError(
                f"metric '{metric.name}' needs the model's pixel mean/std for its baselines and cannot derive them "
                f"from {type(self.adapter.model).__name__}; pass data_config={{'mean': ..., 'std': ...}} to the "
                "metric or set model.vitlens_data_config"
            ) from None

    def feature_size(self, granularity: str | int | Sequence[int]) -> tuple[int, int]:
        if granularity == "pixel":
            return (1, 1)
        if granularity == "patch":
            ps = getattr(self.adapter, "patch_size", None)
            if ps is None:
                raise InputError(
                    f"granularity 'patch' needs the model's patch size, but {type(self.adapter.model).__name__} "
                    "has none; give the patch size in pixels instead (e.g. granularity=16)"
                )
            return (int(ps[0]), int(ps[1])) if isinstance(ps, (tuple, list)) else (int(ps), int(ps))
        if isinstance(granularity, int):
            return (granularity, granularity)
        return (int(granularity[0]), int(granularity[1]))

    def baseline(self, kind: str, settings: Mapping[str, Any]) -> Tensor:
        return make_baseline(kind, self.x, self.cfg, mean_color=settings.get("mean_color"),
                             blur_kernel=settings.get("blur_kernel", 11), blur_sigma=settings.get("blur_sigma", 5.0),
                             noise_seed=settings.get("noise_seed", 0))


# --------------------------------------------------------------------------------------------------------------------
# Settings validation
# --------------------------------------------------------------------------------------------------------------------


def _choice(name: str, value: Any, options: Sequence[str]) -> str:
    if value not in options:
        raise InputError(f"{name} must be one of {', '.join(repr(o) for o in options)}; got {value!r}")
    return str(value)


def _granularity(value: Any) -> str | int | list[int]:
    if value in ("pixel", "patch"):
        return str(value)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return int(value)
    if isinstance(value, (tuple, list)) and len(value) == 2 and all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value):
        return [int(value[0]), int(value[1])]
    raise InputError(f"granularity must be 'pixel', 'patch' (the model's patch size) or a patch size in pixels "
                     f"(int >= 1 or (h, w)); got {value!r}")


def _positive_int(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InputError(f"{name} must be an integer >= {minimum}; got {value!r}")
    return int(value)


def _baseline_settings(mean_color: Any, blur_kernel: Any, blur_sigma: Any, noise_seed: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if mean_color is not None:
        try:
            colour = [float(v) for v in mean_color]
        except (TypeError, ValueError):
            colour = []
        if len(colour) != 3 or not all(math.isfinite(v) for v in colour):
            raise InputError(f"mean_color must be 3 finite pixel values in [0, 1] (RGB); got {mean_color!r}")
        out["mean_color"] = colour
    else:
        out["mean_color"] = None
    blur_kernel = _positive_int("blur_kernel", blur_kernel)
    if blur_kernel % 2 == 0:
        raise InputError(f"blur_kernel must be odd; got {blur_kernel}")
    out["blur_kernel"] = blur_kernel
    try:
        sigma = float(blur_sigma)
    except (TypeError, ValueError):
        sigma = float("nan")
    if not (math.isfinite(sigma) and sigma > 0):
        raise InputError(f"blur_sigma must be a number > 0; got {blur_sigma!r}")
    out["blur_sigma"] = sigma
    if isinstance(noise_seed, bool) or not isinstance(noise_seed, int):
        raise InputError(f"noise_seed must be an int; got {noise_seed!r}")
    out["noise_seed"] = int(noise_seed)
    return out


def _config_setting(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if isinstance(value, DataConfig):
        return value.to_dict()
    return data_config(value).to_dict()


class _PerturbationMetric(Metric):
    """Shared parts: ``batch_size`` (a cost knob, kept out of the protocol) and the resolved protocol."""

    needs = frozenset({"model", "x", "targets"})

    def __init__(self, batch_size: int, **settings: Any) -> None:
        super().__init__(**settings)
        self.batch_size = _positive_int("batch_size", batch_size)

    def _result(self, values: dict[str, Tensor], resolved: dict[str, Any], **extra: Any) -> MetricResult:
        protocol = {**self.protocol(), **resolved}
        return MetricResult(self.name, values, {k: self.outputs[k] for k in values}, protocol, **extra)

    @staticmethod
    def _resolved(inp: _Inputs, size: tuple[int, int], num_features: int) -> dict[str, Any]:
        return {"feature_size": list(size), "num_features": num_features, "image_size": list(inp.x.shape[-2:]),
                "data_mean": list(inp.cfg.mean), "data_std": list(inp.cfg.std)}


def _trapezoid(curves: Tensor, xs: Tensor) -> Tensor:
    return torch.trapezoid(curves, xs.to(curves), dim=1)


# --------------------------------------------------------------------------------------------------------------------
# Insertion / deletion
# --------------------------------------------------------------------------------------------------------------------

_ID_DEFAULTS: dict[str, Any] = {
    "steps": 224, "granularity": "pixel", "deletion_baseline": "black", "insertion_baseline": "blur",
    "score": "probability", "blur_kernel": 11, "blur_sigma": 5.0, "mean_color": None, "noise_seed": 0,
}

#: presets of :class:`InsertionDeletion` (settings not listed take the defaults above).
ID_PRESETS: dict[str, dict[str, Any]] = {
    # Petsiuk et al.: 224 steps of 224 pixels at 224 px; deletion → black, insertion → blur (k=11, σ=5).
    "rise": {"steps": 224, "granularity": "pixel", "deletion_baseline": "black", "insertion_baseline": "blur",
             "blur_kernel": 11, "blur_sigma": 5.0, "score": "probability"},
    # AHA: 21 points (20 steps of 5 %), pixel level, the dataset-mean colour as reference for both curves.
    "aha": {"steps": 20, "granularity": "pixel", "deletion_baseline": "mean", "insertion_baseline": "mean",
            "score": "probability"},
    # MUTEX-style harnesses: 0 % then 10 %, 20 %, …, 100 % of the model's patches, black for both curves.
    "mutex": {"steps": 10, "granularity": "patch", "deletion_baseline": "black", "insertion_baseline": "black",
              "score": "probability"},
}


@register_metric
class InsertionDeletion(_PerturbationMetric):
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

    Args:
        preset: ``"rise"``, ``"aha"`` or ``"mutex"`` (see :data:`ID_PRESETS`); explicit arguments override it, and
            the overridden keys are listed in the protocol under ``preset_overrides``.
        steps: number of steps (the curves have ``steps + 1`` points).
        granularity: ``"pixel"``, ``"patch"`` (the model's patch size) or a patch size in pixels.
        deletion_baseline, insertion_baseline: one of :data:`BASELINES`.
        score: ``"probability"`` or ``"logit"``.
        blur_kernel, blur_sigma: the ``blur`` baseline's Gaussian. mean_color: RGB pixel values of the ``mean``
            baseline (default: the data config's mean). noise_seed: seed of the ``noise`` baseline.
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
                 batch_size: int = 64) -> None:
        given = {"steps": steps, "granularity": granularity, "deletion_baseline": deletion_baseline,
                 "insertion_baseline": insertion_baseline, "score": score, "blur_kernel": blur_kernel,
                 "blur_sigma": blur_sigma, "mean_color": mean_color, "noise_seed": noise_seed}
        given = {k: v for k, v in given.items() if v is not None}
        base = dict(_ID_DEFAULTS)
        overrides: list[str] = []
        if preset is not None:
            if preset not in ID_PRESETS:
                raise InputError(f"unknown preset {preset!r}; available: {', '.join(sorted(ID_PRESETS))}")
            base.update(ID_PRESETS[preset])
            overrides = sorted(k for k, v in given.items() if base.get(k) != v)
        base.update(given)
        settings: dict[str, Any] = {"preset": preset}
        if preset is not None:
            settings["preset_overrides"] = overrides
        settings["steps"] = _positive_int("steps", base["steps"])
        settings["granularity"] = _granularity(base["granularity"])
        settings["deletion_baseline"] = _choice("deletion_baseline", base["deletion_baseline"], BASELINES)
        settings["insertion_baseline"] = _choice("insertion_baseline", base["insertion_baseline"], BASELINES)
        settings["score"] = _choice("score", base["score"], _SCORES_ID)
        settings.update(_baseline_settings(base["mean_color"], base["blur_kernel"], base["blur_sigma"],
                                           base["noise_seed"]))
        settings["data_config"] = _config_setting(data_config)
        super().__init__(batch_size, **settings)

    @classmethod
    def presets(cls) -> dict[str, dict[str, Any]]:
        """The presets' settings (copies)."""
        return {k: dict(v) for k, v in ID_PRESETS.items()}

    def compute(self, maps: Tensor, *, model: nn.Module | None = None, x: Tensor | None = None,
                targets: TargetSpec = None, **_: Any) -> MetricResult:
        s = self.settings
        inp = _Inputs(self, maps, model, x, targets)
        b = inp.x.shape[0]
        hw = (inp.x.shape[-2], inp.x.shape[-1])
        size = inp.feature_size(s["granularity"])
        scores = feature_scores(inp.maps, size)
        grid = (scores.shape[-2], scores.shape[-1])
        n = grid[0] * grid[1]
        ranks = _pixel_ranks(feature_ranks(scores.reshape(b, -1)), grid, size, hw)
        steps = s["steps"]
        ks = (2 * torch.arange(steps + 1, device=inp.device) * n + steps) // (2 * steps)  # round half up
        same = s["deletion_baseline"] == s["insertion_baseline"]
        del_base = inp.baseline(s["deletion_baseline"], s)
        sources = [inp.x, del_base] if same else [inp.x, del_base, inp.baseline(s["insertion_baseline"], s)]
        src = torch.cat(sources)
        ins_off = b if same else 2 * b
        img = torch.arange(b, device=inp.device)
        tgt = inp.targets
        jobs = _Jobs()
        zero = torch.zeros(1, device=inp.device)
        j_orig = jobs.add(row=img, lo=zero, hi=zero, top=img, rest=img, target=tgt)
        # the points that differ from the image, one row per (image, step), image-major (one segment per image)
        per = img.repeat_interleave(steps)
        j_del = jobs.add(row=per, lo=zero, hi=ks[1:].repeat(b), top=per + b, rest=per,
                         target=tgt.repeat_interleave(steps))
        first_ins = 1 if same else 0  # with a shared baseline, insertion's first point is deletion's last
        reps = steps - first_ins
        per = img.repeat_interleave(reps)
        j_ins = jobs.add(row=per, lo=zero, hi=ks[first_ins:steps].repeat(b), top=per, rest=per + ins_off,
                         target=tgt.repeat_interleave(reps)) if reps else None
        with torch.no_grad(), inp.adapter.session(capture=False):
            out = _run(inp.adapter, src, ranks, jobs.tensors(), s["score"], self.batch_size, inp.targets)
        orig = out[j_orig]
        deletion = torch.cat([orig[:, None], out[j_del].view(b, steps)], dim=1)
        ins_pts = out[j_ins].view(b, reps) if j_ins is not None else orig.new_zeros(b, 0)
        if same:
            ins_pts = torch.cat([deletion[:, -1:], ins_pts], dim=1)
        insertion = torch.cat([ins_pts, orig[:, None]], dim=1)
        xs = ks.double() / n
        ins_auc, del_auc = _trapezoid(insertion, xs), _trapezoid(deletion, xs)
        resolved = self._resolved(inp, size, n)
        return self._result({"insertion": ins_auc, "deletion": del_auc, "ins_minus_del": ins_auc - del_auc},
                            resolved, curves={"insertion": insertion, "deletion": deletion},
                            curve_x=xs.float())


# --------------------------------------------------------------------------------------------------------------------
# Positive / negative perturbation
# --------------------------------------------------------------------------------------------------------------------


@register_metric
class PositiveNegativePerturbation(_PerturbationMetric):
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
        settings = {"fractions": fr, "score": _choice("score", score, _SCORES_PN),
                    "baseline": _choice("baseline", baseline, BASELINES), "granularity": _granularity(granularity)}
        settings.update(_baseline_settings(mean_color, blur_kernel, blur_sigma, noise_seed))
        settings["data_config"] = _config_setting(data_config)
        super().__init__(batch_size, **settings)

    def compute(self, maps: Tensor, *, model: nn.Module | None = None, x: Tensor | None = None,
                targets: TargetSpec = None, **_: Any) -> MetricResult:
        s = self.settings
        inp = _Inputs(self, maps, model, x, targets)
        b = inp.x.shape[0]
        hw = (inp.x.shape[-2], inp.x.shape[-1])
        size = inp.feature_size(s["granularity"])
        scores = feature_scores(inp.maps, size)
        grid = (scores.shape[-2], scores.shape[-1])
        scores = scores.reshape(b, -1)
        n = scores.shape[1]
        pos = _pixel_ranks(feature_ranks(scores, descending=True), grid, size, hw)
        neg = _pixel_ranks(feature_ranks(scores, descending=False), grid, size, hw)
        ranks = torch.cat([pos, neg])
        ks = torch.tensor([0] + [math.floor(f * n + 1e-9) for f in s["fractions"]], device=inp.device)
        m = len(s["fractions"])
        src = torch.cat([inp.x, inp.baseline(s["baseline"], s)])
        img = torch.arange(b, device=inp.device)
        tgt = inp.targets
        zero = torch.zeros(1, device=inp.device)
        jobs = _Jobs()
        j_orig = jobs.add(row=img, lo=zero, hi=zero, top=img, rest=img, target=tgt)
        kk, per, tg = ks[1:].repeat(b), img.repeat_interleave(m), tgt.repeat_interleave(m)
        j_pos = jobs.add(row=per, lo=zero, hi=kk, top=per + b, rest=per, target=tg)
        j_neg = jobs.add(row=per + b, lo=zero, hi=kk, top=per + b, rest=per, target=tg)
        with torch.no_grad(), inp.adapter.session(capture=False):
            out = _run(inp.adapter, src, ranks, jobs.tensors(), s["score"], self.batch_size, inp.targets)
        orig = out[j_orig][:, None]
        positive = torch.cat([orig, out[j_pos].view(b, m)], dim=1)
        negative = torch.cat([orig, out[j_neg].view(b, m)], dim=1)
        xs = ks.double() / n
        pos_auc, neg_auc = _trapezoid(positive, xs), _trapezoid(negative, xs)
        return self._result({"pos_auc": pos_auc, "neg_auc": neg_auc, "neg_minus_pos": neg_auc - pos_auc},
                            self._resolved(inp, size, n), curves={"positive": positive, "negative": negative},
                            curve_x=xs.float())


# --------------------------------------------------------------------------------------------------------------------
# Faithfulness violation
# --------------------------------------------------------------------------------------------------------------------


@register_metric
class FaithfulnessViolation(_PerturbationMetric):
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
        settings = {"k": _positive_int("k", k),
                    "patch_size": "patch" if patch_size is None else _granularity(patch_size),
                    "score": _choice("score", score, _SCORES_ID), "baseline": _choice("baseline", baseline, BASELINES)}
        if settings["patch_size"] == "pixel":
            settings["patch_size"] = 1
        settings.update(_baseline_settings(mean_color, blur_kernel, blur_sigma, noise_seed))
        settings["data_config"] = _config_setting(data_config)
        super().__init__(batch_size, **settings)

    def compute(self, maps: Tensor, *, model: nn.Module | None = None, x: Tensor | None = None,
                targets: TargetSpec = None, **_: Any) -> MetricResult:
        s = self.settings
        inp = _Inputs(self, maps, model, x, targets)
        b = inp.x.shape[0]
        hw = (inp.x.shape[-2], inp.x.shape[-1])
        size = inp.feature_size(s["patch_size"])
        w = feature_scores(inp.maps, size)
        grid = (w.shape[-2], w.shape[-1])
        w = w.reshape(b, -1)
        n = w.shape[1]
        k = min(s["k"], n)
        order_ranks = feature_ranks(w.abs(), descending=True)
        ranks = _pixel_ranks(order_ranks, grid, size, hw)
        order = torch.sort(w.abs(), dim=1, descending=True, stable=True).indices[:, :k]
        w_top = w.gather(1, order)  # (B, k), signed
        src = torch.cat([inp.x, inp.baseline(s["baseline"], s)])
        img = torch.arange(b, device=inp.device)
        tgt = inp.targets
        zero = torch.zeros(1, device=inp.device)
        jobs = _Jobs()
        j_orig = jobs.add(row=img, lo=zero, hi=zero, top=img, rest=img, target=tgt)
        lo = torch.arange(k, device=inp.device).repeat(b)
        per = img.repeat_interleave(k)
        j_rm = jobs.add(row=per, lo=lo, hi=lo + 1, top=per + b, rest=per, target=tgt.repeat_interleave(k))
        with torch.no_grad(), inp.adapter.session(capture=False):
            out = _run(inp.adapter, src, ranks, jobs.tensors(), s["score"], self.batch_size, inp.targets)
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
