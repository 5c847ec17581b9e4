"""Differentiable (soft) deletion and insertion curves of a map, and the AHA training loss.

The pipeline for a batch of maps ``S`` ``(B, H, W)`` (docs/methods/aha.md has the equations):

1. :class:`RegionGrid` partitions the image into ``g × g`` cells (``(g+1) × (g+1)`` with a grid offset) and
   average-pools ``S`` into region scores ``s`` ``(B, d)``.
2. :func:`~vitlens.aha.sorter.soft_sort` turns ``s`` into soft permutations ``P`` ``(B, d, d)`` (rank × region),
   descending for deletion and ascending for insertion.
3. :func:`soft_membership`: ``C = [0; cumsum_rank(P)]`` ``(B, d+1, d)``, ``C[t, k]`` ≈ "region ``k`` is among the
   ``t`` first", read at ``t = p·d`` for the curve fractions ``p`` (:func:`curve_fractions`), linearly interpolated.
4. :meth:`RegionGrid.to_pixels`: region memberships → pixel masks (nearest upsampling), Gaussian blur ``σ = 1`` px,
   clamp to ``[0, 1]``.
5. :func:`blend`: ``x' = (1 − M)·x + M·r`` with a reference ``r`` (:func:`reference`: black, dataset-mean colour or a
   heavy blur of ``x``). The reference is built in pixel space and normalised; because the normalisation is affine
   per channel, blending normalised tensors equals normalising the pixel-space blend (for pixels in ``[0, 1]``).
6. The target model's softmax probability of the class on every ``x'``; AUC by the trapezoidal rule over ``p``.

Deletion AUC uses the descending sort (lower is better), insertion AUC the ascending one (higher is better; deleting
the least important first is, read backwards, inserting the most important first onto the same reference).
:func:`aha_loss` combines them: ``L = w_del·AUC_desc + w_ins·(1 − AUC_asc) + w_peak·P_peak``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .sorter import hard_sort, scale_scores, soft_sort

__all__ = [
    "AUTHORS_BLUR",
    "AUTHORS_MEAN_COLOR",
    "PEAK_INPUTS",
    "POOLINGS",
    "REFERENCES",
    "REFERENCE_STYLES",
    "RegionGrid",
    "CurveResult",
    "aha_loss",
    "blend",
    "curve_fractions",
    "default_grid_range",
    "gaussian_blur",
    "map_loss",
    "peak_penalty",
    "reference",
    "soft_curves",
    "soft_membership",
    "trapezoid_auc",
]

#: the references a deleted pixel is replaced with: black, the dataset-mean colour, the blurred image, and the
#: per-pixel dataset-mean image (``meanimage``: the mean of the training images, pixel by pixel).
REFERENCES: tuple[str, ...] = ("black", "mean", "blur", "meanimage")

#: how the references are defined: ``vitlens`` (the mean colour of the model's data config, a blur of σ = H/16) or
#: ``authors`` (the AHA authors' code: the ImageNet mean colour, a 37-tap Gaussian of σ = 37 px, reflect padding).
REFERENCE_STYLES: tuple[str, ...] = ("vitlens", "authors")
#: the constant "mean" colour of the AHA authors' code (RGB pixel values in [0, 1]: the ImageNet mean)
AUTHORS_MEAN_COLOR: tuple[float, float, float] = (0.485, 0.456, 0.406)
#: the blur reference of the AHA authors' code: (kernel taps, σ in pixels), reflect padding
AUTHORS_BLUR: tuple[int, float] = (37, 37.0)
#: how a map is pooled into region scores (:class:`RegionGrid`): ``partition`` (each pixel in one cell) or
#: ``adaptive`` (``F.adaptive_avg_pool2d``'s windows, as the AHA authors' code pools)
POOLINGS: tuple[str, ...] = ("partition", "adaptive")
#: what the peak penalty sees (:func:`peak_penalty`): the per-image ``minmax`` scaled map, or the ``raw`` map
PEAK_INPUTS: tuple[str, ...] = ("minmax", "raw")


# --------------------------------------------------------------------------------------------------------------------
# Regions
# --------------------------------------------------------------------------------------------------------------------


class RegionGrid:
    """A partition of ``H × W`` pixels into rectangular cells.

    Pixel ``(y, x)`` belongs to cell row ``⌊(y + oy)·g / H⌋`` and column ``⌊(x + ox)·g / W⌋`` (``g`` may be a pair
    ``(g_y, g_x)``). Without offset
    (``oy = ox = 0``) this is a ``g × g`` grid and exactly the partition of nearest-neighbour upsampling from
    ``g × g`` to ``H × W`` (``F.interpolate(mode="nearest")``), so :meth:`pool` is ``F.avg_pool2d`` when ``g`` divides
    ``H`` and ``W``. With an offset in ``[0, H/g)`` pixels the grid shifts and has ``g + 1`` rows (columns), the first
    and last partial.

    Attributes:
        cell: ``(H·W,)`` long, cell index of every pixel (row-major). counts: ``(d,)`` pixels per cell.
        d: number of cells. shape: ``(rows, cols)``.
    """

    def __init__(self, hw: tuple[int, int], g: int | tuple[int, int], offset: tuple[int, int] = (0, 0),
                 device: torch.device | str | None = None, pooling: str = "partition") -> None:
        h, w = int(hw[0]), int(hw[1])
        gy, gx = (int(g), int(g)) if isinstance(g, int) else (int(g[0]), int(g[1]))
        if not (1 <= gy <= h and 1 <= gx <= w):
            raise ValueError(f"grid size must be in [1, {h}] x [1, {w}] for a {h}x{w} image, got {g}")
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
        oy, ox = int(offset[0]), int(offset[1])
        if pooling == "adaptive":
            if (oy, ox) != (0, 0):
                raise ValueError("adaptive pooling has no grid offset (the authors' grid is aligned to the corner)")
            iy, ix = _nearest_index(h, gy), _nearest_index(w, gx)
        else:
            iy = torch.div((torch.arange(h) + oy) * gy, h, rounding_mode="floor")
            ix = torch.div((torch.arange(w) + ox) * gx, w, rounding_mode="floor")
        self.pooling = pooling
        rows, cols = int(iy.max()) + 1, int(ix.max()) + 1
        cell = (iy[:, None] * cols + ix[None, :]).reshape(-1)
        self.hw = (h, w)
        self.g = (gy, gx)
        self.offset = (oy, ox)
        self.shape = (rows, cols)
        self.d = rows * cols
        self.cell = cell.to(device)
        self.rows_of, self.cols_of = iy, ix  # cell row of every pixel row, cell column of every pixel column
        self.counts = torch.bincount(cell, minlength=self.d).to(device)
        if bool((self.counts == 0).any()):
            raise ValueError(f"grid {g} with offset {offset} leaves empty cells on a {h}x{w} image")
        self._blurs: dict[tuple[float, torch.dtype, torch.device], tuple[Tensor, Tensor]] = {}

    def pool(self, maps: Tensor) -> Tensor:
        """Region scores ``(B, d)`` of ``maps`` ``(B, H, W)``: the average over every cell (``partition``), or over
        ``F.adaptive_avg_pool2d``'s windows (``adaptive``: rows ``⌊i·H/g⌋ … ⌈(i+1)·H/g⌉ − 1``, which overlap when
        ``g`` does not divide ``H``; the masks still map cell ``i`` to its nearest-upsampling pixels)."""
        b = maps.shape[0]
        if self.pooling == "adaptive":
            return F.adaptive_avg_pool2d(maps[:, None], self.g).reshape(b, -1)
        flat = maps.reshape(b, -1)
        out = torch.zeros(b, self.d, device=maps.device, dtype=maps.dtype)
        out = out.index_add(1, self.cell.to(maps.device), flat)
        return out / self.counts.to(maps.device, maps.dtype)

    def to_pixels(self, regions: Tensor, blur_sigma: float = 1.0, clamp_before: bool = False) -> Tensor:
        """Region values ``(..., d)`` → pixel masks ``(..., H, W)``: nearest upsampling, Gaussian blur, clamp [0, 1]
        (``clamp_before``: the region values are clamped to [0, 1] before the blur as well, as the authors' code
        does; the soft memberships can exceed 1 by the sorter's column-sum error).

        The cells are rectangles and the blur is separable, so both steps together are ``A_y·R·A_xᵀ`` for the
        ``rows × cols`` region values ``R``, with ``A_y`` ``(H, rows)`` the blurred (reflect-padded, as
        :func:`gaussian_blur`) indicator of each cell row and ``A_x`` ``(W, cols)`` that of each cell column: two small
        matrix products instead of a gather and two convolutions over every mask's pixels (equal up to rounding).
        """
        lead = regions.shape[:-1]
        ay, ax = self._axis_maps(blur_sigma, regions.dtype, regions.device)
        r = regions.reshape(-1, *self.shape)
        if clamp_before:
            r = r.clamp(0.0, 1.0)
        px = torch.matmul(torch.matmul(ay, r), ax.t())
        return px.clamp(0.0, 1.0).reshape(*lead, *self.hw)

    def _axis_maps(self, sigma: float, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
        """``(A_y, A_x)`` of :meth:`to_pixels` for blur ``sigma`` (cached per sigma, dtype and device)."""
        key = (float(sigma), dtype, device)
        if key not in self._blurs:
            h, w = self.hw
            radius = max(1, min(int(math.ceil(3 * sigma)), h - 1, w - 1)) if sigma > 0 else 0
            maps = []
            for n, index, cells in ((h, self.rows_of, self.shape[0]), (w, self.cols_of, self.shape[1])):
                onehot = F.one_hot(index, cells).double()  # (n, cells): pixel line → its cell line
                if radius:
                    maps.append(_blur_matrix(n, radius, sigma) @ onehot)
                else:
                    maps.append(onehot)
            self._blurs[key] = (maps[0].to(device, dtype), maps[1].to(device, dtype))
        return self._blurs[key]


def _nearest_index(n: int, g: int) -> Tensor:
    """The source index of every output line when ``F.interpolate(mode="nearest")`` upsamples ``g`` lines to ``n``
    (computed by that call, so it is torch's own float rounding of ``⌊y·g/n⌋``)."""
    src = torch.arange(g, dtype=torch.float64).view(1, 1, g)
    return F.interpolate(src, size=n, mode="nearest").view(n).round().long()


def _blur_matrix(n: int, radius: int, sigma: float) -> Tensor:
    """The ``(n, n)`` float64 matrix of :func:`gaussian_blur` along one axis of length ``n`` (reflect padding)."""
    k = torch.arange(-radius, radius + 1, dtype=torch.float64)
    k = torch.exp(-0.5 * (k / sigma) ** 2)
    k = k / k.sum()
    src = torch.arange(n)[:, None] + torch.arange(-radius, radius + 1)[None, :]  # (n, taps) source lines
    src = src.abs()
    src = torch.where(src > n - 1, 2 * (n - 1) - src, src).clamp(0, n - 1)
    out = torch.zeros(n, n, dtype=torch.float64)
    return out.index_put_((torch.arange(n)[:, None].expand_as(src), src), k.expand_as(src).clone(), accumulate=True)


def default_grid_range(hw: tuple[int, int]) -> tuple[int, int]:
    """Grid sizes drawn in training: the paper's {7, …, 28} at 224 px scaled to the image, at least {4, …, 16}.

    64 px → (4, 16); 224 px → (7, 28); 448 px → (14, 56). Capped by the image side.
    """
    side = min(hw)
    lo = max(4, round(7 * side / 224))
    hi = max(16, round(28 * side / 224))
    return min(lo, side), min(hi, side)


# --------------------------------------------------------------------------------------------------------------------
# Curves
# --------------------------------------------------------------------------------------------------------------------


def curve_fractions(m: int = 16, mode: str = "fixed", generator: torch.Generator | None = None) -> Tensor:
    """``m`` curve fractions in ``[0, 1]``, sorted, both endpoints included, float32 ``(m,)``.

    ``fixed``: ``linspace(0, 1, m)``; ``random``: ``0``, ``m − 2`` sorted uniform draws, ``1``.
    """
    if m < 2:
        raise ValueError(f"a curve needs m >= 2 fractions, got {m}")
    if mode == "fixed":
        return torch.linspace(0.0, 1.0, m)
    if mode == "random":
        inner = torch.rand(m - 2, generator=generator).sort().values
        return torch.cat([torch.zeros(1), inner, torch.ones(1)])
    raise ValueError(f"step_sampling must be 'fixed' or 'random', got {mode!r}")


def soft_membership(p: Tensor, fractions: Tensor) -> Tensor:
    """Soft top-``t`` membership of every region at ``t = fraction·d``.

    Args:
        p: permutations ``(B, d, d)`` (rank × region).
        fractions: ``(n,)`` in ``[0, 1]``.

    Returns:
        ``(B, n, d)``: ``(1 − w)·C[⌊t⌋] + w·C[⌊t⌋ + 1]`` with ``C = [0; cumsum_rank(P)]`` and ``w = t − ⌊t⌋``.
    """
    b, d, _ = p.shape
    c = torch.cat([p.new_zeros(b, 1, d), p.cumsum(dim=1)], dim=1)  # (B, d+1, d)
    t = fractions.to(p.device, p.dtype).clamp(0.0, 1.0) * d
    lo = t.floor().clamp(max=d - 1)
    w = (t - lo)[None, :, None]
    lo = lo.long()
    return (1.0 - w) * c[:, lo] + w * c[:, lo + 1]


def trapezoid_auc(values: Tensor, fractions: Tensor) -> Tensor:
    """Trapezoidal area under ``values`` ``(..., n)`` over ``fractions`` ``(n,)`` (sorted, spanning [0, 1])."""
    return torch.trapezoid(values, fractions.to(values.device, values.dtype), dim=-1)


def gaussian_blur(x: Tensor, sigma: float, radius: int | None = None) -> Tensor:
    """Separable Gaussian blur of ``x`` ``(N, C, H, W)`` with reflect padding (weights sum to one everywhere).

    Kernel radius ``radius`` (default ``⌈3σ⌉``), capped so the reflect padding fits the image.
    """
    if sigma <= 0:
        return x
    dtype = x.dtype
    if dtype in (torch.float16, torch.bfloat16):  # half-precision depthwise convolution is minutes on a CPU, and
        x = x.float()  # rounds the kernel's small weights: blur in float32, return the input's dtype
    h, w = x.shape[-2:]
    radius = max(1, min(int(math.ceil(3 * sigma)) if radius is None else int(radius), h - 1, w - 1))
    k = torch.arange(-radius, radius + 1, device=x.device, dtype=x.dtype)
    k = torch.exp(-0.5 * (k / sigma) ** 2)
    k = k / k.sum()
    c = x.shape[1]
    x = F.pad(x, (radius, radius, radius, radius), mode="reflect")
    x = F.conv2d(x, k.view(1, 1, 1, -1).expand(c, 1, 1, -1), groups=c)
    x = F.conv2d(x, k.view(1, 1, -1, 1).expand(c, 1, -1, 1), groups=c)
    return x.to(dtype)


def reference(x: Tensor, kind: str, mean: Sequence[float], std: Sequence[float],
              blur_sigma: float | None = None, mean_image: Tensor | None = None, style: str = "vitlens") -> Tensor:
    """The reference image ``r`` (normalised like ``x`` ``(B, 3, H, W)``) for ``kind`` in :data:`REFERENCES`.

    ``black``: pixel value 0; ``mean``: the data config's mean colour (0 after normalisation); ``blur``: ``x`` blurred
    with a Gaussian of ``σ = blur_sigma`` pixels (default ``max(H, W) / 16``: 4 px at 64 px, 14 px at 224 px),
    which commutes with the per-channel affine normalisation; ``meanimage``: ``mean_image`` ``(C, H, W)`` (normalised),
    the per-pixel mean of the training images (:func:`vitlens.aha.data.mean_image`).

    ``style="authors"`` (:data:`REFERENCE_STYLES`): the AHA authors' definitions — ``mean`` is the constant ImageNet
    mean colour :data:`AUTHORS_MEAN_COLOR` whatever the model's normalisation, ``blur`` a 37-tap Gaussian of σ = 37 px
    with reflect padding (:data:`AUTHORS_BLUR`; the radius of 18 px is capped at ``H − 1`` for smaller images).
    """
    if style not in REFERENCE_STYLES:
        raise ValueError(f"reference style must be one of {', '.join(REFERENCE_STYLES)}, got {style!r}")
    if style == "authors" and kind == "mean":
        c = torch.tensor(AUTHORS_MEAN_COLOR, device=x.device, dtype=x.dtype).view(1, -1, 1, 1)
        m = torch.tensor(mean, device=x.device, dtype=x.dtype).view(1, -1, 1, 1)
        s = torch.tensor(std, device=x.device, dtype=x.dtype).view(1, -1, 1, 1)
        return ((c - m) / s).expand_as(x).contiguous()
    if style == "authors" and kind == "blur":
        taps, sigma = AUTHORS_BLUR
        return gaussian_blur(x, sigma, radius=taps // 2)
    if kind == "meanimage":
        if mean_image is None:
            raise ValueError("the 'meanimage' reference needs the dataset's mean image (mean_image=)")
        if tuple(mean_image.shape[-3:]) != tuple(x.shape[-3:]):
            raise ValueError(f"mean image of shape {tuple(mean_image.shape)} does not fit images of shape "
                             f"{tuple(x.shape[-3:])}")
        return mean_image.to(x.device, x.dtype).reshape(1, *x.shape[-3:]).expand_as(x).contiguous()
    if kind == "mean":
        return torch.zeros_like(x)
    if kind == "black":
        m = torch.tensor(mean, device=x.device, dtype=x.dtype).view(1, -1, 1, 1)
        s = torch.tensor(std, device=x.device, dtype=x.dtype).view(1, -1, 1, 1)
        return ((0.0 - m) / s).expand_as(x).contiguous()
    if kind == "blur":
        sigma = blur_sigma if blur_sigma is not None else max(x.shape[-2:]) / 16
        return gaussian_blur(x, sigma)
    raise ValueError(f"unknown reference {kind!r}; choose one of {', '.join(REFERENCES)}")


def blend(x: Tensor, masks: Tensor, ref: Tensor) -> Tensor:
    """``x' = (1 − M)·x + M·r``: ``x``, ``ref`` ``(B, C, H, W)``, masks ``(B, n, H, W)`` → ``(B, n, C, H, W)``."""
    m = masks[:, :, None]
    return x[:, None] + m * (ref - x)[:, None]


def peak_penalty(maps: Tensor, kernel: int = 15, on: str = "minmax") -> Tensor:
    """``mean(ReLU(S' − avgpool_k(S'))²)`` per image ``(B,)``.

    ``on="minmax"``: ``S'`` is the per-image min–max scaled map (independent of the map's arbitrary scale, like the
    sorter), the pooling stride 1 with zero padding excluded from the average (``count_include_pad=False``).
    ``on="raw"`` (the AHA authors' code): ``S' = S`` as the network gives it, the pooling over a reflect-padded map.
    The kernel is shrunk to the largest odd size that fits a smaller map.
    """
    if on not in PEAK_INPUTS:
        raise ValueError(f"peak penalty input must be one of {', '.join(PEAK_INPUTS)}, got {on!r}")
    b, h, w = maps.shape
    k = min(kernel, 2 * (min(h, w) // 2) - 1) if min(h, w) < kernel else kernel
    k = max(k, 1)
    if on == "raw":
        s = maps.reshape(b, 1, h, w)
        pad = k // 2
        pooled = F.avg_pool2d(F.pad(s, (pad, pad, pad, pad), mode="reflect") if pad else s, k, stride=1)
        return F.relu(s - pooled).pow(2).mean(dim=(1, 2, 3))
    s = scale_scores(maps.reshape(b, -1)).reshape(b, 1, h, w)
    pooled = F.avg_pool2d(s, k, stride=1, padding=k // 2, count_include_pad=False)
    return F.relu(s - pooled).pow(2).mean(dim=(1, 2, 3))


# --------------------------------------------------------------------------------------------------------------------
# Soft deletion / insertion
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class CurveResult:
    """Soft (or hard-sorted) curves for ``B`` maps.

    ``deletion``/``insertion``: ``(B, n)`` class probabilities at ``fractions`` ``(n,)``; ``del_auc``/``ins_auc``:
    ``(B,)`` trapezoidal AUCs. ``insertion[:, i]`` is the probability with the fraction ``fractions[i]`` of the
    *least* important regions deleted.
    """

    fractions: Tensor
    deletion: Tensor
    insertion: Tensor
    del_auc: Tensor
    ins_auc: Tensor


def soft_curves(
    prob_fn: Callable[[Tensor, Tensor], Tensor],
    x: Tensor,
    ref: Tensor,
    maps: Tensor,
    classes: Tensor,
    grid: RegionGrid,
    fractions: Tensor,
    tau: float,
    n_iters: int = 30,
    noise: Tensor | None = None,
    endpoints: tuple[Tensor, Tensor] | None = None,
    hard: bool = False,
    mask_sigma: float = 1.0,
    straight_through: bool = False,
    scale: bool = True,
    clamp_before: bool = False,
) -> CurveResult:
    """Soft deletion and insertion curves of ``maps`` ``(B, H, W)`` for ``classes`` ``(B,)``.

    Args:
        prob_fn: ``prob_fn(images (N, C, H, W), classes (N,)) → (N,)`` probability of each image's class under the
            target model (differentiable w.r.t. the images); with ``classes`` ``(B, K)`` (several classes scored on
            one map, the AHA authors' second class) ``prob_fn(images, classes (N, K)) → (N, K)``, and the curves are
            the mean over the ``K`` classes (so their AUCs are the mean of the classes' AUCs).
        x, ref: images and references ``(B, C, H, W)``, normalised as the model expects.
        grid: the region partition; ``fractions`` ``(n,)`` sorted, in ``[0, 1]``.
        tau, n_iters: sorter temperature and Sinkhorn iterations.
        noise: ``(B, 2, d, d)`` Gumbel noise for the descending / ascending sorter (training), or ``None``.
        endpoints: ``(prob(x), prob(ref))`` ``(B,)`` each, if known: then the curves take these values at
            ``p = 0`` and ``p = 1`` (the exact values there: nothing / everything deleted) and only the inner
            fractions are evaluated by the model, saving ``2·B`` images per call. Requires ``fractions[0] == 0`` and
            ``fractions[-1] == 1``.
        hard: use the hard (argsort) permutation instead of the sorter (the limit ``τ → 0``).
        mask_sigma: blur of the pixel masks, in pixels.
        straight_through: forward with the hard permutation, backward through the sorter's
            (``P = P_hard + P_soft − stop_grad(P_soft)``): the curve values are those of the hard ranking at the
            grid's resolution, so the target is queried on images with whole regions deleted (as the metric does),
            and the gradient is the relaxation's. Ignored with ``hard``.
        scale: min–max scale the region scores before the sorter (``False``: the raw scores, the authors' code).
        clamp_before: clamp the region memberships to [0, 1] before the masks' blur too (:meth:`RegionGrid.to_pixels`).
    """
    b = maps.shape[0]
    scores = grid.pool(maps)
    if hard:
        p_desc, p_asc = hard_sort(scores, True), hard_sort(scores, False)
    else:
        nd = None if noise is None else noise[:, 0]
        na = None if noise is None else noise[:, 1]
        p_desc = soft_sort(scores, tau, n_iters, noise=nd, descending=True, scale=scale)
        p_asc = soft_sort(scores, tau, n_iters, noise=na, descending=False, scale=scale)
        if straight_through:
            p_desc = hard_sort(scores.detach(), True) + (p_desc - p_desc.detach())
            p_asc = hard_sort(scores.detach(), False) + (p_asc - p_asc.detach())
    fr = fractions.to(maps.device, maps.dtype)
    if endpoints is not None:
        if float(fr[0]) != 0.0 or float(fr[-1]) != 1.0:
            raise ValueError("endpoints need fractions that start at 0 and end at 1")
        inner = fr[1:-1]
    else:
        inner = fr
    n = inner.shape[0]
    if n:
        memb = torch.cat([soft_membership(p_desc, inner), soft_membership(p_asc, inner)], dim=1)  # (B, 2n, d)
        masks = grid.to_pixels(memb, mask_sigma, clamp_before)  # (B, 2n, H, W)
        xs = blend(x, masks, ref)  # (B, 2n, C, H, W)
        if classes.ndim == 2:  # several classes scored on each map: the mean of their curves
            kc = classes.shape[1]
            cls = classes[:, None].expand(b, 2 * n, kc).reshape(-1, kc)
            probs = prob_fn(xs.reshape(b * 2 * n, *x.shape[1:]), cls).reshape(b, 2, n, kc).mean(-1)
        else:
            cls = classes[:, None].expand(b, 2 * n).reshape(-1)
            probs = prob_fn(xs.reshape(b * 2 * n, *x.shape[1:]), cls).reshape(b, 2, n)
        dele, ins = probs[:, 0], probs[:, 1]
    else:
        dele = ins = maps.new_zeros(b, 0)
    if endpoints is not None:
        p0 = endpoints[0].to(maps.dtype).reshape(b, 1)
        p1 = endpoints[1].to(maps.dtype).reshape(b, 1)
        dele = torch.cat([p0, dele, p1], dim=1)
        ins = torch.cat([p0, ins, p1], dim=1)
    return CurveResult(fractions=fr, deletion=dele, insertion=ins,
                       del_auc=trapezoid_auc(dele, fr), ins_auc=trapezoid_auc(ins, fr))


def aha_loss(curves: CurveResult, maps: Tensor, w_del: float = 1.0, w_ins: float = 1.0, w_peak: float = 0.0025,
             peak_kernel: int = 15, peak_on: str = "minmax") -> tuple[Tensor, dict[str, Tensor]]:
    """Per-map loss ``w_del·AUC_desc + w_ins·(1 − AUC_asc) + w_peak·P_peak``, ``(B,)``, and its parts
    (``peak_on``: what the peak penalty sees, :func:`peak_penalty`)."""
    peak = peak_penalty(maps, peak_kernel, peak_on) if w_peak else maps.new_zeros(maps.shape[0])
    loss = w_del * curves.del_auc + w_ins * (1.0 - curves.ins_auc) + w_peak * peak
    return loss, {"del_auc": curves.del_auc, "ins_auc": curves.ins_auc, "peak": peak}


def map_loss(prob_fn: Callable[[Tensor, Tensor], Tensor], x: Tensor, ref: Tensor, maps: Tensor, classes: Tensor,
             grid: RegionGrid, fractions: Tensor, tau: float, cfg: Any, noise: Tensor | None = None,
             endpoints: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """The training loss per map ``(B,)`` and its parts (:func:`aha_loss` of :func:`soft_curves`) under the options of
    ``cfg`` (an :class:`~vitlens.aha.config.AHATrainConfig`): its sorter input, mask clamp, endpoints, mask blur,
    straight-through sorting, loss weights and peak penalty. ``classes`` ``(B,)``, or ``(B, K)`` for one map scored on
    ``K`` classes (``cfg.classes == "authors"``); ``grid`` is built with ``cfg.pooling``; ``endpoints`` (the exact
    probabilities with nothing / everything deleted) are used only with ``cfg.endpoints == "exact"``."""
    curves = soft_curves(prob_fn, x, ref, maps, classes, grid, fractions, tau, cfg.n_iters, noise=noise,
                         endpoints=endpoints if cfg.endpoints == "exact" else None, mask_sigma=cfg.mask_sigma,
                         straight_through=cfg.straight_through, scale=cfg.sorter_input == "minmax",
                         clamp_before=cfg.mask_clamp == "both")
    return aha_loss(curves, maps, cfg.w_del, cfg.w_ins, cfg.w_peak, cfg.peak_kernel, cfg.peak_penalty_on)
