"""The HTML page of a benchmark report: one self-contained file (pictures inline), sortable ranked table, no network.

The layout fits a 1280-px window: the table wraps its headers and method settings and scrolls inside its own box
only on narrower screens. Clicking a column header sorts by it (best first; again for the reverse order).
"""

from __future__ import annotations

import base64
import html
import json
import math
from pathlib import Path
from typing import Any, Sequence

from ..explainers.registry import is_baseline
from .naming import Column
from .report_stats import PAIRED_TEST
from .report_figures import TOP_K
from .report_tables import headline_sentence, mark

__all__ = ["render_page"]

_CSS = """
*{box-sizing:border-box}
body{font:15px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#1b1f24;max-width:1180px;
 margin:1.5em auto;padding:0 16px}
h1{font-size:1.6em;margin:.2em 0}h2{font-size:1.25em;margin-top:1.6em;border-bottom:1px solid #ddd}
.facts{display:grid;grid-template-columns:max-content 1fr;gap:2px 14px;margin:.6em 0}
.facts dt{font-weight:600}.facts dd{margin:0;overflow-wrap:anywhere}
.tablebox{max-width:100%;overflow-x:auto}
table.ranking{border-collapse:collapse;width:100%;font-size:13px}
.ranking th,.ranking td{border:1px solid #d0d4d9;padding:4px 6px;vertical-align:top}
.ranking thead th{background:#f3f5f7;font-weight:600;text-align:center;overflow-wrap:break-word}
.ranking th.rank{white-space:nowrap}
.ranking th.sortable{cursor:pointer}.ranking th.sortable:hover{background:#e6ebf0}
.ranking th[aria-sort=descending]::after{content:" ▾"}.ranking th[aria-sort=ascending]::after{content:" ▴"}
.ranking td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
.ranking td.best{font-weight:700;background:#e7f5e9}.ranking td.best::before{content:"★ ";color:#1a7f37}
.ranking td.tied{background:#f1f9f2}.ranking td.tied::before{content:"≈ ";color:#1a7f37}
.ranking .ci{color:#6a737d;font-size:11px}.ranking .settings{display:block;color:#6a737d;font-size:11px}
.ranking th.group{background:#e9edf1}.ranking th .q{display:block;font-weight:400;font-size:11px;color:#57606a}
.ranking td.method{overflow-wrap:break-word;min-width:9em}
.note{color:#57606a;font-size:13px}.answer{font-size:16px}
figure{margin:1em 0}figure img{max-width:100%;height:auto;display:block}
figcaption{color:#57606a;font-size:13px}
dl.metrics dt{font-weight:600;margin-top:.5em}dl.metrics dd{margin-left:1.2em}
details pre{white-space:pre-wrap;overflow-wrap:anywhere;font-size:12px;background:#f6f8fa;padding:8px}
"""

_JS = """
document.querySelectorAll('table.ranking').forEach(function (table) {
  var body = table.tBodies[0];
  table.querySelectorAll('th.sortable').forEach(function (th) {
    th.addEventListener('click', function () {
      var col = +th.dataset.col, higher = th.dataset.higher === '1';
      var desc = th.getAttribute('aria-sort') ? th.getAttribute('aria-sort') !== 'descending' : higher;
      table.querySelectorAll('th.sortable').forEach(function (o) { o.removeAttribute('aria-sort'); });
      th.setAttribute('aria-sort', desc ? 'descending' : 'ascending');
      var rows = Array.prototype.slice.call(body.rows);
      rows.sort(function (a, b) {
        var x = a.cells[col].dataset.v, y = b.cells[col].dataset.v;
        if (th.dataset.text === '1') { return desc ? y.localeCompare(x) : x.localeCompare(y); }
        x = x === '' ? NaN : +x; y = y === '' ? NaN : +y;
        if (isNaN(x)) { return isNaN(y) ? 0 : 1; } if (isNaN(y)) { return -1; }
        return desc ? y - x : x - y;
      });
      rows.forEach(function (r) { body.appendChild(r); });
    });
  });
});
"""


def _e(x: Any) -> str:
    return html.escape(str(x))


def _img(path: Path | None, alt: str) -> str:
    if path is None or not Path(path).exists():
        return f"<p class='note'>({_e(alt)}: none in this run)</p>"
    data = base64.b64encode(Path(path).read_bytes()).decode()
    return f'<img src="data:image/png;base64,{data}" alt="{_e(alt)}">'


def _num_cell(v: Any, best: float | None, digits: str = ".3f") -> str:
    """One number cell: the mean with its interval (± half width, or [low, high] for a Wilson interval), marked
    ``best`` or ``tied`` (statistically tied with the best); ``data-v`` holds the mean for sorting."""
    if v is None:
        return "<td class='num' data-v=''>—</td>"
    mean, ci = (float(v["mean"]), float(v["ci95"])) if isinstance(v, dict) else (float(v), float("nan"))
    if math.isnan(mean):
        return "<td class='num' data-v=''>—</td>"
    how = mark(v, best)
    cls = f"num {how}" if how else "num"
    title = ""
    if isinstance(v, dict) and v.get("p_vs_best") is not None and not math.isnan(float(v["p_vs_best"])):
        title = f" title='paired test against the best: p = {float(v['p_vs_best']):.3g} (n = {v.get('n_paired')})'"
    if isinstance(v, dict) and v.get("interval") == "wilson":
        ci_text = f" <span class='ci'>[{float(v['low']):.3f}, {float(v['high']):.3f}]</span>"
    else:
        ci_text = "" if math.isnan(ci) else f" <span class='ci'>± {ci:.3f}</span>"
    return f"<td class='{cls}' data-v='{mean!r}'{title}>{format(mean, digits)}{ci_text}</td>"


def _table(rows: list[dict[str, Any]], cols: list[Column], best: dict[str, float],
           cost_keys: Sequence[tuple[str, str]], groups: tuple[Sequence[str], dict[str, str]]) -> str:
    from ..explainers.registry import display_parts

    order, question = groups
    top = ["<th rowspan='2' class='sortable rank' data-col='0' data-higher='0'>rank</th>",
           "<th rowspan='2' class='sortable' data-col='1' data-text='1'>method</th>"]
    sub = []
    col_index = 2
    for group in order:
        members = [c for c in cols if c.group == group]
        if group == "Cost":
            members = []
            span = len(cost_keys)
        else:
            span = len(members)
        if not span:
            continue
        top.append(f"<th colspan='{span}' class='group'>{_e(group)}<span class='q'>{_e(question[group])}</span></th>")
        if group == "Cost":
            for _, title in cost_keys:
                sub.append(f"<th class='sortable' data-col='{col_index}' data-higher='0'>{_e(title)} ↓</th>")
                col_index += 1
        for c in members:
            settings = f"<span class='settings'>{_e(c.settings)}</span>" if c.settings else ""
            sub.append(f"<th class='sortable' data-col='{col_index}' data-higher='{int(c.higher_is_better)}'>"
                       f"{_e(c.title)}{settings}</th>")
            col_index += 1
    body = []
    for rank, row in enumerate(rows, start=1):
        name, settings = display_parts(row["method"])
        cells = [f"<td class='num' data-v='{rank}'>{rank}</td>",
                 f"<td class='method' data-v='{_e(row['method'])}'><b>{_e(name)}</b>"
                 + (f"<span class='settings'>{_e(settings)}</span>" if settings else "") + "</td>"]
        for group in order:
            if group == "Cost":
                for key, _ in cost_keys:
                    digits = ".1f" if key == "ms_per_image" else "g"
                    # a baseline's cost is never marked, even where it ties with the best
                    cost_best = None if is_baseline(str(row["method"])) else best.get(key)
                    cells.append(_num_cell(row.get(key), cost_best, digits))
                continue
            cells += [_num_cell(row.get(c.key), best.get(c.key)) for c in cols if c.group == group]
        body.append("<tr>" + "".join(cells) + "</tr>")
    return (f"<div class='tablebox'><table class='ranking' id='ranking'><thead><tr>{''.join(top)}</tr>"
            f"<tr>{''.join(sub)}</tr></thead><tbody>{''.join(body)}</tbody></table></div>")


def _all_curves(path: Path | None) -> str:
    if path is None or not Path(path).exists():
        return ""
    return (f"<details><summary>Every method's curves</summary><figure>{_img(path, 'curves of every method')}"
            "<figcaption>Mean curves only (no bands), colours as above.</figcaption></figure></details>")


def _facts(cfg: dict[str, Any], model_description: str, acc: dict[str, Any], n_methods: int) -> str:
    model = _e(cfg.get("model"))
    items = [("Model", f"<code>{model}</code>" + (f" — {_e(model_description)}" if model_description else ""))]
    if acc.get("labelled"):
        items.append(("Accuracy on these images",
                      f"{100 * acc['accuracy']:.1f}% top-1 ({acc['correct']} of {acc['labelled']} labelled images"
                      f"); mean top-1 probability {acc['mean_probability']:.2f}"))
    elif acc.get("n"):
        items.append(("Accuracy on these images", f"unknown (no labels); mean top-1 probability "
                                                  f"{acc['mean_probability']:.2f} over {acc['n']} images"))
    target = cfg.get("target", "predicted")
    items.append(("Data", f"<code>{_e(cfg.get('data'))}</code>, {_e(cfg.get('n') or 'all')} images"))
    prompts = cfg.get("prompts")
    if prompts:
        items.append(("Prompts (the classes)", ", ".join(f"{i}: \u201c{_e(p)}\u201d" for i, p in enumerate(prompts))))
    items.append(("Explained class", ("the best-matching prompt" if prompts else "the model's predicted class")
                  if target == "predicted" else "the true label"))
    items.append(("Methods", str(n_methods)))
    return "<dl class='facts'>" + "".join(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in items) + "</dl>"


def render_page(*, rows: list[dict[str, Any]], cols: list[Column], headline: Column | None, best: dict[str, float],
                cost_keys: Sequence[tuple[str, str]], cfg: dict[str, Any], model_description: str,
                accuracy: dict[str, Any], groups: tuple[Sequence[str], dict[str, str]],
                metric_notes: list[tuple[str, str, str]], images: dict[str, Path | None]) -> str:
    """The whole report page as a string."""
    ranked_by = (f"Ranked by <b>{_e(headline.title)}</b>" + (f" ({_e(headline.settings)})" if headline.settings
                                                              else "") + ". ") if headline else ""
    notes = "".join(f"<dt>{_e(m)}</dt><dd>{_e(sentence)}<br><i>Protocol:</i> {_e(words)}</dd>"
                    for m, sentence, words in metric_notes)
    sentence = headline_sentence(rows, headline)
    winner = f"<p class='answer'>{_e(sentence)}</p>" if sentence else ""
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width,initial-scale=1">
<title>vitlens benchmark: {_e(cfg.get('model'))}</title><style>{_CSS}</style></head><body>
<h1>Which explanation method is best here?</h1>
{_facts(cfg, model_description, accuracy, len(rows))}
<h2>Ranking: quality and cost</h2>{winner}
{_table(rows, cols, best, cost_keys, groups)}
<p class="note">{ranked_by}Mean ± 95% confidence interval over images (Student t; for proportions such as the
pointing game the Wilson score interval [low, high]); ★ best in its column; ≈ statistically tied with it
({_e(PAIRED_TEST)}; hover a cell for its p-value); ↑ higher is better, ↓ lower is better. Click a column header to
sort by it. Cost: passes through the model per image, and the median wall time per image on this machine (a
baseline's cost is never marked).</p>
<h2>What each metric measures</h2><dl class="metrics">{notes}</dl>
<h2>Curves</h2><figure>{_img(images.get('curves'), 'perturbation curves')}
<figcaption>The best {TOP_K} methods by the ranking and the baselines: mean curve over images with its 95%
confidence band; the legend gives the area under the mean curve (AUC).</figcaption></figure>
{_all_curves(images.get('curves-all'))}
<h2>Examples</h2><figure>{_img(images.get('examples'), 'example maps')}
<figcaption>Each row one image with the model's answer; each column one method (settings underneath); colour bars
say what the colours mean. Every map is scaled on its own.</figcaption></figure>
<h2>Configuration</h2><details><summary>config.json</summary><pre>{_e(json.dumps(cfg, indent=2))}</pre></details>
<script>{_JS}</script>
</body></html>"""
