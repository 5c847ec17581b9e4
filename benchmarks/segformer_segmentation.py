"""Attribution maps as segmentations on multi-object scenes: GradSkip on SegFormer, its ablations and baselines.

    python benchmarks/segformer_segmentation.py [--n 100] [--seed 2026] [--doc]

For every scene of ``vitlens.data.make_multi_scenes`` and every class ``k`` present in it, the bundled
``shapes-segformer`` model is explained for ``SegmentationTarget(k + 1)`` (the sum of the class's logits over the
pixels the model predicts as that class; all pixels when it predicts none). Each map (input resolution) is min-max
normalised, binarised at its mean or at Otsu's threshold (``vitlens.metrics.segmentation``) and compared with the
class's ground-truth mask ``label_maps == k + 1``: pixel accuracy (PA), mean of foreground and background IoU (mIoU)
and the threshold-free average precision (AP). Scores are averaged over the explained classes of each scene, then
over scenes (mean ± 95% CI, normal approximation). A reference row scores the model's own prediction mask of the
class, i.e. what a perfect explanation of *this model's* output would look like. The CAM rows are Seg-Grad-CAM
(Vinogradova et al. 2020) and Finer-CAM on the decode head's fused feature map, where Grad-CAM equals the class's
bias-free logit map clipped at 0 (``docs/methods/cams.md``, "On SegFormer").

``--doc`` also writes the table to ``docs/benchmarks/segformer_segmentation.md``. ``--untrained`` runs the untrained
architecture (a smoke test: its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

import vitlens
from vitlens.explainers import get_method
from vitlens.explainers.base import upsample_tokens
from vitlens.explainers.gradskip_segformer import attribute_hierarchical
from vitlens.metrics.segmentation import segmentation_scores
from vitlens.models import get_adapter
from vitlens.targets import SegmentationTarget

DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks" / "segformer_segmentation.md"

#: (label, method, options); method "gradskip-last" = GradSkip started on the last stage only (see the method page)
ROWS: list[tuple[str, str, dict[str, Any]]] = [
    ("GradSkip (default)", "gradskip", {}),
    ("  start: last stage only", "gradskip-last", {}),
    ("  heads: uniform", "gradskip", {"head_weighting": "uniform"}),
    ("  heads: gradient only (α=1)", "gradskip", {"head_weighting": "gradient"}),
    ("  heads: sparsity only (α=0)", "gradskip", {"head_weighting": "sparsity"}),
    ("  skip: fixed β=0.5", "gradskip", {"skip": "fixed"}),
    ("  skip: none (β_main=1)", "gradskip", {"skip": "none"}),
    ("  plain gradients (conservative=False)", "gradskip", {"conservative": False}),
    ("input × gradient", "inputxgradient", {}),
    ("gradient (saliency)", "gradient", {}),
    ("SmoothGrad (n=16)", "smoothgrad", {"n": 16}),
    ("integrated gradients (16 steps)", "integrated_gradients", {"n_steps": 16}),
    ("Grad-CAM (decode-head features)", "gradcam", {}),
    ("Finer-CAM", "finercam", {}),
    ("RISE (500 masks, target score)", "rise", {"n_masks": 500, "score": "target"}),
    ("random", "random", {}),
]
QUICK = {"smoothgrad": {"n": 2}, "integrated_gradients": {"n_steps": 2}, "rise": {"n_masks": 8}}


def ci95(v: torch.Tensor) -> float:
    v = v[~torch.isnan(v)]
    return 1.96 * float(v.std(unbiased=True)) / math.sqrt(v.numel()) if v.numel() > 1 else float("nan")


def gradskip_last(model: torch.nn.Module, x: torch.Tensor, target: SegmentationTarget) -> torch.Tensor:
    """GradSkip with the spec's literal start (all of ``y`` on the last stage's output), maps ``(B, H, W)``."""
    adapter = get_adapter(model, require="attention")
    att, _, _ = attribute_hierarchical(get_method("gradskip"), adapter, x, target, start="last")
    return upsample_tokens(att.values.detach(), tuple(x.shape[-2:]))


def explain_pairs(fn: Callable[[torch.Tensor, SegmentationTarget], torch.Tensor], x: torch.Tensor,
                  pairs: torch.Tensor, batch: int) -> torch.Tensor:
    """Maps ``(P, H, W)`` for the ``(image, label)`` pairs, in batches of pairs."""
    maps = []
    for s in range(0, len(pairs), batch):
        p = pairs[s:s + batch]
        maps.append(fn(x[p[:, 0]], SegmentationTarget(p[:, 1])))
    return torch.cat(maps)


def per_scene_mean(values: torch.Tensor, image: torch.Tensor, n: int) -> torch.Tensor:
    """Mean over the explained classes of each scene → ``(n,)`` (NaN-aware)."""
    out = torch.full((n,), float("nan"), dtype=torch.float64)
    for i in range(n):
        v = values[image == i]
        v = v[~torch.isnan(v)]
        if v.numel():
            out[i] = v.mean()
    return out


def load(untrained: bool) -> torch.nn.Module:
    if untrained:
        from vitlens.models.segformer_zoo import build_shapes_segformer

        torch.manual_seed(0)
        return build_shapes_segformer().eval()
    return vitlens.load_model("shapes-segformer")


def run(model: torch.nn.Module, n: int, seed: int, batch: int, size: int = 64, quick: bool = False,
        rows: list | None = None) -> tuple[str, dict]:
    scenes = vitlens.data.make_multi_scenes(n, seed=seed, size=size)
    x = vitlens.load_images(scenes.images, model)
    gt = scenes.label_maps
    with torch.no_grad():
        logits = torch.cat([model(pixel_values=x[s:s + batch]).logits for s in range(0, n, batch)])
    pred = F.interpolate(logits, size=gt.shape[-2:], mode="bilinear", align_corners=False).argmax(1)
    labels = torch.arange(logits.shape[1])[None, :, None, None]
    p_is, g_is = pred[:, None] == labels, gt[:, None] == labels
    inter, union = (p_is & g_is).sum((0, 2, 3)), (p_is | g_is).sum((0, 2, 3))
    model_miou = float((inter.double() / union.clamp_min(1).double())[union > 0].mean())
    model_pa = float((pred == gt).double().mean())

    pairs = torch.tensor([(i, k + 1) for i in range(n) for k in scenes.present[i].nonzero().flatten().tolist()])
    masks = gt[pairs[:, 0]] == pairs[:, 1, None, None]
    predicted_none = ~((logits.argmax(1)[pairs[:, 0]] == pairs[:, 1, None, None]).flatten(1).any(1))

    lines = [
        "| method | PA (mean thr.) | mIoU (mean thr.) | PA (Otsu) | mIoU (Otsu) | AP | s / map |",
        "|---|---|---|---|---|---|---|",
    ]
    results: dict[str, Any] = {}
    own = (pred[pairs[:, 0]] == pairs[:, 1, None, None]).float()  # the model's own mask of the class
    table_rows = [("reference: the model's prediction mask", "prediction", {})] + list(rows or ROWS)
    for label, method, opts in table_rows:
        if quick and method in QUICK:
            opts = {**opts, **QUICK[method]}
            label = f"{label} [quick: {QUICK[method]}]"
        t0 = time.perf_counter()
        if method == "prediction":
            maps = own
        elif method == "gradskip-last":
            maps = explain_pairs(lambda xb, t: gradskip_last(model, xb, t), x, pairs, batch)
        else:
            maps = explain_pairs(lambda xb, t: vitlens.explain(model, xb, method=method, target=t, **opts).maps,
                                 x, pairs, batch)
        seconds = (time.perf_counter() - t0) / len(pairs)
        mean_thr = segmentation_scores(maps, masks, "mean")
        otsu = segmentation_scores(maps, masks, "otsu")
        vals = {"pa_mean": mean_thr["pa"], "miou_mean": mean_thr["miou"], "pa_otsu": otsu["pa"],
                "miou_otsu": otsu["miou"], "ap": mean_thr["ap"]}
        scene = {k: per_scene_mean(v, pairs[:, 0], n) for k, v in vals.items()}
        results[label.strip()] = {k: (float(torch.nanmean(v)), ci95(v)) for k, v in scene.items()}
        results[label.strip()]["seconds_per_map"] = seconds
        cells = " | ".join(f"{float(torch.nanmean(v)):.3f} ± {ci95(v):.3f}" for v in scene.values())
        name = "&nbsp;&nbsp;" + label.strip() if label.startswith("  ") else label
        time_cell = "–" if method == "prediction" else f"{seconds:.3f}"
        lines.append(f"| {name} | {cells} | {time_cell} |")
    area = float(masks.double().mean())
    header = (
        f"Model `{getattr(model, 'name_or_path', '') or 'shapes-segformer'}`: on these scenes pixel accuracy "
        f"{model_pa:.3f}, mIoU over the 7 labels {model_miou:.3f} (logits upsampled to 64 px). {n} fresh scenes "
        f"(seed {seed}, {size} px), {len(pairs)} explained (scene, class) pairs; the class's mask covers {area:.1%} "
        f"of the pixels on average. The model predicts no pixel of the explained class in "
        f"{int(predicted_none.sum())} pairs (their target falls back to all pixels). Mean ± 95% CI over scenes; "
        f"each scene's value is the mean over its explained classes.\n"
    )
    info = {"model_pa": model_pa, "model_miou": model_miou, "pairs": len(pairs), "mask_area": area,
            "fallback_pairs": int(predicted_none.sum()), "rows": results}
    return header + "\n" + "\n".join(lines), info


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=100, help="number of scenes")
    p.add_argument("--seed", type=int, default=2026)
    p.add_argument("--batch", type=int, default=16, help="(scene, class) pairs per explain call")
    p.add_argument("--threads", type=int, default=None, help="torch threads for the run (restored after)")
    p.add_argument("--doc", action="store_true", help=f"also write the table to {DOC.relative_to(DOC.parents[2])}")
    p.add_argument("--out", default=None, help="also write the table to this file")
    p.add_argument("--untrained", action="store_true", help="untrained architecture (smoke test only)")
    p.add_argument("--quick", action="store_true", help="cheap settings for the sampling baselines (smoke test)")
    a = p.parse_args(argv)
    threads = torch.get_num_threads()
    try:
        if a.threads:
            torch.set_num_threads(a.threads)
        model = load(a.untrained)
        table, info = run(model, a.n, a.seed, a.batch, quick=a.quick)
    finally:
        torch.set_num_threads(threads)
    cmd = "python benchmarks/segformer_segmentation.py " + " ".join(argv if argv is not None else sys.argv[1:])
    meta = (f"\n\nCommand: `{cmd.strip()}` — vitlens {vitlens.__version__}, torch {torch.__version__}, "
            f"Python {platform.python_version()}.\n")
    warn = "**Untrained model: smoke test, the numbers mean nothing.**\n\n" if a.untrained else ""
    print(warn + table + meta)
    doc = ("# Attribution as segmentation: SegFormer on multi-object scenes\n\n" + warn + table + meta
           + "\nMethod page: [GradSkip on SegFormer](../methods/gradskip_segformer.md).\n")
    for path in ([DOC] if a.doc else []) + ([Path(a.out)] if a.out else []):
        path.write_text(doc)
    return info


if __name__ == "__main__":
    main()
    sys.exit(0)
