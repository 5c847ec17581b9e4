"""Choose which AHA explainer to ship for a model on the *validation* matrix, never on evaluation images.

Each candidate explainer file (the shipped one and retrained ones) is scored with the validation that ``train-aha``
runs (:func:`vitlens.aha.validation.validate`): hard deletion/insertion of the predicted class on the held-out
validation images of the model's training data (scenes/planted: seed 20,000 + 0; digits: the first MNIST-5k test
digits), under the four deletion references {mean colour, black, blur, per-pixel mean image}, with pixel and token
pooling. The candidate with the best mean over the references (its better pooling) is the one to ship; the
protocol matrix of ``benchmarks/aha_protocols.py`` then scores it on evaluation images no choice has seen.

``--authors N`` also scores every candidate (T = 0 and the default refinement) and GradSkip on the first ``N``
validation images under the AHA authors' protocol (``InsertionDeletion(preset="aha_authors")``, their three
references; ``benchmarks/aha_authors_protocol.py`` runs it on evaluation images), each row − GradSkip paired over
images: a candidate can be chosen for that protocol without looking at its evaluation images.

``--refine N`` also chooses the refinement's default deletion reference on the first ``N`` validation images: the
first candidate's maps at T = 0 and at T = 3 refined with each of ``--refine-references`` are scored with the hard
metric (pixel ranking, 21 points) under each of the four references, next to GradSkip, paired over images.

Usage::

    python benchmarks/aha_select.py --model planted-vit \\
        --candidates shipped=src/vitlens/aha/weights/planted-vit-aha.safetensors \\
                     retrain=runs/aha-planted-vit/planted-vit-aha.safetensors
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

import vitlens
from vitlens.aha import load_explainer
from vitlens.aha.config import AHATrainConfig
from vitlens.aha.data import datasets, mean_std
from vitlens.aha.validation import validate
from vitlens.models import get_adapter
from vitlens.runtime import DistributedRun

DATA = {"shapes-vit": "scenes", "shapes-deit": "scenes", "shapes-vit-gap-reg": "scenes", "digits-vit": "digits",
        "planted-vit": "planted"}
REFS = ("mean", "black", "blur", "meanimage")


def score(model_name: str, path: Path, n_val: int) -> dict[str, float]:
    model = vitlens.load_model(model_name)
    net = load_explainer(path, model)
    net.eval()
    from aha_protocols import training_mean_image  # noqa: E402

    cfg = AHATrainConfig(n_val=n_val, steps=1, batch_size=1)  # the validation images (the card's seed and count)
    _, val_set, _ = datasets(DATA[model_name], model, cfg, net.num_classes)
    # meanimage: the mean of 512 training images, as training and the protocol matrix take it (before session 25
    # this took the training set of the config above, one image)
    return validate(net, val_set, DistributedRun(), pools=["tokens", "none"], references=REFS,
                    mean_std=mean_std(model), mean_img=training_mean_image(model_name, model, net.num_classes))


def validation_images(model_name: str, model: torch.nn.Module, n: int, num_classes: int) -> torch.Tensor:
    cfg = AHATrainConfig(n_val=n, steps=1, batch_size=1)
    _, val_set, _ = datasets(DATA[model_name], model, cfg, num_classes)
    return torch.stack([val_set[i][0] for i in range(min(n, len(val_set)))])


def variant(spec: str) -> dict[str, Any]:
    """AHA options of a refinement variant ``REFERENCE[,KEY=VALUE...]`` (e.g. ``mixed,lr=0.1,refine_steps=5``);
    ``refine_steps`` defaults to 3."""
    kind, *pairs = spec.split(",")
    opts: dict[str, Any] = {"refine_steps": 3, "reference": kind}
    for pair in pairs:
        key, _, value = pair.partition("=")
        opts[key] = int(value) if value.lstrip("-").isdigit() else float(value)
    return opts


def refine_choice(model_name: str, path: Path, n: int, kinds: list[str], batch: int = 8) -> dict[str, dict]:
    """Insertion − deletion per validation image (21 points) under each reference with pixel and token ranking
    (``REF`` and ``REF/token``), for GradSkip, AHA T = 0 and each refinement variant in ``kinds``
    (:func:`variant`)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from aha_protocols import ins_minus_del, maps_of, training_mean_image  # noqa: E402

    from vitlens.aha.soft_metrics import reference
    from vitlens.images import data_config

    model = vitlens.load_model(model_name).eval()
    net = load_explainer(path, model)
    x = validation_images(model_name, model, n, net.num_classes)
    with torch.no_grad():
        cls = model(x).argmax(-1)
    mi = training_mean_image(model_name, model, net.num_classes)
    dc = data_config(model)
    refs = {r: reference(x, r, tuple(dc.mean), tuple(dc.std), mean_image=mi) for r in REFS}
    rows = {"gradskip": maps_of(model, x, "gradskip", batch),
            "T=0": maps_of(model, x, "aha", batch, refine_steps=0, explainer=str(path))}
    for kind in kinds:
        opts = variant(kind)
        rows[f"T={opts['refine_steps']} {kind}"] = maps_of(model, x, "aha", batch, explainer=str(path), **opts)
    ps = get_adapter(model).patch_size
    unit = int(ps[0] if isinstance(ps, (tuple, list)) else ps) if ps else 0
    units = {"": 1, **({"/token": unit} if unit and x.shape[-1] % unit == 0 and x.shape[-2] % unit == 0 else {})}
    out: dict[str, dict] = {}
    for label, maps in rows.items():
        out[label] = {r + tag: torch.cat([ins_minus_del(model, x[s:s + batch], maps[s:s + batch], cls[s:s + batch],
                                                        refs[r][s:s + batch], u, 21)
                                          for s in range(0, len(x), batch)]).tolist()
                      for tag, u in units.items() for r in REFS}
    return out


def authors_choice(model_name: str, candidates: dict[str, Path], n: int, batch: int = 8) -> dict[str, dict]:
    """Per validation image, ``auc_asc − auc_desc`` under each of the authors' references (keys of
    ``aha_authors_protocol.REFERENCES``) for GradSkip and every candidate at T = 0 and at the default refinement."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from aha_authors_protocol import REFERENCES, TR  # noqa: E402
    from aha_authors_protocol import score as authors_score  # noqa: E402
    from aha_protocols import maps_of  # noqa: E402

    model = vitlens.load_model(model_name).eval()
    first = load_explainer(next(iter(candidates.values())), model)
    x = validation_images(model_name, model, n, first.num_classes)
    with torch.no_grad():
        cls = model(x).argmax(-1)
    out = {"gradskip": authors_score(model, x, maps_of(model, x, "gradskip", batch), cls)}
    for label, path in candidates.items():
        for key, opts in ((f"{label} T=0", {"refine_steps": 0}), (f"{label} {TR}", {})):
            out[key] = authors_score(model, x, maps_of(model, x, "aha", batch, explainer=str(path), **opts), cls)
    return {k: {r: v[r] for r in REFERENCES} for k, v in out.items()}


def print_authors(res: dict[str, dict], n: int) -> None:
    from aha_protocols import fmt, paired  # noqa: E402

    refs = list(res["gradskip"])
    print(f"\nThe AHA authors' protocol on {n} validation images: auc_asc − auc_desc, row − GradSkip, paired 95 % t "
          "interval (✓ above 0, ✗ below)\n")
    print("| row | " + " | ".join(f"reference {r}" for r in refs) + " | average |")
    print("|---" * (len(refs) + 2) + "|")
    base = res["gradskip"]
    print("| GradSkip (absolute) | " + " | ".join(f"{sum(base[r]) / len(base[r]):.3f}" for r in refs) + " | |")
    for label, v in res.items():
        if label != "gradskip":
            cells = [paired(v[r], base[r]) for r in refs]
            print(f"| {label} | " + " | ".join(fmt(*c) for c in cells)
                  + f" | {sum(c[0] for c in cells) / len(cells):+.3f} |")


def print_refine(res: dict[str, dict], n: int) -> None:
    import numpy as np
    from scipy.stats import t as student

    print(f"\nRefinement on {n} validation images: insertion − deletion (21 pts; pixel ranking, and token ranking as "
          "REF/token), row − GradSkip, paired 95 % t interval\n")
    cols = list(res["gradskip"])
    print("| row | " + " | ".join(cols) + " | mean | worst cell |")
    print("|---" * (len(cols) + 3) + "|")
    for label, v in res.items():
        if label == "gradskip":
            continue
        cells, worst, total = [], 1e9, 0.0
        for r in cols:
            d = np.asarray(v[r]) - np.asarray(res["gradskip"][r])
            h = float(student.ppf(0.975, len(d) - 1) * d.std(ddof=1) / np.sqrt(len(d))) if len(d) > 1 else 0.0
            worst = min(worst, float(d.mean()))
            total += float(d.mean()) / len(cols)
            cells.append(f"{d.mean():+.3f} ± {h:.3f}")
        print(f"| {label} | " + " | ".join(cells) + f" | {total:+.3f} | {worst:+.3f} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, choices=sorted(DATA))
    p.add_argument("--candidates", nargs="+", required=True, metavar="LABEL=PATH")
    p.add_argument("--n-val", type=int, default=96)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--refine", type=int, default=0, metavar="N", help="also compare refinement references on N images")
    p.add_argument("--refine-only", action="store_true", help="skip the validation matrix (only --refine)")
    p.add_argument("--refine-references", nargs="+", default=["mean", "mixed"], metavar="REF[,KEY=VALUE...]",
                   help="refinement variants: a reference kind and AHA options, e.g. mixed,lr=0.1,refine_steps=5")
    p.add_argument("--authors", type=int, default=0, metavar="N",
                   help="also score the candidates and GradSkip under the AHA authors' protocol on N validation images")
    p.add_argument("--json", type=Path, default=None, help="also write the scores here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = {}
    for item in [] if args.refine_only else args.candidates:
        label, _, path = item.partition("=")
        t0 = time.perf_counter()
        rows[label] = score(args.model, Path(path), args.n_val)
        rows[label]["seconds"] = round(time.perf_counter() - t0, 1)
        print(f"{label}: {rows[label]['difference']:.4f} ({rows[label]['seconds']} s)", file=sys.stderr)
    print(f"Validation matrix of {args.model} ({args.n_val} validation images; insertion − deletion, hard, "
          "predicted class)\n")
    heads = [f"{pool} @{r}" for pool in ("tokens", "pixel") for r in REFS]
    print("| candidate | mean (tokens) | mean (pixel) | " + " | ".join(heads) + " |")
    print("|---" * (3 + len(heads)) + "|")
    for label, v in rows.items():
        cells = [v[f"difference@{r}"] for r in REFS] + [v[f"difference_none@{r}"] for r in REFS]
        print(f"| {label} | {v['difference']:.4f} | {v['difference_none']:.4f} | "
              + " | ".join(f"{c:.4f}" for c in cells) + " |")
    best = "" if not rows else max(rows, key=lambda k: max(rows[k]["difference"], rows[k]["difference_none"]))
    print(f"\nBest on validation: **{best}**")
    refine = {}
    if args.refine:
        first = Path(args.candidates[0].partition("=")[2])
        refine = refine_choice(args.model, first, args.refine, args.refine_references)
        print_refine(refine, args.refine)
    authors = {}
    if args.authors:
        paths = {lab: Path(path) for lab, _, path in (c.partition("=") for c in args.candidates)}
        authors = authors_choice(args.model, paths, args.authors)
        print_authors(authors, args.authors)
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "n_val": args.n_val, "rows": rows, "best": best,
                                         "refine": refine, "authors": authors}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
