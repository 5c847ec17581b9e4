"""The report's statistics and its tables for a paper: the paired test (checked against SciPy), Wilson intervals,
a tied pair reported tied, and the Markdown / LaTeX tables (structure checked cell by cell) from ``vitlens report``.
"""

from __future__ import annotations

import json
import re
import sqlite3
from pathlib import Path

import numpy as np
import pytest
import scipy.stats

from vitlens.bench.report import summarise, table_text, write_report
from vitlens.bench.report_stats import ALPHA, paired_ties, wilcoxon_signed_rank, wilson_interval
from vitlens.bench.store import SCHEMA
from vitlens.cli import main


@pytest.mark.parametrize("n", [5, 9, 17, 40])
def test_signed_rank_p_is_scipys_exact_p(n: int) -> None:
    d = np.random.default_rng(n).normal(0.3, 1.0, n)
    assert wilcoxon_signed_rank(d) == pytest.approx(scipy.stats.wilcoxon(d, method="exact").pvalue, rel=1e-9)


def test_signed_rank_with_ties_and_zeros_is_the_exact_permutation_p() -> None:
    d = np.array([2.0, 2.0, 0.0, 0.0, -1.0, 1.0, -1.0, 2.0, 3.0, -1.0, 0.5])
    # zeros dropped (Wilcoxon's rule): 9 non-zero differences, every sign pattern enumerated by SciPy
    expected = scipy.stats.wilcoxon(d, method=scipy.stats.PermutationMethod()).pvalue
    assert wilcoxon_signed_rank(d) == pytest.approx(expected, rel=1e-9)
    assert wilcoxon_signed_rank(np.zeros(7)) == 1.0


def test_signed_rank_beyond_the_exact_range_is_the_corrected_normal_approximation() -> None:
    d = np.round(np.random.default_rng(1).normal(0.2, 1.0, 200), 1)  # many tied magnitudes
    expected = scipy.stats.wilcoxon(d, method="approx", correction=True).pvalue
    assert wilcoxon_signed_rank(d) == pytest.approx(expected, rel=1e-9)


def test_wilson_interval_stays_in_range_and_has_width_at_the_ends() -> None:
    low, high = wilson_interval(5, 6)
    assert (round(low, 4), round(high, 4)) == (0.4365, 0.9699)  # the textbook value for 5 of 6
    low, high = wilson_interval(6, 6)
    assert high == 1.0 and 0.5 < low < 0.7  # the t interval of 6 hits out of 6 has width 0
    assert wilson_interval(0, 10)[0] == 0.0 and 0.2 < wilson_interval(0, 10)[1] < 0.35


def _fake_run(run: Path, n: int = 20) -> Path:
    """A run folder whose results say: A best, B a hair below A on every image but not always (tied), C clearly
    worse; pointing game hits 19/20, 18/20, 4/20."""
    rng = np.random.default_rng(0)
    run.mkdir(parents=True)
    con = sqlite3.connect(run / "results.sqlite")
    con.executescript(SCHEMA)
    base = rng.uniform(0.3, 0.6, n)
    scores = {"gradskip": base + 0.02, "rollout": base + 0.02 + rng.normal(0, 0.03, n), "random": base - 0.3}
    hits = {"gradskip": 19, "rollout": 18, "random": 4}
    proto = json.dumps({"metric": "pointing_game", "tolerance": 4})
    for m, vals in scores.items():
        for i in range(n):
            con.execute("INSERT INTO results VALUES (?,?,?,?,?,?,?,?)",
                        (i, str(i), m, "insertion_deletion[preset=aha]", "ins_minus_del", float(vals[i]), 1, "{}"))
            con.execute("INSERT INTO results VALUES (?,?,?,?,?,?,?,?)",
                        (i, str(i), m, "pointing_game[tolerance=4]", "pointing_game", float(i < hits[m]), 1, proto))
            con.execute("INSERT INTO costs VALUES (?,?,?,?,?)", (i, m, 1.0, 0.0 if m == "random" else 1.0, 0.01))
    for i in range(n):
        con.execute("INSERT INTO predictions VALUES (?,?,?,?)", (i, 0, 0.9, 0))
    con.commit()
    con.close()
    return run


def test_a_tied_pair_is_reported_tied_and_a_worse_method_is_not(tmp_path: Path) -> None:
    run = _fake_run(tmp_path / "run")
    table = {r["method"]: r for r in summarise(run)}
    key = "insertion_deletion[preset=aha]/ins_minus_del"
    best = max(table, key=lambda m: table[m][key]["mean"])
    other = "rollout" if best == "gradskip" else "gradskip"
    assert table[best][key]["best"] and table[other][key]["tied_with_best"], table[other][key]
    assert table[other][key]["p_vs_best"] >= ALPHA
    assert not table["random"][key]["tied_with_best"] and table["random"][key]["p_vs_best"] < 1e-4
    pg = table["random"]["pointing_game[tolerance=4]/pointing_game"]
    assert pg["interval"] == "wilson" and (pg["low"], pg["high"]) == pytest.approx(wilson_interval(4, 20))
    for row in table.values():  # no interval of a proportion passes [0, 1]
        v = row["pointing_game[tolerance=4]/pointing_game"]
        assert 0.0 <= v["low"] <= v["mean"] <= v["high"] <= 1.0
    write_report(run)
    page = (run / "report.html").read_text()
    assert "Wilcoxon signed-rank" in page and "α = 0.05" in page and "these are tied with it" in page
    assert "num tied" in page and "[0.081, 0.416]" in page  # Wilson interval of 4/20 in the table


def test_paired_ties_uses_only_the_images_both_methods_have() -> None:
    out = paired_ties({"a": {0: 1.0, 1: 1.0, 2: 1.0}, "b": {1: 0.0, 2: 0.0, 3: 5.0}}, higher_is_better=True)
    assert out["b"]["best"] and out["a"]["n_paired"] == 2


def _cells(line: str, sep: str) -> list[str]:
    return re.split(r"(?<!\\)" + re.escape(sep), line)


def test_markdown_table_is_one_table_with_intervals_and_marks(tmp_path: Path) -> None:
    text = table_text(summarise(_fake_run(tmp_path / "run")), "markdown")
    rows = [line for line in text.splitlines() if line.startswith("|")]
    widths = {len(line.strip("|").split("|")) for line in rows}
    assert len(widths) == 1 and re.fullmatch(r"\|(---\|)+", rows[1]), rows[:2]
    assert len(rows) == 2 + 3
    body = "\n".join(rows[2:])
    assert "± " in body and re.search(r"\*\*0\.950 \[0\.\d{3}, 0\.\d{3}\]\*\*", body)  # best, Wilson interval
    assert re.search(r"\| \*[0-9.]+ ± [0-9.]+\* \|", body)  # a tied cell in italics
    assert "| Random |" in body and "Wilcoxon" in text


def test_latex_table_is_a_valid_tabular(tmp_path: Path) -> None:
    text = table_text(summarise(_fake_run(tmp_path / "run")), "latex")
    lines = [line for line in text.splitlines() if not line.startswith("%")]
    assert lines[0] == "\\begin{table}[t]" and lines[-1] == "\\end{table}"  # a float with its legend under it
    start = next(i for i, line in enumerate(lines) if line.startswith("\\sbox0{\\begin{tabular}{"))
    lines = lines[start:lines.index("\\end{tabular}}%") + 1]
    spec = re.match(r"\\sbox0\{\\begin\{tabular\}\{([lcr]+)\}", lines[0]).group(1)
    assert lines[1] == "\\toprule" and lines[3] == "\\midrule" and lines[-2] == "\\bottomrule"
    rows = [lines[2]] + lines[4:-2]
    assert len(rows) == 1 + 3
    for row in rows:
        assert row.endswith(r" \\"), row
        assert len(_cells(row[:-3], "&")) == len(spec), row
        assert row.count("{") - row.count("\\{") == row.count("}") - row.count("\\}"), row
        assert len(re.findall(r"(?<!\\)\$", row)) % 2 == 0, row  # math opened and closed
        assert not re.search(r"(?<!\\)[_#%]", row), row  # special characters escaped
        assert not re.search(r"[^\x00-\x7f]", row), row  # symbols written as LaTeX, not Unicode
    body = "\n".join(rows[1:])
    assert "\\textbf{" in body and "\\underline{" in body and "$\\pm$" in body
    assert "% needs \\usepackage{booktabs}" in text


def test_vitlens_report_writes_the_tables(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run = _fake_run(tmp_path / "run")
    assert main(["report", str(run), "--format", "latex"]) == 0
    assert "\\begin{tabular}" in capsys.readouterr().out
    assert main(["report", str(run), "--format", "markdown", "--out", str(tmp_path / "t.md")]) == 0
    assert (tmp_path / "t.md").read_text().startswith("| rank | method |")
    assert main(["report", str(run)]) == 0
    assert (run / "report.html").exists() and (run / "summary.tex").exists()
    capsys.readouterr()
    assert main(["report", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no results.sqlite" in err
