"""Pixels of attribution maps: scaling a map for display, colouring it and blending it over an image.

Everything here returns or writes plain ``(H, W, 3)`` uint8 RGB pixels (figures with colour bars and captions are in
:mod:`vitlens.viz.figures`).

Images are pixels in ``[0, 1]`` (or uint8), not model-normalised input: use :func:`vitlens.images.denormalize` first.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import matplotlib
import numpy as np
import torch
import torch.nn.functional as F
from matplotlib.colors import Colormap
from PIL import Image
from PIL.PngImagePlugin import PngInfo

from vitlens.atomic import atomic_path
from vitlens.errors import InputError
from vitlens.images import to_rgb as _to_rgb

__all__ = [
    "ImageLike",
    "MapLike",
    "MapNormalization",
    "MapStyle",
    "STYLES",
    "Scale",
    "smooth_map",
    "default_style",
    "kind_normalize",
    "style_normalize",
    "to_uint8",
    "is_signed",
    "scale_map",
    "map_scale",
    "apply_scale",
    "normalize_map",
    "default_cmap",
    "upsample_image",
    "display_image",
    "overlay",
    "overlay_with_scale",
    "map_to_original",
    "save_overlay",
    "map_array",
    "prepare_path",
]

ImageLike = torch.Tensor | np.ndarray | Image.Image
"""An image: tensor ``(3, H, W)`` / ``(1, H, W)`` or array ``(H, W, 3)`` / ``(H, W)`` (also ``(H, W, 4)``: alpha is
composited onto white), float in ``[0, 1]`` or uint8; or a PIL image."""

MapLike = torch.Tensor | np.ndarray
"""A heatmap ``(H, W)`` of any real values (leading singleton dimensions such as ``(1, H, W)`` are dropped)."""

MapNormalization = Literal["auto", "signed", "positive", "minmax", "abs", "none"]
"""How a map is scaled for display (see :func:`scale_map`); ``'positive'``: from 0 to the top (non-negative maps)."""

MapStyle = Literal["overlay", "blend", "abs"]
"""How a map is drawn over its image: ``'overlay'`` — colours over the colour image (token-level maps);
``'blend'`` — signed colours (blue < 0 < red) over a dimmed greyscale image, opacity growing with ``|h|``;
``'abs'`` — ``|h|`` on a sequential colour map over the greyscale image, opacity growing with ``|h|``. The last two
keep pixel-level maps (input × gradient, Integrated Gradients) readable on colour photos."""

STYLES: tuple[str, ...] = ("overlay", "blend", "abs")

# Float images may overshoot [0, 1] by interpolation round-off; beyond this they are taken to be normalised input.
_RANGE_TOLERANCE = 1e-3


def _as_numpy(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def to_uint8(image: ImageLike) -> np.ndarray:
    """Convert an image to ``(H, W, 3)`` uint8 RGB.

    Layout: tensors are read as channels-first ``(C, H, W)`` when their first dimension is 1 or 3, otherwise as
    channels-last; arrays as channels-last ``(H, W, C)`` when their last dimension is 1, 3 or 4, otherwise as
    channels-first. A leading batch dimension of size 1 is dropped. Floats are scaled by 255 and rounded.

    Raises:
        InputError: wrong rank or channel count, unsupported dtype, non-finite values, or float values outside
            ``[0, 1]`` (normalised model input: call :func:`vitlens.images.denormalize` first).
    """
    if isinstance(image, Image.Image):
        return np.array(_to_rgb(image), dtype=np.uint8)
    is_tensor = isinstance(image, torch.Tensor)
    arr = _as_numpy(image)
    shape = arr.shape
    if arr.ndim == 4 and arr.shape[0] == 1:
        arr = arr[0]
    if arr.ndim == 2:
        arr = arr[..., None]
    elif arr.ndim == 3:
        channels_first = arr.shape[0] in (1, 3) if is_tensor else arr.shape[-1] not in (1, 3, 4)
        if channels_first:
            arr = np.moveaxis(arr, 0, -1)
    if arr.ndim != 3 or arr.shape[-1] not in (1, 3, 4) or arr.size == 0:
        raise InputError(f"image of shape {shape} is not an image; expected (3, H, W), (H, W, 3) or (H, W)")
    if arr.dtype == np.uint8 and arr.shape[-1] in (1, 3):  # already 8-bit: no float copy (8 bytes per value)
        return np.ascontiguousarray(np.repeat(arr, 3, axis=-1) if arr.shape[-1] == 1 else arr)
    if arr.dtype == np.uint8:
        pixels = arr.astype(np.float64) / 255.0
    elif np.issubdtype(arr.dtype, np.floating):
        pixels = arr.astype(np.float64)
        if not np.all(np.isfinite(pixels)):
            raise InputError("image contains NaN or infinite values")
        lo, hi = float(pixels.min()), float(pixels.max())
        if lo < -_RANGE_TOLERANCE or hi > 1.0 + _RANGE_TOLERANCE:
            raise InputError(
                f"float image values must lie in [0, 1], got [{lo:.4g}, {hi:.4g}]; "
                "for model input call vitlens.images.denormalize first"
            )
        pixels = np.clip(pixels, 0.0, 1.0)
    else:
        raise InputError(f"image dtype {arr.dtype} not supported; use uint8 or float in [0, 1]")
    if pixels.shape[-1] == 4:  # straight alpha onto white
        alpha = pixels[..., 3:4]
        pixels = pixels[..., :3] * alpha + (1.0 - alpha)
    elif pixels.shape[-1] == 1:
        pixels = np.repeat(pixels, 3, axis=-1)
    return np.rint(pixels * 255.0).astype(np.uint8)


def map_array(heatmap: MapLike, allow_nan: bool = False) -> np.ndarray:
    """Validated ``(H, W)`` float64 heatmap (leading size-1 axes dropped; infinities refused, NaN only with
    ``allow_nan`` and never everywhere)."""
    arr = _as_numpy(heatmap)
    shape = arr.shape
    while arr.ndim > 2 and arr.shape[0] == 1:
        arr = arr[0]
    if arr.ndim != 2 or arr.size == 0:
        raise InputError(f"heatmap of shape {shape} is not a map; expected (H, W)")
    if not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer) or arr.dtype == bool):
        raise InputError(f"heatmap dtype {arr.dtype} not supported; expected real numbers")
    arr = arr.astype(np.float64)
    if np.isinf(arr).any() or (not allow_nan and np.isnan(arr).any()):
        raise InputError("heatmap contains NaN or infinite values")
    if np.isnan(arr).all():
        raise InputError("heatmap is NaN everywhere")
    return arr


def warn_if_stretched(map_hw: tuple[int, int], image_hw: tuple[int, int]) -> None:
    """Warn when a ``map_hw`` map drawn over an ``image_hw`` image would be stretched: its aspect ratio is not the
    image's, beyond the rounding of one map cell (a 10x20 map on a 64x64 picture; a 14x14 map on 224x224 is fine)."""
    (h, w), (ih, iw) = map_hw, image_hw
    if (h, w) == (ih, iw) or round(h * iw / ih) == w or round(w * ih / iw) == h:
        return
    import warnings

    warnings.warn(f"a {h}x{w} map is stretched onto a {ih}x{iw} image (aspect ratio {w / h:.3g} vs {iw / ih:.3g}): "
                  "the map was not computed on this image's geometry; for an explanation of a preprocessed input "
                  "use viz.map_to_original(map, original_hw, model) to place it on the original picture",
                  UserWarning, stacklevel=3)


def _resize_map(heatmap: np.ndarray, size_hw: tuple[int, int]) -> np.ndarray:
    """Bilinear resize (half-pixel centres; antialiased when shrinking) of an ``(h, w)`` map to ``size_hw``.

    NaN pixels (no value) are left out: the result is the weighted mean of the neighbours that have a value, and NaN
    where less than half of the weight had one."""
    if heatmap.shape == size_hw:
        return heatmap
    missing = np.isnan(heatmap)
    if missing.any():
        weight = _resize_map((~missing).astype(np.float64), size_hw)
        total = _resize_map(np.where(missing, 0.0, heatmap), size_hw)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(weight >= 0.5, total / np.maximum(weight, 1e-12), np.nan)
    shrinking = size_hw[0] < heatmap.shape[0] or size_hw[1] < heatmap.shape[1]
    t = torch.from_numpy(np.ascontiguousarray(heatmap))[None, None]
    out = F.interpolate(t, size=size_hw, mode="bilinear", align_corners=False, antialias=shrinking)
    return out[0, 0].numpy()


@dataclass(frozen=True)
class Scale:
    """How a map was scaled for display: ``mode`` (``'signed'``, ``'positive'``, ``'abs'``, ``'minmax'`` or
    ``'none'``) and the map values ``vmin``/``vmax`` that got the two ends of the colour map (``vmin = -vmax`` for
    ``'signed'``, 0 for ``'positive'``). ``data_min``/``data_max``: the map's own range (NaN: not recorded) and
    ``clip`` the percentile the scale ends at, so a colour bar can say what it cut (:meth:`clipped`)."""

    mode: str
    vmin: float
    vmax: float
    data_min: float = float("nan")
    data_max: float = float("nan")
    clip: float | None = None

    def clipped(self) -> tuple[bool, bool]:
        """Whether values lie below ``vmin`` / above ``vmax`` (drawn in the end colours: a colour bar's arrows).
        For ``'abs'`` the low end is 0 = no magnitude and never clipped; ``'positive'`` clips values below 0."""
        lo, hi = self.data_min, self.data_max
        if self.mode == "abs":
            top = max(abs(lo), abs(hi)) if math.isfinite(lo) and math.isfinite(hi) else float("nan")
            return False, bool(top > self.vmax * (1 + 1e-9))
        if self.mode == "none":
            return bool(lo < 0.0), bool(hi > 1.0)
        span = 1e-9 * max(abs(self.vmin), abs(self.vmax))
        return bool(lo < self.vmin - span), bool(hi > self.vmax + span)


def is_signed(heatmap: MapLike, share: float = 0.05) -> bool:
    """Whether a map carries real evidence of both signs: its negative part holds at least ``share`` of ``Σ|h|``
    (NaN pixels, without a value, are ignored)."""
    arr = map_array(heatmap, allow_nan=True)
    arr = arr[np.isfinite(arr)]
    total = float(np.abs(arr).sum())
    return total > 0 and float(-arr[arr < 0].sum()) >= share * total


def kind_normalize(value_kind: str | None) -> MapNormalization:
    """The scaling for a method's declared value kind (:data:`vitlens.explainers.VALUE_KINDS`): ``'signed'`` →
    ``'signed'`` (diverging, centred at 0); ``'nonnegative'`` → ``'positive'`` (sequential from 0);
    ``'probability'`` / ``'score'`` → ``'minmax'`` (sequential, lowest to highest); ``None`` (undeclared) →
    ``'auto'`` (judged from the map)."""
    return {"signed": "signed", "nonnegative": "positive", "probability": "minmax",
            "score": "minmax"}.get(str(value_kind), "auto")  # type: ignore[return-value]


def _resolve_mode(arr: np.ndarray, normalize: str) -> MapNormalization:
    if normalize == "auto":
        return "signed" if is_signed(arr) else "minmax"
    if normalize not in ("signed", "positive", "abs", "minmax", "none"):
        raise InputError(f"normalize must be 'auto', 'signed', 'positive', 'abs', 'minmax' or 'none', "
                         f"got {normalize!r}")
    return normalize  # type: ignore[return-value]  # checked against the literals just above


def map_scale(heatmap: MapLike, normalize: MapNormalization = "auto", clip: float | None = None) -> Scale:
    """The :class:`Scale` :func:`scale_map` uses for a heatmap ``(H, W)``, computed over the pixels that have a value.

    NaN (the uncovered area of a map placed on the original image by :func:`map_to_original`) takes no part in the
    range or the percentile clip, so a map and the same map placed on the original get the same scale (up to the
    resampling of :func:`map_to_original`). Pass the result to :func:`overlay` (``scale=``) to draw several figures
    of one map on exactly the same colour range.
    """
    arr = map_array(heatmap, allow_nan=True)
    values = arr[np.isfinite(arr)]
    mode = _resolve_mode(values[None, :], normalize)
    if clip is not None and not 0.0 < float(clip) <= 100.0:
        raise InputError(f"clip must be a percentile in (0, 100], got {clip!r}")
    q = 100.0 if clip is None else float(clip)
    seen: dict[str, Any] = {"data_min": float(values.min()), "data_max": float(values.max()), "clip": None if q >= 100.0 else q}
    if mode in ("signed", "abs"):
        top = float(np.percentile(np.abs(values), q))
        return Scale("signed", -top, top, **seen) if mode == "signed" else Scale("abs", 0.0, top, **seen)
    if mode == "positive":  # 0 to the top of the positive part; values below 0 saturate at 0 (and are said)
        positive = values[values > 0]
        top = float(np.percentile(positive, q)) if positive.size else 0.0
        return Scale("positive", 0.0, top, **seen)
    if mode == "minmax":
        lo, hi = float(np.percentile(values, 100.0 - q)), float(np.percentile(values, q))
        if hi - lo <= 1e-9 * max(abs(lo), abs(hi)):  # constant up to resampling round-off: not stretched to noise
            lo = hi = float(np.median(values))
        return Scale("minmax", lo, hi, **seen)
    return Scale("none", 0.0, 1.0, **seen)


def apply_scale(heatmap: MapLike, scale: Scale) -> np.ndarray:
    """Map values ``(H, W)`` to ``[0, 1]`` on a given :class:`Scale` (values beyond saturate; NaN stays NaN).
    A scale of zero width gives a constant result (0.5 for ``'signed'``, else 0), never NaN."""
    arr = map_array(heatmap, allow_nan=True)
    if scale.mode == "signed":
        top = scale.vmax
        return 0.5 + 0.5 * np.clip(arr / top, -1.0, 1.0) if top > 0 else np.where(np.isnan(arr), np.nan, 0.5)
    if scale.mode == "abs":
        top = scale.vmax
        return np.clip(np.abs(arr) / top, 0.0, 1.0) if top > 0 else np.where(np.isnan(arr), np.nan, 0.0)
    if scale.mode == "positive":
        top = scale.vmax
        return np.clip(arr / top, 0.0, 1.0) if top > 0 else np.where(np.isnan(arr), np.nan, 0.0)
    if scale.mode == "minmax":
        lo, hi = scale.vmin, scale.vmax
        return np.clip((arr - lo) / (hi - lo), 0.0, 1.0) if hi > lo else np.where(np.isnan(arr), np.nan, 0.0)
    return np.clip(arr, 0.0, 1.0)


def scale_map(heatmap: MapLike, normalize: MapNormalization = "auto", clip: float | None = None
              ) -> tuple[np.ndarray, Scale]:
    """Scale a heatmap ``(H, W)`` to ``[0, 1]`` for a colour map; returns ``(values, scale)``.

    Modes: ``'signed'``: ``0.5 + h / (2 s)`` with ``s = max|h|`` (0 lands on the middle of a diverging colour map);
    ``'positive'``: ``h / max h`` (non-negative maps, from 0; values below 0 saturate at 0); ``'abs'``: ``|h| / s`` (magnitude only); ``'minmax'``: ``(h - min) / (max - min)``; ``'none'``: clipped to
    ``[0, 1]``; ``'auto'``: ``'signed'`` when :func:`is_signed`, else ``'minmax'``.
    ``clip`` (a percentile in ``(0, 100]``, e.g. 99) replaces the maximum (and, for ``'minmax'``, the minimum by the
    ``100 - clip`` percentile) so that a few extreme pixels do not wash out the rest; values beyond saturate.
    A constant map gives a constant result, never NaN. NaN pixels (no value) are left out of the range and the
    percentiles (see :func:`map_scale`) and stay NaN in the result.
    """
    scale = map_scale(heatmap, normalize, clip)
    return apply_scale(heatmap, scale), scale


def normalize_map(heatmap: MapLike, normalize: MapNormalization = "minmax", clip: float | None = None) -> np.ndarray:
    """Scale a heatmap ``(H, W)`` to ``[0, 1]`` for display; returns ``(H, W)`` float64 (see :func:`scale_map`).

    ``'minmax'``: ``(h - min) / (max - min)``; ``'abs'``: ``|h| / max|h|`` (signed maps, magnitude only);
    ``'signed'``: zero at 0.5; ``'none'``: values clipped to ``[0, 1]`` (maps already on that scale). A constant map
    gives all zeros (0.5 for ``'signed'``), never NaN.
    """
    return scale_map(heatmap, normalize, clip)[0]


def default_cmap(mode: str) -> str:
    """The colour map used when none is given: diverging ``'RdBu_r'`` (blue < 0 < red, white at 0) for signed maps,
    sequential ``'inferno'`` (perceptually uniform, dark = low, readable in grey print) otherwise."""
    return "RdBu_r" if mode == "signed" else "inferno"


def _colormap(cmap: str | Colormap) -> Colormap:
    if isinstance(cmap, Colormap):
        return cmap
    try:
        return matplotlib.colormaps[cmap]
    except KeyError:
        raise InputError(f"unknown matplotlib colormap {cmap!r}") from None


def default_style(level: str, value_kind: str | None = "signed") -> MapStyle:
    """The style a method's maps are drawn in by default: pixel-level methods (``level='pixel'``) on a grey copy of
    the image — ``'blend'`` for signed maps, ``'abs'`` for non-negative ones (a gradient's magnitude); smooth
    probability-like pixel maps (RISE) and token-level maps ``'overlay'`` the colour image."""
    if level != "pixel" or value_kind in ("probability", "score"):
        return "overlay"
    return "abs" if value_kind == "nonnegative" else "blend"


def style_normalize(style: str, normalize: MapNormalization) -> MapNormalization:
    """The scaling a style implies: ``'abs'`` always scales ``|h|``; ``'blend'`` turns ``'auto'`` into ``'signed'``."""
    if style == "abs":
        return "abs"
    return "signed" if style == "blend" and normalize == "auto" else normalize


def smooth_map(heatmap: MapLike, sigma: float) -> np.ndarray:
    """Gaussian smoothing of a heatmap ``(H, W)`` with standard deviation ``sigma`` in map pixels (0: unchanged).

    For display only (speckled pixel-level maps); NaN pixels take no part and stay NaN. Edges are handled by
    normalising with the kernel weight that fell inside the map, so a constant map stays constant.
    Returns ``(H, W)`` float64.
    """
    arr = map_array(heatmap, allow_nan=True)
    if not (math.isfinite(float(sigma)) and float(sigma) >= 0.0):
        raise InputError(f"smoothing sigma must be a number >= 0 (map pixels), got {sigma!r}")
    if float(sigma) == 0.0:
        return arr
    radius = max(1, int(math.ceil(3.0 * float(sigma))))
    taps = torch.arange(-radius, radius + 1, dtype=torch.float64)
    kernel = torch.exp(-0.5 * (taps / float(sigma)) ** 2)
    kernel = kernel / kernel.sum()
    missing = np.isnan(arr)

    def blur(values: np.ndarray) -> np.ndarray:
        t = torch.from_numpy(np.ascontiguousarray(values))[None, None]
        t = F.conv2d(F.pad(t, (radius, radius, 0, 0)), kernel.view(1, 1, 1, -1))
        t = F.conv2d(F.pad(t, (0, 0, radius, radius)), kernel.view(1, 1, -1, 1))
        return t[0, 0].numpy()

    weight = blur((~missing).astype(np.float64))
    total = blur(np.where(missing, 0.0, arr))
    return np.where(missing, np.nan, total / np.maximum(weight, 1e-12))


def display_image(image: ImageLike, min_side: int, max_side: int = 2048) -> np.ndarray:
    """``(H', W', 3)`` uint8 for display: small images enlarged by an integer factor (nearest) towards a shorter side
    ``>= min_side``, but never beyond a longer side of ``max_side``; images whose longer side exceeds ``max_side``
    shrunk to it (antialiased), so a figure never holds a huge photo at full size and any aspect ratio stays bounded.
    """
    pixels = to_uint8(image)
    h, w = pixels.shape[:2]
    longest = max(h, w)
    if longest > max_side:
        size = (max(1, round(w * max_side / longest)), max(1, round(h * max_side / longest)))
        return np.asarray(Image.fromarray(pixels).resize(size, Image.Resampling.LANCZOS))
    factor = max(1, min(math.ceil(int(min_side) / min(h, w)), max_side // longest))
    return pixels if factor == 1 else np.repeat(np.repeat(pixels, factor, axis=0), factor, axis=1)


def upsample_image(image: ImageLike, min_side: int) -> np.ndarray:
    """``(H, W, 3)`` uint8, enlarged by the smallest integer factor that makes its shorter side ``>= min_side``
    (nearest neighbour: every input pixel stays a visible square, nothing is invented)."""
    pixels = to_uint8(image)
    factor = max(1, math.ceil(int(min_side) / min(pixels.shape[:2])))
    return pixels if factor == 1 else np.repeat(np.repeat(pixels, factor, axis=0), factor, axis=1)


def _greyscale_background(pixels: np.ndarray) -> np.ndarray:
    """``(H, W, 3)`` float: the image in grey (Rec. 601 luma), its contrast reduced so colours stand out on it."""
    grey = pixels.astype(np.float64) @ np.array([0.299, 0.587, 0.114])
    return np.repeat((64.0 + 0.5 * grey)[..., None], 3, axis=-1)


def overlay_with_scale(
    image: ImageLike,
    heatmap: MapLike,
    alpha: float = 0.5,
    cmap: str | Colormap | None = None,
    normalize: MapNormalization = "auto",
    clip: float | None = None,
    scale: Scale | None = None,
    style: MapStyle = "overlay",
) -> tuple[np.ndarray, Scale, Colormap]:
    """:func:`overlay` that also returns the :class:`Scale` and colour map it used (for a colour bar)."""
    if not 0.0 <= float(alpha) <= 1.0:
        raise InputError(f"alpha must lie in [0, 1], got {alpha!r}")
    if style not in STYLES:
        raise InputError(f"style must be one of {', '.join(STYLES)}, got {style!r}")
    pixels = to_uint8(image)
    arr = map_array(heatmap, allow_nan=True)
    if scale is None:  # over the map's own pixels that have a value, before any resampling to the image
        scale = map_scale(arr, style_normalize(style, normalize), clip)
    mode = scale.mode
    default = default_cmap(mode)
    colormap = _colormap(cmap if cmap is not None else default)
    warn_if_stretched(arr.shape, pixels.shape[:2])
    scaled = apply_scale(_resize_map(arr, pixels.shape[:2]), scale)
    valid = ~np.isnan(scaled)  # areas the model did not see (map_to_original): the image shows through
    scaled = np.where(valid, scaled, 0.0)
    colours = colormap(scaled)[..., :3] * 255.0
    weight = np.full(scaled.shape, float(alpha))
    if mode == "signed":  # opacity grows with |h| (full colour at ±max for alpha 0.5): 0 leaves the image as it is
        weight = min(1.0, 2.0 * float(alpha)) * np.abs(2.0 * scaled - 1.0)
    elif style != "overlay":  # magnitude on grey: opacity grows with the value, 0 shows the grey image
        weight = min(1.0, 2.0 * float(alpha)) * scaled
    weight = np.where(valid, weight, 0.0)[..., None]
    background = pixels.astype(np.float64) if style == "overlay" else _greyscale_background(pixels)
    blended = (1.0 - weight) * background + weight * colours
    return np.clip(np.rint(blended), 0, 255).astype(np.uint8), scale, colormap


def overlay(
    image: ImageLike,
    heatmap: MapLike,
    alpha: float = 0.5,
    cmap: str | Colormap | None = None,
    normalize: MapNormalization = "auto",
    clip: float | None = None,
    scale: Scale | None = None,
    style: MapStyle = "overlay",
) -> np.ndarray:
    """Blend a colour-mapped heatmap over an image.

    Args:
        image: the picture (see :data:`ImageLike`), pixels in ``[0, 1]`` or uint8.
        heatmap: ``(h, w)`` real values; resized bilinearly to the image's ``(H, W)`` if the sizes differ (a
            ``UserWarning`` when that stretches it: aspect ratios that differ beyond one map cell). NaN
            marks pixels without a value (outside what the model saw, see :func:`map_to_original`): left uncoloured.
        alpha: heatmap opacity in ``[0, 1]``; 0 returns the image unchanged, 1 the coloured map alone.
        cmap: matplotlib colormap name or object; default :func:`default_cmap` of the scaling mode.
        normalize: how the map is scaled to ``[0, 1]`` (see :func:`scale_map`); ``'auto'`` picks ``'signed'`` for
            maps with real negative evidence, else ``'minmax'``.
        clip: percentile clipping of the scale (see :func:`scale_map`).
        scale: a fixed colour range (from :func:`map_scale`) instead of one computed from this map; ``normalize``
            and ``clip`` are then unused.
        style: ``'overlay'``, ``'blend'`` (greyscale image, signed colours) or ``'abs'`` (greyscale image, ``|h|``
            on ``'inferno'``); see :data:`MapStyle`.

    Returns:
        ``(H, W, 3)`` uint8 RGB: ``round((1 - a) * image + a * 255 * cmap(map))`` with ``a = alpha``; for signed
        scaling ``a = min(1, 2 alpha) * |h| / max|h|``, so zero relevance leaves the image as it is and the strongest
        evidence of either sign is drawn in full colour.
    """
    return overlay_with_scale(image, heatmap, alpha, cmap, normalize, clip, scale, style)[0]


def map_to_original(heatmap: MapLike, original_hw: tuple[int, int], config: Any) -> np.ndarray:
    """Place a map of the model's input view ``(H, W)`` on the original image ``(h, w)`` it was cut from.

    Inverts the geometry of :func:`vitlens.images.preprocess` (resize, then centre crop or pad) for ``config`` (a
    model or anything :func:`vitlens.images.data_config` accepts). Pixels of the original that the model never saw
    (cropped away) are NaN; :func:`overlay` leaves them uncoloured. Returns ``(h, w)`` float64.
    """
    from vitlens.images import data_config, resize_shape

    from vitlens.errors import InputError

    h, w = (int(v) for v in original_hw)
    if h < 1 or w < 1:
        raise InputError(f"map_to_original: the original image size must be at least 1 x 1 pixels; got {h} x {w}")
    cfg = data_config(config)
    arr = np.nan_to_num(map_array(heatmap, allow_nan=True), nan=0.0)
    out_h, out_w = cfg.size_hw
    if arr.shape != (out_h, out_w):
        arr = _resize_map(arr, (out_h, out_w))
    new_h, new_w = resize_shape(h, w, cfg)
    # Offsets of the view in the resized image (negative where the view was padded), as in images._crop_or_pad.
    pad_top = (out_h - new_h) // 2 if out_h > new_h else 0
    pad_left = (out_w - new_w) // 2 if out_w > new_w else 0
    top = int(round((max(new_h, out_h) - out_h) / 2.0)) - pad_top
    left = int(round((max(new_w, out_w) - out_w) / 2.0)) - pad_left
    sy, sx = h / new_h, w / new_w
    y0, y1, x0, x1 = top * sy, (top + out_h) * sy, left * sx, (left + out_w) * sx
    box_h, box_w = max(1, int(round(y1 - y0))), max(1, int(round(x1 - x0)))
    placed = _resize_map(arr, (box_h, box_w))
    canvas = np.full((h, w), np.nan)
    r0, c0 = int(round(y0)), int(round(x0))
    rs, cs = max(0, r0), max(0, c0)
    re_, ce = min(h, r0 + box_h), min(w, c0 + box_w)
    if re_ > rs and ce > cs:
        canvas[rs:re_, cs:ce] = placed[rs - r0:re_ - r0, cs - c0:ce - c0]
    return canvas


def prepare_path(path: str | Path) -> Path:
    """``path`` as a :class:`~pathlib.Path` whose parent folders exist (created if missing)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def save_overlay(
    path: str | Path,
    image: ImageLike,
    heatmap: MapLike,
    *,
    metadata: Mapping[str, str] | None = None,
    **overlay_kwargs: Any,
) -> Path:
    """Write :func:`overlay` ``(image, heatmap, **overlay_kwargs)`` as an image file (format from the suffix).

    ``metadata`` (provenance: method, model, settings) is stored as PNG text chunks; it requires a ``.png`` path.
    Parent folders are created. Returns the path written.
    """
    pixels = overlay(image, heatmap, **overlay_kwargs)
    path = prepare_path(path)
    if metadata:
        if path.suffix.lower() != ".png":
            raise InputError(f"metadata can only be stored in a PNG file, got '{path.name}'")
        info = PngInfo()
        for key, value in metadata.items():
            info.add_text(str(key), str(value))
        with atomic_path(path) as tmp:
            Image.fromarray(pixels).save(tmp, pnginfo=info)
    else:
        with atomic_path(path) as tmp:
            Image.fromarray(pixels).save(tmp)
    return path
