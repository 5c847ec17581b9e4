"""The learning curves and validation matrices of AHA training runs side by side (issue 54: the authors' recipe
against the tracked one at the same budget), as Markdown for docs/benchmarks/aha.md.

Each run is a finished explainer's metadata (``<name>.json``, its ``learning_curve``) or a run folder's
``checkpoint.pt`` (its ``val_history``, for a run still training; read with ``weights_only=True``). Every validation
is :func:`vitlens.aha.validation.validate` on the run's held-out images: hard deletion/insertion of the predicted
class, 21 points, under each of the four references (mean colour, black, blur, per-pixel mean image), with the pixel
map and the map pooled per token — the matrix ``benchmarks/aha_select.py`` scores. Nothing here is chosen on
evaluation images.

Usage::

    python benchmarks/aha_authors_recipe.py \\
        tracked=src/vitlens/aha/weights/shapes-vit-aha.json authors=runs/aha-authors-shapes-vit/checkpoint.pt
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

REFS = ("mean", "black", "blur", "meanimage")


def curve(path: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The run's validations (step order) and its training config."""
    if path.suffix == ".json":
        meta = json.loads(path.read_text(encoding="utf-8"))
        return list(meta.get("learning_curve") or []), dict(meta.get("train") or {})
    import torch

    ck = torch.load(path, map_location="cpu", weights_only=True)
    return list(ck.get("val_history") or []), dict(ck.get("config") or {})


def by_pool(v: dict[str, Any]) -> dict[str, dict[str, float]]:
    """``{"none": {ref: ins − del}, "tokens": {...}}`` of one validation (its own pooling is the unsuffixed key)."""
    own = v.get("pool", "none")
    out: dict[str, dict[str, float]] = {}
    for pool in ("none", "tokens"):
        suffix = "" if pool == own else f"_{pool}"
        vals = {r: v.get(f"difference{suffix}@{r}") for r in REFS}
        if all(isinstance(x, (int, float)) for x in vals.values()):
            out[pool] = {r: float(x) for r, x in vals.items()}
    return out


def table(runs: list[tuple[str, Path]]) -> str:
    lines = ["| run | step | images seen | pooling | " + " | ".join(REFS) + " | mean of the four |",
             "|---|---|---|---|" + "---|" * (len(REFS) + 1)]
    for label, path in runs:
        vals, _ = curve(path)
        for v in vals:
            for pool, d in by_pool(v).items():
                mean = sum(d.values()) / len(d)
                lines.append(f"| {label} | {v['step']} | {v.get('images_seen', '')} | {pool} | "
                             + " | ".join(f"{d[r]:.4f}" for r in REFS) + f" | {mean:.4f} |")
    return "\n".join(lines)


def plot(runs: list[tuple[str, Path]], out: Path, title: str) -> None:
    """Learning curves: the mean of the four references against images seen, one line per run and pooling."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.6, 3.4), dpi=150)
    styles = {"none": "-", "tokens": "--"}
    for i, (label, path) in enumerate(runs):
        vals, _ = curve(path)
        for pool, style in styles.items():
            pts = [(v.get("images_seen", 0), sum(d.values()) / len(d)) for v in vals
                   for pl, d in by_pool(v).items() if pl == pool]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, style, marker="o", ms=3, color=f"C{i}",
                        label=f"{label}, {'pixel map' if pool == 'none' else 'pooled per token'}")
    ax.set_xlabel("training images seen")
    ax.set_ylabel("insertion − deletion\n(validation, mean of 4 references)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", metavar="LABEL=PATH")
    p.add_argument("--png", type=Path, default=None, help="also draw the learning curves into this PNG")
    p.add_argument("--title", default="AHA: tracked recipe and the authors' recipe")
    args = p.parse_args()
    runs = [(r.partition("=")[0], Path(r.partition("=")[2])) for r in args.runs]
    print(table(runs))
    if args.png:
        plot(runs, args.png, args.title)
    for label, path in runs:
        _, cfg = curve(path)
        keys = ("recipe", "steps", "batch_size", "lr", "tau_start", "tau_end", "noise_scale", "m", "sorter_input",
                "pooling", "classes", "reference_style", "lr_schedule", "pool")
        print(f"\n{label}: " + ", ".join(f"{k} {cfg.get(k, '(default)')}" for k in keys))


if __name__ == "__main__":
    main()
