"""Pictures of attribution maps: heatmap overlays and side-by-side comparison grids.

The last stage of ``image → model adapter → explainer → map → metric/report``. Everything returns or writes plain
``(H, W, 3)`` uint8 RGB pixels. Figures are drawn with :class:`matplotlib.figure.Figure` on an explicit
``FigureCanvasAgg``, so importing or using this module never changes matplotlib's global backend or pyplot state.

Images are pixels in ``[0, 1]`` (or uint8), not model-normalised input: use :func:`vitlens.images.denormalize` first.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import matplotlib
import numpy as np
import torch
import torch.nn.functional as F
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import Colormap
from matplotlib.figure import Figure
from PIL import Image
from PIL.PngImagePlugin import PngInfo

from vitlens.errors import InputError
from vitlens.images import _to_rgb

__all__ = [
    "ImageLike",
    "MapLike",
    "MapNormalization",
    "to_uint8",
    "normalize_map",
    "overlay",
    "save_overlay",
    "save_grid",
]

ImageLike = torch.Tensor | np.ndarray | Image.Image
"""An image: tensor ``(3, H, W)`` / ``(1, H, W)`` or array ``(H, W, 3)`` / ``(H, W)`` (also ``(H, W, 4)``: alpha is
composited onto white), float in ``[0, 1]`` or uint8; or a PIL image."""

MapLike = torch.Tensor | np.ndarray
"""A heatmap ``(H, W)`` of any real values (leading singleton dimensions such as ``(1, H, W)`` are dropped)."""

MapNormalization = Literal["minmax", "abs", "none"]

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


def _map_array(heatmap: MapLike) -> np.ndarray:
    """Validated ``(H, W)`` float64 heatmap."""
    arr = _as_numpy(heatmap)
    shape = arr.shape
    while arr.ndim > 2 and arr.shape[0] == 1:
        arr = arr[0]
    if arr.ndim != 2 or arr.size == 0:
        raise InputError(f"heatmap of shape {shape} is not a map; expected (H, W)")
    if not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer) or arr.dtype == bool):
        raise InputError(f"heatmap dtype {arr.dtype} not supported; expected real numbers")
    arr = arr.astype(np.float64)
    if not np.all(np.isfinite(arr)):
        raise InputError("heatmap contains NaN or infinite values")
    return arr


def _resize_map(heatmap: np.ndarray, size_hw: tuple[int, int]) -> np.ndarray:
    """Bilinear resize (half-pixel centres; antialiased when shrinking) of an ``(h, w)`` map to ``size_hw``."""
    if heatmap.shape == size_hw:
        return heatmap
    shrinking = size_hw[0] < heatmap.shape[0] or size_hw[1] < heatmap.shape[1]
    t = torch.from_numpy(np.ascontiguousarray(heatmap))[None, None]
    out = F.interpolate(t, size=size_hw, mode="bilinear", align_corners=False, antialias=shrinking)
    return out[0, 0].numpy()


def normalize_map(heatmap: MapLike, normalize: MapNormalization = "minmax") -> np.ndarray:
    """Scale a heatmap ``(H, W)`` to ``[0, 1]`` for display; returns ``(H, W)`` float64.

    ``'minmax'``: ``(h - min) / (max - min)``; ``'abs'``: ``|h| / max|h|`` (signed maps, magnitude only);
    ``'none'``: values clipped to ``[0, 1]`` (maps already on that scale). A constant map gives all zeros, never NaN.
    """
    arr = _map_array(heatmap)
    if normalize == "minmax":
        lo, hi = float(arr.min()), float(arr.max())
        return (arr - lo) / (hi - lo) if hi > lo else np.zeros_like(arr)
    if normalize == "abs":
        mag = np.abs(arr)
        top = float(mag.max())
        return mag / top if top > 0 else np.zeros_like(arr)
    if normalize == "none":
        return np.clip(arr, 0.0, 1.0)
    raise InputError(f"normalize must be 'minmax', 'abs' or 'none', got {normalize!r}")


def _colormap(cmap: str | Colormap) -> Colormap:
    if isinstance(cmap, Colormap):
        return cmap
    try:
        return matplotlib.colormaps[cmap]
    except KeyError:
        raise InputError(f"unknown matplotlib colormap {cmap!r}") from None


def overlay(
    image: ImageLike,
    heatmap: MapLike,
    alpha: float = 0.5,
    cmap: str | Colormap = "jet",
    normalize: MapNormalization = "minmax",
) -> np.ndarray:
    """Blend a colour-mapped heatmap over an image.

    Args:
        image: the picture (see :data:`ImageLike`), pixels in ``[0, 1]`` or uint8.
        heatmap: ``(h, w)`` real values; resized bilinearly to the image's ``(H, W)`` if the sizes differ.
        alpha: heatmap opacity in ``[0, 1]``; 0 returns the image unchanged, 1 the coloured map alone.
        cmap: matplotlib colormap name (looked up in ``matplotlib.colormaps``) or object.
        normalize: how the map is scaled to ``[0, 1]`` before colouring (see :func:`normalize_map`).

    Returns:
        ``(H, W, 3)`` uint8 RGB: ``round((1 - alpha) * image + alpha * 255 * cmap(map))``.
    """
    if not 0.0 <= float(alpha) <= 1.0:
        raise InputError(f"alpha must lie in [0, 1], got {alpha!r}")
    colormap = _colormap(cmap)
    pixels = to_uint8(image)
    scaled = normalize_map(_resize_map(_map_array(heatmap), pixels.shape[:2]), normalize)
    colours = colormap(scaled)[..., :3] * 255.0
    blended = (1.0 - alpha) * pixels.astype(np.float64) + alpha * colours
    return np.clip(np.rint(blended), 0, 255).astype(np.uint8)


def _prepare_path(path: str | Path) -> Path:
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
    path = _prepare_path(path)
    if metadata:
        if path.suffix.lower() != ".png":
            raise InputError(f"metadata can only be stored in a PNG file, got '{path.name}'")
        info = PngInfo()
        for key, value in metadata.items():
            info.add_text(str(key), str(value))
        Image.fromarray(pixels).save(path, pnginfo=info)
    else:
        Image.fromarray(pixels).save(path)
    return path


def _image_list(images: ImageLike | Sequence[ImageLike]) -> list[ImageLike]:
    if isinstance(images, (torch.Tensor, np.ndarray)):
        if images.ndim == 4:
            return list(images)
        return [images]
    if isinstance(images, Image.Image):
        return [images]
    return list(images)


def _map_list(maps: MapLike | Sequence[MapLike], name: str, count: int) -> list[MapLike]:
    if isinstance(maps, (torch.Tensor, np.ndarray)):
        maps_list: list[MapLike] = list(maps) if maps.ndim == 3 else [maps]
    else:
        maps_list = list(maps)
    if len(maps_list) != count:
        raise InputError(f"heatmaps[{name!r}] has {len(maps_list)} map(s) for {count} image(s)")
    return maps_list


def save_grid(
    path: str | Path,
    images: ImageLike | Sequence[ImageLike],
    heatmaps: Mapping[str, MapLike | Sequence[MapLike]],
    titles: Sequence[str] | None = None,
    row_labels: Sequence[str] | None = None,
    col_size: float = 2.0,
    *,
    alpha: float = 0.5,
    cmap: str | Colormap = "jet",
    normalize: MapNormalization = "minmax",
    dpi: int = 100,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write a comparison grid: one row per image; the image, then one overlay column per method.

    Args:
        path: output file (``.png``; matplotlib picks the format from the suffix). Parent folders are created.
        images: ``(B, 3, H, W)`` tensor, ``(B, H, W, 3)`` array, or a list of B images (see :data:`ImageLike`).
        heatmaps: method name → its B maps, as a ``(B, h, w)`` tensor/array or a list; column order is dict order.
        titles: column titles, ``1 + len(heatmaps)`` of them; default ``['image', *heatmaps]``.
        row_labels: one label per image, drawn left of each row; default none.
        col_size: edge of each cell in inches.
        alpha, cmap, normalize: passed to :func:`overlay`.
        dpi: resolution of the written raster.
        metadata: provenance stored in the file (PNG text chunks).

    Returns:
        The path written.
    """
    image_list = _image_list(images)
    if not image_list:
        raise InputError("save_grid got no images")
    rows = len(image_list)
    columns = {name: _map_list(maps, name, rows) for name, maps in heatmaps.items()}
    column_titles = ["image", *columns] if titles is None else [str(t) for t in titles]
    if len(column_titles) != 1 + len(columns):
        raise InputError(f"titles has {len(column_titles)} entries for {1 + len(columns)} columns (image + methods)")
    if row_labels is not None and len(row_labels) != rows:
        raise InputError(f"row_labels has {len(row_labels)} entries for {rows} image(s)")
    if not col_size > 0:
        raise InputError(f"col_size must be > 0 inches, got {col_size!r}")

    ncols = 1 + len(columns)
    fig = Figure(figsize=(col_size * ncols, col_size * rows), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, ncols, squeeze=False)
    for r, image in enumerate(image_list):
        pixels = to_uint8(image)
        cells = [pixels] + [
            overlay(pixels, maps[r], alpha=alpha, cmap=cmap, normalize=normalize) for maps in columns.values()
        ]
        for c, cell in enumerate(cells):
            ax = axes[r, c]
            ax.imshow(cell, interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            for spine in ax.spines.values():
                spine.set_visible(False)
            if r == 0:
                ax.set_title(column_titles[c], fontsize=9)
            if c == 0 and row_labels is not None:
                ax.set_ylabel(str(row_labels[r]), fontsize=9)
    path = _prepare_path(path)
    fig.savefig(path, dpi=dpi, metadata=dict(metadata) if metadata else None)
    return path
