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


START, END = "<!-- aha_authors_recipe:start -->", "<!-- aha_authors_recipe:end -->"
MODELS = ("shapes-vit", "shapes-deit", "shapes-vit-gap-reg", "digits-vit", "planted-vit")


def authors_run(model: str, root: Path) -> Path | None:
    """The authors'-recipe run of ``model`` under ``root``: its explainer's metadata, else its checkpoint (still
    training), else ``None``."""
    for path in (root / f"aha-authors-{model}" / f"{model}-aha.json", root / f"aha-authors-{model}" / "checkpoint.pt"):
        if path.is_file():
            return path
    return None


def checkpoint_step(path: Path) -> int:
    """The step a run folder's checkpoint holds."""
    import torch

    return int(torch.load(path, map_location="cpu", weights_only=True)["step"])


def last_means(path: Path) -> tuple[int, dict[str, float]]:
    """The last validation's step and its mean of the four references per pooling."""
    vals, _ = curve(path)
    v = vals[-1]
    return int(v["step"]), {pool: sum(d.values()) / len(d) for pool, d in by_pool(v).items()}


def models_section(models: list[str], root: Path, png_dir: Path, doc_dir: Path) -> list[str]:
    """The summary table over ``models`` (the shipped explainer against the authors' recipe at its budget), each
    model's learning-curve table and a PNG of the curves."""
    from aha_sorter_error import print_section  # noqa: F401  (the page writer used by main)

    summary = ["| model | budget (steps × batch) | shipped (tracked): pixel / token | authors' recipe: pixel / token "
               "| authors − shipped, at the pooling each would ship | authors' run |",
               "|---|---|---|---|---|---|"]
    body: list[str] = []
    for m in models:
        tracked = Path(__file__).resolve().parents[1] / "src" / "vitlens" / "aha" / "weights" / f"{m}-aha.json"
        run = authors_run(m, root)
        if run is None:
            summary.append(f"| {m} | | | | | not trained |")
            continue
        _, cfg = curve(run)
        _, t = last_means(tracked)
        st, a = last_means(run)
        finished = run.suffix == ".json"
        best = {k: max(v.values()) for k, v in (("t", t), ("a", a)) if v}
        ships = curve(tracked)[1].get("recipe") == "authors"  # chosen on validation: this run is what ships
        summary.append(f"| {m} | {cfg.get('steps')} × {cfg.get('batch_size')} | "
                       + ("this run ships (the authors' recipe, chosen on validation) | " if ships else
                          " / ".join(f"{t[k]:.4f}" if k in t else "—" for k in ("none", "tokens")) + " | ")
                       + " / ".join(f"{a[k]:.4f}" if k in a else "—" for k in ("none", "tokens")) + " | "
                       + ("—" if ships else f"{best['a'] - best['t']:+.4f}" if len(best) == 2 else "—") + " | "
                       + (f"finished (step {st})" if finished else
                          f"**unfinished**: checkpoint at step {checkpoint_step(run)} of {cfg.get('steps')}, last "
                          f"validation at step {st}")
                       + " |")
        png = png_dir / f"aha_authors_curve_{m}.png"
        runs = [("authors (shipped)", run)] if ships else [("tracked (shipped)", tracked), ("authors", run)]
        plot(runs, png, f"{m}: the authors' recipe (shipped)" if ships else f"{m}: shipped (tracked) and authors' recipe")
        body += [f"### {m}", "", f"![learning curves of {m}]({png.relative_to(doc_dir).as_posix()})", "", table(runs), ""]
    return summary + [""] + body


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="*", metavar="LABEL=PATH")
    p.add_argument("--models", nargs="+", default=None, choices=MODELS,
                   help="instead of runs: each model's shipped explainer against runs/aha-authors-MODEL (--root)")
    p.add_argument("--root", type=Path, default=Path("runs"))
    p.add_argument("--out", type=Path, default=None, help="with --models: write the section into this page")
    p.add_argument("--png", type=Path, default=None, help="also draw the learning curves into this PNG")
    p.add_argument("--title", default="AHA: tracked recipe and the authors' recipe")
    args = p.parse_args()
    if args.models:
        import sys

        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from aha_sorter_error import print_section

        out = args.out or Path("docs/benchmarks/aha.md")
        lines = [START, "", *models_section(args.models, args.root, out.parent, out.parent),
                 "Command: `python benchmarks/aha_authors_recipe.py " + " ".join(sys.argv[1:]) + "`", "", END]
        print_section(lines, args.out, START, END)
        return
    if not args.runs:
        p.error("give LABEL=PATH runs or --models")
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
