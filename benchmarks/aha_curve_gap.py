"""Where on the curves AHA T = 0 loses to GradSkip, and whether GradSkip's order inside a token is what it loses to.

Issue #27 asks, for every protocol-matrix cell where AHA T = 0 is still behind GradSkip, for the reason as a
measurement. The matrix (``aha_protocols.py``) stores AUCs only; this script scores the same evaluation images of
the same models (its ``eval_images``: 0–47 are the two halves the matrix pools) with the whole curves:

* rows: AHA T = 0 (the shipped explainer with its spread), GradSkip, and **GradSkip per token**: GradSkip's map
  averaged over each patch (constant inside a token, as AHA's is at spread 0), which keeps GradSkip's order of the
  tokens and drops its order of the pixels inside a token;
* per reference (the matrix's four) and ranking (pixel / token), 21 points: insertion − deletion per row, the paired
  differences AHA − GradSkip and AHA − GradSkip per token, and the deletion and insertion curves' paired difference
  AHA − GradSkip at each fraction removed (where on the curve the AUC difference comes from).

With token ranking every row is a token map, so GradSkip per token equals GradSkip there (a check of the script).
Results are stored per model in ``--work`` (JSON, per image); ``--resume`` keeps the models already there.

Usage::

    python benchmarks/aha_curve_gap.py --models planted-vit shapes-deit shapes-vit --n 48 --threads 1 \
        --work benchmarks/results/aha-curve-gap --resume --out docs/benchmarks/aha.md
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import vitlens
from vitlens.aha.network import pool_maps
from vitlens.aha.soft_metrics import reference
from vitlens.images import data_config
from vitlens.models import get_adapter
from vitlens.preprocessing import int_pair

sys.path.insert(0, str(Path(__file__).resolve().parent))
from aha_protocols import (MODELS, REF_NAMES, REFERENCES, del_and_ins_curves, eval_images, fmt,  # noqa: E402
                           maps_of, paired, training_mean_image)
from aha_sorter_error import print_section  # noqa: E402

START, END = "<!-- aha_curve_gap:start -->", "<!-- aha_curve_gap:end -->"
POINTS = 21
ROWS = ("aha_t0", "gradskip", "gradskip_token")
#: fractions removed shown in the curve table (of the 21 points 0, 0.05, …, 1)
SHOWN = (0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75)


def per_token(maps: torch.Tensor, adapter: Any) -> torch.Tensor:
    """``maps`` ``(B, H, W)`` averaged over each patch of the model and spread back (constant inside a token): AHA's
    own ``tokens`` pooling at spread 0 (:func:`vitlens.aha.network.pool_maps`)."""
    return pool_maps(maps.float(), adapter, "tokens")


def run_model(name: str, n: int, batch: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    model = vitlens.load_model(name).eval()
    adapter = get_adapter(model)
    if adapter.patch_size is None:
        raise SystemExit(f"{name}: no patch grid, no tokens to average over")
    unit = int_pair(adapter.patch_size)[0]
    dc = data_config(model)
    x = eval_images(name, model, n, 0)
    with torch.no_grad():
        cls = model(x).argmax(-1)
    mi = training_mean_image(name, model, int(model(x[:1]).shape[-1]))
    refs = {r: reference(x, r, tuple(dc.mean), tuple(dc.std), mean_image=mi) for r in REFERENCES}
    gs = maps_of(model, x, "gradskip", batch)
    maps = {"aha_t0": maps_of(model, x, "aha", batch, refine_steps=0), "gradskip": gs,
            "gradskip_token": per_token(gs, adapter)}
    curves: dict[str, dict[str, list[list[list[float]]]]] = {}
    for row, mp in maps.items():
        curves[row] = {}
        for r in REFERENCES:
            for ranking, u in (("pixel", 1), ("token", unit)):
                c = torch.cat([del_and_ins_curves(model, x[s:s + batch], mp[s:s + batch], cls[s:s + batch],
                                                  refs[r][s:s + batch], u, POINTS) for s in range(0, n, batch)])
                # (n, 2 [deletion, insertion], POINTS), probabilities to 5 decimals (the page shows 3)
                curves[row][f"{r}/{ranking}"] = np.round(c.numpy(), 5).tolist()
        print(f"  {name}: {row} done ({time.perf_counter() - t0:.0f} s)", flush=True)
    return {"model": name, "n": n, "unit": unit, "points": POINTS, "curves": curves,
            "seconds": round(time.perf_counter() - t0, 1)}


def auc(c: np.ndarray) -> np.ndarray:
    """Insertion − deletion AUC per image from curves ``(n, 2, P)`` (trapezoidal over evenly spaced fractions)."""
    fr = np.linspace(0.0, 1.0, c.shape[-1])
    return np.trapezoid(c[:, 1], fr, axis=-1) - np.trapezoid(c[:, 0], fr, axis=-1)


def model_section(res: dict[str, Any]) -> list[str]:
    cv = {row: {k: np.asarray(v) for k, v in cells.items()} for row, cells in res["curves"].items()}
    out = [f"### {res['model']} ({res['n']} evaluation images, 0–{res['n'] - 1}; token = {res['unit']}×{res['unit']} "
           "px)", "",
           "| cell | AHA T=0 | GradSkip | GradSkip per token | AHA − GradSkip | AHA − GradSkip per token | "
           "GradSkip − GradSkip per token |", "|---|---|---|---|---|---|---|"]
    for key in cv["aha_t0"]:
        r, ranking = key.split("/")
        a, g, t = (auc(cv[row][key]) for row in ROWS)
        out.append(f"| {REF_NAMES[r]}, {ranking} | {a.mean():.3f} | {g.mean():.3f} | {t.mean():.3f} | "
                   f"{fmt(*paired(a, g))} | {fmt(*paired(a, t))} | {fmt(*paired(g, t))} |")
    fr = np.linspace(0.0, 1.0, res["points"])
    idx = [int(np.argmin(np.abs(fr - f))) for f in SHOWN]
    for curve, label, better in ((0, "Deletion", "lower is better, so a positive difference is where AHA loses"),
                                 (1, "Insertion", "higher is better")):
        out += ["", f"{label} curve, AHA T=0 − GradSkip: the class probability at each fraction of the image removed "
                f"({better}):", "",
                "| cell | " + " | ".join(f"{fr[i]:.2f}" for i in idx) + " |", "|---|" + "---|" * len(idx)]
        for key in cv["aha_t0"]:
            r, ranking = key.split("/")
            d = cv["aha_t0"][key][:, curve] - cv["gradskip"][key][:, curve]
            out.append(f"| {REF_NAMES[r]}, {ranking} | " + " | ".join(fmt(*paired(d[:, i], np.zeros(len(d))))
                                                                   for i in idx) + " |")
    return out + [""]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["planted-vit", "shapes-deit", "shapes-vit"], choices=list(MODELS))
    p.add_argument("--n", type=int, default=48, help="evaluation images per model (from image 0)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work", type=Path, default=Path("runs/aha-curve-gap"))
    p.add_argument("--resume", action="store_true", help="keep the models already in --work")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    results = []
    for name in args.models:
        path = args.work / f"{name}.json"
        stored = json.loads(path.read_text()) if args.resume and path.is_file() else None
        if stored is None or stored["n"] != args.n:
            print(f"{name} ...", flush=True)
            stored = run_model(name, args.n, args.batch)
            path.write_text(json.dumps(stored))
        results.append(stored)
    lines = [START, "", "## Where AHA T = 0 loses to GradSkip: the curves, and GradSkip's order inside a token", "",
             "Each cell: mean insertion − deletion (21 points, hard masks, predicted class) on the protocol matrix's "
             "evaluation images, and paired differences with 95 % t intervals (✓ above 0, ✗ below 0). *GradSkip per "
             "token* is GradSkip's map averaged over each patch: GradSkip's order of the tokens without its order "
             "of the pixels inside a token (`benchmarks/aha_curve_gap.py`).", ""]
    for res in results:
        lines += model_section(res)
    cmd = "python benchmarks/aha_curve_gap.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    lines += [f"Command: `{cmd}` — torch {torch.__version__}, {args.threads} thread(s), "
              f"{sum(r['seconds'] for r in results):.0f} s of scoring.", "", END]
    print_section(lines, args.out, START, END)
    return 0


if __name__ == "__main__":
    sys.exit(main())
