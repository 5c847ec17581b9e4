"""Does the soft AHA objective track the hard metric?  Measured on the same images and maps.

For a batch of fresh scenes and several maps per image of very different quality (GradSkip, rollout, input x
gradient, the shipped AHA explainer, GradSkip degraded by noise, random, inverted GradSkip), compute

* the hard metric: insertion - deletion with the AHA protocol (pixel level, 21 points, mean reference, predicted
  class, softmax probability), and
* the soft objective ``1 - loss = ins_AUC_soft - del_AUC_soft`` (no peak term) for each sorter setting
  (temperature, Gumbel noise, reference, grid),

and report, per setting, the Pearson correlation over all (image, map) pairs and the correlation of the per-map-kind
means.  Usage: ``python benchmarks/aha_objective.py [--n 24] [--out docs/benchmarks/aha.md]``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import sys
import time
from pathlib import Path

import torch

import vitlens
from vitlens.aha.evaluation import deletion_insertion
from vitlens.aha.soft_metrics import RegionGrid, curve_fractions, reference, soft_curves
from vitlens.aha.sorter import gumbel_noise
from vitlens.aha.train import target_probs
from vitlens.models import get_adapter


def maps_for(model, x, n_seed=0):
    out = {}
    for m in ("gradskip", "rollout", "inputxgradient"):
        out[m] = vitlens.explain(model, x, method=m).maps.float()
    out["aha (shipped)"] = vitlens.explain(model, x, method="aha", refine_steps=0).maps.float()
    g = torch.Generator().manual_seed(n_seed)
    gs = out["gradskip"]
    z = (gs - gs.mean((1, 2), keepdim=True)) / gs.std((1, 2), keepdim=True).clamp_min(1e-12)
    for a in (1.0, 3.0):
        out[f"gradskip + {a:g}x noise"] = z + a * torch.randn(z.shape, generator=g)
    out["random"] = torch.rand(z.shape, generator=g)
    out["inverted gradskip"] = -gs
    return out


def pearson(a, b):
    a = a - a.mean()
    b = b - b.mean()
    return float((a * b).sum() / (a.norm() * b.norm()).clamp_min(1e-12))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=24)
    p.add_argument("--model", default="shapes-vit")
    p.add_argument("--seed", type=int, default=31000)
    p.add_argument("--out", type=Path, default=None, help="Markdown page to write the section into")
    args = p.parse_args()
    rows: list[str] = []
    torch.set_num_threads(1)
    model = vitlens.load_model(args.model)
    scenes = vitlens.data.make_scenes(args.n, seed=args.seed)
    x = vitlens.load_images(scenes.images, model)
    adapter = get_adapter(model)
    maps = maps_for(model, x)
    with torch.no_grad():
        cls = model(x).argmax(-1)
    hard = {k: deletion_insertion(model, x, v, cls)["difference"] for k, v in maps.items()}
    kinds = list(maps)
    hard_all = torch.cat([hard[k] for k in kinds])
    kinds_line = ", ".join(f"{k} {float(hard[k].mean()):.3f}" for k in kinds)
    print("hard ins-del per map kind: " + kinds_line)
    mean, std = (0.5,) * 3, (0.5,) * 3
    from vitlens.images import data_config

    c = data_config(model)
    mean, std = tuple(c.mean), tuple(c.std)
    settings = []
    for tau in (1.0, 0.3, 0.1, 0.03, 0.01, 0.003):
        for noise in (0.0, 1.0):
            settings.append(dict(tau=tau, noise=noise, ref="mean", grid=8))
    settings += [dict(tau=0.3, noise=1.0, ref="black", grid=8), dict(tau=0.3, noise=1.0, ref="blur", grid=8),
                 dict(tau=0.01, noise=0.0, ref="mean", grid=16), dict(tau=0.01, noise=0.0, ref="mean", grid=4),
                 dict(tau=0.01, noise=0.01, ref="mean", grid=8), dict(tau=0.01, noise=0.1, ref="mean", grid=8)]
    fr = curve_fractions(16)
    rows += ["| τ | Gumbel × | reference | grid | soft ins−del (mean over maps) | Pearson r, all pairs | "
             "r of kind means |", "|---|---|---|---|---|---|---|"]
    with adapter.session(capture=False), torch.no_grad():
        for st in settings:
            t0 = time.perf_counter()
            ref = reference(x, st["ref"], mean, std)
            p0 = target_probs(adapter, x, cls)
            p1 = target_probs(adapter, ref, cls)
            grid = RegionGrid(tuple(x.shape[-2:]), st["grid"])
            soft = {}
            for k in kinds:
                noise = None
                if st["noise"]:
                    g = torch.Generator().manual_seed(7)
                    noise = st["noise"] * gumbel_noise((x.shape[0], 2, grid.d, grid.d), generator=g)
                cur = soft_curves(lambda im, c_: target_probs(adapter, im, c_), x, ref, maps[k], cls, grid, fr,
                                  st["tau"], 30, noise=noise, endpoints=(p0, p1))
                soft[k] = cur.ins_auc - cur.del_auc
            soft_all = torch.cat([soft[k] for k in kinds])
            r_all = pearson(soft_all, hard_all)
            r_kind = pearson(torch.stack([soft[k].mean() for k in kinds]), torch.stack([hard[k].mean() for k in kinds]))
            rows.append(f"| {st['tau']:g} | {st['noise']:g} | {st['ref']} | {st['grid']} | "
                        f"{float(soft_all.mean()):.3f} | {r_all:.3f} | {r_kind:.3f} |")
            print(rows[-1], f"({time.perf_counter() - t0:.0f} s)", flush=True)
    start, end = "<!-- aha_objective:start -->", "<!-- aha_objective:end -->"
    text = "\n".join([
        start, "## Does the soft objective track the hard metric?", "",
        f"Command: `python benchmarks/aha_objective.py {' '.join(sys.argv[1:])}` — {_dt.date.today().isoformat()}, "
        f"torch {torch.__version__}.", "",
        f"{args.n} fresh scenes (seed {args.seed}), {len(kinds)} maps per scene of very different quality; hard "
        f"insertion − deletion (21 points, mean reference, predicted class) per kind: {kinds_line}. For each sorter "
        "setting, the soft objective (soft insertion − deletion at 16 fixed points, the same class) of every "
        "(scene, map) pair, and its Pearson correlation with the hard metric over all pairs and over the kind means.",
        "", *rows, "", end])
    if args.out:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from aha_sorter_error import write_section

        write_section(args.out, text, start, end)


if __name__ == "__main__":
    main()
