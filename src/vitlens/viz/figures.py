"""Figures of attribution maps: one explanation with its colour bar and caption, and method comparison grids.

Figures are drawn with :class:`matplotlib.figure.Figure` on an explicit ``FigureCanvasAgg``, so importing or using
this module never changes matplotlib's global backend or pyplot state. Small inputs (a 64-px scene, a 28-px digit)
are enlarged by an integer factor (nearest neighbour) before the map is blended, so the map is drawn smoothly at the
resolution of the figure and every input pixel stays visible as a square.

What a figure says about its colours is what was drawn: a method's maps are scaled by what its values mean (its
declared :attr:`~vitlens.explainers.registry.Method.value_kind`), the same way on every image; colour bars carry the
map's values in one number format, arrows where the scale was clipped and the percentile it ends at; captions wrap
between phrases. PDF figures embed TrueType fonts (no Type 3), SVG keeps text as text, and the default resolution
draws every panel at least as large as the image it shows.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import Colormap
from matplotlib.figure import Figure

from vitlens.errors import InputError

from .pixels import (
    ImageLike,
    MapLike,
    MapNormalization,
    MapStyle,
    Scale,
    default_style,
    is_signed,
    kind_normalize,
    map_array,
    map_scale,
    overlay_with_scale,
    prepare_path,
    smooth_map,
    style_normalize,
    display_image,
    to_uint8,
)

from ..atomic import atomic_path
from .colorbars import (add_colorbar as _add_colorbar, bar_label, clip_note, colorbar_label, target_phrase, tick_labels,
                        wrap_phrases)

__all__ = ["save_figure", "save_grid", "colorbar_label", "target_phrase", "split_label", "wrap_phrases", "tick_labels",
           "clip_note", "JOURNAL_RC"]

#: matplotlib settings every figure is written with (locally, :func:`matplotlib.rc_context`; the global rcParams
#: are never changed): PDF and PS embed TrueType (Type 42) fonts, not Type 3 (publishers' checkers flag those);
#: SVG keeps text as text (editable, searchable), not paths.
JOURNAL_RC: dict[str, Any] = {"pdf.fonttype": 42, "ps.fonttype": 42, "svg.fonttype": "none"}

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


def _method_kind(label: str | None) -> tuple[str | None, str | None]:
    """A method label's declared value kind and level (``None``, ``None`` for a label of no registered method)."""
    if label is None:
        return None, None
    from vitlens.explainers.registry import method_classes, value_kind  # the registry imports no method

    cls = method_classes().get(str(label).partition("[")[0])
    return value_kind(str(label)), (cls.level if cls is not None else None)


def _panel_dpi(fig: Figure, axes: Sequence[Any], sizes: Sequence[tuple[int, int]], floor: float = 100.0,
               ceiling: float = 600.0) -> int:
    """The smallest resolution (>= ``floor``) at which each panel ``axes[i]`` is at least ``sizes[i]`` (height,
    width) pixels: the layout is in inches, so a panel's pixels grow linearly with the dpi."""
    fig.set_dpi(100)
    fig.draw_without_rendering()
    need = floor
    for ax, (h, w) in zip(axes, sizes):
        box = ax.get_window_extent()  # after the layout and the image's aspect, in pixels at 100 dpi
        if box.width > 0 and box.height > 0:
            need = max(need, 100.0 * w / box.width, 100.0 * h / box.height)
    return int(math.ceil(min(need, ceiling)))


def _save(fig: Figure, path: Path, dpi: int, metadata: Mapping[str, str] | None) -> None:
    """Write ``fig`` with :data:`JOURNAL_RC` (set for this call only) atomically."""
    from matplotlib import rc_context

    with rc_context(dict[Any, Any](JOURNAL_RC)), atomic_path(path) as tmp:  # no half-written picture survives an error or a kill
        fig.savefig(tmp, dpi=dpi, format=path.suffix.lstrip(".").lower() or None,
                    metadata=_file_metadata(path, metadata))


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
    style: MapStyle | None = None,
    method: str | None = None,
    smooth: float = 0.0,
    units: str = "relevance",
    target: str | None = None,
    min_side: int = 320,
    max_side: int = 2048,
    panel_size: float = 3.6,
    dpi: int | None = None,
    min_panel_px: int | None = None,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write one explanation as a figure: the image, the overlay, a colour bar saying what the colours mean, and a
    caption (e.g. ``"tiger cat, p = 0.93 (true: tiger cat)"``).

    Args:
        path: output file; the format follows the suffix (``.png``, ``.pdf``, ``.svg``); parent folders are created.
            PDF embeds TrueType fonts and SVG keeps text as text (:data:`JOURNAL_RC`).
        image: the picture (see :data:`vitlens.viz.ImageLike`) at any resolution, e.g. the original photo with
            :func:`vitlens.viz.map_to_original` applied to the map.
        heatmap: ``(h, w)`` map, resized to the image; NaN where the model saw nothing (left uncoloured).
        title: drawn above the overlay (e.g. the method and its settings).
        caption: drawn under the panels, wrapped between phrases.
        show_image: also show the plain image left of the overlay.
        alpha, cmap, normalize, clip: as in :func:`vitlens.viz.overlay`; by default the colour scale ends at the
            99.5th percentile (a few extreme pixels, common in gradient maps, would wash out the rest; ``None``:
            the maximum), and the colour bar says so (arrows at a clipped end, the percentile in its label). The
            scale is computed over the pixels that have a value (NaN is left out).
        scale: a fixed colour range (:func:`vitlens.viz.map_scale`), e.g. to draw a map on the original image and
            on the model's view with the same colours; ``normalize`` and ``clip`` are then unused.
        style: ``'overlay'``, ``'blend'`` or ``'abs'`` (see :data:`vitlens.viz.MapStyle`); the plain image panel is
            shown in colour in every style. ``None``: the method's default (:func:`vitlens.viz.default_style`),
            else ``'overlay'``.
        method: the label of the method that made the map (``'rise'``, ``'gradient[reduce=sum]'``): with
            ``normalize='auto'`` its declared value kind sets the scale (signed → diverging at 0; non-negative →
            from 0; probability-like → lowest to highest), never a guess from this one map.
        smooth: Gaussian smoothing of the map before drawing, standard deviation in map pixels (0: none).
        units: what the map's values are, for the colour bar's label.
        target: what the map explains, for the colour bar's label (a signed map is blue against it, red for it):
            ``None`` the class; for a text target its prompt, e.g. ``'“a ring”'`` (:func:`vitlens.viz.target_phrase`).
        min_side: images whose shorter side is smaller are enlarged (integer factor, nearest) before blending.
        max_side: the longest side drawn, in pixels: larger images (and their maps) are shrunk to it, smaller ones
            are never enlarged beyond it (see :func:`vitlens.viz.display_image`).
        panel_size: width of each panel in inches; the height follows the aspect ratio, bounded to between a
            quarter of and four times the width (very thin images are drawn in a panel of that size).
        dpi: resolution of the written raster; ``None``: the smallest (>= 100) at which each panel is at least
            ``min_panel_px`` pixels on its longer side.
        min_panel_px: the panels' least size at the default dpi (e.g. the model's input size); ``None``: the
            image's own longer side, up to 512.
        metadata: provenance stored in the file (PNG text chunks; for PDF and SVG as JSON in the document's
            subject/description).

    Returns:
        The path written.
    """
    _check_suffix(path)
    if dpi is not None:
        _check_dpi(dpi)
    kind, level = _method_kind(method)
    if style is None:
        style = default_style(level, kind) if level is not None else "overlay"
    if normalize == "auto" and kind is not None:
        normalize = kind_normalize(kind)
    own = to_uint8(image).shape[:2]
    pixels = display_image(image, min_side, max_side)
    arr = map_array(heatmap, allow_nan=True)
    arr = smooth_map(np.abs(arr) if style == "abs" else arr, smooth)  # |h| is smoothed: signs never cancel
    blended, scale, colormap = overlay_with_scale(pixels, arr, alpha, cmap, normalize, clip, scale, style)
    h, w = blended.shape[:2]
    panels = [("image", pixels), (title or "explanation", blended)] if show_image else [(title or "", blended)]
    width = panel_size * len(panels) + 1.1
    aspect = min(4.0, max(0.25, h / w))  # a 1 x 500 strip must not make a figure a hundred metres tall
    height = panel_size * aspect + (0.65 if caption else 0.3) + (0.35 if title else 0.0)
    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (name, cell) in zip(axes, panels):
        ax.imshow(cell, interpolation="antialiased")
        _clean_axes(ax)
        if name:
            ax.set_title(name, fontsize=10)
    note = _add_colorbar(fig, list(axes), colormap, scale, units, relative=False, value_kind=kind, with_note=False,
                         target=target)
    text = "; ".join(t for t in (caption, note and f"colour {note}") if t)  # the clipping is said in the caption
    if text:
        fig.supxlabel(wrap_phrases(text, int(12 * width)), fontsize=10)
    if dpi is None:
        side = int(min_panel_px) if min_panel_px is not None else min(max(own), 512)
        ratio = side / max(own)
        dpi = _panel_dpi(fig, list(axes), [(round(own[0] * ratio), round(own[1] * ratio))] * len(panels))
    path = prepare_path(path)
    _save(fig, path, dpi, metadata)
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


def _column_looks(columns: Mapping[str, list], normalize: str, styles: Mapping[str, MapStyle] | None
                  ) -> dict[str, tuple[str, MapNormalization, str | None]]:
    """Per column: its style, its scaling and its method's value kind. The scaling of ``normalize='auto'`` is the
    method's declared kind; a label of no registered method is judged on all its maps at once (signed when any is),
    so a column is drawn one way on every row."""
    looks: dict[str, tuple[str, MapNormalization, str | None]] = {}
    for name, maps in columns.items():
        kind, level = _method_kind(name)
        given = (styles or {}).get(name)
        style = given if given is not None else (default_style(level, kind) if level is not None else "overlay")
        mode: MapNormalization = normalize  # type: ignore[assignment]
        if mode == "auto":
            mode = kind_normalize(kind) if kind is not None else (
                "signed" if any(is_signed(m) for m in maps) else "minmax")
        looks[name] = (style, style_normalize(style, mode) if style != "overlay" else mode, kind)
    return looks


def _row_scale(maps: Sequence[np.ndarray], modes: Sequence[str], clip: float | None) -> Scale:
    """One colour range for the maps of a grid row (``shared_scale``): their common mode (``'signed'`` when the
    modes differ and one is signed, else lowest to highest) over all their values."""
    mode = modes[0] if len(set(modes)) == 1 else ("signed" if "signed" in modes else "minmax")
    values = np.concatenate([np.asarray(m, dtype=np.float64).ravel() for m in maps])
    return map_scale(values[None, :], mode, clip)  # type: ignore[arg-type]


def _grid_cells(image_list: list, columns: Mapping[str, list], looks: Mapping[str, tuple], alpha: float,
                cmap: str | Colormap | None, clip: float | None, smooth: float, cell_px: int, row_bars: bool
                ) -> tuple[list, list, dict[str, list[Scale]], dict[str, Colormap], list]:
    """The blended cells of a grid, row by row, with each map's scale and colour map (``row_bars``: one scale per
    row), and each image's own size (up to 1024 px) for the default resolution."""
    scales: dict[str, list[Scale]] = {name: [] for name in columns}
    maps_of: dict[str, Colormap] = {}
    own_sizes, rows_cells, row_scales = [], [], []
    for r, image in enumerate(image_list):
        own = to_uint8(image).shape[:2]
        own_sizes.append(tuple(min(1024, v) for v in own))
        pixels = display_image(image, cell_px, max(cell_px, 1024))
        drawn = {name: smooth_map(np.abs(map_array(maps[r])) if looks[name][0] == "abs" else maps[r], smooth)
                 for name, maps in columns.items()}
        fixed = _row_scale(list(drawn.values()), [looks[n][1] for n in columns], clip) if row_bars else None
        cells = [pixels]
        row_map: Colormap | None = None
        for name in columns:
            style, mode, _ = looks[name]
            blended, scale, colormap = overlay_with_scale(pixels, drawn[name], alpha, cmap, mode, clip, scale=fixed,
                                                          style=style)
            scales[name].append(scale)
            maps_of.setdefault(name, colormap)
            row_map = row_map or colormap
            cells.append(blended)
        rows_cells.append(cells)
        row_scales.append((fixed, row_map))
    return rows_cells, row_scales, scales, maps_of, own_sizes


def _column_bars(columns: Mapping[str, list], scales: Mapping[str, list[Scale]], looks: Mapping[str, tuple],
                 units: str, wrap: int, target: str | None = None) -> tuple[dict[str, dict[str, Any]], int]:
    """Per column its colour bar's arguments (arrows where any of its maps was clipped, values below 0 anywhere),
    and the most lines a bar's label takes (for the figure's height)."""
    args: dict[str, dict[str, Any]] = {}
    for name in columns:
        column = scales[name]
        args[name] = dict(value_kind=looks[name][2], low=any(sc.clipped()[0] for sc in column),
                          high=any(sc.clipped()[1] for sc in column), below_zero=any(sc.data_min < 0 for sc in column),
                          target=target)
    lines = max((bar_label(scales[n][0], units, True, a["value_kind"], (a["low"], a["high"]), a["below_zero"],
                           wrap=wrap, target=target)[0].count("\n") + 1 for n, a in args.items()), default=0)
    return args, lines


def _check_grid_settings(path: str | Path, text_size: float, dpi: int | None) -> None:
    """The output name, text size and resolution :func:`save_grid` accepts (one-line errors)."""
    _check_suffix(path)
    if not 4.0 <= float(text_size) <= 40.0:
        raise InputError(f"save_grid: text_size must be between 4 and 40 points; got {text_size!r}")
    if dpi is not None:
        _check_dpi(dpi)


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
    shared_scale: bool = False,
    smooth: float = 0.0,
    units: str = "relevance",
    target: str | None = None,
    dpi: int | None = None,
    metadata: Mapping[str, str] | None = None,
    text_size: float = 7.5,
) -> Path:
    """Write a comparison grid: one row per image; the image, then one overlay column per method.

    Args:
        path: output file (``.png``, ``.pdf`` with TrueType fonts, ``.svg`` with text as text). Parent folders are
            created.
        images: ``(B, 3, H, W)`` tensor, ``(B, H, W, 3)`` array, or a list of B images (see :data:`ImageLike`).
        heatmaps: method label → its B maps, as a ``(B, h, w)`` tensor/array or a list; column order is dict order.
            A label with settings (``'gradskip[alpha=0]'``) is titled by its display name with its settings
            underneath (``GradSkip`` / ``alpha = 0``; see :func:`vitlens.explainers.display_parts`).
        titles: column titles, ``1 + len(heatmaps)`` of them; default ``['image', *heatmaps]``.
        row_labels: one label per image, drawn left of each row (wrapped, never cut); default none.
        captions: one caption per image, drawn under the image (e.g. class, probability, true label).
        col_size: edge of each cell in inches.
        colorbar: draw one colour bar under each method column saying what its colours mean (each map is scaled on
            its own; arrows when a map's scale was clipped); with ``shared_scale``, one bar per row in map values.
        alpha, cmap, clip: passed to :func:`vitlens.viz.overlay` (``clip``: see :func:`save_figure`).
        normalize: ``'auto'``: each column by what its method's values mean (its declared value kind: signed →
            diverging at 0, non-negative → from 0, probability-like → lowest to highest), the same on every row;
            a label of no registered method: signed when any of its maps is. Or one mode for all columns.
        styles: method label → its style (see :data:`vitlens.viz.MapStyle`); a method not given gets its default
            (:func:`vitlens.viz.default_style`: pixel-level maps on a grey copy of the image), as ``vitlens
            explain`` draws it; a label of no registered method ``'overlay'``.
        shared_scale: one colour range per row, over all its methods' maps (for methods whose values compare,
            e.g. one method at several settings), with its colour bar in map values at the row's end.
        smooth: Gaussian smoothing of every map, standard deviation in map pixels (0: none).
        units: what the maps' values are, for the colour bars.
        target: what the maps explain, for the colour bars' labels (as in :func:`save_figure`; ``None``: the class).
        dpi: resolution of the written raster; ``None``: the smallest (>= 100) at which every panel is at least
            as large as its image (up to 1024 px), so a 224-px model input is never drawn smaller.
        metadata: provenance stored in the file (PNG text chunks).
        text_size: size of captions and colour-bar labels in points (column titles 1.5 pt larger, tick labels 1 pt
            smaller); lines are wrapped to the columns' width at that size. Raise it for a grid shown scaled down.

    Returns:
        The path written.
    """
    _check_grid_settings(path, text_size, dpi)
    image_list = _image_list(images)
    if not image_list:
        raise InputError("save_grid got no images")
    rows = len(image_list)
    columns = {name: _map_list(maps, name, rows) for name, maps in heatmaps.items()}
    column_titles = _check_grid(rows, columns, titles, row_labels, captions, col_size)
    looks = _column_looks(columns, normalize, styles)

    ncols = 1 + len(columns)
    grow = float(text_size) / 7.5  # text sizes and wrap widths relative to the defaults
    chars = max(8, int(col_size * 11 / grow))
    heads = [_column_title(t, chars) for t in column_titles]
    notes = [wrap_phrases(str(c), chars + int(10 / grow)) for c in captions] if captions is not None else None
    with_bars = bool(colorbar and columns and not shared_scale)
    row_bars = bool(colorbar and columns and shared_scale)
    cell_px = max(1, int(col_size * (dpi or 100)))
    # the cells first (their scales size the colour bars' labels), then the figure
    rows_cells, row_scales, scales, maps_of, own_sizes = _grid_cells(image_list, columns, looks, alpha, cmap, clip,
                                                                     smooth, cell_px, row_bars)
    bar_args, bar_lines = _column_bars(columns if with_bars else {}, scales, looks, units, max(12, int(34 / grow)),
                                       target)
    extra = ((0.3 + 0.13 * bar_lines) * grow if with_bars else 0.0)
    extra += max(0.45, 0.15 * max(n.count("\n") + 1 for n in notes)) * grow if notes else 0.0
    extra += 0.17 * grow * max(h.count("\n") + 1 for h in heads)
    width = col_size * ncols + (0.4 if row_labels else 0) + (0.9 * grow if row_bars else 0.0)
    fig = Figure(figsize=(width, col_size * rows + 0.3 + extra), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(rows + with_bars, ncols + row_bars,
                            height_ratios=[1.0] * rows + [0.06] * with_bars,
                            width_ratios=[1.0] * ncols + [0.07] * row_bars)
    axes = np.array([[fig.add_subplot(grid[r, c]) for c in range(ncols)] for r in range(rows)], dtype=object)
    kinds = {looks[n][2] for n in columns}
    for r, cells in enumerate(rows_cells):
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
        fixed, row_map = row_scales[r]
        if row_bars and fixed is not None and row_map is not None:
            _add_colorbar(fig, fig.add_subplot(grid[r, ncols]), row_map, fixed, units, relative=False,
                          location="side", fontsize=text_size, value_kind=next(iter(kinds)) if len(kinds) == 1
                          else None, target=target)
    if with_bars:
        fig.add_subplot(grid[rows, 0]).set_axis_off()
        for c, name in enumerate(columns, start=1):
            _add_colorbar(fig, fig.add_subplot(grid[rows, c]), maps_of[name], scales[name][0], units, relative=True,
                          location="bottom", fontsize=text_size, wrap=max(12, int(34 / grow)), **bar_args[name])
    if dpi is None:
        dpi = _panel_dpi(fig, list(axes.ravel()), [own_sizes[r] for r in range(rows) for _ in range(ncols)])
    path = prepare_path(path)
    _save(fig, path, dpi, metadata)
    return path
