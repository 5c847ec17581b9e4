"""The report's pictures: perturbation curves (mean, 95% band, AUC in the legend) and the per-image gallery."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from ..explainers.registry import display_label
from .naming import column_info
from .store import read_rows

__all__ = ["plot_curves", "plot_examples", "curve_auc", "top_methods", "TOP_K", "grid_text_size"]

_T95 = {2: 12.706, 3: 4.303, 4: 3.182, 5: 2.776, 6: 2.571, 7: 2.447, 8: 2.365, 9: 2.306, 10: 2.262,
        15: 2.145, 20: 2.093, 25: 2.064, 30: 2.045}


def t95(n: int) -> float:
    """Two-sided 95% Student-t quantile for ``n`` samples (``n - 1`` degrees of freedom; normal beyond 30);
    conservative between tabulated values."""
    if n < 2:
        return float("nan")
    return 1.96 if n > 30 else _T95[min(k for k in _T95 if k >= n)]


def curve_auc(x: np.ndarray, y: np.ndarray) -> float:
    """Trapezoidal area under ``y(x)``."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    return float(np.sum((x[1:] - x[:-1]) * (y[1:] + y[:-1]) / 2.0))


_CURVE_TEXT = {  # output -> (title, x label, which way is better)
    "deletion": ("Deletion: most relevant pixels removed first", "fraction of pixels removed", "lower area is better"),
    "insertion": ("Insertion: most relevant pixels put back first", "fraction of pixels inserted",
                  "higher area is better"),
    "positive": ("Positive perturbation: most relevant tokens removed first", "fraction of tokens removed",
                 "lower area is better"),
    "negative": ("Negative perturbation: least relevant tokens removed first", "fraction of tokens removed",
                 "higher area is better"),
}


def _score_label(run_dir: Path, metric: str) -> str:
    rows = read_rows(run_dir / "results.sqlite", "SELECT protocol FROM results WHERE metric = ? LIMIT 1", (metric,))
    score = json.loads(rows[0][0]).get("score") if rows else None
    return {"probability": "class probability", "logit": "class logit"}.get(str(score), "class score")


#: How many of the best methods the main curve view shows (with the baselines).
TOP_K = 3


def top_methods(order: list[str], k: int = TOP_K) -> list[str]:
    """The methods of the curves' main view: the best ``k`` of ``order`` (the ranking) that are not baselines, then
    the baselines (the floor they are read against)."""
    from ..explainers.registry import is_baseline

    return [m for m in order if not is_baseline(m)][:k] + [m for m in order if is_baseline(m)]


def plot_curves(run_dir: Path, order: list[str], show: list[str] | None = None, name: str = "curves.png",
                bands: bool = True, dest: Path | None = None) -> Path | None:
    """``curves.png``: one panel per curve kind; per method the mean curve over images with its 95% confidence band
    (Student t; cut at the ends of a probability's range), the area under the mean curve in the legend. Methods in
    ``order`` (the table's ranking; colours follow it, so two views of one run agree); ``show``: only these
    (default all); ``bands=False`` draws the mean curves alone (the view of every method). Written into ``dest``
    (default ``run_dir``)."""
    rows = read_rows(run_dir / "results.sqlite", "SELECT method, metric, output, x, y FROM curves")
    rows = [r for r in rows if r[2] in _CURVE_TEXT and (show is None or r[0] in show)]
    if not rows:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    groups: dict[tuple[str, str], dict[str, list]] = {}
    xs: dict[tuple[str, str], list[float]] = {}
    for method, metric, out, x, y in rows:
        groups.setdefault((metric, out), {}).setdefault(method, []).append(json.loads(y))
        xs[(metric, out)] = json.loads(x)
    keys = sorted(groups, key=lambda k: (k[0], list(_CURVE_TEXT).index(k[1])))
    ncols = min(2, len(keys))
    nrows = math.ceil(len(keys) / ncols)
    fig = Figure(figsize=(5.6 * ncols, 4.6 * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    colours = {m: f"C{k % 10}" for k, m in enumerate(order)}
    for k, key in enumerate(keys):
        ax = fig.add_subplot(nrows, ncols, k + 1)
        # a probability lies in [0, 1]: the band of a mean near an end is cut there, not drawn beyond it
        lo, hi = (0.0, 1.0) if _score_label(run_dir, key[0]) == "class probability" else (-np.inf, np.inf)
        x = np.asarray(xs[key], float)
        for method in [m for m in order if m in groups[key]] + [m for m in groups[key] if m not in order]:
            arr = np.asarray(groups[key][method], dtype=float)
            mean = arr.mean(0)
            label = f"{display_label(method)} (AUC {curve_auc(x, mean):.3f})"
            line = ax.plot(x, mean, label=label, color=colours.get(method), lw=1.6 if bands else 1.3)[0]
            if bands and arr.shape[0] > 1:
                half = t95(arr.shape[0]) * arr.std(0, ddof=1) / math.sqrt(arr.shape[0])
                ax.fill_between(x, np.clip(mean - half, lo, hi), np.clip(mean + half, lo, hi), color=line.get_color(),
                                alpha=0.15, lw=0)
        title, xlabel, better = _CURVE_TEXT[key[1]]
        settings = column_info(f"{key[0]}/{key[1]}", True).settings
        ax.set_title(f"{title}\n({better}{'; ' + settings if settings else ''})", fontsize=10)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"{_score_label(run_dir, key[0])} (mean{', 95% band' if bands else ''})")
        ax.set_xlim(float(x[0]), float(x[-1]))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=9, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncols=2, frameon=False)
    path = (dest or run_dir) / name
    fig.savefig(path, dpi=100)
    return path


def _caption(pred: tuple | None, target: str, names: list[str] | None, random_weights: bool = False) -> str:
    """The model's answer for an image; a model with random weights gives no prediction, and is said to."""
    if pred is None:
        return ""
    _, predicted, prob, label = pred
    if random_weights:
        return f"random weights: highest score class {int(predicted)}, p\u00a0=\u00a0{float(prob):.2f} (not a prediction)"

    def name(c: int) -> str:
        return names[c] if names and 0 <= c < len(names) else f"class {c}"

    nb = "\u00a0"  # no-break spaces: a wrapped caption never splits "p = 0.91" or a mark from its class
    text = f"predicted: {name(int(predicted))}, p{nb}={nb}{float(prob):.2f}"
    if label is not None:
        text += f"; true: {name(int(label))}" + (f"{nb}✓" if int(label) == int(predicted) else f"{nb}✗")
    if target == "label" and label is not None:
        text += f"; explained: {name(int(label))}"
    return text


def stored_array(path: Path) -> np.ndarray:
    """A map or picture the run stored under ``examples/``: a regular ``.npy`` file of numbers, read without
    unpickling; a damaged, object-array or non-regular file is a one-line :class:`DamagedFileError` naming it."""
    from ..errors import DamagedFileError
    from ..files import open_regular

    with open_regular(path, f"stored example {path}", DamagedFileError) as f:
        try:
            arr = np.load(f, allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            raise DamagedFileError(f"stored example {path} is damaged ({' '.join(str(e).split())[:120]}); delete "
                                   "the examples folder and rerun the benchmark to redraw it") from None
    if not isinstance(arr, np.ndarray):  # (an .npz archive under a .npy name)
        raise DamagedFileError(f"stored example {path} is not a .npy array; delete the examples folder and rerun")
    if arr.dtype.kind not in "biuf" or arr.ndim not in (2, 3):
        raise DamagedFileError(f"stored example {path} is not a map or a picture ({arr.dtype} array of shape "
                               f"{arr.shape}); delete the examples folder and rerun the benchmark to redraw it")
    return arr


def plot_examples(run_dir: Path, methods: list[str], class_names: list[str] | None, target: str = "predicted",
                  dest: Path | None = None) -> Path | None:
    """``examples.png`` (in ``dest``, default ``run_dir``): the shown images × methods (in ``methods`` order),
    captions with the model's answer."""
    from ..viz import save_grid
    from .specs import safe_label as _safe

    ex = run_dir / "examples"
    import re

    found = [p for p in ex.glob("image__*.npy") if re.fullmatch(r"image__\d+", p.stem)] if ex.is_dir() else []
    images = sorted(found, key=lambda p: int(p.stem.split("__")[1]))
    if not images:
        return None
    idx = [int(p.stem.split("__")[1]) for p in images]
    pix = [stored_array(p) for p in images]
    maps: dict[str, Any] = {}
    for m in methods:
        files = [ex / f"{_safe(m)}__{i}.npy" for i in idx]
        if all(f.exists() for f in files):
            maps[m] = [stored_array(f) for f in files]
    preds = {int(r[0]): r for r in read_rows(run_dir / "results.sqlite", "SELECT * FROM predictions")}
    untrained = random_weights(run_dir)
    captions = [_caption(preds.get(i), target, None if untrained else class_names, untrained) for i in idx]
    path = (dest or run_dir) / "examples.png"
    # each method drawn by its declared value kind and default style, as vitlens explain draws it; the resolution
    # holds each panel at least at its image's size (a cell is ~85% of its column), the text sized for that
    side = max(min(1024, max(np.asarray(p).shape[:2])) for p in pix)
    dpi = max(100, math.ceil(side / (0.85 * _COL_INCHES)))
    save_grid(str(path), pix, maps, row_labels=[f"image {i}" for i in idx],
              captions=captions if any(captions) else None, col_size=_COL_INCHES,
              text_size=grid_text_size(1 + len(maps), dpi), dpi=dpi)
    return path


def random_weights(run_dir: Path) -> bool:
    """Whether the run's model had random weights (``pretrained=False`` and no weights file, from its
    ``provenance.json``): its class scores are then no prediction."""
    try:
        record = json.loads((Path(run_dir) / "provenance.json").read_text())
        model = record.get("model", {}) if isinstance(record, dict) else {}
        return model.get("pretrained") is False and not model.get("weights_file")
    except (OSError, ValueError, AttributeError):
        return False


_COL_INCHES = 1.9  # edge of one cell of the examples grid
PAGE_PX = 1148  # widest the report shows a picture: the page's 1180 px less its padding (report_html's CSS)
MIN_TEXT_PX = 11.0  # smallest text (tick labels) as shown in the report


def grid_text_size(columns: int, dpi: int = 100) -> float:
    """Text size (points) of an examples grid of ``columns`` columns such that, shown at most :data:`PAGE_PX` wide,
    its smallest text (tick labels, 1 pt under the captions) is at least :data:`MIN_TEXT_PX` pixels high — up to
    :data:`MAX_TEXT_PT`, the largest that still sets about 11 characters a line in a column (a grid too wide for
    that at page width, ~10 columns and more, is read zoomed in)."""
    width_px = (_COL_INCHES * columns + 0.4) * dpi  # save_grid's figure width (row labels: +0.4 in)
    shrink = min(1.0, PAGE_PX / width_px)
    return min(MAX_TEXT_PT, max(7.5, 1.0 + MIN_TEXT_PX * 72.0 / (dpi * shrink)))


#: the largest text size of an examples grid (points): larger text no longer fits a 1.9-in column (at 40 pt, what
#: save_grid accepts, 30 columns overlapped their captions and colour-bar labels)
MAX_TEXT_PT = 14.0
