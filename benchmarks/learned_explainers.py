"""AHA against ViT-Shapley, the other learned (amortized) explainer, paired over the images of the all-methods tables
(issue 53: "does AHA beat the other learned explainer?").

Reads two finished ``benchmarks/all_methods.py`` runs of one model — the main table's run (ViT-Shapley and GradSkip
among its rows) and the ``--section aha`` run (AHA at T = 0 and with its default refinement) — which score the same 50
images with the same metrics, and pairs their per-image values (matched by image id). Each cell: the mean difference
of the row's method minus ViT-Shapley, oriented so that a positive number is better for the row's method (deletion,
positive perturbation and violation are lower-is-better and are negated), with its 95 % t interval (✓ above 0,
✗ below 0). Nothing is recomputed: the numbers are those of the tables.

Usage::

    python benchmarks/all_methods.py --model shapes-vit --n 50 --out runs/all-shapes-vit ...       # first, both runs
    python benchmarks/all_methods.py --model shapes-vit --n 50 --methods aha:refine_steps=0,aha,gradskip \\
        --out runs/all-shapes-vit-aha --section aha ...
    python benchmarks/learned_explainers.py shapes-vit=runs/all-shapes-vit,runs/all-shapes-vit-aha \\
        digits-vit=runs/all-digits-vit,runs/all-digits-vit-aha --out docs/benchmarks/all_methods.md
"""

from __future__ import annotations

import argparse
import datetime as _dt
import sqlite3
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from aha_protocols import fmt, paired  # noqa: E402
from aha_sorter_error import print_section  # noqa: E402

START, END = "<!-- learned_explainers:start -->", "<!-- learned_explainers:end -->"
ROWS = {"aha[refine_steps=0]": "AHA T=0", "aha": "AHA (default refinement)", "gradskip": "GradSkip"}
OUTPUTS = {"ins_minus_del": "insertion − deletion", "insertion": "insertion", "deletion": "deletion ↓",
           "neg_minus_pos": "neg − pos perturbation", "saco": "SaCo", "pointing_game": "pointing game",
           "energy_inside": "relevance in object", "violation": "faithfulness violation ↓"}


def values(run: Path) -> dict[tuple[str, str], dict[str, tuple[float, bool]]]:
    """``{(method, output): {image_id: (value, higher_is_better)}}`` of a run's store (opened read-only)."""
    store = run / "results.sqlite"
    if not store.is_file():
        raise SystemExit(f"{store}: no results store (run benchmarks/all_methods.py first)")
    con = sqlite3.connect(f"file:{store}?mode=ro", uri=True)
    try:
        out: dict[tuple[str, str], dict[str, tuple[float, bool]]] = {}
        for image_id, method, output, value, hib in con.execute(
                "select image_id, method, output, value, higher_is_better from results"):
            if value is not None:
                out.setdefault((method, output), {})[image_id] = (float(value), bool(hib))
        return out
    finally:
        con.close()


def section(model: str, main: Path, aha: Path) -> list[str]:
    a, b = values(main), values(aha)
    both = {**a, **{k: v for k, v in b.items() if k[0] != "gradskip"}}
    outputs = [o for o in OUTPUTS if ("vit_shapley", o) in both]
    lines = [f"### {model} ({main} and {aha})", "",
             "| row − ViT-Shapley | " + " | ".join(OUTPUTS[o] for o in outputs) + " |",
             "|---|" + "---|" * len(outputs)]
    vs = {o: both[("vit_shapley", o)] for o in outputs}
    lines.append("| ViT-Shapley (mean) | " + " | ".join(f"{np.mean([v for v, _ in vs[o].values()]):.3f}"
                                                       for o in outputs) + " |")
    n_images = 0
    for method, label in ROWS.items():
        cells = []
        for o in outputs:
            row = both.get((method, o))
            if row is None:
                cells.append("—")
                continue
            ids = sorted(set(row) & set(vs[o]))
            n_images = max(n_images, len(ids))
            sign = 1.0 if vs[o][ids[0]][1] else -1.0
            cells.append(fmt(*paired([sign * row[i][0] for i in ids], [sign * vs[o][i][0] for i in ids])))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", f"{n_images} images paired (image ids common to both runs).", ""]
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", metavar="MODEL=MAIN_RUN,AHA_RUN")
    p.add_argument("--out", type=Path, default=None, help="write the section into this Markdown page (markers)")
    args = p.parse_args(argv)
    lines = [START, "", "## AHA against ViT-Shapley on the all-methods images (issue 53)", "",
             "Both learned explainers and GradSkip on the 50 images of the all-methods tables "
             "(the per-model pages above), paired per image; each cell is the row's method minus ViT-Shapley, "
             "signed so that positive favours the row's method (↓ metrics negated), with its 95 % t interval "
             "(✓ above 0, ✗ below 0). Script: `benchmarks/learned_explainers.py` (reads the two runs' stores).", ""]
    for spec in args.runs:
        model, _, paths = spec.partition("=")
        main_run, _, aha_run = paths.partition(",")
        lines += section(model, Path(main_run), Path(aha_run))
    cmd = "python benchmarks/learned_explainers.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines += [f"Command: `{cmd}` — {_dt.date.today().isoformat()}.", "", END]
    print_section(lines, args.out, START, END)
    return 0


if __name__ == "__main__":
    sys.exit(main())
