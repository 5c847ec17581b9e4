"""Summary tables (Markdown + CSV + JSON) and the HTML report of a benchmark run directory.

The report answers "which method is best, on what, at what cost": one table ranked by the headline metric, columns
under plain names grouped by what they measure, the best value per column marked, cost beside quality; a sentence per
metric with its protocol in words; the model and its accuracy on the data; curves with 95% bands and AUCs; a gallery.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from .naming import (
    GROUP_ORDER,
    is_proportion,
    GROUP_QUESTION,
    Column,
    column_info,
    metric_sentence,
    metric_title,
    protocol_words,
)
from .report_figures import plot_curves, plot_examples, t95, top_methods
from .report_html import render_page
from .report_stats import paired_ties, wilson_interval
from .report_tables import latex_table, markdown_table
from ..atomic import atomic_path, write_text
from .store import check_store, read_rows

__all__ = ["summarise", "write_report", "ranked", "accuracy", "table_text", "run_config", "REPORT_FILES"]


def _ci95(values: np.ndarray) -> float:
    """Half-width of the 95% confidence interval of the mean (Student t for small n, normal beyond 30)."""
    n = values.size
    if n < 2:
        return float("nan")
    return float(t95(n) * values.std(ddof=1) / math.sqrt(n))


def summarise(run_dir: str | Path) -> list[dict[str, Any]]:
    """One row per method: for each metric output its mean, 95% interval (``low``/``high``; ``ci95`` its half
    width), ``n``, and the paired test against the column's best (``best``, ``tied_with_best``, ``p_vs_best``; see
    :mod:`vitlens.bench.report_stats`); plus mean passes and median time per image."""
    db = Path(run_dir) / "results.sqlite"
    check_store(db)  # read-only; an empty, foreign or damaged store is one line, before anything is written
    rows = read_rows(db, "SELECT image, method, metric, output, value, higher_is_better FROM results")
    costs = read_rows(db, "SELECT method, forward_passes, backward_passes, seconds FROM costs")
    methods: list[str] = []
    for r in [(r[1],) for r in rows] + [(c[0],) for c in costs]:
        if r[0] not in methods:
            methods.append(r[0])
    per_image: dict[str, dict[str, dict[int, float]]] = {}  # column key -> method -> image -> value
    direction: dict[str, bool] = {}
    for image, meth, metric, out, value, hib in rows:
        if value is not None:
            key = f"{metric}/{out}"
            per_image.setdefault(key, {}).setdefault(meth, {})[int(image)] = float(value)
            direction[key] = bool(hib)
    ties = {key: paired_ties(by_method, direction[key]) for key, by_method in per_image.items()}
    table = []
    for m in methods:
        entry: dict[str, Any] = {"method": m}
        for key in sorted(per_image):
            if m not in per_image[key]:
                continue
            arr = np.asarray(list(per_image[key][m].values()), dtype=float)
            entry[key] = {**_interval(key, arr), "n": int(arr.size), "higher_is_better": direction[key],
                          **ties[key][m]}
        c = [x for x in costs if x[0] == m]
        if c:
            entry["forward_passes"] = float(np.mean([x[1] for x in c]))
            entry["backward_passes"] = float(np.mean([x[2] for x in c]))
            entry["ms_per_image"] = float(np.median([x[3] for x in c]) * 1000)
        table.append(entry)
    return table


def _interval(key: str, values: np.ndarray) -> dict[str, Any]:
    """Mean and 95% interval: Wilson for a proportion (hits per image), Student t for other means."""
    mean = float(values.mean())
    metric, _, output = key.rpartition("/")
    if is_proportion(metric.partition("[")[0], output) and np.isin(values, (0.0, 1.0)).all():
        low, high = wilson_interval(int(values.sum()), int(values.size))
        return {"mean": mean, "ci95": (high - low) / 2, "low": low, "high": high, "interval": "wilson"}
    half = _ci95(values)
    return {"mean": mean, "ci95": half, "low": mean - half, "high": mean + half, "interval": "t"}


COST_KEYS = (("forward_passes", "forward passes"), ("backward_passes", "backward passes"),
             ("ms_per_image", "ms per image"))

#: Headline metrics in order of preference: the table is ranked by the first one the run has.
_HEADLINE = ("ins_minus_del", "neg_minus_pos", "miou", "pointing_game", "insertion", "deletion")


def columns_of(table: list[dict[str, Any]]) -> list[Column]:
    """The quality columns of a summary, grouped (faithfulness, localisation, ...) and in a fixed order."""
    keys: dict[str, bool] = {}
    for row in table:
        for k, v in row.items():
            if isinstance(v, dict):
                keys.setdefault(k, bool(v["higher_is_better"]))
    cols = [column_info(k, hib) for k, hib in keys.items()]
    return sorted(cols, key=lambda c: (GROUP_ORDER.index(c.group), c.metric, c.settings, c.position, c.name))


def _mean(row: dict[str, Any], key: str) -> float:
    v = row.get(key)
    if isinstance(v, dict):
        return float(v["mean"])
    return float("nan") if v is None else float(v)


def ranked(table: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], Column | None]:
    """The rows ranked by the headline column (best first; methods without it last), and that column."""
    cols = columns_of(table)
    headline = next((c for h in _HEADLINE for c in cols if c.output == h), cols[0] if cols else None)
    if headline is None:
        return list(table), None

    def key(row: dict[str, Any]) -> tuple[int, float]:
        v = _mean(row, headline.key)
        return (1, 0.0) if math.isnan(v) else (0, -v if headline.higher_is_better else v)

    return sorted(table, key=key), headline


def best_values(table: list[dict[str, Any]], cols: list[Column]) -> dict[str, float]:
    """Column key → its best mean (highest or lowest by the column's direction; cost: lowest among the methods
    that are not baselines: the random map is cheapest by construction and earns no mark)."""
    from ..explainers.registry import is_baseline

    best: dict[str, float] = {}
    for c in cols:
        vals = [v for v in (_mean(r, c.key) for r in table) if not math.isnan(v)]
        if vals:
            best[c.key] = max(vals) if c.higher_is_better else min(vals)
    for key, _ in COST_KEYS:
        vals = [v for v in (_mean(r, key) for r in table if not is_baseline(str(r.get("method", ""))))
                if not math.isnan(v)]
        if vals and min(vals) < max(vals):  # a tie across all methods marks nothing
            best[key] = min(vals)
    return best


def accuracy(run_dir: str | Path) -> dict[str, Any]:
    """The model's top-1 accuracy on the run's labelled images, and its mean top-1 probability."""
    preds = read_rows(Path(run_dir) / "results.sqlite", "SELECT predicted, probability, label FROM predictions")
    labelled = [(p, lab) for p, _, lab in preds if lab is not None]
    out: dict[str, Any] = {"n": len(preds), "labelled": len(labelled),
                           "mean_probability": float(np.mean([q for _, q, _ in preds])) if preds else None}
    if labelled:
        correct = sum(int(p == lab) for p, lab in labelled)
        out.update(correct=correct, accuracy=correct / len(labelled))
    return out


def table_text(table: list[dict[str, Any]], fmt: str = "markdown", wide: bool = False) -> str:
    """The ranked table of a summary for a paper: ``fmt`` ``'markdown'`` or ``'latex'`` (a ``table`` float that fits
    one column's ``\\linewidth``, short heads and a legend under it; ``wide``: a ``table*`` across both columns with
    full heads), with the mean ± 95% interval, the best per column and the methods statistically tied with it
    marked."""
    rows, headline = ranked(table)
    cols = columns_of(table)
    best = best_values(rows, cols)
    if fmt == "latex":
        return latex_table(rows, cols, best, headline, wide=wide)
    if fmt == "markdown":
        return markdown_table(rows, cols, best, headline)
    raise ValueError(f"unknown table format {fmt!r}; formats: markdown, latex")


def csv_cell(value: Any) -> Any:
    """A value as a CSV cell a spreadsheet shows as text: a string starting with ``=``, ``+``, ``-``, ``@``, a tab or
    a carriage return gets a leading ``'`` (a method label is never run as a formula); numbers are kept."""
    if isinstance(value, str) and value[:1] in ("=", "+", "-", "@", "\t", "\r"):
        return "'" + value
    return value


_CSV_FIELDS = ("mean", "ci95", "low", "high", "interval", "n", "best", "tied_with_best", "p_vs_best")


def _write_csv(table: list[dict[str, Any]], path: Path) -> None:
    keys = sorted({k for row in table for k, v in row.items() if isinstance(v, dict)})
    with atomic_path(path) as tmp, tmp.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["method"] + [f"{k}/{s}" for k in keys for s in _CSV_FIELDS]
                   + ["forward_passes", "backward_passes", "ms_per_image"])
        for row in table:
            vals: list[Any] = [csv_cell(row["method"])]
            for k in keys:
                v = row.get(k) or {}
                vals += [v.get(s) for s in _CSV_FIELDS]
            vals += [row.get("forward_passes"), row.get("backward_passes"), row.get("ms_per_image")]
            w.writerow([csv_cell(v) for v in vals])


def _model_facts(model: str | None) -> tuple[str, list[str] | None]:
    """A bundled model's description and class names (other models: nothing known offline)."""
    from ..models.zoo import BUNDLED

    spec = BUNDLED.get(str(model))
    if spec is None:
        return "", None
    return spec.description, list(spec.class_names) or None


#: the files :func:`write_report` writes into a run folder (derived from ``results.sqlite``, which it only reads)
REPORT_FILES = ("summary.md", "summary.tex", "summary.csv", "summary.json", "curves.png", "curves-all.png",
                "examples.png", "report.html")


def run_config(run_dir: str | Path) -> dict[str, Any]:
    """The run's ``config.json`` (``{}`` when there is none); one that is not a regular file, not UTF-8 JSON or not
    a JSON object is a one-line :class:`~vitlens.errors.DamagedFileError` naming it."""
    from ..errors import DamagedFileError
    from ..files import read_text_file

    path = Path(run_dir) / "config.json"
    if not path.exists() and not path.is_symlink():
        return {}
    text = read_text_file(path, f"run configuration {path}", error=DamagedFileError)
    try:
        cfg = json.loads(text)
    except ValueError as e:
        raise DamagedFileError(f"run configuration {path} is not JSON ({' '.join(str(e).split())[:100]})") from None
    if not isinstance(cfg, dict):
        raise DamagedFileError(f"run configuration {path} is not a JSON object (it is a {type(cfg).__name__})")
    return cfg


def write_report(run_dir: str | Path, config: Any = None, out: str | Path | None = None) -> dict[str, Path]:
    """Write ``summary.md``, ``summary.tex``, ``summary.csv``, ``summary.json``, ``curves.png`` (the best methods and
    the baselines), ``curves-all.png``, ``examples.png`` and ``report.html`` into the run folder; with ``out``, only
    the (self-contained) HTML page, to ``out``, and nothing into the run folder. ``results.sqlite`` is only read
    (opened read-only), and checked before anything is written: an empty, foreign or damaged store, or a damaged
    ``config.json``, leaves every file as it was."""
    import tempfile

    run_dir = Path(run_dir)
    cfg = run_config(run_dir)
    table = summarise(run_dir)
    if out is not None:
        with tempfile.TemporaryDirectory(prefix="vitlens-report-") as tmp:
            write_text(Path(out), _page(run_dir, table, cfg, Path(tmp)))
        return {"report": Path(out)}
    page = _page(run_dir, table, cfg, run_dir)
    write_text(run_dir / "summary.md", table_text(table) + "\n")
    write_text(run_dir / "summary.tex", table_text(table, "latex") + "\n")
    _write_csv(table, run_dir / "summary.csv")
    write_text(run_dir / "summary.json", json.dumps(table, indent=2))
    write_text(run_dir / "report.html", page)
    return {"summary": run_dir / "summary.md", "report": run_dir / "report.html"}


def _page(run_dir: Path, table: list[dict[str, Any]], cfg: dict[str, Any], figures: Path) -> str:
    """The HTML report of the run (its figures drawn into ``figures`` and inlined)."""
    rows, headline = ranked(table)
    order = [r["method"] for r in rows]
    description, class_names = _model_facts(cfg.get("model"))
    if cfg.get("prompts"):  # a vision-language model over prompts: the prompts are its classes
        class_names = [str(p) for p in cfg["prompts"]]
    curves = plot_curves(run_dir, order, show=top_methods(order), dest=figures)
    every = plot_curves(run_dir, order, name="curves-all.png", bands=False, dest=figures) \
        if len(top_methods(order)) < len(order) else None
    examples = plot_examples(run_dir, order, class_names, str(cfg.get("target", "predicted")), dest=figures)
    protocols = read_rows(run_dir / "results.sqlite", "SELECT DISTINCT metric, protocol FROM results")
    cols = columns_of(table)
    return render_page(
        rows=rows, cols=cols, headline=headline, best=best_values(rows, cols), cost_keys=COST_KEYS, cfg=cfg,
        model_description=description, accuracy=accuracy(run_dir), groups=(GROUP_ORDER, GROUP_QUESTION),
        metric_notes=[(metric_title(m), metric_sentence(column_info(m + "/x", True).metric), protocol_words(p))
                      for m, p in protocols],
        images={"curves": curves, "curves-all": every, "examples": examples},
    )
