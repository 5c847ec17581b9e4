"""Write the pictures in docs/images/: a method grid, an overlay on an uncropped photo, a screenshot of a report.

    python scripts/docs_pictures.py [--report RUN_DIR]

``grid.png``: the bundled shapes ViT on four fresh scenes × six methods, captions with the model's answer.
``overlay.png``: Grad-CAM of the real ImageNet classifier EfficientNet-Lite0 on a bundled photo (scikit-image's
Chelsea), on the original image at its own resolution (the centre crop's edges left uncoloured).
``report.png`` / ``report-1920.png``: ``RUN_DIR/report.html`` rendered by headless Chromium at 1280 and 1920 px
(e.g. a ``vitlens demo`` run).

Every map is drawn as ``vitlens explain`` draws it: by what its method's values mean (signed on a diverging scale,
non-negative from 0), pixel-level methods on a grey copy of the image, at the default resolution (every panel at
least the model's input size).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import torch

import vitlens
from vitlens import viz
from vitlens.images import data_config, denormalize

OUT = Path(__file__).resolve().parents[1] / "docs" / "images"
METHODS = ["gradskip", "gae", "rollout", "attnlrp", "inputxgradient", "random"]


def grid() -> Path:
    torch.manual_seed(0)
    model = vitlens.load_model("shapes-vit")
    names = list(vitlens.data.CLASS_NAMES)
    scenes = vitlens.data.make_scenes(n=4, seed=11)
    x = vitlens.load_images(scenes.images, model)
    maps = {m: vitlens.explain(model, x, method=m).maps for m in METHODS}
    with torch.no_grad():
        prob, pred = model(x).softmax(-1).max(-1)
    captions = [f"predicted {names[int(c)]}, p = {float(p):.2f}; true {names[int(t)]}"
                for c, p, t in zip(pred, prob, scenes.labels)]
    return viz.save_grid(OUT / "grid.png", denormalize(x, model), maps, captions=captions,
                         row_labels=[f"scene {i}" for i in range(4)], col_size=1.8,
                         metadata={"command": "python scripts/docs_pictures.py", "model": "shapes-vit"})


def overlay() -> Path:
    from vitlens.data.photos import bundled_photos
    from vitlens.data.classes import model_class_names

    name, _, photo = next(p for p in bundled_photos() if p[0] == "chelsea")
    original = np.asarray(photo)
    model = vitlens.load_model("efficientnet_lite0")
    cfg = data_config(model)
    x = vitlens.load_images([original], cfg)
    exp = vitlens.explain(model, x, method="gradcam")
    with torch.no_grad():
        prob = float(model(x).softmax(-1)[0, int(exp.targets[0])])
    label = model_class_names(model)[int(exp.targets[0])]
    placed = viz.map_to_original(exp.maps[0].numpy(), original.shape[:2], cfg)
    return viz.save_figure(OUT / "overlay.png", original, placed, title="Grad-CAM (EfficientNet-Lite0)",
                           method="gradcam", min_panel_px=max(cfg.size_hw),
                           caption=f"{label} (class {int(exp.targets[0])}), p = {prob:.2f}; on the original "
                                   f"{original.shape[1]}×{original.shape[0]} photo (uncoloured: cropped away)",
                           metadata={"command": "python scripts/docs_pictures.py", "photo": name})


def report(run_dir: Path, width: int = 1280) -> Path:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        raise SystemExit("chromium not found (apt-get install chromium)")
    out = OUT / ("report.png" if width == 1280 else f"report-{width}.png")
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                        "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
                        f"--user-data-dir={profile}", f"--window-size={width},2400", f"--screenshot={out}",
                        (run_dir / "report.html").resolve().as_uri()],
                       check=True, capture_output=True, timeout=180)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--report", type=Path, default=None, help="run directory whose report.html to screenshot")
    parser.add_argument("--only", choices=["grid", "overlay", "report"], default=None, help="one picture only")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    if args.only in (None, "grid"):
        print(grid())
    if args.only in (None, "overlay"):
        print(overlay())
    if args.report is not None and args.only in (None, "report"):
        print(report(args.report))
        print(report(args.report, 1920))


if __name__ == "__main__":
    main()
