"""AHA against GradSkip on an explainer's own validation images, per deletion reference (issue #27).

The protocol matrix (``aha_protocols.py``) scores evaluation images no run has seen. This script asks the question
one step earlier: on the held-out images the shipped checkpoint was *chosen* on (the card's validation set: scenes
seed 20,000 + seed, or the validation digits), is AHA (T = 0) already behind GradSkip under some reference? If it
is, a loss on evaluation images is the same trade seen again, not a failure to generalise from validation.

Rows: the shipped explainer with its own output pooling, the same decoder output with each other spreading of the
token scores (``none``: the decoder's pixel map; ``tokens``: constant per token, or with the explainer's
``spread`` where it ships that pooling; ``tokens-bilinear``: the token
means upsampled bilinearly, as GradSkip's token scores are), and GradSkip. Cells: the four deletion references ×
``--points`` pixel-ranking curves (hard masks, predicted class, softmax, trapezoidal AUC, as the protocol matrix).
Per model the JSON goes to ``--work``; ``--resume`` keeps the models already there. ``--explainer FOLDER`` adds a
row for another explainer of the same target (a training run's output folder, e.g. a second seed), scored with its
own pooling on the *shipped* card's validation images, so that two trainings are compared on the same images.

Usage::

    python benchmarks/aha_validation_gap.py --models shapes-deit shapes-vit --threads 1 --resume
    python benchmarks/aha_validation_gap.py --models shapes-deit --n 8 --points 21   # quick look
    python benchmarks/aha_validation_gap.py --models shapes-deit --explainer runs/aha-shapes-deit-s1 --points 21
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

import vitlens
from vitlens.aha import load_explainer, shipped_explainer
from vitlens.aha.config import AHATrainConfig
from vitlens.aha.data import datasets, mean_image
from vitlens.aha.network import pool_maps
from vitlens.aha.soft_metrics import reference
from vitlens.images import data_config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from aha_protocols import MODELS, REF_NAMES, REFERENCES, maps_of, paired, score_matrix  # noqa: E402
from aha_sorter_error import print_section  # noqa: E402

SPREADS = ("tokens", "tokens-bilinear", "none")
START, END = "<!-- aha_validation_gap:start -->", "<!-- aha_validation_gap:end -->"


def spread(raw: torch.Tensor, patch: int | None, how: str) -> torch.Tensor:
    """The decoder's pixel map ``raw`` ``(B, H, W)`` as ``how`` spreads it (see the module docstring): the explainers'
    own pooling (:func:`vitlens.aha.network.pool_maps`) with spread 0 (``tokens``) or 1 (``tokens-bilinear``)."""
    if how == "none" or patch is None:
        return raw
    lam = {"tokens": 0.0, "tokens-bilinear": 1.0}[how]
    return pool_maps(raw, SimpleNamespace(patch_size=(patch, patch)), "tokens", lam)


def validation_images(name: str, model: torch.nn.Module, meta: dict[str, Any], n: int | None
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The card's validation images (its seed and count, or the first ``n``) and the training mean image."""
    t = meta["train"]
    cfg = AHATrainConfig(steps=t["steps"], batch_size=t["batch_size"], n_val=meta["data"]["n_val"], seed=meta["seed"])
    nc = int(model(torch.zeros(1, 3, *data_config(model).size_hw)).shape[-1])
    train, val, _ = datasets(MODELS[name], model, cfg, nc)
    count = min(len(val), n or len(val))
    return torch.stack([val[i][0] for i in range(count)]), mean_image(train)


def shipped(name: str) -> tuple[torch.nn.Module, Path, dict[str, Any], Any]:
    """The bundled model ``name``, its shipped explainer's weights path, metadata and loaded network."""
    model = vitlens.load_model(name).eval()
    found = shipped_explainer(model)
    if found is None:
        raise SystemExit(f"{name}: no shipped AHA explainer")
    path = found[1]
    return model, path, json.loads(path.with_suffix(".json").read_text()), load_explainer(path, model)


def run_model(name: str, n: int | None, points: list[int], batch: int,
              others: list[Path] | None = None) -> dict[str, Any]:
    t0 = time.perf_counter()
    model, path, meta, net = shipped(name)
    x, mi = validation_images(name, model, meta, n)
    with torch.no_grad():
        feats, logits = net.features(x)
        cls = logits.argmax(-1)
        raw = net.decoder(feats, cls, tuple(x.shape[-2:]))
    patch = net.target_adapter.patch_size
    patch = int(patch[0] if isinstance(patch, (tuple, list)) else patch) if patch else None
    dc = data_config(model)
    refs = {r: reference(x, r, dc.mean, dc.std, mean_image=mi) for r in REFERENCES}
    cells = [(r, "pixel", p) for r in REFERENCES for p in points]
    rows_maps = {f"aha_{s}": net.finish(raw) if s == net.output_pool else spread(raw, patch, s)  # shipped: its spread
                 for s in (SPREADS if patch else ("none",))}
    for folder in others or []:  # another training of an explainer for this target, with its own pooling
        other = load_explainer(folder, model)
        with torch.no_grad():
            rows_maps[f"aha_{other.output_pool} ({folder.name})"] = other(x, cls)
    rows_maps["gradskip"] = maps_of(model, x, "gradskip", batch)
    rows = {}
    for key, mp in rows_maps.items():
        rows[key] = score_matrix(model, x, mp, cls, refs, None, cells, dc, batch)
        print(f"  {name}: {key} done ({time.perf_counter() - t0:.0f} s)", flush=True)
    return {"model": name, "n": int(x.shape[0]), "shipped_pool": net.output_pool, "spread": net.spread,
            "points": points,
            "explainers": [str(f) for f in others or []],
            "val_seed": meta["data"].get("val_seed"), "rows": rows, "seconds": round(time.perf_counter() - t0, 1)}


def section(res: dict[str, Any]) -> list[str]:
    rows, pool = res["rows"], res["shipped_pool"]
    keys = [k for k in rows if k != "gradskip"]
    cols = [f"{r}/pixel/{p}" for p in res["points"] for r in REFERENCES]
    head = [REF_NAMES[c.split("/")[0]] + f", {c.split('/')[2]} pts" for c in cols]
    lam = f", spread λ = {res['spread']:g}" if res.get("spread") else ""
    out = [f"### {res['model']} ({res['n']} validation images, seed {res['val_seed']}; shipped pooling `{pool}`{lam})",
           "",
           "| row | " + " | ".join(head) + " | mean of refs (21 pts) |", "|---|" + "---|" * (len(cols) + 1)]

    def mean21(k: str) -> float:
        return float(np.mean([np.mean(rows[k][f"{r}/pixel/21"]) for r in REFERENCES])) if 21 in res["points"] \
            else float("nan")

    for k in [*keys, "gradskip"]:
        label = "GradSkip" if k == "gradskip" else f"AHA T=0, `{k[4:]}`" + (" (shipped)" if k[4:] == pool else "")
        out.append(f"| {label} | " + " | ".join(f"{np.mean(rows[k][c]):.3f}" for c in cols) + f" | {mean21(k):.4f} |")
    for k in keys:
        diffs = [paired(rows[k][c], rows["gradskip"][c]) for c in cols]
        out.append(f"| AHA `{k[4:]}` − GradSkip | " + " | ".join(f"{m:+.3f} ± {h:.3f}" for m, h in diffs)
                   + f" | {mean21(k) - mean21('gradskip'):+.4f} |")
    return out + [""]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=[m for m in MODELS], choices=list(MODELS))
    p.add_argument("--n", type=int, default=None, help="validation images (default: the card's)")
    p.add_argument("--points", type=int, nargs="+", default=[21, 51])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work", type=Path, default=Path("runs/aha-validation-gap"))
    p.add_argument("--resume", action="store_true", help="keep the models already in --work")
    p.add_argument("--out", type=Path, default=None, help="write the section into this page (between its markers)")
    p.add_argument("--explainer", type=Path, action="append", default=[], metavar="FOLDER",
                   help="also score this trained explainer (a run's output folder; repeatable; one model)")
    args = p.parse_args(argv)
    if args.explainer and len(args.models) != 1:
        p.error("--explainer needs exactly one model in --models (the target it was trained for)")
    torch.set_num_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    lines = [START, "", "## AHA against GradSkip on the validation images, per reference", "",
             "Each cell: mean insertion − deletion (pixel ranking, hard masks, predicted class); the difference rows "
             "are paired over images with 95 % t intervals (`benchmarks/aha_validation_gap.py`).", ""]
    wanted = [str(f) for f in args.explainer]
    for name in args.models:
        path = args.work / f"{name}.json"
        res = json.loads(path.read_text()) if args.resume and path.is_file() else None
        if res is None or (args.n is not None and res["n"] != args.n) or res["points"] != args.points \
                or res.get("explainers", []) != wanted:
            print(f"{name} ...", flush=True)
            res = run_model(name, args.n, args.points, args.batch, args.explainer)
            path.write_text(json.dumps(res))
        lines += section(res)
    cmd = "python benchmarks/aha_validation_gap.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines += [f"Command: `{cmd}` — torch {torch.__version__}, {args.threads} thread(s).", "", END]
    print_section(lines, args.out, START, END)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
