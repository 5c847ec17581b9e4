"""ViT-Shapley's estimation error against KernelSHAP, as the paper measures it, and its insertion/deletion beside
GradSkip and AHA: writes docs/benchmarks/vit_shapley.md (issue 53, item 3).

* Reference values: for each evaluation image, KernelSHAP with paired Shapley-kernel sampling (Covert & Lee, 2021) on
  the shipped explainer's own surrogate game ``v(S)`` (the surrogate's softmax probabilities with only the patches
  ``S``), ``--samples`` subsets; its convergence is reported as the relative ℓ2 change from half the samples. Cached
  per (model, surrogate digest, image, samples) in ``--cache`` so the expensive part runs once.
* Errors, for the model's predicted class: ℓ2 distance ``‖φ̂ − φ*‖₂`` over the patches, the same relative to ``‖φ*‖₂``,
  Pearson and Spearman correlation; also the ℓ2 distance averaged over all classes (the paper's error is over every
  class's values). Rows: the explainer (one pass) and KernelSHAP with small budgets (an independent seed), so the
  explainer's error reads as "KernelSHAP with that many samples".
* Insertion/deletion (``vitlens.metrics.InsertionDeletion`` with the ``aha`` preset: 21 points, pixel ranking, mean
  reference, softmax probability of the predicted class) of ViT-Shapley, GradSkip, AHA (T = 0) and the random map on
  ``--n-id`` held-out evaluation images (scenes seed 40,000 + k; the first MNIST-5k test digits of the shuffled order,
  as benchmarks/aha_protocols.py), with the paired mean difference to ViT-Shapley and its 95 % t interval.

Evaluation images: the first ``--images`` of those; neither training nor validation used them.

Usage::

    OMP_NUM_THREADS=1 python benchmarks/vit_shapley.py --images 4 --samples 8192 --n-id 32 \
        --cache runs/vit-shapley/bench --out docs/benchmarks/vit_shapley.md
    # the references alone, from a run's surrogate while its explainer still trains:
    OMP_NUM_THREADS=1 python benchmarks/vit_shapley.py --models shapes-vit --references-only \
        --checkpoint shapes-vit=runs/vit-shapley/shapes-vit/checkpoint.pt
"""

from __future__ import annotations

import argparse
import copy
import datetime as _dt
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import vitlens
from vitlens.aha.network import model_digest
from vitlens.shapley import load_shapley, patch_layout, shipped_shapley
from vitlens.shapley.kernelshap import kernelshap, surrogate_game

MODELS = {"shapes-vit": "scenes", "digits-vit": "digits"}
#: KernelSHAP budgets compared with the explainer, in subsets per patch
BUDGETS = (2, 8, 32)


def eval_images(model: Any, kind: str, n: int) -> torch.Tensor:
    """The evaluation images (normalised): scenes seed 40,000 + k, or the first shuffled MNIST-5k test digits."""
    from vitlens.aha.data import data_config, shuffled_digits
    from vitlens.images import normalize

    cfg = data_config(model)
    if kind == "scenes":
        from vitlens.data.scenes import make_scenes

        return torch.stack([normalize(make_scenes(1, seed=40_000 + k, size=64).images[0], cfg) for k in range(n)])
    return normalize(shuffled_digits()[1].images[:n], cfg)


def surrogate_of(model: Any, checkpoint: str | None, path: Any = None) -> Any:
    """The trained explainer's surrogate: from the explainer file (default: the shipped one), or from a run's
    checkpoint (weights only)."""
    if checkpoint is None:
        return load_shapley(path or shipped_shapley(model)[1], model).surrogate
    ck = torch.load(checkpoint, map_location="cpu", weights_only=True)
    sur = copy.deepcopy(model).eval()
    sur.load_state_dict(ck["surrogate"])
    return sur


def references(name: str, sur: Any, x: torch.Tensor, samples: int, cache: Path) -> list[dict[str, Any]]:
    """KernelSHAP reference values of each image (cached): ``{"phi": (n, K), "half": (n, K), "seconds"}``."""
    cache.mkdir(parents=True, exist_ok=True)
    digest = model_digest(sur)
    out = []
    for i in range(x.shape[0]):
        f = cache / f"{name}-{digest}-img{i}-s{samples}.pt"
        if f.is_file():
            out.append(torch.load(f, weights_only=True))
            continue
        t0 = time.perf_counter()
        n = patch_layout(sur).n
        phi, at = kernelshap(surrogate_game(sur, x[i:i + 1]), n, samples, seed=0, checkpoints=(samples // 2,))
        rec = {"phi": phi, "half": at[samples // 2], "seconds": time.perf_counter() - t0}
        torch.save(rec, f)
        print(f"{name} image {i}: {samples} samples in {rec['seconds']:.0f} s", flush=True)
        out.append(rec)
    return out


def _pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double() - a.double().mean(), b.double() - b.double().mean()
    return float((a * b).sum() / (a.norm() * b.norm()).clamp_min(1e-30))


def _spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    return _pearson(a.argsort().argsort().double(), b.argsort().argsort().double())


def errors(est: torch.Tensor, ref: torch.Tensor, c: int) -> dict[str, float]:
    """Errors of ``est`` against ``ref`` (both ``(n, K)``) for class ``c`` and over all classes."""
    d = est[:, c].double() - ref[:, c].double()
    return {"l2": float(d.norm()), "rel": float(d.norm() / ref[:, c].double().norm()),
            "pearson": _pearson(est[:, c], ref[:, c]), "spearman": _spearman(est[:, c], ref[:, c]),
            "l2_all": float((est.double() - ref.double()).norm(dim=0).mean())}


def error_rows(name: str, model: Any, x: torch.Tensor, refs: list[dict[str, Any]], path: Any = None) -> dict[str, Any]:
    path = path or shipped_shapley(model)[1]
    net = load_shapley(path, model)
    with torch.no_grad():
        c = model(x).argmax(-1)
        t0 = time.perf_counter()
        out = net(x)
        t_net = (time.perf_counter() - t0) / x.shape[0]
    rows: dict[str, list[dict[str, float]]] = {"ViT-Shapley (1 pass)": []}
    ks_time = []
    for i, ref in enumerate(refs):
        rows["ViT-Shapley (1 pass)"].append(errors(out.values[i], ref["phi"], int(c[i])))
        n = out.values.shape[1]
        budgets = [b * n for b in BUDGETS]
        t0 = time.perf_counter()
        est, at = kernelshap(surrogate_game(net.surrogate, x[i:i + 1]), n, budgets[-1], seed=1,
                             checkpoints=tuple(budgets[:-1]))
        ks_time.append((time.perf_counter() - t0) / budgets[-1])
        for b in budgets:
            rows.setdefault(f"KernelSHAP, {b} subsets", []).append(errors(at.get(b, est), ref["phi"], int(c[i])))
    for label, (method, opts) in {"GradSkip (map)": ("gradskip", {}), "AHA, T = 0 (map)": ("aha", {"refine_steps": 0}),
                                  "input × gradient (map)": ("inputxgradient", {})}.items():
        try:  # other methods' maps are on another scale: only their correlations with φ* are comparable
            tm = vitlens.explain(model, x, method=method, target=c, **opts).token_maps.flatten(1)
        except vitlens.VitlensError as err:
            print(f"{label}: {err}")
            continue
        rows[label] = [{"l2": float("nan"), "rel": float("nan"), "pearson": _pearson(tm[i], r["phi"][:, int(c[i])]),
                        "spearman": _spearman(tm[i], r["phi"][:, int(c[i])]), "l2_all": float("nan")}
                       for i, r in enumerate(refs)]
    grid = patch_layout(model).grid
    shown = [{"image": x[i], "class": int(c[i]), "reference": refs[i]["phi"][:, int(c[i])].reshape(grid),
              "explainer": out.values[i, :, int(c[i])].reshape(grid)} for i in range(min(2, len(refs)))]
    conv = [float((r["phi"] - r["half"]).norm() / r["phi"].norm()) for r in refs]
    return {"rows": {k: {m: float(np.mean([e[m] for e in v])) for m in v[0]} for k, v in rows.items()},
            "convergence": conv, "ref_seconds": [float(r["seconds"]) for r in refs], "t_net": t_net,
            "t_subset": float(np.mean(ks_time)), "n": n, "images": len(refs),
            "train": {k: net.meta.get(k) for k in ("steps", "seconds")}, "validation": net.meta.get("validation"),
            "shown": shown}


def figure(results: dict[str, Any], path: Path) -> None:
    """Per model, two images: the image, the reference φ* and the explainer's φ of the predicted class (one signed
    colour scale per row)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(name, s) for name, r in results.items() for s in r["errors"]["shown"]]
    fig, axes = plt.subplots(len(rows), 3, figsize=(7.5, 2.5 * len(rows)), squeeze=False)
    for (name, s), ax in zip(rows, axes):
        img = s["image"].float()
        img = (img - img.min()) / (img.max() - img.min()).clamp_min(1e-8)
        ax[0].imshow(img.permute(1, 2, 0).numpy())
        ax[0].set_title(f"{name}, class {s['class']}", fontsize=9)
        lim = float(max(s["reference"].abs().max(), s["explainer"].abs().max()))
        for a, key, title in ((ax[1], "reference", "KernelSHAP reference φ*"), (ax[2], "explainer", "ViT-Shapley φ")):
            im = a.imshow(s[key].float().numpy(), cmap="RdBu_r", vmin=-lim, vmax=lim)
            a.set_title(title, fontsize=9)
        fig.colorbar(im, ax=list(ax[1:]), shrink=0.8)
        for a in ax:
            a.set_xticks([])
            a.set_yticks([])
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def insertion_deletion(model: Any, x: torch.Tensor, path: Any = None) -> dict[str, Any]:
    """Per-image insertion − deletion of each method's maps (the model's predicted class)."""
    from vitlens.explainers import get_method
    from vitlens.metrics import get_metric

    methods = {"ViT-Shapley": ("vit_shapley", {"explainer": str(path)} if path else {}), "GradSkip": ("gradskip", {}),
               "AHA (T = 0)": ("aha", {"refine_steps": 0}), "random": ("random", {})}
    metric = get_metric("insertion_deletion", preset="aha")
    out: dict[str, Any] = {}
    for label, (name, opts) in methods.items():
        try:
            exp = get_method(name, **opts).explain(model, x, batch_size=16)
        except vitlens.VitlensError as e:  # e.g. no shipped AHA explainer for a model
            print(f"{label}: {e}")
            continue
        res = metric.compute(exp.maps, model=model, x=x, targets=exp.targets)
        out[label] = {k: v.double().tolist() for k, v in res.values.items()}
        out[label]["seconds_per_image"] = exp.cost.seconds / x.shape[0] if hasattr(exp.cost, "seconds") else None
    out["protocol"] = res.protocol
    return out


def _t_interval(d: np.ndarray) -> tuple[float, float]:
    from scipy import stats

    half = stats.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / math.sqrt(len(d)) if len(d) > 1 else float("nan")
    return float(d.mean() - half), float(d.mean() + half)


def markdown(results: dict[str, Any], args: argparse.Namespace) -> str:
    lines = ["# ViT-Shapley: estimation error against KernelSHAP, and insertion/deletion", "",
             f"Written by `benchmarks/vit_shapley.py` ({_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d %H:%M UTC}); "
             "command: `OMP_NUM_THREADS=1 python benchmarks/vit_shapley.py "
             f"--images {args.images} --samples {args.samples} --n-id {args.n_id}`. One CPU thread on a shared "
             "machine (timings are noisy: read their ratios, not their values).", "",
             "The game is the shipped explainer's surrogate: `v(S)` = its softmax probability of a class with only "
             "the patches `S` present (held-out patches zeroed and masked out of every attention). The reference "
             "φ* is KernelSHAP with paired Shapley-kernel sampling on that game (the paper's ground truth: "
             "KernelSHAP run until it converges); convergence: the relative ℓ2 change of φ* between half and all of "
             "its subsets. Errors are for the model's predicted class over the patches (ℓ2, relative ℓ2 = ℓ2 / ‖φ*‖, "
             "Pearson, Spearman) and, in the last column, the ℓ2 distance averaged over all classes. KernelSHAP rows "
             "use an independent seed.", ""]
    for name, r in results.items():
        e = r.get("errors")
        if e:
            lines += [f"## {name} ({e['n']} patches, {e['images']} images)", "",
                      f"Reference: {args.samples} subsets per image ({np.mean(e['ref_seconds']):.0f} s per image); "
                      f"convergence {np.mean(e['convergence']):.3f} (max {max(e['convergence']):.3f}). Explainer: "
                      f"{e['train']['steps']} training steps in {e['train']['seconds']:.0f} s (model card in "
                      f"src/vitlens/shapley/weights/). Time per image: explainer {1e3 * e['t_net']:.1f} ms, one "
                      f"KernelSHAP subset {1e3 * e['t_subset']:.2f} ms (so the explainer costs as much as "
                      f"{e['t_net'] / e['t_subset']:.0f} subsets).", "",
                      "| estimate | ℓ2 ↓ | relative ℓ2 ↓ | Pearson ↑ | Spearman ↑ | ℓ2, all classes ↓ |",
                      "|---|---|---|---|---|---|"]
            for row, m in e["rows"].items():
                f4 = lambda v, k=4: "—" if math.isnan(v) else f"{v:.{k}f}"  # noqa: E731
                lines.append(f"| {row} | {f4(m['l2'])} | {f4(m['rel'], 3)} | {m['pearson']:.3f} | {m['spearman']:.3f} "
                             f"| {f4(m['l2_all'])} |")
            lines += ["", "The map rows are other methods' token maps of the same class (on another scale: only "
                      "their correlation with φ* is comparable)."]
            lines.append("")
        d = r.get("insdel")
        if d:
            proto = d.pop("protocol")
            base = np.array(d["ViT-Shapley"]["ins_minus_del"])
            lines += [f"### {name}: insertion/deletion on {len(base)} held-out images", "",
                      f"Protocol: {proto}.", "",
                      "| method | insertion ↑ | deletion ↓ | insertion − deletion ↑ | minus ViT-Shapley (95 % t interval) |",
                      "|---|---|---|---|---|"]
            for label, v in d.items():
                diff = np.array(v["ins_minus_del"]) - base
                lo, hi = _t_interval(diff) if label != "ViT-Shapley" else (float("nan"), float("nan"))
                cmp = "—" if label == "ViT-Shapley" else f"{diff.mean():+.4f} [{lo:+.4f}, {hi:+.4f}]"
                lines.append(f"| {label} | {np.mean(v['insertion']):.4f} | {np.mean(v['deletion']):.4f} | "
                             f"{np.mean(v['ins_minus_del']):.4f} | {cmp} |")
            lines.append("")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--images", type=int, default=4, help="images with a KernelSHAP reference")
    p.add_argument("--samples", type=int, default=8192, help="KernelSHAP subsets of the reference")
    p.add_argument("--n-id", type=int, default=32, help="images for insertion/deletion (0: none)")
    p.add_argument("--cache", default="runs/vit-shapley/bench")
    p.add_argument("--references-only", action="store_true", help="compute the references and stop")
    p.add_argument("--checkpoint", action="append", default=[], metavar="MODEL=PATH",
                   help="take MODEL's surrogate from a training checkpoint (with --references-only)")
    p.add_argument("--explainer", action="append", default=[], metavar="MODEL=PATH",
                   help="score this explainer file instead of MODEL's shipped one")
    p.add_argument("--out", default="docs/benchmarks/vit_shapley.md")
    args = p.parse_args()
    torch.set_num_threads(1)
    ckpts = dict(c.split("=", 1) for c in args.checkpoint)
    files = dict(c.split("=", 1) for c in args.explainer)
    results: dict[str, Any] = {}
    for name in args.models.split(","):
        model = vitlens.load_model(name)
        x = eval_images(model, MODELS[name], max(args.images, args.n_id))
        refs = references(name, surrogate_of(model, ckpts.get(name), files.get(name)), x[:args.images], args.samples,
                          Path(args.cache))
        if args.references_only:
            continue
        results[name] = {"errors": error_rows(name, model, x[:args.images], refs, files.get(name))}
        if args.n_id:
            results[name]["insdel"] = insertion_deletion(model, x[:args.n_id], files.get(name))
    if not args.references_only:
        png = Path(args.out).with_name(Path(args.out).stem + "_maps.png")
        figure(results, png)
        text = markdown(results, args).replace("\n## ", f"\n![maps](./{png.name})\n\n*The first two evaluation images "
                                               "per model: the reference and the explainer's values of the predicted "
                                               "class on the patch grid (red positive, blue negative, one scale per "
                                               "row).*\n\n## ", 1)
        Path(args.out).write_text(text, encoding="utf-8")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
