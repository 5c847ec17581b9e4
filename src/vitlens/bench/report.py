"""Summary tables (Markdown + CSV), curve plots and an HTML report for a benchmark run directory."""

from __future__ import annotations

import base64
import csv
import html
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from ..atomic import atomic_path, write_text
from .store import read_rows

__all__ = ["summarise", "write_report"]


def _ci95(values: np.ndarray) -> float:
    """Half-width of the 95% confidence interval of the mean (Student t for small n, normal beyond 30)."""
    n = values.size
    if n < 2:
        return float("nan")
    t = {2: 12.706, 3: 4.303, 4: 3.182, 5: 2.776, 6: 2.571, 7: 2.447, 8: 2.365, 9: 2.306, 10: 2.262,
         15: 2.145, 20: 2.093, 25: 2.064, 30: 2.045}
    q = 1.96 if n > 30 else t[min(k for k in t if k >= n)]
    return float(q * values.std(ddof=1) / math.sqrt(n))


def summarise(run_dir: str | Path) -> list[dict[str, Any]]:
    """One row per method: for each metric output its mean, 95% CI and n; plus mean passes and median time."""
    db = Path(run_dir) / "results.sqlite"
    rows = read_rows(db, "SELECT method, metric, output, value, higher_is_better FROM results")
    costs = read_rows(db, "SELECT method, forward_passes, backward_passes, seconds FROM costs")
    methods: list[str] = []
    for r in rows + [(c[0],) for c in costs]:
        if r[0] not in methods:
            methods.append(r[0])
    table = []
    for m in methods:
        entry: dict[str, Any] = {"method": m}
        cols: dict[tuple[str, str], list[float]] = {}
        direction: dict[tuple[str, str], bool] = {}
        for meth, metric, out, value, hib in rows:
            if meth == m and value is not None:
                cols.setdefault((metric, out), []).append(value)
                direction[(metric, out)] = bool(hib)
        for (metric, out), vals in sorted(cols.items()):
            arr = np.asarray(vals, dtype=float)
            entry[f"{metric}/{out}"] = {"mean": float(arr.mean()), "ci95": _ci95(arr), "n": int(arr.size),
                                        "higher_is_better": direction[(metric, out)]}
        c = [x for x in costs if x[0] == m]
        if c:
            entry["forward_passes"] = float(np.mean([x[1] for x in c]))
            entry["backward_passes"] = float(np.mean([x[2] for x in c]))
            entry["ms_per_image"] = float(np.median([x[3] for x in c]) * 1000)
        table.append(entry)
    return table


def _markdown(table: list[dict[str, Any]]) -> str:
    keys = sorted({k for row in table for k, v in row.items() if isinstance(v, dict)})
    head = ["method"] + [f"{k} {'↑' if table_dir(table, k) else '↓'}" for k in keys]
    head += ["fwd passes", "bwd passes", "ms/image (median)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in table:
        cells = [row["method"]]
        for k in keys:
            v = row.get(k)
            cells.append("—" if v is None else f"{v['mean']:.4f} ± {v['ci95']:.4f}")
        cells += [f"{row.get('forward_passes', float('nan')):g}", f"{row.get('backward_passes', float('nan')):g}",
                  f"{row.get('ms_per_image', float('nan')):.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table_dir(table: list[dict[str, Any]], key: str) -> bool:
    for row in table:
        if key in row:
            return bool(row[key]["higher_is_better"])
    return True


def _write_csv(table: list[dict[str, Any]], path: Path) -> None:
    keys = sorted({k for row in table for k, v in row.items() if isinstance(v, dict)})
    with atomic_path(path) as tmp, tmp.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["method"] + [f"{k}/{s}" for k in keys for s in ("mean", "ci95", "n")]
                   + ["forward_passes", "backward_passes", "ms_per_image"])
        for row in table:
            vals: list[Any] = [row["method"]]
            for k in keys:
                v = row.get(k) or {}
                vals += [v.get("mean"), v.get("ci95"), v.get("n")]
            vals += [row.get("forward_passes"), row.get("backward_passes"), row.get("ms_per_image")]
            w.writerow(vals)


def _plot_curves(run_dir: Path) -> Path | None:
    rows = read_rows(run_dir / "results.sqlite", "SELECT method, metric, output, x, y FROM curves")
    if not rows:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    groups: dict[tuple[str, str], dict[str, list]] = {}
    xs: dict[tuple[str, str], list[float]] = {}
    for method, metric, out, x, y in rows:
        groups.setdefault((metric, out), {}).setdefault(method, []).append(json.loads(y))
        xs[(metric, out)] = json.loads(x)
    fig = Figure(figsize=(4.2 * len(groups), 3.4))
    FigureCanvasAgg(fig)
    for k, ((metric, out), by_method) in enumerate(sorted(groups.items())):
        ax = fig.add_subplot(1, len(groups), k + 1)
        for method, curves in by_method.items():
            mean = np.asarray(curves, dtype=float).mean(0)
            ax.plot(xs[(metric, out)], mean, label=method)
        ax.set_title(f"{out} ({metric})", fontsize=9)
        ax.set_xlabel("fraction of features")
        ax.set_ylabel("score")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = run_dir / "curves.png"
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110)
    return path


def _examples(run_dir: Path, methods: list[str]) -> Path | None:
    ex = run_dir / "examples"
    images = sorted(ex.glob("image__*.npy"), key=lambda p: int(p.stem.split("__")[1])) if ex.exists() else []
    if not images:
        return None
    from ..viz import save_grid

    from .runner import _safe

    idx = [int(p.stem.split("__")[1]) for p in images]
    pix = [np.load(p) for p in images]
    maps = {}
    for m in methods:
        files = [ex / f"{_safe(m)}__{i}.npy" for i in idx]
        if all(f.exists() for f in files):
            maps[m] = [np.load(f) for f in files]
    path = run_dir / "examples.png"
    with atomic_path(path) as tmp:
        save_grid(str(tmp), pix, maps, row_labels=[f"#{i}" for i in idx])
    return path


def _img_tag(path: Path | None) -> str:
    if path is None:
        return "<p>(none)</p>"
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<img src="data:image/png;base64,{data}" style="max-width:100%">'


def write_report(run_dir: str | Path, config: Any = None) -> dict[str, Path]:
    """Write ``summary.md``, ``summary.csv``, ``summary.json``, ``curves.png``, ``examples.png``, ``report.html``."""
    run_dir = Path(run_dir)
    table = summarise(run_dir)
    md = _markdown(table)
    write_text(run_dir / "summary.md", md + "\n\nMean ± 95% confidence interval over images.\n")
    _write_csv(table, run_dir / "summary.csv")
    write_text(run_dir / "summary.json", json.dumps(table, indent=2))
    curves = _plot_curves(run_dir)
    examples = _examples(run_dir, [r["method"] for r in table])
    cfg = json.loads((run_dir / "config.json").read_text()) if (run_dir / "config.json").exists() else {}
    protocols = read_rows(run_dir / "results.sqlite", "SELECT DISTINCT metric, protocol FROM results")
    html_table = _html_table(md)
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>vitlens benchmark</title>
<style>body{{font-family:sans-serif;max-width:1200px;margin:2em auto}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px;font-size:13px}}code{{font-size:12px}}</style></head><body>
<h1>vitlens benchmark</h1>
<p>Model <code>{html.escape(str(cfg.get('model')))}</code>, data <code>{html.escape(str(cfg.get('data')))}</code>,
n = {html.escape(str(cfg.get('n')))}, target: {html.escape(str(cfg.get('target')))}.</p>
<h2>Quality and cost</h2>{html_table}<p>Mean ± 95% confidence interval over images; ↑ higher is better.</p>
<h2>Curves</h2>{_img_tag(curves)}
<h2>Examples</h2>{_img_tag(examples)}
<h2>Protocols</h2><ul>{''.join(f'<li><b>{html.escape(m)}</b>: <code>{html.escape(p)}</code></li>' for m, p in protocols)}</ul>
<h2>Configuration</h2><pre>{html.escape(json.dumps(cfg, indent=2))}</pre>
</body></html>"""
    write_text(run_dir / "report.html", page)
    return {"summary": run_dir / "summary.md", "report": run_dir / "report.html"}


def _html_table(md: str) -> str:
    lines = [ln for ln in md.splitlines() if ln.startswith("|")]
    out = ["<table>"]
    for k, ln in enumerate(lines):
        if k == 1:
            continue
        cells = [c.strip() for c in ln.strip("|").split("|")]
        tag = "th" if k == 0 else "td"
        out.append("<tr>" + "".join(f"<{tag}>{html.escape(c)}</{tag}>" for c in cells) + "</tr>")
    out.append("</table>")
    return "".join(out)
