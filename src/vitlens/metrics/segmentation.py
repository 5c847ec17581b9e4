"""Attribution as segmentation (Chefer et al., CVPR 2021; the GradSkip seed's PA / mIoU on ADE20K-150).

Each map ``(H, W)`` is min-max normalised per image to ``[0, 1]`` and binarised: a pixel is foreground when its
normalised value is **strictly greater** than the threshold — the normalised map's mean (default, as Chefer et al.),
Otsu's threshold, or a fixed number in ``[0, 1]``. Against the ground-truth mask of the explained class:

* ``pa``      pixel accuracy ``(TP + TN) / N``;
* ``iou_fg``  ``TP / (TP + FP + FN)``; ``iou_bg`` ``TN / (TN + FN + FP)``; ``miou`` their mean;
* ``ap``      average precision of the continuous map against the mask, computed exactly as scikit-learn's
  ``average_precision_score``: ``Σ_k (R_k − R_{k−1}) P_k`` over the distinct map values taken as thresholds from
  high to low (ties form one step). Min-max normalisation preserves the order, so AP is computed on the raw map.

All outputs: higher is better. Values are per image; a data set's score is their mean (``MetricResult.mean``).
Chefer et al. instead pool TP/FP/FN/TN over the whole data set before dividing; :func:`segmentation_counts` and
:func:`pooled_scores` give that variant.

Defined edge cases:

* **Constant map** (max = min): the normalised map is all 0, nothing is strictly above any threshold ≥ 0, so the
  predicted foreground is empty (``pa`` = background fraction, ``iou_fg`` = 0 when the mask is non-empty); its AP
  equals the foreground fraction (every pixel ties: one step at chance precision).
* **Empty mask** (the explained class has no pixels): ``iou_fg``, ``miou`` and ``ap`` are NaN — there is no object
  to localise, so a foreground score would only reflect the binarisation rule (with no positives, precision and
  recall are undefined). ``pa`` and ``iou_bg`` are still reported. NaNs are skipped by ``MetricResult.mean``.
* **Full mask** (every pixel foreground): ``iou_bg`` and ``miou`` are NaN (no background); ``ap`` is 1.

For label maps with several classes, :func:`segmentation_per_class` scores each explained class against its own mask
``seg == c`` and :meth:`Segmentation.compute_per_class` averages per image over the explained classes (NaN-mean:
classes absent from an image are skipped); the data-set value is then the mean over images.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ..errors import InputError
from .base import Metric, MetricResult, check_maps, register_metric

__all__ = [
    "Segmentation",
    "average_precision",
    "binarise",
    "classes_in",
    "minmax_normalise",
    "otsu_threshold",
    "pooled_scores",
    "segmentation_counts",
    "segmentation_per_class",
    "segmentation_scores",
]

Threshold = str | float


def minmax_normalise(maps: Tensor) -> Tensor:
    """Per-image min-max normalisation of ``(B, H, W)`` maps to ``[0, 1]`` (float64); constant maps become 0."""
    flat = maps.flatten(1).double()
    lo = flat.amin(dim=1, keepdim=True)
    span = flat.amax(dim=1, keepdim=True) - lo
    safe = torch.where(span > 0, span, torch.ones_like(span))
    out = torch.where(span > 0, (flat - lo) / safe, torch.zeros_like(flat))
    return out.view(maps.shape)


def otsu_threshold(maps: Tensor, nbins: int = 256) -> Tensor:
    """Otsu's threshold per image of ``(B, H, W)`` (or ``(B, N)``) values, ``(B,)`` float64.

    Same rule as ``skimage.filters.threshold_otsu`` on float images: ``nbins`` equal bins spanning the image's
    ``[min, max]`` (numpy's binning, last bin closed), the threshold is the centre of the bin that maximises the
    between-class variance (first maximum); a constant image returns its value. Foreground is ``value > threshold``.
    """
    if nbins < 2:
        raise InputError(f"otsu needs nbins >= 2, got {nbins}")
    v = maps.flatten(1).double()
    b = v.shape[0]
    lo = v.amin(dim=1, keepdim=True)
    hi = v.amax(dim=1, keepdim=True)
    const = (hi == lo)[:, 0]
    hi_safe = torch.where(hi > lo, hi, lo + 1)
    # numpy.linspace: start + i * step, last edge set to stop
    step = (hi_safe - lo) / nbins
    edges = torch.arange(nbins + 1, dtype=torch.float64, device=v.device)[None] * step + lo
    edges[:, -1] = hi_safe[:, 0]
    # numpy.histogram's uniform-bin index computation, including its edge corrections
    idx = ((v - lo) / (hi_safe - lo) * nbins).long()
    idx = torch.where(idx == nbins, idx - 1, idx).clamp(0, nbins - 1)
    idx = torch.where(v < edges.gather(1, idx), idx - 1, idx)
    idx = torch.where((v >= edges.gather(1, idx + 1)) & (idx != nbins - 1), idx + 1, idx)
    counts = torch.zeros(b, nbins, dtype=torch.float64, device=v.device).scatter_add_(1, idx, torch.ones_like(v))
    centers = (edges[:, :-1] + edges[:, 1:]) / 2
    w1 = counts.cumsum(1)
    w2 = counts.flip(1).cumsum(1).flip(1)
    m1 = (counts * centers).cumsum(1) / w1
    m2 = (counts * centers).flip(1).cumsum(1).flip(1) / w2
    var12 = w1[:, :-1] * w2[:, 1:] * (m1[:, :-1] - m2[:, 1:]) ** 2
    t = centers.gather(1, var12.argmax(dim=1, keepdim=True))[:, 0]
    return torch.where(const, lo[:, 0], t)


def _check_threshold(threshold: Threshold) -> Threshold:
    if isinstance(threshold, str):
        if threshold not in ("mean", "otsu"):
            raise InputError(f"threshold must be 'mean', 'otsu' or a number in [0, 1]; got {threshold!r}")
        return threshold
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
        raise InputError(f"threshold must be 'mean', 'otsu' or a number in [0, 1]; got {threshold!r}")
    if not (math.isfinite(threshold) and 0.0 <= threshold <= 1.0):
        raise InputError(f"a fixed threshold (on min-max normalised maps) must lie in [0, 1]; got {threshold}")
    return float(threshold)


def binarise(maps: Tensor, threshold: Threshold = "mean", nbins: int = 256) -> Tensor:
    """Foreground masks ``(B, H, W)`` bool: the min-max normalised map strictly above ``threshold``.

    ``threshold``: ``"mean"`` (the normalised map's mean), ``"otsu"`` (:func:`otsu_threshold` with ``nbins``) or a
    number in ``[0, 1]``. A constant map has no foreground.
    """
    threshold = _check_threshold(threshold)
    norm = minmax_normalise(_maps(maps))
    if threshold == "mean":
        t = norm.flatten(1).mean(dim=1)
    elif threshold == "otsu":
        t = otsu_threshold(norm, nbins)
    else:
        t = torch.full((norm.shape[0],), float(threshold), dtype=norm.dtype, device=norm.device)
    return norm > t[:, None, None]


def _maps(maps: Tensor) -> Tensor:
    """Validated maps as float32, or float64 when given in float64 (no precision is thrown away)."""
    checked = check_maps(maps)
    return maps if maps.dtype == torch.float64 else checked


def _pair(maps: Tensor, masks: Tensor) -> tuple[Tensor, Tensor]:
    maps = _maps(maps)
    if not isinstance(masks, Tensor):
        raise InputError(f"masks must be a torch.Tensor (B, H, W), got {type(masks).__name__}")
    if masks.shape != maps.shape:
        raise InputError(f"masks must have the maps' shape {tuple(maps.shape)}; got {tuple(masks.shape)}")
    return maps, masks.to(device=maps.device, dtype=torch.bool)


def average_precision(maps: Tensor, masks: Tensor) -> Tensor:
    """Average precision of each continuous map against its mask, ``(B,)`` float64.

    Exactly scikit-learn's ``average_precision_score(mask.ravel(), map.ravel())``: pixels sorted by decreasing
    value, one precision/recall point per distinct value, ``AP = Σ_k (R_k − R_{k−1}) P_k``; equivalently the mean,
    over foreground pixels, of the precision at the last pixel tied with it. NaN for an empty mask.
    """
    maps, masks = _pair(maps, masks)
    b = maps.shape[0]
    scores = maps.flatten(1)
    y = masks.flatten(1)
    order = torch.sort(scores, dim=1, descending=True, stable=True)
    s, ys = order.values, y.gather(1, order.indices)
    n = s.shape[1]
    tps = ys.long().cumsum(1)
    pos = torch.arange(n, device=s.device).expand(b, n)
    is_last = torch.ones_like(ys)
    is_last[:, :-1] = s[:, 1:] != s[:, :-1]
    # index of the last pixel of each pixel's tie group: reverse cumulative minimum of the group ends
    ends = torch.where(is_last, pos, torch.full_like(pos, n - 1))
    end_of = ends.flip(1).cummin(dim=1).values.flip(1)
    precision = tps.gather(1, end_of).double() / (end_of + 1).double()
    n_pos = ys.sum(1)
    ap = (precision * ys.double()).sum(1) / n_pos.clamp_min(1).double()
    return torch.where(n_pos > 0, ap, torch.full_like(ap, float("nan")))


def segmentation_counts(maps: Tensor, masks: Tensor, threshold: Threshold = "mean",
                        nbins: int = 256) -> dict[str, Tensor]:
    """Confusion counts of the binarised maps against the masks: ``tp``, ``fp``, ``fn``, ``tn``, each ``(B,)``
    int64. Concatenate them over batches and call :func:`pooled_scores` for data-set-level (Chefer-style) numbers."""
    maps, masks = _pair(maps, masks)
    pred = binarise(maps, threshold, nbins).flatten(1)
    gt = masks.flatten(1)
    return {
        "tp": (pred & gt).sum(1),
        "fp": (pred & ~gt).sum(1),
        "fn": (~pred & gt).sum(1),
        "tn": (~pred & ~gt).sum(1),
    }


def _ratio(num: Tensor, den: Tensor) -> Tensor:
    num, den = num.double(), den.double()
    return torch.where(den > 0, num / den.clamp_min(1), torch.full_like(num, float("nan")))


def _scores_from_counts(c: dict[str, Tensor]) -> dict[str, Tensor]:
    tp, fp, fn, tn = c["tp"], c["fp"], c["fn"], c["tn"]
    pa = _ratio(tp + tn, tp + fp + fn + tn)
    # an IoU is NaN when its class is absent from the ground truth (see module doc)
    iou_fg = torch.where(tp + fn > 0, _ratio(tp, tp + fp + fn), torch.full_like(pa, float("nan")))
    iou_bg = torch.where(tn + fp > 0, _ratio(tn, tn + fn + fp), torch.full_like(pa, float("nan")))
    return {"pa": pa, "iou_fg": iou_fg, "iou_bg": iou_bg, "miou": (iou_fg + iou_bg) / 2}


def pooled_scores(counts: dict[str, Tensor]) -> dict[str, float]:
    """Data-set-level PA / IoUs from summed counts (Chefer et al. pool intersections and unions over all images)."""
    total = {k: counts[k].sum().reshape(1) for k in ("tp", "fp", "fn", "tn")}
    return {k: float(v[0]) for k, v in _scores_from_counts(total).items()}


def segmentation_scores(maps: Tensor, masks: Tensor, threshold: Threshold = "mean",
                        nbins: int = 256) -> dict[str, Tensor]:
    """Per-image ``pa``, ``iou_fg``, ``iou_bg``, ``miou`` and ``ap`` (each ``(B,)`` float64; see module doc).

    Args:
        maps: ``(B, H, W)`` attribution maps at the masks' resolution.
        masks: ``(B, H, W)`` bool ground truth of the explained class.
        threshold: ``"mean"`` (default), ``"otsu"`` or a number in ``[0, 1]`` applied to the normalised map.
        nbins: histogram bins for Otsu.
    """
    maps, masks = _pair(maps, masks)
    out = _scores_from_counts(segmentation_counts(maps, masks, threshold, nbins))
    out["ap"] = average_precision(maps, masks)
    return out


def classes_in(seg: Tensor, ignore: tuple[int, ...] = (0,), max_classes: int | None = None) -> Tensor:
    """Classes present in each label map ``(B, H, W)``, by decreasing pixel count → ``(B, K)`` int64 padded with
    ``-1`` (``ignore``: labels to leave out, e.g. 0 = "other" in ADE20K; ``max_classes`` keeps the K largest)."""
    if seg.ndim != 3 or seg.is_floating_point() or seg.dtype == torch.bool:
        raise InputError(f"seg must be an integer label map (B, H, W); got {seg.dtype} {tuple(seg.shape)}")
    rows = []
    for s in seg:
        vals, counts = torch.unique(s, return_counts=True)
        keep = ~torch.isin(vals, torch.tensor(list(ignore), dtype=vals.dtype, device=vals.device))
        vals, counts = vals[keep], counts[keep]
        order = torch.sort(counts, descending=True, stable=True).indices
        rows.append(vals[order][:max_classes])
    k = max((len(r) for r in rows), default=0)
    out = torch.full((seg.shape[0], k), -1, dtype=torch.int64, device=seg.device)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def segmentation_per_class(maps: Tensor, seg: Tensor, classes: Tensor, threshold: Threshold = "mean",
                           nbins: int = 256) -> dict[str, Tensor]:
    """Scores of one map per explained class against that class's mask in a label map.

    Args:
        maps: ``(B, K, H, W)``, ``maps[:, k]`` explains class ``classes[:, k]``.
        seg: ``(B, H, W)`` integer label map.
        classes: ``(B, K)`` label ids (as in ``seg``); entries ``< 0`` are padding and give NaN.

    Returns:
        output name → ``(B, K)`` float64 (the rules of :func:`segmentation_scores`, mask = ``seg == classes[b, k]``).
    """
    if maps.ndim != 4:
        raise InputError(f"per-class maps must have shape (B, K, H, W); got {tuple(maps.shape)}")
    b, k, h, w = maps.shape
    classes = torch.as_tensor(classes, device=maps.device)
    if tuple(classes.shape) != (b, k) or classes.is_floating_point():
        raise InputError(f"classes must be integer (B, K) = {(b, k)}; got {classes.dtype} {tuple(classes.shape)}")
    if tuple(seg.shape) != (b, h, w):
        raise InputError(f"seg must have shape {(b, h, w)}; got {tuple(seg.shape)}")
    seg = seg.to(maps.device)
    masks = seg[:, None] == classes[:, :, None, None]
    scores = segmentation_scores(maps.reshape(b * k, h, w), masks.reshape(b * k, h, w), threshold, nbins)
    pad = (classes < 0).reshape(-1)
    return {n: torch.where(pad, torch.full_like(v, float("nan")), v).reshape(b, k) for n, v in scores.items()}


@register_metric
class Segmentation(Metric):
    """Attribution as segmentation: ``pa``, ``iou_fg``, ``iou_bg``, ``miou``, ``ap`` (all higher is better).

    Settings: ``threshold`` (``"mean"`` | ``"otsu"`` | number in ``[0, 1]``), ``nbins`` (Otsu histogram bins).
    Needs ``masks`` ``(B, H, W)`` bool of the explained class at the maps' resolution. See the module doc for the
    definitions and the edge cases (constant maps, empty and full masks).
    """

    name = "segmentation"
    outputs = {"pa": True, "iou_fg": True, "iou_bg": True, "miou": True, "ap": True}
    needs = frozenset({"masks"})

    def __init__(self, threshold: Threshold = "mean", nbins: int = 256) -> None:
        threshold = _check_threshold(threshold)
        if int(nbins) < 2:
            raise InputError(f"nbins must be >= 2, got {nbins}")
        super().__init__(threshold=threshold, nbins=int(nbins), normalise="minmax", foreground="strictly above",
                         averaging="per image")

    def compute(self, maps: Tensor, *, masks: Tensor | None = None, **_: Any) -> MetricResult:
        if masks is None:
            raise InputError("metric 'segmentation' needs masks")
        scores = segmentation_scores(maps, masks, self.settings["threshold"], self.settings["nbins"])
        return self.result({k: scores[k] for k in self.outputs})

    def compute_per_class(self, maps: Tensor, seg: Tensor, classes: Tensor) -> MetricResult:
        """Multi-class label maps: :func:`segmentation_per_class`, then the NaN-mean over the explained classes of
        each image → ``(B,)`` per output. The protocol records ``averaging = "per explained class, then image"``."""
        per = segmentation_per_class(maps, seg, classes, self.settings["threshold"], self.settings["nbins"])
        values = {k: torch.nanmean(per[k], dim=1) if per[k].shape[1] else per[k].sum(1) * float("nan")
                  for k in self.outputs}
        res = self.result(values)
        res.protocol["averaging"] = "per explained class, then image"
        return res
