"""Figures of attribution maps: one explanation with its colour bar and caption, and method comparison grids.

Figures are drawn with :class:`matplotlib.figure.Figure` on an explicit ``FigureCanvasAgg``, so importing or using
this module never changes matplotlib's global backend or pyplot state. Small inputs (a 64-px scene, a 28-px digit)
are enlarged by an integer factor (nearest neighbour) before the map is blended, so the map is drawn smoothly at the
resolution of the figure and every input pixel stays visible as a square.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.cm import ScalarMappable
from matplotlib.colors import Colormap, Normalize
from matplotlib.figure import Figure

from vitlens.errors import InputError

from .pixels import (
    ImageLike,
    MapLike,
    MapNormalization,
    MapStyle,
    Scale,
    is_signed,
    map_array,
    overlay_with_scale,
    prepare_path,
    smooth_map,
    style_normalize,
    display_image,
    to_uint8,
)

from ..atomic import atomic_path

__all__ = ["save_figure", "save_grid", "colorbar_label", "split_label"]


def colorbar_label(mode: str, units: str = "relevance") -> str:
    """What the colours mean, in words, for a scaling mode (see :func:`vitlens.viz.scale_map`)."""
    if mode == "signed":
        return f"{units}: blue against the class, red for it (white = 0)"
    if mode == "abs":
        return f"|{units}| (sign ignored)"
    if mode == "minmax":
        return f"{units}, lowest to highest"
    return units


def _ticks(scale: Scale, relative: bool) -> tuple[list[float], list[str]]:
    """Tick positions on the ``[0, 1]`` colour scale and their labels (map values, or words when maps differ)."""
    if scale.mode == "signed":
        if relative:
            return [0.0, 0.5, 1.0], ["−max", "0", "+max"]
        return [0.0, 0.5, 1.0], [f"{scale.vmin:.3g}", "0", f"+{scale.vmax:.3g}"]
    if relative:
        return [0.0, 1.0], ["0" if scale.mode == "abs" else "min", "max"]
    return [0.0, 1.0], [f"{scale.vmin:.3g}", f"{scale.vmax:.3g}"]


def _add_colorbar(fig: Figure, axes: Any, cmap: Colormap, scale: Scale, units: str, relative: bool,
                  location: str = "right", fontsize: float = 8, wrap: int = 34) -> None:
    """A colour bar beside ``axes`` (``location='right'``) or drawn into the axes ``axes`` (``'bottom'``)."""
    mappable = ScalarMappable(norm=Normalize(0.0, 1.0), cmap=cmap)
    if location == "right":
        bar = fig.colorbar(mappable, ax=axes, location="right", fraction=0.05, aspect=25)
    else:
        bar = fig.colorbar(mappable, cax=axes, orientation="horizontal")
    ticks, labels = _ticks(scale, relative)
    bar.set_ticks(ticks, labels=labels, fontsize=fontsize - 1)
    label = colorbar_label(scale.mode, units)
    if location == "right":  # wrap to the bar's height so the label is never cut
        label = textwrap.fill(label, max(20, int(fig.get_figheight() * 10)))
    else:
        label = textwrap.fill(label, wrap)
    bar.set_label(label, fontsize=fontsize)


def split_label(label: str) -> tuple[str, str]:
    """``'gradskip[alpha=0,skip=fixed]'`` → ``('gradskip', 'alpha=0, skip=fixed')``; a plain name: ``(name, '')``."""
    name, sep, rest = str(label).partition("[")
    if sep and rest.endswith("]"):
        return name, rest[:-1].replace(",", ", ")
    return str(label), ""


def _clean_axes(ax: Any) -> None:
    ax.set_xticks([])
    ax.set_yticks([])
    for spine in ax.spines.values():
        spine.set_visible(False)


def _check_dpi(dpi: Any) -> None:
    """A figure's resolution: an integer in [1, 1200] (a larger one makes gigapixel rasters of a few-inch figure)."""
    if isinstance(dpi, bool) or not isinstance(dpi, (int, float)) or not 1 <= dpi <= 1200:
        raise InputError(f"dpi must be a number in [1, 1200], got {dpi!r}")


def _check_suffix(path: str | Path) -> None:
    """A figure's file name must end in a format matplotlib writes (``.png``, ``.pdf``, ``.svg``, ...)."""
    kinds = FigureCanvasAgg(Figure()).get_supported_filetypes()
    if Path(path).suffix.lower().lstrip(".") not in kinds:
        raise InputError(f"cannot save a figure as {path}: its name must end in one of "
                         f"{', '.join('.' + k for k in sorted(kinds))}")


def save_figure(
    path: str | Path,
    image: ImageLike,
    heatmap: MapLike,
    *,
    title: str | None = None,
    caption: str | None = None,
    show_image: bool = True,
    alpha: float = 0.5,
    cmap: str | Colormap | None = None,
    normalize: MapNormalization = "auto",
    clip: float | None = 99.5,
    scale: Scale | None = None,
    style: MapStyle = "overlay",
    smooth: float = 0.0,
    units: str = "relevance",
    min_side: int = 320,
    max_side: int = 2048,
    panel_size: float = 3.6,
    dpi: int = 100,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write one explanation as a figure: the image, the overlay, a colour bar saying what the colours mean, and a
    caption (e.g. ``"tiger cat, p = 0.93 (true: tiger cat)"``).

    Args:
        path: output file; the format follows the suffix (``.png``, ``.pdf``, ``.svg``); parent folders are created.
        image: the picture (see :data:`vitlens.viz.ImageLike`) at any resolution, e.g. the original photo with
            :func:`vitlens.viz.map_to_original` applied to the map.
        heatmap: ``(h, w)`` map, resized to the image; NaN where the model saw nothing (left uncoloured).
        title: drawn above the overlay (e.g. the method and its settings).
        caption: drawn under the panels, wrapped.
        show_image: also show the plain image left of the overlay.
        alpha, cmap, normalize, clip: as in :func:`vitlens.viz.overlay`; by default the colour scale ends at the
            99.5th percentile (a few extreme pixels, common in gradient maps, would wash out the rest; ``None``:
            the maximum). The scale is computed over the pixels that have a value (NaN is left out).
        scale: a fixed colour range (:func:`vitlens.viz.map_scale`), e.g. to draw a map on the original image and
            on the model's view with the same colours; ``normalize`` and ``clip`` are then unused.
        style: ``'overlay'``, ``'blend'`` or ``'abs'`` (see :data:`vitlens.viz.MapStyle`); the plain image panel is
            shown in colour in every style.
        smooth: Gaussian smoothing of the map before drawing, standard deviation in map pixels (0: none).
        units: what the map's values are, for the colour bar's label.
        min_side: images whose shorter side is smaller are enlarged (integer factor, nearest) before blending.
        max_side: the longest side drawn, in pixels: larger images (and their maps) are shrunk to it, smaller ones
            are never enlarged beyond it (see :func:`vitlens.viz.display_image`).
        panel_size: width of each panel in inches; the height follows the aspect ratio, bounded to between a
            quarter of and four times the width (very thin images are drawn in a panel of that size).
        dpi: resolution of the written raster.
        metadata: provenance stored in the file (PNG text chunks; for PDF and SVG as JSON in the document's
            subject/description).

    Returns:
        The path written.
    """
    _check_suffix(path)
    _check_dpi(dpi)
    pixels = display_image(image, min_side, max_side)
    arr = map_array(heatmap, allow_nan=True)
    arr = smooth_map(np.abs(arr) if style == "abs" else arr, smooth)  # |h| is smoothed: signs never cancel
    blended, scale, colormap = overlay_with_scale(pixels, arr, alpha, cmap, normalize, clip, scale, style)
    h, w = blended.shape[:2]
    panels = [("image", pixels), (title or "explanation", blended)] if show_image else [(title or "", blended)]
    width = panel_size * len(panels) + 1.1
    aspect = min(4.0, max(0.25, h / w))  # a 1 x 500 strip must not make a figure a hundred metres tall
    height = panel_size * aspect + (0.5 if caption else 0.15) + (0.35 if title else 0.0)
    fig = Figure(figsize=(width, height), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (name, cell) in zip(axes, panels):
        ax.imshow(cell, interpolation="antialiased")
        _clean_axes(ax)
        if name:
            ax.set_title(name, fontsize=10)
    _add_colorbar(fig, list(axes), colormap, scale, units, relative=False)
    if caption:
        fig.supxlabel(textwrap.fill(caption, int(12 * width)), fontsize=10)
    path = prepare_path(path)
    with atomic_path(path) as tmp:  # no half-written picture survives an error or a kill
        fig.savefig(tmp, dpi=dpi, format=path.suffix.lstrip(".").lower() or None,
                    metadata=_file_metadata(path, metadata))
    return path


def _file_metadata(path: Path, metadata: Mapping[str, str] | None) -> dict[str, str] | None:
    """Provenance in the form each format takes: PNG text chunks; PDF ``Subject`` and SVG ``Description`` (JSON)."""
    if not metadata:
        return None
    kind = path.suffix.lower()
    if kind == ".png":
        return {str(k): str(v) for k, v in metadata.items()}
    import json

    text = json.dumps({str(k): str(v) for k, v in metadata.items()})
    if kind == ".pdf":
        return {"Subject": text}
    if kind == ".svg":
        return {"Description": text}
    return None


def _image_list(images: ImageLike | Sequence[ImageLike]) -> list[ImageLike]:
    if isinstance(images, (torch.Tensor, np.ndarray)):
        if images.ndim == 4:
            return list(images)
        return [images]
    from PIL import Image

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


def _check_grid(rows: int, columns: Mapping[str, list], titles: Sequence[str] | None,
                row_labels: Sequence[str] | None, captions: Sequence[str] | None, col_size: float) -> list[str]:
    column_titles = ["image", *columns] if titles is None else [str(t) for t in titles]
    if len(column_titles) != 1 + len(columns):
        raise InputError(f"titles has {len(column_titles)} entries for {1 + len(columns)} columns (image + methods)")
    for name, given in (("row_labels", row_labels), ("captions", captions)):
        if given is not None and len(given) != rows:
            raise InputError(f"{name} has {len(given)} entries for {rows} image(s)")
    if not col_size > 0:
        raise InputError(f"col_size must be > 0 inches, got {col_size!r}")
    return column_titles


def _column_title(title: str, width_chars: int) -> str:
    from vitlens.explainers.registry import display_parts  # the registry imports no method

    name, settings = display_parts(title)
    text = textwrap.fill(name, width_chars)
    return text + ("\n" + textwrap.fill(settings, width_chars + 4) if settings else "")


def save_grid(
    path: str | Path,
    images: ImageLike | Sequence[ImageLike],
    heatmaps: Mapping[str, MapLike | Sequence[MapLike]],
    titles: Sequence[str] | None = None,
    row_labels: Sequence[str] | None = None,
    col_size: float = 2.0,
    *,
    captions: Sequence[str] | None = None,
    colorbar: bool = True,
    alpha: float = 0.5,
    cmap: str | Colormap | None = None,
    normalize: MapNormalization = "auto",
    clip: float | None = 99.5,
    styles: Mapping[str, MapStyle] | None = None,
    smooth: float = 0.0,
    units: str = "relevance",
    dpi: int = 100,
    metadata: Mapping[str, str] | None = None,
    text_size: float = 7.5,
) -> Path:
    """Write a comparison grid: one row per image; the image, then one overlay column per method.

    Args:
        path: output file (``.png``; matplotlib picks the format from the suffix). Parent folders are created.
        images: ``(B, 3, H, W)`` tensor, ``(B, H, W, 3)`` array, or a list of B images (see :data:`ImageLike`).
        heatmaps: method label → its B maps, as a ``(B, h, w)`` tensor/array or a list; column order is dict order.
            A label with settings (``'gradskip[alpha=0]'``) is titled by its display name with its settings
            underneath (``GradSkip`` / ``alpha = 0``; see :func:`vitlens.explainers.display_parts`).
        titles: column titles, ``1 + len(heatmaps)`` of them; default ``['image', *heatmaps]``.
        row_labels: one label per image, drawn left of each row (wrapped, never cut); default none.
        captions: one caption per image, drawn under the image (e.g. class, probability, true label).
        col_size: edge of each cell in inches.
        colorbar: draw one colour bar under each method column saying what its colours mean. Each map is scaled on
            its own; ``normalize='auto'`` scales a whole column as signed when any of its maps is signed.
        alpha, cmap, normalize, clip: passed to :func:`vitlens.viz.overlay` (``clip``: see :func:`save_figure`).
        styles: method label → its style (see :data:`vitlens.viz.MapStyle`); default ``'overlay'``.
        smooth: Gaussian smoothing of every map, standard deviation in map pixels (0: none).
        units: what the maps' values are, for the colour bars.
        dpi: resolution of the written raster.
        metadata: provenance stored in the file (PNG text chunks).
        text_size: size of captions and colour-bar labels in points (column titles 1.5 pt larger, tick labels 1 pt
            smaller); lines are wrapped to the columns' width at that size. Raise it for a grid shown scaled down.

    Returns:
        The path written.
    """
    _check_suffix(path)
    if not 4.0 <= float(text_size) <= 40.0:
        raise InputError(f"save_grid: text_size must be between 4 and 40 points; got {text_size!r}")
    _check_dpi(dpi)
    image_list = _image_list(images)
    if not image_list:
        raise InputError("save_grid got no images")
    rows = len(image_list)
    columns = {name: _map_list(maps, name, rows) for name, maps in heatmaps.items()}
    column_titles = _check_grid(rows, columns, titles, row_labels, captions, col_size)
    modes = {name: normalize if normalize != "auto" else
             ("signed" if any(is_signed(m) for m in maps) else "minmax") for name, maps in columns.items()}

    ncols = 1 + len(columns)
    grow = float(text_size) / 7.5  # text sizes and wrap widths relative to the defaults
    chars = max(8, int(col_size * 11 / grow))
    heads = [_column_title(t, chars) for t in column_titles]
    notes = [textwrap.fill(str(c), chars + int(10 / grow)) for c in captions] if captions is not None else None
    extra = (0.6 * grow if colorbar and columns else 0.0)
    extra += max(0.45, 0.15 * max(n.count("\n") + 1 for n in notes)) * grow if notes else 0.0
    extra += 0.17 * grow * max(h.count("\n") + 1 for h in heads)
    fig = Figure(figsize=(col_size * ncols + (0.4 if row_labels else 0), col_size * rows + 0.3 + extra),
                 dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    with_bars = bool(colorbar and columns)
    grid = fig.add_gridspec(rows + with_bars, ncols, height_ratios=[1.0] * rows + [0.06] * with_bars)
    axes = np.array([[fig.add_subplot(grid[r, c]) for c in range(ncols)] for r in range(rows)], dtype=object)
    cell_px = max(1, int(col_size * dpi))
    scales: dict[str, tuple[Scale, Colormap]] = {}
    for r, image in enumerate(image_list):
        pixels = display_image(image, cell_px, max(cell_px, 1024))
        cells = [pixels]
        for name, maps in columns.items():
            style = (styles or {}).get(name, "overlay")
            mode = style_normalize(style, normalize) if style != "overlay" else modes[name]
            blended, scale, colormap = overlay_with_scale(pixels, smooth_map(np.abs(map_array(maps[r])) if style == "abs"
                                                                     else maps[r], smooth), alpha, cmap, mode,
                                                          clip, style=style)
            scales.setdefault(name, (scale, colormap))
            cells.append(blended)
        for c, cell in enumerate(cells):
            ax = axes[r, c]
            ax.imshow(cell, interpolation="antialiased")
            _clean_axes(ax)
            if r == 0:
                ax.set_title(heads[c], fontsize=text_size + 1.5)
            if c == 0 and row_labels is not None:
                ax.set_ylabel(textwrap.fill(str(row_labels[r]), chars), fontsize=text_size + 0.5)
            if c == 0 and notes is not None:
                ax.set_xlabel(notes[r], fontsize=text_size)
    if with_bars:
        fig.add_subplot(grid[rows, 0]).set_axis_off()
        for c, name in enumerate(columns, start=1):
            scale, colormap = scales[name]
            _add_colorbar(fig, fig.add_subplot(grid[rows, c]), colormap, scale, units, relative=True,
                          location="bottom", fontsize=text_size, wrap=max(12, int(34 / grow)))
    path = prepare_path(path)
    with atomic_path(path) as tmp:  # no half-written picture survives an error or a kill
        fig.savefig(tmp, dpi=dpi, format=path.suffix.lstrip(".").lower() or None,
                    metadata=_file_metadata(path, metadata))
    return path
