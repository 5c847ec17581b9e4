"""The learning curve of an AHA training run: a plot and a table, and how well the soft objective tracks the hard
metric across its checkpoints.

Reads the run's ``learning_curve`` (written by ``train-aha --val-every N`` into ``<name>.json`` and
``checkpoint.pt``): at every validation the hard held-out metric (deletion, insertion, insertion − deletion; the
authors' protocol) and the training objective measured on the same images (soft insertion − deletion, no noise).

Usage::

    python benchmarks/aha_learning_curve.py src/vitlens/aha/weights/shapes-vit-aha.json \\
        --plot docs/benchmarks/aha_learning_curve_shapes-vit.png --out docs/benchmarks/aha.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from aha_sorter_error import print_section  # noqa: E402


def load_curve(path: Path) -> tuple[list[dict], dict]:
    if path.suffix == ".json":
        meta = json.loads(path.read_text(encoding="utf-8"))
        return list(meta.get("learning_curve") or []), meta
    import torch

    ck = torch.load(path, map_location="cpu", weights_only=False)
    return list(ck.get("val_history") or []), {"name": path.parent.name, "train": ck.get("config", {})}


def pearson(a: list[float], b: list[float]) -> float:
    n = len(a)
    if n < 3:
        return float("nan")
    ma, mb = sum(a) / n, sum(b) / n
    cov = sum((x - ma) * (y - mb) for x, y in zip(a, b))
    va = sum((x - ma) ** 2 for x in a) ** 0.5
    vb = sum((y - mb) ** 2 for y in b) ** 0.5
    return cov / max(va * vb, 1e-12)


def _references(meta: dict) -> str:
    """The deletion reference(s) the card's validation averaged, in words."""
    refs = (meta.get("validation") or {}).get("references") or ["mean"]
    return f"{refs[0]} reference" if len(refs) == 1 else f"the mean over the references {', '.join(refs)}"


def plot(curve: list[dict], path: Path, title: str, reference: dict[str, float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [v["images_seen"] for v in curve]
    fig, ax = plt.subplots(figsize=(8.6, 4.2), dpi=150)
    ax.plot(x, [v["insertion"] for v in curve], "o-", color="tab:green", label="insertion ↑")
    ax.plot(x, [v["deletion"] for v in curve], "o-", color="tab:red", label="deletion ↓")
    ax.plot(x, [v["difference"] for v in curve], "o-", color="black", lw=2, label="insertion − deletion ↑")
    soft = [v.get("soft_difference") for v in curve]
    if all(s is not None for s in soft):
        ax.plot(x, soft, "s--", color="tab:blue", alpha=0.7, label="soft ins − del (training objective)")
    for name, val in reference.items():
        ax.axhline(val, color="grey", ls=":", lw=1)
        ax.text(x[-1], val, f" {name} {val:.3f}", va="bottom", ha="right", fontsize=8, color="grey")
    ax.set_xlabel("training images seen")
    ax.set_ylabel("AUC (held-out, hard metric)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)  # outside: hides no point
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path, help="<name>.json of a finished run, or a run's checkpoint.pt")
    p.add_argument("--plot", type=Path, default=None)
    p.add_argument("--out", type=Path, default=None, help="Markdown page to write the section into")
    p.add_argument("--reference", action="append", default=[], metavar="NAME=VALUE",
                   help="horizontal reference line, e.g. GradSkip=0.436 (repeatable)")
    args = p.parse_args(argv)
    curve, meta = load_curve(args.run)
    if not curve:
        print(f"{args.run}: no learning curve (train with --val-every N)", file=sys.stderr)
        return 1
    name = meta.get("name", args.run.stem)
    refs = {k: float(v) for k, _, v in (r.partition("=") for r in args.reference)}
    hard = [v["difference"] for v in curve]
    soft = [v.get("soft_difference") for v in curve]
    r = pearson([s for s in soft if s is not None], [h for h, s in zip(hard, soft) if s is not None])
    r_trained = pearson([s for s in soft[1:] if s is not None], [h for h, s in zip(hard[1:], soft[1:]) if s is not None])
    start, end = f"<!-- aha_curve:{name}:start -->", f"<!-- aha_curve:{name}:end -->"
    lines = [start, f"## Learning curve of `{name}`", "",
             f"Command: `python benchmarks/aha_learning_curve.py {' '.join(argv or sys.argv[1:])}`. Training command "
             f"and machine: the model card `{name}.md`. Held-out validation on {curve[-1].get('n', '?')} scenes "
             f"(hard metric: 21 points, {_references(meta)}, predicted class, constant token scores where the "
             "explainer pools per token); the soft column is the training objective "
             "(soft insertion − deletion at the run's temperature, no noise, 16 fixed points, the middle grid) on "
             "the first 50 of the same scenes.", ""]
    if args.plot:
        plot(curve, args.plot, f"{name}: held-out deletion / insertion while training", refs)
        lines += [f"![learning curve]({args.plot.name})", ""]
    lines += ["| step | images seen | wall time (s) | deletion ↓ | insertion ↑ | insertion − deletion ↑ | soft ins − del |",
              "|---|---|---|---|---|---|---|"]
    for v in curve:
        s = v.get("soft_difference")
        lines.append(f"| {v['step']} | {v['images_seen']:,} | {v['seconds']:.0f} | {v['deletion']:.4f} | "
                     f"{v['insertion']:.4f} | {v['difference']:.4f} | {'' if s is None else f'{s:.4f}'} |")
    lines += ["", f"Correlation of the soft objective with the hard metric across these checkpoints: Pearson r = "
              f"{r:.3f} ({len(curve)} checkpoints); without the untrained start, which dominates it: "
              f"r = {r_trained:.3f} ({len(curve) - 1} checkpoints).", "", end]
    print_section(lines, args.out, start, end)
    return 0


if __name__ == "__main__":
    sys.exit(main())
