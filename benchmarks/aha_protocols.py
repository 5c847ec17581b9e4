"""AHA under every deletion protocol: the protocol matrix of docs/benchmarks/aha.md (issue #27).

A learned explainer trained to optimise deletion/insertion under one protocol can win only under that protocol. This
script scores the shipped explainers under protocols they were and were not chosen on, on evaluation images that no
training or validation run used (scenes seed 40,000 + k; the first MNIST-5k test digits of their fixed shuffled
order, :func:`vitlens.aha.data.shuffled_digits`, as bench takes them, while AHA validates from position 500 on), paired over images:

* cells: deletion reference ∈ {dataset-mean colour, black, blurred image (σ = side/16), per-pixel dataset-mean image
  (mean of 512 training images)} × ranking ∈ {pixel, token (the map averaged over each patch, whole tokens removed)}
  × curve points ∈ {21, 51}; score insertion − deletion AUC of the softmax probability of the predicted class, hard
  masks, stable sort; plus Chefer's positive/negative perturbation (``neg_minus_pos``, top-1 accuracy, black).
* rows: AHA T = 0 and refined with the defaults (the shipped explainer; T = 6, lr 0.025, ``reference="mixed"``;
  the JSON key stays ``aha_t3``), AHA T = 3, lr 0.05 (the previous default, ``aha_t3_prev``), GradSkip, and the best other single-pass
  method, chosen per model among AttnLRP, GAE, input × gradient, Grad-CAM, LeGrad, LibraGrad input × gradient and
  Grad-CAM, and ViT-Shapley (where an explainer for the model ships; candidates added to a stored result are scored
  with ``--resume --redo candidates`` and replace its choice only if they beat it) by the mean over the four references
  at 21 pixel points *on the evaluation images themselves* (which favours that baseline, not AHA); ``--extra NAME=PATH``
  adds an AHA explainer file at T = 0 (e.g. the one shipped before the retraining); AHA T = 3 with the earlier
  default refinement (``reference="mean"``, the mean colour alone) is scored on the 21-point pixel cells.
* where AHA T = 0 is behind GradSkip, the cell's insertion and deletion AUCs are compared separately (which curve
  it loses on); time per map of each row is reported.
* each cell: the paired mean difference over images with its 95 % t interval; a win is an interval above 0.

Results are stored per model in ``--work`` (JSON); ``--resume`` skips the models already there, so a run split over
sessions gives the same page.

Usage::

    python benchmarks/aha_protocols.py --n 32 --out docs/benchmarks/aha.md --resume
    python benchmarks/aha_protocols.py --models digits-vit --n 8          # quick look
    python benchmarks/aha_protocols.py --n 24 --first 24 --work benchmarks/results/aha-protocols-fresh --resume \
        --out docs/benchmarks/aha_protocols_fresh.md                      # replication on the next 24 images
    python benchmarks/aha_protocols.py --n 24 --first 24 --work benchmarks/results/aha-protocols-fresh --resume \
        --pool benchmarks/results/aha-protocols                           # both runs as one over 48 images
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

import vitlens
from vitlens.aha.config import AHATrainConfig
from vitlens.aha.data import DIGITS_VAL_FROM, datasets, mean_image
from vitlens.aha.soft_metrics import reference
from vitlens.explainers.aha import AHA
from vitlens.images import data_config, normalize
from vitlens.metrics import PositiveNegativePerturbation
from vitlens.models import get_adapter

sys.path.insert(0, str(Path(__file__).resolve().parent))
from aha_sorter_error import print_section  # noqa: E402

AHA_DEFAULTS = AHA.defaults
START, END = "<!-- aha_protocols:start -->", "<!-- aha_protocols:end -->"
MODELS = {"shapes-vit": "scenes", "shapes-deit": "scenes", "shapes-vit-gap-reg": "scenes", "digits-vit": "digits",
          "planted-vit": "planted"}
REFERENCES = ("mean", "black", "blur", "meanimage")
REF_NAMES = {"mean": "mean colour", "black": "black", "blur": "blur", "meanimage": "mean image"}
RANKINGS = ("pixel", "token")
POINTS = (21, 51)
CANDIDATES = ("attnlrp", "gae", "inputxgradient", "gradcam", "legrad", "libragrad_inputxgradient", "libragrad_gradcam",
              "vit_shapley")
#: references whose cells are also scored with 51 points: all four (until session 9 only the mean colour; stored
#: results from then are completed with ``--resume --complete``)
REFS_51 = REFERENCES
EVAL_SEED = 40_000
DIGITS_FROM = 0  # the first shuffled test digits, as bench's; AHA validates from position 500 on


def eval_images(model_name: str, model: torch.nn.Module, n: int, first: int = 0) -> torch.Tensor:
    """``n`` normalised evaluation images of the model's own kind (seeds and indices no training run uses), from
    evaluation image ``first`` on (``first = 24``: the 24 images after those of a 24-image run, the same images a
    larger run would score there)."""
    cfg = data_config(model)
    kind = MODELS[model_name]
    if kind == "digits":
        from vitlens.aha.data import shuffled_digits

        _, test = shuffled_digits()  # the class-ordered split, shuffled
        if DIGITS_FROM + first + n > DIGITS_VAL_FROM:
            raise SystemExit(f"digits {first}..{first + n} would reach the validation digits (from "
                             f"{DIGITS_VAL_FROM})")
        return normalize(test.images[DIGITS_FROM + first:DIGITS_FROM + first + n], cfg)
    from vitlens.data.evidence import make_planted_scenes
    from vitlens.data.scenes import make_scenes

    make = make_scenes if kind == "scenes" else make_planted_scenes
    s = make(first + n, seed=EVAL_SEED, size=cfg.size_hw[0])
    return normalize(s.images[first:], cfg)


def training_mean_image(model_name: str, model: torch.nn.Module, num_classes: int) -> torch.Tensor:
    """The per-pixel mean of the first 512 AHA training images (what training's ``meanimage`` reference uses)."""
    cfg = AHATrainConfig(steps=64, batch_size=8, n_val=1)
    train, _, _ = datasets(MODELS[model_name], model, cfg, num_classes)
    mi = mean_image(train)
    assert mi is not None
    return mi


def token_ranks(maps: torch.Tensor, unit: int) -> tuple[torch.Tensor, int]:
    """Per-pixel rank ``(B, H·W)`` of the pixel's unit (a pixel, or a ``unit × unit`` patch) under a stable descending
    sort of the units' mean relevance, and the number of units."""
    b, h, w = maps.shape
    m = maps.float() if unit == 1 else F.avg_pool2d(maps.float()[:, None], unit)[:, 0]
    flat = m.reshape(b, -1)
    order = torch.argsort(flat, dim=1, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(flat.shape[1]).expand(b, -1).contiguous())
    if unit > 1:
        rank = rank.reshape(b, h // unit, w // unit).repeat_interleave(unit, 1).repeat_interleave(unit, 2)
    return rank.reshape(b, -1), flat.shape[1]


@torch.no_grad()
def ins_and_del(model: torch.nn.Module, x: torch.Tensor, maps: torch.Tensor, cls: torch.Tensor, ref: torch.Tensor,
                unit: int, n_points: int, chunk: int = 256) -> torch.Tensor:
    """Insertion and deletion AUC ``(B, 2)`` (hard masks, ``n_points`` fractions of the units, trapezoidal)."""
    probs = del_and_ins_curves(model, x, maps, cls, ref, unit, n_points, chunk)
    fr = torch.linspace(0.0, 1.0, n_points)
    return torch.stack([torch.trapezoid(probs[:, 1], fr, dim=-1), torch.trapezoid(probs[:, 0], fr, dim=-1)], 1)


@torch.no_grad()
def del_and_ins_curves(model: torch.nn.Module, x: torch.Tensor, maps: torch.Tensor, cls: torch.Tensor,
                       ref: torch.Tensor, unit: int, n_points: int, chunk: int = 256) -> torch.Tensor:
    """The deletion and insertion curves ``(B, 2, n_points)``: the class probability after the top fraction of the
    units is replaced by ``ref`` (deletion, ``[:, 0]``) or kept with the rest replaced (insertion, ``[:, 1]``), at
    ``n_points`` evenly spaced fractions from 0 to 1."""
    b, c, h, w = x.shape
    rank, d = token_ranks(maps, unit)
    fr = torch.linspace(0.0, 1.0, n_points)
    ks = torch.round(fr * d).long()
    top = (rank[:, None, :] < ks[None, :, None]).reshape(b, n_points, 1, h, w)
    xd = torch.where(top, ref[:, None], x[:, None])
    xi = torch.where(top, x[:, None], ref[:, None])
    imgs = torch.stack([xd, xi], 1).reshape(-1, c, h, w)
    labels = cls[:, None].expand(b, 2 * n_points).reshape(-1)
    return torch.cat([model(imgs[s:s + chunk]).float().softmax(-1).gather(1, labels[s:s + chunk, None])[:, 0]
                      for s in range(0, imgs.shape[0], chunk)]).reshape(b, 2, n_points)


def ins_minus_del(model: torch.nn.Module, x: torch.Tensor, maps: torch.Tensor, cls: torch.Tensor, ref: torch.Tensor,
                  unit: int, n_points: int, chunk: int = 256) -> torch.Tensor:
    """Insertion − deletion AUC ``(B,)``."""
    v = ins_and_del(model, x, maps, cls, ref, unit, n_points, chunk)
    return v[:, 0] - v[:, 1]


def maps_of(model: torch.nn.Module, x: torch.Tensor, method: str, batch: int, timings: dict[str, float] | None = None,
            label: str = "", **options: Any) -> torch.Tensor:
    """The method's maps for ``x`` in batches; ``timings[label]`` gets the seconds per image."""
    t = time.perf_counter()
    out = torch.cat([vitlens.explain(model, x[s:s + batch], method, **options).maps.detach()
                     for s in range(0, x.shape[0], batch)])
    if timings is not None:
        timings[label or method] = (time.perf_counter() - t) / len(x)
    return out


def score_matrix(model: torch.nn.Module, x: torch.Tensor, maps: torch.Tensor, cls: torch.Tensor,
                 refs: dict[str, torch.Tensor], unit: int | None, cells: list[tuple[str, str, int]],
                 dc: Any, batch: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for ref_name, ranking, points in cells:
        u = 1 if ranking == "pixel" else unit
        if u is None:
            continue
        vals = torch.cat([ins_and_del(model, x[s:s + batch], maps[s:s + batch], cls[s:s + batch],
                                      refs[ref_name][s:s + batch], u, points) for s in range(0, len(x), batch)])
        key = f"{ref_name}/{ranking}/{points}"
        out[key] = (vals[:, 0] - vals[:, 1]).tolist()
        out[key + ":ins"], out[key + ":del"] = vals[:, 0].tolist(), vals[:, 1].tolist()
    return out


def run_model(name: str, n: int, batch: int, extra: dict[str, str], candidates: list[str],
              previous: dict[str, Any] | None = None, redo: tuple[str, ...] = (), first: int = 0) -> dict[str, Any]:
    """The model's rows; with ``previous`` (an earlier result on the same images), its rows are kept except those
    named in ``redo`` (e.g. the refinement rows after a change of the refinement's defaults)."""
    t0 = time.perf_counter()
    keep = {k: v for k, v in (previous or {}).get("rows", {}).items() if k not in redo}
    kept_times = {k: v for k, v in (previous or {}).get("seconds_per_image", {}).items() if k in keep}
    model = vitlens.load_model(name).eval()
    adapter = get_adapter(model)
    dc = data_config(model)
    x = eval_images(name, model, n, first)
    with torch.no_grad():
        cls = model(x).argmax(-1)
    mi = training_mean_image(name, model, int(model(x[:1]).shape[-1]))
    mean, std = tuple(dc.mean), tuple(dc.std)
    refs = {r: reference(x, r, mean, std, mean_image=mi) for r in REFERENCES}
    unit = adapter.patch_size
    unit = int(unit[0] if isinstance(unit, (tuple, list)) else unit) if unit else None
    if unit and (x.shape[-1] % unit or x.shape[-2] % unit):
        unit = None
    full = [(r, k, p) for r in REFERENCES for k in RANKINGS for p in POINTS if p == 21 or r in REFS_51]
    quick = [(r, "pixel", 21) for r in REFERENCES]
    posneg = PositiveNegativePerturbation(data_config=dc)

    def pn(maps: torch.Tensor) -> list[float]:
        return posneg(maps, model=model, x=x, targets=cls).values["neg_minus_pos"].tolist()

    rows: dict[str, dict[str, list[float]]] = dict(keep)
    timings: dict[str, float] = dict(kept_times)
    cand_scores = {}
    stored = dict((previous or {}).get("candidates", {})) if previous and "best_other" in keep else {}
    if stored:  # the candidates were scored already: reuse them, score only those added since
        candidates = [m for m in candidates if m not in stored]
    for m in candidates:
        try:
            mp = maps_of(model, x, m, batch)
        except vitlens.VitlensError as e:  # a method that does not apply to this family
            print(f"  {name}: {m} skipped ({str(e)[:80]})")
            continue
        cand_scores[m] = (score_matrix(model, x, mp, cls, refs, unit, quick, dc, batch), mp)
    means = {**{m: float(np.mean(list(v.values()))) for m, v in stored.items()},
             **{m: float(np.mean([np.mean(v) for k, v in sc.items() if ":" not in k])) for m, (sc, _) in
                cand_scores.items()}}
    if previous is not None and stored:
        best_other = max(means, key=means.__getitem__)
        if best_other != previous["best_other"]:  # a candidate added since beats the stored choice: its row anew
            print(f"  {name}: best other {previous['best_other']} -> {best_other}")
            rows.pop("best_other", None)
            timings.pop("best_other", None)
    elif cand_scores:
        best_other = max(means, key=means.__getitem__)
    else:
        assert previous is not None
        best_other = previous["best_other"]
    # "aha_t3" is the default refinement (the key predates the default's T = 6, lr = 0.025; kept for stored results)
    methods = {"aha_t0": ("aha", {"refine_steps": 0}), "aha_t3": ("aha", {}),
               "gradskip": ("gradskip", {}),
               "aha_t3_prev": ("aha", {"refine_steps": 3, "lr": 0.05})}  # the previous default, on every cell
    # stored rows that lack some of the full cells (e.g. results from before every reference got 51 points): the
    # maps are recomputed (every method here is deterministic) and only the missing cells are scored
    main_rows = {**methods, "best_other": (best_other, {})}
    for key, (m, opts) in main_rows.items():
        missing = [c for c in full if key in rows and f"{c[0]}/{c[1]}/{c[2]}" not in rows[key]
                   and not (c[1] == "token" and unit is None)]
        if missing:
            mp = maps_of(model, x, m, batch, **opts)
            rows[key] = {**rows[key], **score_matrix(model, x, mp, cls, refs, unit, missing, dc, batch)}
            print(f"  {name}: {key} completed with {len(missing)} cells ({time.perf_counter() - t0:.0f} s)")
    for key, (m, opts) in methods.items():
        if key in rows:
            continue
        mp = maps_of(model, x, m, batch, timings, key, **opts)
        rows[key] = {**score_matrix(model, x, mp, cls, refs, unit, full, dc, batch), "posneg": pn(mp)}
        print(f"  {name}: {key} done ({time.perf_counter() - t0:.0f} s)")
    if "best_other" not in rows:
        mp = cand_scores[best_other][1]
        rows["best_other"] = {**score_matrix(model, x, mp, cls, refs, unit, full, dc, batch), "posneg": pn(mp)}
    # the refinement's earlier default, the mean colour alone, on the pixel cells: what the mixed reference is worth
    if "aha_t3_mean" not in rows:
        mp = maps_of(model, x, "aha", batch, timings, "aha_t3_mean", refine_steps=3, reference="mean")
        rows["aha_t3_mean"] = {**score_matrix(model, x, mp, cls, refs, unit, quick, dc, batch), "posneg": pn(mp)}
    for label, path in extra.items():
        mp = maps_of(model, x, "aha", batch, refine_steps=0, explainer=path)
        rows[label] = {**score_matrix(model, x, mp, cls, refs, unit, quick, dc, batch), "posneg": pn(mp)}
    cands = {**stored, **{m: {k: float(np.mean(v)) for k, v in s.items() if ":" not in k}
                          for m, (s, _) in cand_scores.items()}}
    return {"model": name, "n": n, "first": first, "best_other": best_other, "unit": unit, "rows": rows,
            "candidates": cands or (previous or {}).get("candidates", {}),
            "seconds_per_image": timings,
            "seconds": round(time.perf_counter() - t0, 1)}


def image_ranges(res: dict[str, Any]) -> list[tuple[int, int]]:
    """The evaluation-image ranges ``[first, first + n)`` a result scored (several after :func:`pool`)."""
    return [tuple(r) for r in res.get("ranges", [(res.get("first", 0), res.get("first", 0) + res["n"])])]


def pool(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One model's results on disjoint evaluation-image ranges as one result on all their images: the per-image
    values of the rows and cells every part has are concatenated (so the paired intervals are over all images). The
    best other single-pass method stays the one each part chose on its own images; where the parts chose different
    methods, the row pairs each image with its own part's choice and is named by both."""
    model = {p["model"] for p in parts}
    if len(model) != 1:
        raise SystemExit(f"cannot pool results of different models: {sorted(model)}")
    ranges = sorted(r for p in parts for r in image_ranges(p))
    for (a0, a1), (b0, b1) in zip(ranges, ranges[1:]):
        if b0 < a1:
            raise SystemExit(f"{parts[0]['model']}: evaluation images {a0}..{a1 - 1} and {b0}..{b1 - 1} overlap; "
                             "pool only runs on disjoint images (--first)")
    row_keys = set.intersection(*(set(p["rows"]) for p in parts))
    rows = {}
    for r in sorted(row_keys, key=list(parts[0]["rows"]).index):
        cells = [k for k in parts[0]["rows"][r] if all(k in p["rows"][r] for p in parts)]
        rows[r] = {k: [v for p in parts for v in p["rows"][r][k]] for k in cells}
    n = sum(p["n"] for p in parts)
    others = list(dict.fromkeys(p["best_other"] for p in parts))
    times = set.intersection(*(set(p.get("seconds_per_image", {})) for p in parts))
    cands = set.intersection(*(set(p.get("candidates", {})) for p in parts))
    return {"model": parts[0]["model"], "n": n, "first": ranges[0][0], "ranges": ranges, "best_other": "/".join(others),
            "unit": parts[0]["unit"], "rows": rows,
            "candidates": {m: {k: sum(p["n"] * p["candidates"][m][k] for p in parts) / n
                               for k in parts[0]["candidates"][m] if all(k in p["candidates"][m] for p in parts)}
                           for m in cands},
            "seconds_per_image": {k: sum(p["n"] * p["seconds_per_image"][k] for p in parts) / n for k in times},
            "seconds": sum(p["seconds"] for p in parts)}


def paired(a: list[float], b: list[float]) -> tuple[float, float]:
    """Mean of ``a − b`` and the half-width of its 95 % t interval."""
    from scipy.stats import t as student

    d = np.asarray(a) - np.asarray(b)
    half = float(student.ppf(0.975, len(d) - 1) * d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else float("nan")
    return float(d.mean()), half


def fmt(m: float, h: float) -> str:
    mark = " ✓" if m - h > 0 else (" ✗" if m + h < 0 else "")
    return f"{m:+.3f} ± {h:.3f}{mark}"


def cell_name(key: str) -> str:
    if key == "posneg":
        return "pos/neg perturbation (neg − pos, accuracy, black)"
    r, k, p = key.split("/")
    return f"{REF_NAMES[r]}, {k}, {p} pts"


def model_section(res: dict[str, Any]) -> tuple[list[str], dict[str, int]]:
    rows = res["rows"]
    other = res["best_other"]
    keys = [k for k in rows["gradskip"] if ":" not in k]
    spans = " and ".join(f"{a}–{b - 1}" for a, b in image_ranges(res))
    lines = [f"### {res['model']} ({res['n']} evaluation images, {spans}; best other single-pass method: {other})", "",
             f"| protocol | GradSkip | {other} | AHA T=0 − GradSkip | AHA {TR} − GradSkip | AHA {TR} − T=0 | "
             f"AHA T=0 − {other} | AHA {TR} − {other} |", "|---|---|---|---|---|---|---|---|"]
    count = {"cells": 0, "t0_ge": 0, "t0_win": 0, "t0_loss": 0, "t3_win": 0, "t3_ge": 0, "t3_loss": 0,
             "o_t0_ge": 0, "o_t3_ge": 0, "r_ge": 0}
    behind: list[str] = []
    for key in keys:
        g, o = rows["gradskip"][key], rows["best_other"][key]
        d0, d3 = paired(rows["aha_t0"][key], g), paired(rows["aha_t3"][key], g)
        e0, e3 = paired(rows["aha_t0"][key], o), paired(rows["aha_t3"][key], o)
        r = paired(rows["aha_t3"][key], rows["aha_t0"][key])
        lines.append(f"| {cell_name(key)} | {np.mean(g):.3f} | {np.mean(o):.3f} | {fmt(*d0)} | {fmt(*d3)} | "
                     f"{fmt(*r)} | {fmt(*e0)} | {fmt(*e3)} |")
        if key != "posneg":
            count["cells"] += 1
            count["t0_ge"] += d0[0] >= 0
            count["t0_win"] += d0[0] - d0[1] > 0
            count["t0_loss"] += d0[0] + d0[1] < 0
            count["t3_ge"] += d3[0] >= 0
            count["t3_win"] += d3[0] - d3[1] > 0
            count["t3_loss"] += d3[0] + d3[1] < 0
            count["o_t0_ge"] += e0[0] >= 0
            count["o_t3_ge"] += e3[0] >= 0
            count["r_ge"] += r[0] >= 0
        if key != "posneg" and d0[0] < 0 and key + ":ins" in rows["aha_t0"]:
            di = paired(rows["aha_t0"][key + ":ins"], rows["gradskip"][key + ":ins"])
            dd = paired(rows["aha_t0"][key + ":del"], rows["gradskip"][key + ":del"])
            behind.append(f"| {cell_name(key)} | {fmt(*d0)} | {fmt(*di)} | {fmt(*dd)} |")
    if behind:
        lines += ["", "Where AHA T=0 is behind GradSkip, which curve it loses on (insertion higher is better, "
                  "deletion lower is better; AHA − GradSkip):", "",
                  "| protocol | ins − del | insertion | deletion |", "|---|---|---|---|", *behind]
    quick_rows = [k for k in rows if k not in ("aha_t0", "aha_t3", "gradskip", "best_other")]
    if quick_rows:
        qkeys = [k for k in rows[quick_rows[0]] if ":" not in k and all(k in rows[q] for q in quick_rows)]
        lines += ["", "| other AHA rows − GradSkip | " + " | ".join(cell_name(k) for k in qkeys) + " |",
                  "|---|" + "---|" * len(qkeys)]
        for label in quick_rows:
            name = {"aha_t3_mean": "AHA T=3, lr 0.05, mean colour (the default two releases ago)",
                    "aha_t3_prev": "AHA T=3, lr 0.05, mixed (the previous default)",
                    "aha_t3_mixed": "AHA T=3, mixed-reference refinement"}.get(label, f"AHA `{label}` (T=0)")
            lines.append(f"| {name} | " + " | ".join(fmt(*paired(rows[label][k], rows["gradskip"][k]))
                                                   for k in qkeys) + " |")
    tm = res.get("seconds_per_image", {})
    if tm:
        lines += ["", "Time per map (this run, one thread, batches of 8): " + ", ".join(
            f"{ROW_NAMES.get(k, k)} {1000 * v:.1f} ms" for k, v in tm.items()) + "."]
    lines += ["", "Candidates (mean insertion − deletion over the four references, 21 pixel points): "
              + ", ".join(f"{m} {np.mean(list(v.values())):.3f}" for m, v in res["candidates"].items())
              + f". {res['seconds']:.0f} s.", ""]
    return lines, count


#: the default refinement's label (the stored row key stays ``aha_t3``)
TR = f"T={AHA_DEFAULTS['refine_steps']}"
ROW_NAMES = {"aha_t0": "AHA T=0", "aha_t3": f"AHA {TR}", "gradskip": "GradSkip",
             "aha_t3_mean": "AHA T=3 (mean colour)", "aha_t3_prev": "AHA T=3 (mixed, lr 0.05)"}


def command_line(script: str, argv: list[str] | None, threads: int, t0: float) -> str:
    """The page's last line: the command that wrote it, the date, torch, the machine and this invocation's time."""
    cmd = f"python benchmarks/{script} " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    return (f"Command: `{cmd}` — {_dt.date.today().isoformat()}, torch {torch.__version__}, {platform.machine()}, "
            f"{threads} thread(s), {time.perf_counter() - t0:.0f} s (this invocation; per-model times above).")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--n", type=int, default=32, help="evaluation images per model")
    p.add_argument("--first", type=int, default=0, help="index of the first evaluation image (e.g. 24: a "
                   "replication on the 24 images after a 24-image run's; use its own --work)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--candidates", nargs="+", default=list(CANDIDATES), help="single-pass methods the best other is "
                   "chosen from")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--extra", action="append", default=[], metavar="LABEL=PATH_PATTERN",
                   help="another AHA explainer at T=0; {model} in the path is replaced (e.g. "
                        "before=/tmp/old/{model}-aha.safetensors)")
    p.add_argument("--work", type=Path, default=Path("runs/aha-protocols"))
    p.add_argument("--resume", action="store_true", help="keep the models already in --work")
    p.add_argument("--redo", nargs="+", default=[], metavar="ROW",
                   help="with --resume: recompute only these rows of the models in --work (e.g. aha_t3 aha_t3_mean)")
    p.add_argument("--complete", action="store_true",
                   help="with --resume: score the cells the stored rows lack (their maps are recomputed)")
    p.add_argument("--pool", nargs="+", type=Path, default=[], metavar="WORK",
                   help="pool each model's results with those stored in these --work folders from runs on other, "
                        "disjoint evaluation images (per-image values concatenated; the page is over all images)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--note", action="append", default=[], metavar="MODEL=TEXT",
                   help="a sentence printed under the model's heading (e.g. which explainer file the rows scored)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    args.work.mkdir(parents=True, exist_ok=True)
    extra = dict(e.split("=", 1) for e in args.extra)
    t0 = time.perf_counter()
    results = []
    for name in args.models:
        path = args.work / f"{name}.json"
        previous = json.loads(path.read_text()) if args.resume and path.is_file() else None
        if previous is not None and (previous["n"], previous.get("first", 0)) != (args.n, args.first):
            previous = None
        if previous is not None and not args.redo and not args.complete:
            results.append(previous)
            continue
        print(f"{name} ...", flush=True)
        res = run_model(name, args.n, args.batch, {k: v.format(model=name) for k, v in extra.items()},
                        args.candidates, previous, tuple(args.redo), args.first)
        path.write_text(json.dumps(res))
        results.append(res)
    for i, res in enumerate(results if args.pool else []):
        stored = [w / f"{res['model']}.json" for w in args.pool]
        lacking = [str(s) for s in stored if not s.is_file()]
        if lacking:
            raise SystemExit(f"--pool: no stored results {', '.join(lacking)}")
        results[i] = pool([res, *(json.loads(s.read_text()) for s in stored)])
    lines = [START, "", "## AHA under every deletion protocol (the protocol matrix)", "",
             "Each cell: the paired mean difference of insertion − deletion over the evaluation images with its 95 % "
             "t interval (✓ interval above 0, ✗ below 0). Protocols, rows and images as in the script's docstring "
             "(`benchmarks/aha_protocols.py`): four deletion references × pixel/token ranking × 21/51 points, and "
             "positive/negative perturbation.", ""]
    total: dict[str, int] = {}
    summary = ["| model | cells | T=0 ≥ GradSkip | T=0 wins / losses | " + f"{TR} ≥ GradSkip | {TR} wins / losses | "
               f"{TR} ≥ T=0 | T=0 ≥ best other | {TR} ≥ best other |", "|---|---|---|---|---|---|---|---|---|"]
    body: list[str] = []
    notes = dict(n.split("=", 1) for n in args.note)
    for res in results:
        sec, c = model_section(res)
        if res["model"] in notes:
            sec[1:1] = ["", notes[res["model"]]]
        body += sec
        summary.append(f"| {res['model']} | {c['cells']} | {c['t0_ge']} | {c['t0_win']} / {c['t0_loss']} | "
                       f"{c['t3_ge']} | {c['t3_win']} / {c['t3_loss']} | {c['r_ge']} | {c['o_t0_ge']} | {c['o_t3_ge']} |")
        for k, v in c.items():
            total[k] = total.get(k, 0) + v
    summary.append(f"| **all** | {total.get('cells', 0)} | {total.get('t0_ge', 0)} | {total.get('t0_win', 0)} / "
                   f"{total.get('t0_loss', 0)} | {total.get('t3_ge', 0)} | {total.get('t3_win', 0)} / "
                   f"{total.get('t3_loss', 0)} | {total.get('r_ge', 0)} | {total.get('o_t0_ge', 0)} | "
                   f"{total.get('o_t3_ge', 0)} |")
    lines += summary + ["", *body, command_line("aha_protocols.py", argv, args.threads, t0), "", END]
    print_section(lines, args.out, START, END)
    return 0


if __name__ == "__main__":
    sys.exit(main())
