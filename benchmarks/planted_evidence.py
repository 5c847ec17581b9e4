"""Faithfulness against verified evidence, and the seed's GradSkip claims on models with heterogeneous heads.

    python benchmarks/planted_evidence.py planted [--n 60] [--out runs/planted] [--doc docs/benchmarks/planted_evidence.md]
    python benchmarks/planted_evidence.py heads [--n 60] [--models cues-vit-12h,cues-vit-12h-s1,cues-vit-12h-s2]
        [--doc docs/benchmarks/gradskip_heads.md]

``planted``: on the bundled ``planted-vit`` (trained on planted-cue scenes, :mod:`vitlens.data.evidence`), first the
causal check of what the model uses (flip rates on 2,000 fresh candidate scenes), then every method — GradSkip and its
ablations, AHA with the explainer trained for this model, all baselines — through ``vitlens bench`` with the
``planted`` data source (``decided=both``: ``n`` cue-decided and ``n`` object-decided *verified* images) and the
``evidence`` metric: share of positive relevance, pointing game and rank AUC on the evidence that decided. Mean and
95% interval (normal approximation; n images per group) per method and group.

``heads``: on each of the ``cues-vit-12h`` models (the same recipe, three training seeds; 8 blocks × 12 heads, scenes
whose classes need shape, texture, colour or count), the head statistics (per-head Gini and mean attention distance,
their spread per layer) and GradSkip's head options — adaptive vs uniform, α ∈ {0, .25, .5, .75, 1}, top-25% vs
bottom-25% sparse heads — on verified images (``cues`` data source), scored by insertion − deletion (``aha`` preset)
and the evidence metrics. Differences are paired per image (95% interval) per seed; across seeds the mean of the
three per-seed means with a t interval (2 degrees of freedom).

Both runs resume (rerun the command); every number in the docs comes from these commands (``--doc`` rewrites the
generated part and keeps a hand-written ``## Reading`` section at the end).
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time
from pathlib import Path

import torch

import vitlens
from vitlens.bench import BenchConfig, run_benchmark
from vitlens.bench.specs import spec_label
from vitlens.bench.store import read_rows

sys.path.insert(0, str(Path(__file__).resolve().parent))
from all_methods import REDUCED, applicable  # noqa: E402  (the same reduced settings as the all-methods tables)

ABLATIONS = [
    ("gradskip", {"head_weighting": "uniform"}),
    ("gradskip", {"head_weighting": "gradient"}),
    ("gradskip", {"head_weighting": "sparsity"}),
    ("gradskip", {"head_subset": "top25"}),
    ("gradskip", {"head_subset": "bottom25"}),
    ("gradskip", {"skip": "fixed"}),
    ("gradskip", {"skip": "none"}),
]
HEAD_VARIANTS = [
    ("adaptive (α = 0.5, default)", "gradskip", {}),
    ("uniform heads", "gradskip", {"head_weighting": "uniform"}),
    ("α = 0 (sparsity only)", "gradskip", {"alpha": 0.0}),
    ("α = 0.25", "gradskip", {"alpha": 0.25}),
    ("α = 0.75", "gradskip", {"alpha": 0.75}),
    ("α = 1 (gradient only)", "gradskip", {"alpha": 1.0}),
    ("top-25% sparse heads", "gradskip", {"head_subset": "top25"}),
    ("bottom-25% sparse heads", "gradskip", {"head_subset": "bottom25"}),
]
EVIDENCE = ("evidence", {})
ID = ("insertion_deletion", {"preset": "aha"})


def ci(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% interval (normal approximation)."""
    v = torch.tensor(values, dtype=torch.float64)
    v = v[~torch.isnan(v)]
    if v.numel() < 2:
        return float(v.mean()) if v.numel() else float("nan"), float("nan")
    return float(v.mean()), 1.96 * float(v.std(unbiased=True)) / math.sqrt(v.numel())


def per_image(run_dir: Path) -> dict[tuple[str, str], dict[str, float]]:
    """(method, metric/output) → {image id: value} from a finished run."""
    out: dict[tuple[str, str], dict[str, float]] = {}
    for image_id, method, metric, output, value in read_rows(
            run_dir / "results.sqlite", "SELECT image_id, method, metric, output, value FROM results"):
        out.setdefault((method, f"{metric}/{output}"), {})[image_id] = float("nan") if value is None else value
    return out


def fmt(m: float, h: float) -> str:
    return f"{m:.3f} ± {h:.3f}" if not math.isnan(h) else f"{m:.3f}"


# ----------------------------------------------------------------------------------------------------------------------
# planted cues
# ----------------------------------------------------------------------------------------------------------------------


def run_planted(a: argparse.Namespace) -> str:
    model = vitlens.load_model("planted-vit")
    t0 = time.time()
    from vitlens.data.evidence import make_planted_scenes
    from vitlens.metrics.evidence import evidence_use

    ver = evidence_use(model, make_planted_scenes(2000, seed=2026))
    names = [m for m in vitlens.methods() if m != "aha"]
    ok, skipped = applicable(model, names)
    methods = [(m, dict(REDUCED.get(m, {}))) for m in ok] + ABLATIONS
    from vitlens.aha import shipped_explainer

    shipped = shipped_explainer(model)
    if shipped is not None and shipped[1].is_file():
        methods += [("aha", {"refine_steps": 0}), ("aha", {})]
    else:
        skipped["aha"] = "no explainer trained for planted-vit is shipped"
    cfg = BenchConfig(model="planted-vit", data="planted:seed=2026;decided=both", methods=methods,
                      metrics=[EVIDENCE], n=2 * a.n, batch_size=20)
    run_dir = Path(run_benchmark(cfg, a.out or "runs/planted", progress=not a.quiet))
    vals = per_image(run_dir)
    labels = [spec_label(m, o) for m, o in methods]
    outs = ["evidence/evidence_share", "evidence/evidence_pointing", "evidence/evidence_auc"]
    head = ("| method | cue: share ↑ | cue: pointing ↑ | cue: rank AUC ↑ | object: share ↑ | object: pointing ↑ | "
            "object: rank AUC ↑ |\n|---|---|---|---|---|---|---|\n")
    rows = []
    for lab in labels:
        cells = []
        for group in ("cue", "object"):
            for o in outs:
                d = vals.get((lab, o), {})
                cells.append(fmt(*ci([v for k, v in d.items() if k.endswith("-" + group)])))
        rows.append(f"| {lab} | " + " | ".join(cells) + " |")
    # what a map that knows nothing scores on share: the evidence's share of the image, regenerated from the ids
    # ("planted-<seed>-<index>-<group>") of the images the run scored
    area: dict[str, list[float]] = {"cue": [], "object": []}
    for image_id in vals[(labels[0], outs[0])]:
        _, seed, index, group = image_id.rsplit("-", 3)
        sc = make_planted_scenes(1, seed=int(seed), start=int(index))
        area[group].append(float((sc.cue_masks if group == "cue" else sc.object_masks)[0].float().mean()))
    cmd = "python benchmarks/planted_evidence.py " + " ".join(sys.argv[1:])
    text = (
        "## What planted-vit uses (causal check)\n\n"
        f"On {ver['n']:,} fresh planted scenes (seed 2026): accuracy {ver['accuracy']:.1%} (label = the cue where one "
        f"is planted); on the same scenes without any cue {ver['accuracy_cue_removed']:.1%}. Of the "
        f"{ver['conflicting']} images whose cue conflicts with the object, the model follows the cue in "
        f"{ver['follows_cue']:.1%}; removing the cue flips those predictions back to the object's class in "
        f"**{ver['cue_flip_rate']:.1%}** (cue flip rate). Of the {ver['no_cue']} images without a cue it names the "
        f"object's class in {ver['accuracy_without_cue']:.1%}; removing the object changes those predictions in "
        f"**{ver['object_flip_rate']:.1%}** (object flip rate). Only images where the flip happened count below.\n\n"
        f"## Every method on verified evidence ({a.n} cue-decided + {a.n} object-decided images)\n\n"
        "Share: positive relevance on the evidence ÷ all positive relevance; pointing: the map's maximum is on the "
        "evidence (0 px tolerance); rank AUC: P(random evidence pixel outranks a random other pixel), 0.5 = chance. "
        f"The evidence covers {ci(area['cue'])[0]:.1%} of the image for the cue (8×8 px) and "
        f"{ci(area['object'])[0]:.1%} for the object on average: the share a map that knows nothing would get. "
        "Mean ± 95% interval over images; the predicted class (= the label, on verified images).\n\n"
        + head + "\n".join(rows) + "\n\n"
        f"Command: `{cmd.strip()}` ({time.time() - t0:.0f} s; vitlens {vitlens.__version__}, torch "
        f"{torch.__version__}, Python {platform.python_version()}, {time.strftime('%Y-%m-%d')}). Reduced settings of "
        "the perturbation methods as in `benchmarks/all_methods.py`; run folder "
        f"`{run_dir}` (resumable).\n"
    )
    if skipped:
        text += "\nNot applicable: " + "; ".join(f"{k} ({v})" for k, v in sorted(skipped.items())) + ".\n"
    return text


# ----------------------------------------------------------------------------------------------------------------------
# heterogeneous heads
# ----------------------------------------------------------------------------------------------------------------------


def head_table(model: torch.nn.Module, name: str) -> tuple[str, dict[str, float]]:
    from vitlens.data.evidence import make_cue_scenes
    from vitlens.metrics.heads import head_statistics

    x = vitlens.load_images(make_cue_scenes(200, seed=2026).images, model)
    st = head_statistics(model, x)
    g, d = st["gini"], st["distance"]
    lines = ["| layer | Gini min / mean / max | Gini spread | distance min / mean / max (patches) | distance spread |",
             "|---|---|---|---|---|"]
    for li in range(g.shape[0]):
        lines.append(f"| {li} | {g[li].min():.3f} / {g[li].mean():.3f} / {g[li].max():.3f} | "
                     f"{g[li].max() - g[li].min():.3f} | {d[li].min():.2f} / {d[li].mean():.2f} / {d[li].max():.2f} | "
                     f"{d[li].max() - d[li].min():.2f} |")
    summary = {"gini_spread": float((g.max(1).values - g.min(1).values).mean()),
               "distance_spread": float((d.max(1).values - d.min(1).values).mean())}
    return f"**{name}** — per-head statistics on 200 scenes:\n\n" + "\n".join(lines) + "\n", summary


def run_heads(a: argparse.Namespace) -> str:
    t0 = time.time()
    models = a.models.split(",")
    outs = [("insertion_deletion[preset=aha]/ins_minus_del", "ins − del"),
            ("evidence/evidence_auc", "rank AUC"), ("evidence/evidence_share", "share")]
    labels = [spec_label(m, o) for _, m, o in HEAD_VARIANTS]
    per_seed: dict[str, dict[tuple[str, str], tuple[float, float]]] = {}
    runs: dict[str, dict[tuple[str, str], dict[str, float]]] = {}  # model → its per-image values
    stats_text, spreads = [], {}
    for name in models:
        model = vitlens.load_model(name)
        txt, spreads[name] = head_table(model, name)
        stats_text.append(txt)
        cfg = BenchConfig(model=name, data="cues:seed=2026", methods=[(m, o) for _, m, o in HEAD_VARIANTS],
                          metrics=[ID, EVIDENCE], n=a.n, batch_size=20)
        run_dir = Path(run_benchmark(cfg, f"{a.out or 'runs/heads'}-{name}", progress=not a.quiet))
        runs[name] = per_image(run_dir)
        per_seed[name] = {(lab, o): ci(list(runs[name][(lab, o)].values())) for lab in labels for o, _ in outs}
    # the seed's three claims as paired contrasts, per seed and pooled over seeds
    contrasts = [("adaptive − uniform", labels[0], labels[1]),
                 ("α 0.5 − α 0", labels[0], labels[2]), ("α 0.5 − α 1", labels[0], labels[5]),
                 ("top-25% − bottom-25%", labels[6], labels[7])]
    t2 = 4.303  # t quantile, 2 degrees of freedom, 95%
    lines = ["| contrast | metric | " + " | ".join(models) + " | over seeds (mean, t interval) | reproduces? |",
             "|---|---|" + "---|" * len(models) + "---|---|"]
    for cname, la, lb in contrasts:
        for o, oname in outs:
            cells, means, signs = [], [], []
            for name in models:
                da, db = runs[name][(la, o)], runs[name][(lb, o)]
                m, h = ci([da[k] - db[k] for k in da])
                cells.append(fmt(m, h))
                means.append(m)
                signs.append(1 if m - h > 0 else -1 if m + h < 0 else 0)
            mt = torch.tensor(means, dtype=torch.float64)
            half = t2 * float(mt.std(unbiased=True)) / math.sqrt(len(means)) if len(means) > 1 else float("nan")
            verdict = ("yes (every seed)" if all(s > 0 for s in signs) else
                       "reversed (every seed)" if all(s < 0 for s in signs) else
                       f"no ({sum(s > 0 for s in signs)} of {len(signs)} seeds better, "
                       f"{sum(s < 0 for s in signs)} worse)")
            lines.append(f"| {cname} | {oname} | " + " | ".join(cells) + f" | {fmt(float(mt.mean()), half)} | "
                         f"{verdict} |")
    alpha_lines = ["| variant | " + " | ".join(f"{n}: {on}" for n in models for _, on in outs[:2]) + " |",
                   "|---|" + "---|" * (2 * len(models))]
    for (title, _, _), lab in zip(HEAD_VARIANTS, labels):
        alpha_lines.append(f"| {title} | " + " | ".join(fmt(*per_seed[n][(lab, o)]) for n in models
                                                          for o, _ in outs[:2]) + " |")
    cmd = "python benchmarks/planted_evidence.py " + " ".join(sys.argv[1:])
    return (
        "## Head specialisation\n\n"
        + "\n".join(stats_text)
        + "\nMean spread over layers (max − min over the 12 heads of a layer): "
        + "; ".join(f"{n}: Gini {s['gini_spread']:.3f}, distance {s['distance_spread']:.2f} patches"
                    for n, s in spreads.items()) + ".\n\n"
        f"## GradSkip's head options ({a.n} verified images per model; mean ± 95% interval)\n\n"
        + "\n".join(alpha_lines) + "\n\n"
        "## The seed's claims, paired per image (difference ± 95% interval per seed)\n\n"
        "A claim *reproduces* when every seed's paired interval lies above 0.\n\n"
        + "\n".join(lines) + "\n\n"
        f"Command: `{cmd.strip()}` ({time.time() - t0:.0f} s; vitlens {vitlens.__version__}, torch "
        f"{torch.__version__}, {time.strftime('%Y-%m-%d')}). Data: `cues:seed=2026` (verified images: the model names "
        "the class and no longer does once the class's evidence is removed); insertion/deletion with the `aha` "
        "preset; evidence metrics as in the planted table.\n"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("part", choices=["planted", "heads"])
    p.add_argument("--n", type=int, default=60, help="verified images (per group for planted)")
    p.add_argument("--out", default=None, help="run directory (prefix for heads)")
    p.add_argument("--models", default="cues-vit-12h,cues-vit-12h-s1,cues-vit-12h-s2")
    p.add_argument("--doc", default=None, help="write the result to this Markdown file")
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args(argv)
    text = run_planted(a) if a.part == "planted" else run_heads(a)
    print(text)
    if a.doc:
        title = ("# Faithfulness on verified evidence: planted-vit" if a.part == "planted" else
                 "# GradSkip's head claims on models with heterogeneous heads")
        Path(a.doc).parent.mkdir(parents=True, exist_ok=True)
        old = Path(a.doc).read_text() if Path(a.doc).is_file() else ""
        reading = old[old.index("\n## Reading"):] if "\n## Reading" in old else ""  # hand-written, kept
        Path(a.doc).write_text(title + "\n\n" + text + reading)
    return 0


if __name__ == "__main__":
    sys.exit(main())
