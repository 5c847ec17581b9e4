"""The statistics of a benchmark report: intervals for means and proportions, and the paired test that says which
methods are statistically tied with the best.

* A mean over images gets a Student-t 95% interval (normal beyond 30 images).
* A proportion (the pointing game: hit or miss per image) gets a Wilson score interval, which stays inside [0, 1]
  and keeps a sensible width at 0 or n hits (the t interval of 6 hits out of 6 has width 0; of 5 out of 6 it
  passes 1).
* "Tied with the best": per column, each method is compared with the best one (by mean) on the images both were
  scored on, by a two-sided Wilcoxon signed-rank test of the per-image differences at ``ALPHA`` = 0.05; a method is
  tied when p ≥ ``ALPHA``. Each comparison is made on its own (no correction for the number of methods), so with
  more methods more of them are called different by chance; a correction (e.g. Holm) would call more of them tied.
  Zero differences are dropped (Wilcoxon's rule); the p-value is exact (the permutation distribution of the
  signed ranks, average ranks for ties) up to ``EXACT_MAX`` non-zero differences, and from the normal approximation
  with tie and continuity corrections beyond.
"""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np

__all__ = ["ALPHA", "EXACT_MAX", "Z95", "PAIRED_TEST", "wilson_interval", "wilcoxon_signed_rank", "paired_ties"]

#: Significance level of the paired test.
ALPHA = 0.05
#: Up to this many non-zero differences the signed-rank p-value is exact.
EXACT_MAX = 50
#: Two-sided 95% normal quantile.
Z95 = 1.959963984540054
#: The test in words, as the report states it.
PAIRED_TEST = (f"two-sided Wilcoxon signed-rank test on the per-image scores of each method paired with the best, "
               f"α = {ALPHA:g}, no correction for multiple comparisons")


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval ``(low, high)`` of a proportion ``successes / n`` (``z``: the normal quantile; 95% by
    default); ``(nan, nan)`` for ``n = 0``."""
    if n <= 0:
        return float("nan"), float("nan")
    p = successes / n
    z2 = z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def _average_ranks(values: np.ndarray) -> np.ndarray:
    """Ranks 1..n of ``values``, ties sharing their average rank."""
    order = np.argsort(values, kind="mergesort")
    ranks = np.empty(values.size, dtype=float)
    sorted_vals = values[order]
    start = 0
    while start < values.size:
        stop = start + 1
        while stop < values.size and sorted_vals[stop] == sorted_vals[start]:
            stop += 1
        ranks[order[start:stop]] = (start + stop + 1) / 2.0  # mean of ranks start+1 .. stop
        start = stop
    return ranks


def _exact_p(ranks: np.ndarray, w_plus: float) -> float:
    """Two-sided p of ``w_plus`` under the permutation distribution of the signed ranks (each rank's sign + or −
    with probability 1/2). Ranks are whole or half numbers, so doubled they index an integer table of counts."""
    doubled = np.rint(2 * ranks).astype(np.int64)
    total = int(doubled.sum())
    counts = np.zeros(total + 1, dtype=float)
    counts[0] = 1.0
    for r in doubled:  # counts[s]: sign patterns whose positive ranks sum to s / 2
        counts[r:] = counts[r:] + counts[:-r]  # a new array: the right side is read before it is written
    counts /= counts.sum()
    w = int(round(2 * w_plus))
    low = counts[: w + 1].sum()
    high = counts[w:].sum()
    return float(min(1.0, 2 * min(low, high)))


def wilcoxon_signed_rank(differences: np.ndarray) -> float:
    """Two-sided p-value of the Wilcoxon signed-rank test that the paired differences are symmetric about 0.

    Zero differences are dropped; ``1.0`` when none is left. Exact up to :data:`EXACT_MAX` non-zero differences,
    else the normal approximation with tie correction and continuity correction."""
    d = np.asarray(differences, dtype=float)
    d = d[np.isfinite(d) & (d != 0)]
    n = d.size
    if n == 0:
        return 1.0
    ranks = _average_ranks(np.abs(d))
    w_plus = float(ranks[d > 0].sum())
    if n <= EXACT_MAX:
        return _exact_p(ranks, w_plus)
    mean = n * (n + 1) / 4.0
    _, tie_counts = np.unique(np.abs(d), return_counts=True)
    var = n * (n + 1) * (2 * n + 1) / 24.0 - float(np.sum(tie_counts ** 3 - tie_counts)) / 48.0
    if var <= 0:
        return 1.0
    z = (abs(w_plus - mean) - 0.5) / math.sqrt(var)
    return float(min(1.0, math.erfc(max(z, 0.0) / math.sqrt(2.0))))


def paired_ties(per_image: Mapping[str, Mapping[int, float]], higher_is_better: bool,
                alpha: float = ALPHA) -> dict[str, dict[str, object]]:
    """For one column: method → ``{"best": bool, "p_vs_best": float | None, "tied_with_best": bool,
    "n_paired": int}``. The best method is the one with the best mean; every other method is tested against it
    on the images both have (p ≥ ``alpha``: tied). Methods without values are left out."""
    means = {m: float(np.mean(list(v.values()))) for m, v in per_image.items() if v}
    if not means:
        return {}
    best = (max if higher_is_better else min)(means, key=lambda m: means[m])
    out: dict[str, dict[str, object]] = {}
    for m in means:
        if m == best:
            out[m] = {"best": True, "p_vs_best": None, "tied_with_best": True, "n_paired": len(per_image[m])}
            continue
        common = sorted(set(per_image[m]) & set(per_image[best]))
        diff = np.array([per_image[m][i] - per_image[best][i] for i in common], dtype=float)
        p = wilcoxon_signed_rank(diff) if common else float("nan")
        out[m] = {"best": False, "p_vs_best": p, "tied_with_best": bool(common) and p >= alpha,
                  "n_paired": len(common)}
    return out
