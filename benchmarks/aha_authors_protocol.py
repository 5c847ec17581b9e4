"""AHA under the AHA authors' own evaluation protocol, on every bundled model (issue 54, item 4).

The authors' ``scripts/eval.py`` ranks the explainer's map per pixel and reports two areas towards one reference, in
[0, 1] pixel space, 21 points (5 % steps), softmax probability of the predicted class, trapezoids over the nominal
fraction: ``auc_desc`` (most important first, lower is better) and ``auc_asc`` (least important first, higher is
better). vitlens has it as ``InsertionDeletion(preset="aha_authors")`` (pinned to their ``PixelAUCMetric``;
docs/metrics.md); their three references are the constant ImageNet mean colour, black, and a 37-tap σ = 37 blur with
reflect padding. Each cell here is ``auc_asc − auc_desc`` (higher is better).

Rows, per model, on the evaluation images of ``benchmarks/aha_protocols.py`` (scenes seed 40,000 + k, the first
shuffled MNIST-5k test digits; no training or validation run uses them):

* AHA T = 0 (the shipped explainer alone) and AHA with the default test-time refinement (the shipped behaviour);
* GradSkip;
* the best other single-pass method, chosen per model among :data:`CANDIDATES` (ViT-Shapley where an explainer for
  the model ships) by the mean over the three references *on the evaluation images themselves* — which favours that
  method, not AHA;
* ``--extra LABEL=PATH``: another AHA explainer file at T = 0 (e.g. one trained with ``--recipe authors``).

Every difference is paired over images with its 95 % t interval (✓ above 0, ✗ below 0). Results are stored per model
in ``--work`` (JSON, per-image values); ``--resume`` keeps the models (and the rows) already there.

Usage::

    python benchmarks/aha_authors_protocol.py --n 48 --out docs/benchmarks/aha.md --resume
    python benchmarks/aha_authors_protocol.py --models digits-vit --n 8 --work /tmp/x      # quick look
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import vitlens
from vitlens.explainers.aha import AHA
from vitlens.metrics import InsertionDeletion

sys.path.insert(0, str(Path(__file__).resolve().parent))
from aha_protocols import MODELS, command_line, eval_images, fmt, maps_of, paired  # noqa: E402
from aha_sorter_error import print_section  # noqa: E402

START, END = "<!-- aha_authors_protocol:start -->", "<!-- aha_authors_protocol:end -->"
#: the authors' three references, as ``deletion_baseline`` of the ``aha_authors`` preset
REFERENCES = {"mean": "ImageNet mean colour", "black": "black", "blur": "blur (37 taps, σ 37, reflect)"}
#: single-pass methods the best other is chosen from (a method that does not run on the model is skipped)
CANDIDATES = ("attnlrp", "gae", "inputxgradient", "gradcam", "legrad", "libragrad_inputxgradient",
              "libragrad_gradcam", "vit_shapley")
TR = f"T={AHA.defaults['refine_steps']}"


def score(model: torch.nn.Module, x: torch.Tensor, maps: torch.Tensor, cls: torch.Tensor) -> dict[str, list[float]]:
    """Per image, for each reference: ``asc − desc`` and the two areas (keys ``REF``, ``REF:asc``, ``REF:desc``)."""
    out: dict[str, list[float]] = {}
    for ref in REFERENCES:
        res = InsertionDeletion(preset="aha_authors", deletion_baseline=ref)(maps, model=model, x=x, targets=cls)
        out[ref] = res.values["ins_minus_del"].tolist()
        out[f"{ref}:asc"], out[f"{ref}:desc"] = res.values["insertion"].tolist(), res.values["deletion"].tolist()
    return out


def run_model(name: str, n: int, batch: int, extra: dict[str, str], candidates: list[str],
              previous: dict[str, Any] | None) -> dict[str, Any]:
    t0 = time.perf_counter()
    model = vitlens.load_model(name).eval()
    x = eval_images(name, model, n)
    with torch.no_grad():
        cls = model(x).argmax(-1)
    res = previous or {"model": name, "n": n, "rows": {}, "candidates": {}, "seconds_per_image": {}}
    rows, times = res["rows"], res["seconds_per_image"]

    def add(key: str, method: str, **options: Any) -> torch.Tensor | None:
        if key in rows:
            return None
        try:
            mp = maps_of(model, x, method, batch, times, key, **options)
        except vitlens.VitlensError as e:  # a method that does not apply to this model
            print(f"  {name}: {key} skipped ({str(e)[:90]})", flush=True)
            return None
        rows[key] = score(model, x, mp, cls)
        print(f"  {name}: {key} done ({time.perf_counter() - t0:.0f} s)", flush=True)
        return mp

    add("aha_t0", "aha", refine_steps=0)
    add("aha", "aha")
    add("gradskip", "gradskip")
    for m in candidates:
        add(f"cand:{m}", m)
    for label, path in extra.items():
        add(f"extra:{label}", "aha", refine_steps=0, explainer=path)
    cands = {k.removeprefix("cand:"): float(np.mean([np.mean(v[r]) for r in REFERENCES]))
             for k, v in rows.items() if k.startswith("cand:")}
    res["candidates"] = cands
    res["best_other"] = max(cands, key=cands.__getitem__)
    res["seconds"] = round(res.get("seconds", 0.0) + time.perf_counter() - t0, 1)
    return res


def model_section(res: dict[str, Any]) -> tuple[list[str], dict[str, int]]:
    rows, other = res["rows"], res["best_other"]
    o = rows[f"cand:{other}"]
    lines = [f"### {res['model']} ({res['n']} evaluation images; best other single-pass method: {other})", "",
             f"| reference | GradSkip | {other} | AHA T=0 | AHA {TR} | AHA T=0 − GradSkip | AHA {TR} − GradSkip | "
             f"AHA T=0 − {other} | AHA {TR} − {other} |", "|---|---|---|---|---|---|---|---|---|"]
    count = {"cells": 0, "t0_ge": 0, "t0_loss": 0, "tr_ge": 0, "tr_win": 0, "tr_loss": 0, "o_t0_ge": 0, "o_tr_ge": 0}
    for ref, ref_name in REFERENCES.items():
        g, a0, a = rows["gradskip"][ref], rows["aha_t0"][ref], rows["aha"][ref]
        d0, d, e0, e = paired(a0, g), paired(a, g), paired(a0, o[ref]), paired(a, o[ref])
        lines.append(f"| {ref_name} | {np.mean(g):.3f} | {np.mean(o[ref]):.3f} | {np.mean(a0):.3f} | {np.mean(a):.3f} "
                     f"| {fmt(*d0)} | {fmt(*d)} | {fmt(*e0)} | {fmt(*e)} |")
        count["cells"] += 1
        count["t0_ge"] += d0[0] >= 0
        count["t0_loss"] += d0[0] + d0[1] < 0
        count["tr_ge"] += d[0] >= 0
        count["tr_win"] += d[0] - d[1] > 0
        count["tr_loss"] += d[0] + d[1] < 0
        count["o_t0_ge"] += e0[0] >= 0
        count["o_tr_ge"] += e[0] >= 0
    lines += ["", "The two areas (mean over images; `asc` higher is better, `desc` lower is better):", "",
              "| row | " + " | ".join(f"{REFERENCES[r]}: asc / desc" for r in REFERENCES) + " |",
              "|---|" + "---|" * len(REFERENCES)]
    named = {"aha_t0": "AHA T=0", "aha": f"AHA {TR}", "gradskip": "GradSkip", f"cand:{other}": other}
    extras = [k for k in rows if k.startswith("extra:")]
    for key in [*named, *extras]:
        label = named.get(key, f"AHA `{key.removeprefix('extra:')}` (T=0)")
        lines.append(f"| {label} | " + " | ".join(f"{np.mean(rows[key][r + ':asc']):.3f} / "
                                                  f"{np.mean(rows[key][r + ':desc']):.3f}" for r in REFERENCES) + " |")
    if extras:
        lines += ["", "| other explainer (T=0) − GradSkip | " + " | ".join(REFERENCES.values()) + " |",
                  "|---|" + "---|" * len(REFERENCES)]
        for key in extras:
            lines.append(f"| `{key.removeprefix('extra:')}` | " + " | ".join(
                fmt(*paired(rows[key][r], rows["gradskip"][r])) for r in REFERENCES) + " |")
    tm = res.get("seconds_per_image", {})
    lines += ["", "Candidates (mean asc − desc over the three references): " + ", ".join(
        f"{m} {v:.3f}" for m, v in sorted(res["candidates"].items(), key=lambda kv: -kv[1])) + ". Time per map "
        "(one thread, batches of 8): " + ", ".join(f"{named.get(k, k.split(':')[-1])} {1000 * v:.1f} ms"
                                                     for k, v in tm.items() if k in named) + f". {res['seconds']:.0f} s.",
              ""]
    return lines, count


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--n", type=int, default=48, help="evaluation images per model (from the first on)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--candidates", nargs="+", default=list(CANDIDATES))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--extra", action="append", default=[], metavar="LABEL=PATH_PATTERN",
                   help="another AHA explainer at T=0; {model} in the path is replaced; a missing file is skipped")
    p.add_argument("--work", type=Path, default=Path("benchmarks/results/aha-authors-protocol"))
    p.add_argument("--resume", action="store_true", help="keep the models and rows already in --work")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    args.work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    results = []
    for name in args.models:
        path = args.work / f"{name}.json"
        previous = json.loads(path.read_text()) if args.resume and path.is_file() else None
        if previous is not None and previous["n"] != args.n:
            previous = None
        extra = {k: v.format(model=name) for k, v in (e.split("=", 1) for e in args.extra)}
        extra = {k: v for k, v in extra.items() if Path(v).is_file()}
        print(f"{name} ...", flush=True)
        res = run_model(name, args.n, args.batch, extra, args.candidates, previous)
        path.write_text(json.dumps(res))
        results.append(res)
    lines = [START, "", "## AHA under the authors' evaluation protocol (issue 54)", "",
             "The AHA authors' `scripts/eval.py` as `InsertionDeletion(preset=\"aha_authors\")` (docs/metrics.md): the "
             "map ranked per pixel, 21 points, softmax of the predicted class, blending in [0, 1] pixel space towards "
             "one reference; each cell is `auc_asc − auc_desc` (least-important-first minus most-important-first "
             "deletion, higher is better), paired over the evaluation images with its 95 % t interval (✓ above 0, "
             "✗ below 0). The best other single-pass method is chosen per model on these images (which favours it). "
             "Script and rows: `benchmarks/aha_authors_protocol.py`.", ""]
    summary = [f"| model | cells | T=0 ≥ GradSkip | T=0 significantly behind | {TR} ≥ GradSkip | "
               f"{TR} wins / losses | T=0 ≥ best other | {TR} ≥ best other |", "|---|---|---|---|---|---|---|---|"]
    total: dict[str, int] = {}
    body: list[str] = []
    for res in results:
        sec, c = model_section(res)
        body += sec
        summary.append(f"| {res['model']} | {c['cells']} | {c['t0_ge']} | {c['t0_loss']} | {c['tr_ge']} | "
                       f"{c['tr_win']} / {c['tr_loss']} | {c['o_t0_ge']} | {c['o_tr_ge']} |")
        for k, v in c.items():
            total[k] = total.get(k, 0) + v
    t = total
    summary.append(f"| **all** | {t.get('cells', 0)} | {t.get('t0_ge', 0)} | {t.get('t0_loss', 0)} | "
                   f"{t.get('tr_ge', 0)} | {t.get('tr_win', 0)} / {t.get('tr_loss', 0)} | {t.get('o_t0_ge', 0)} | "
                   f"{t.get('o_tr_ge', 0)} |")
    lines += summary + ["", *body, command_line("aha_authors_protocol.py", argv, args.threads, t0), "", END]
    print_section(lines, args.out, START, END)
    return 0


if __name__ == "__main__":
    sys.exit(main())
