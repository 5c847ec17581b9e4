"""The benchmark report: ranked table with plain names and marked bests, and the page checked in a real browser
(headless Chromium: nothing overflows at 1280 px, every image loads, the table is sorted and sorts on click)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from vitlens.bench import BenchConfig, run_benchmark
from vitlens.bench.naming import column_info, protocol_words
from vitlens.bench.report import accuracy, columns_of, ranked

WIDTH = 1280

# Appended to a copy of report.html: measure the laid-out page and write the results into the DOM.
_CHECKS = """
<script>
window.addEventListener('load', function () {
  var out = {};
  var doc = document.documentElement;
  out.viewport = window.innerWidth;
  out.page_width = Math.max(doc.scrollWidth, document.body.scrollWidth);
  var box = document.querySelector('.tablebox');
  out.table_box = [box.scrollWidth, box.clientWidth];
  var wide = [];
  document.querySelectorAll('body *').forEach(function (el) {
    var r = el.getBoundingClientRect();
    if (r.width > 0 && r.right > window.innerWidth + 0.5) { wide.push(el.tagName + '.' + el.className); }
  });
  out.past_right_edge = wide.slice(0, 10);
  out.images = Array.prototype.map.call(document.images, function (im) {
    return [im.alt, im.complete, im.naturalWidth, im.getBoundingClientRect().width];
  });
  var table = document.getElementById('ranking');
  function column(i) {
    return Array.prototype.map.call(table.tBodies[0].rows, function (r) { return r.cells[i].dataset.v; });
  }
  out.ranks = column(0);
  var headers = Array.prototype.slice.call(table.querySelectorAll('th.sortable'));
  out.headers = headers.map(function (th) { return [th.textContent, +th.dataset.col, th.dataset.higher]; });
  var target = headers.filter(function (th) { return th.textContent.indexOf('pointing game') === 0; })[0];
  target.click();
  out.after_click = column(+target.dataset.col);
  out.after_click_sort = target.getAttribute('aria-sort');
  var pre = document.createElement('pre');
  pre.id = 'vitlens-checks';
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real (small) benchmark of the bundled shapes ViT: 3 methods, insertion/deletion and the pointing game."""
    import torch

    import vitlens

    out = tmp_path_factory.mktemp("report") / "run"
    torch.manual_seed(0)
    model = vitlens.load_model("shapes-vit")
    config = BenchConfig(model="shapes-vit", data="scenes:seed=3",
                         methods=[("gradskip", {}), ("rollout", {}), ("random", {}), ("gradskip", {"alpha": 0.0})],
                         metrics=[("insertion_deletion", {"preset": "aha", "steps": 8}),
                                  ("pointing_game", {"tolerance": 4})], n=6, batch_size=6, show=3)
    return run_benchmark(config, out, model=model, progress=False)


def test_table_uses_plain_names_ranks_and_marks_the_best(run: Path) -> None:
    table = json.loads((run / "summary.json").read_text())
    rows, headline = ranked(table)
    assert headline is not None and headline.title == "insertion − deletion ↑"
    values = [r[headline.key]["mean"] for r in rows]
    assert values == sorted(values, reverse=True)
    titles = [c.title for c in columns_of(table)]
    assert titles == ["deletion ↓", "insertion ↑", "insertion − deletion ↑", "pointing game ↑",
                      "relevance in object ↑"]
    md = (run / "summary.md").read_text()
    from vitlens.explainers import display_label

    # display names in the table a paper copies; code names stay in summary.json
    assert "insertion_deletion[" not in md.splitlines()[0] and "| 1 | " + display_label(rows[0]["method"]) + " |" in md
    assert md.count("**") >= 2 * len(titles)  # one best per column at least
    page = (run / "report.html").read_text()
    for text in ("deletion ↓", "Faithfulness", "Localisation", "Cost", "Accuracy on these images", "Protocol:",
                 "shapes-vit", "★"):
        assert text in page, text
    acc = accuracy(run)
    assert acc["labelled"] == 6 and 0.0 <= acc["accuracy"] <= 1.0


def test_names_and_protocols_in_words() -> None:
    col = column_info("insertion_deletion[preset=aha]/deletion", False)
    assert (col.title, col.group, col.settings) == ("deletion ↓", "Faithfulness", "preset=aha")
    assert column_info("new_metric/score_x", True).group == "Other"
    words = protocol_words({"metric": "pointing_game", "tolerance": 4.0, "skip_large": None})
    assert words == "a hit when the maximum lies within 4 px of the object's mask."


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def test_report_in_headless_chromium(run: Path, tmp_path: Path) -> None:
    browser = _chromium()
    if browser is None:
        pytest.skip("Debian package 'chromium' not installed (.ci/run installs it)")
    page = (run / "report.html").read_text(encoding="utf-8")
    checked = tmp_path / "checked.html"
    checked.write_text(page.replace("</body>", _CHECKS + "</body>"), encoding="utf-8")
    with tempfile.TemporaryDirectory() as profile:
        proc = subprocess.run(
            [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
             f"--user-data-dir={profile}", f"--window-size={WIDTH},1000", "--virtual-time-budget=15000",
             "--dump-dom", checked.as_uri()],
            capture_output=True, text=True, timeout=180,
        )
    found = re.search(r'<pre id="vitlens-checks">(.*?)</pre>', proc.stdout, flags=re.S)
    assert found, f"the check script did not run; chromium said: {proc.stderr[-1500:]}"
    import html

    out = json.loads(html.unescape(found.group(1)))
    assert out["viewport"] == WIDTH
    assert out["page_width"] <= WIDTH, out
    assert out["past_right_edge"] == [], out["past_right_edge"]
    assert out["table_box"][0] <= out["table_box"][1], "the table scrolls sideways at 1280 px"
    assert len(out["images"]) == 2
    for alt, complete, natural, shown in out["images"]:
        assert complete and natural > 0 and 0 < shown <= WIDTH, (alt, complete, natural, shown)
    assert out["ranks"] == [str(k) for k in range(1, 5)]
    clicked = [float(v) for v in out["after_click"]]
    assert out["after_click_sort"] == "descending" and clicked == sorted(clicked, reverse=True)


def test_baseline_cost_is_never_marked_best_and_methods_show_display_names(run: Path) -> None:
    from vitlens.bench.report import COST_KEYS, best_values

    table = json.loads((run / "summary.json").read_text())
    best = best_values(table, columns_of(table))
    random_row = next(r for r in table if r["method"] == "random")
    others = [r for r in table if r["method"] != "random"]
    for key, _ in COST_KEYS:
        if key in best:
            assert best[key] == min(float(r[key]["mean"] if isinstance(r[key], dict) else r[key]) for r in others
                                    if r.get(key) is not None), key
    assert random_row["method"] == "random"  # the code name stays in the JSON
    random_html = (run / "report.html").read_text().split("<b>Random</b>")[1].split("</tr>")[0]
    cost_cells = re.findall(r"<td class='([^']*)'", random_html)[-3:]
    assert "num best" not in cost_cells, cost_cells
    page = (run / "report.html").read_text()
    assert "<b>GradSkip</b>" in page and "<b>Random</b>" in page and "alpha = 0.0" in page
