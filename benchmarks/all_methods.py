"""Every method that applies × the quality metrics, on one bundled model, through ``vitlens bench``.

    python benchmarks/all_methods.py --model shapes-vit [--n 50] [--out runs/all-shapes-vit] [--doc PATH]

Models and their data:

- ``shapes-vit``, ``shapes-deit``, ``shapes-vit-gap-reg``: fresh synthetic scenes (seed 2026) — insertion/deletion,
  pointing game + energy in the object mask, positive/negative perturbation, faithfulness violation;
- ``digits-vit``: the held-out MNIST-5k test split — everything except the mask metrics (digits have no masks);
- ``efficientnet_lite0``: the real photographs bundled in wheels (``photos``) — insertion/deletion and faithfulness
  violation (only the methods that run on a CNN).

Methods that need attention or tokens are skipped on models without them (the table lists what was skipped and
why). Expensive perturbation methods run with reduced settings so a table finishes in minutes on 2 CPU cores; the
settings are printed in the table's method names (``rise[n_masks=500]``). The run is resumable (rerun the command).
AHA needs an explainer trained for the model and is evaluated separately (``benchmarks/aha_eval.py``).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch

import vitlens
from vitlens.bench import BenchConfig, run_benchmark

#: reduced settings for methods whose paper settings take thousands of forwards per image
REDUCED = {
    "rise": {"n_masks": 500},
    "tis": {"n_masks": 256},
    "integrated_gradients": {"n_steps": 16},
    "libragrad_ig": {"n_steps": 16},
    "smoothgrad": {"n": 16},
    "mda": {"n_regions": 16},
}
SKIP = {"aha"}  # needs a trained explainer for the model: run with --methods aha,... --section aha (see the docs)

ID = ("insertion_deletion", {"preset": "aha"})
POINTING = ("pointing_game", {"tolerance": 4})
POSNEG = ("pos_neg_perturbation", {})
VIOLATION = ("faithfulness_violation", {})
SACO = ("saco", {})  # Wu et al., CVPR 2024: groups perturbed one at a time (docs/metrics.md)

#: model → (data spec, metrics, description of the data)
SETUPS = {
    "shapes-vit": ("scenes:seed=2026", [ID, POINTING, POSNEG, VIOLATION, SACO], "fresh synthetic scenes (seed 2026)"),
    "shapes-deit": ("scenes:seed=2026", [ID, POINTING, POSNEG, VIOLATION, SACO],
                    "fresh synthetic scenes (seed 2026)"),
    "shapes-vit-gap-reg": ("scenes:seed=2026", [ID, POINTING, POSNEG, VIOLATION, SACO],
                           "fresh synthetic scenes (seed 2026)"),
    "digits-vit": ("mnist5k:split=test", [ID, POSNEG, VIOLATION, SACO], "the held-out MNIST-5k test split"),
    # a CNN has no patches: the violation metric perturbs 32-px cells, the network's total stride (7×7 at 224 px)
    "efficientnet_lite0": ("photos", [ID, ("faithfulness_violation", {"patch_size": 32})],
                           "the real photographs bundled in wheels"),
}


def applicable(model: torch.nn.Module, names: list[str]) -> tuple[list[str], dict[str, str]]:
    """Split method names into those that run on ``model`` and those that do not (with the reason)."""
    from vitlens.explainers.support import why_not

    ok, skipped = [], {}
    for name in names:
        why = why_not(model, name)  # the support query: the capability the method needs and the model lacks
        if why is None and name == "vit_shapley":  # a learned explainer: runs only where one was trained
            from vitlens.shapley import shipped_shapley

            if shipped_shapley(model) is None:
                why = "no shipped ViT-Shapley explainer for this model (train one with `vitlens train-shapley`)"
        if why is None:
            ok.append(name)
        else:
            skipped[name] = why.split(";")[0]
    return ok, skipped


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(SETUPS), default="shapes-vit")
    p.add_argument("--n", type=int, default=50, help="images (the photos source has 7)")
    p.add_argument("--out", default=None, help="run directory (default runs/all-<model>)")
    p.add_argument("--doc", default=None, help="also write the table to this Markdown file")
    p.add_argument("--methods", default=None,
                   help="comma-separated subset of methods, each NAME or NAME:key=value;... (default: all that apply)")
    p.add_argument("--section", default=None,
                   help="write the table as section NAME of --doc (between markers) instead of replacing the file")
    a = p.parse_args(argv)
    data, metrics, data_text = SETUPS[a.model]
    model = vitlens.load_model(a.model)
    from vitlens.bench.specs import parse_spec

    specs = [parse_spec(s) for s in a.methods.split(",")] if a.methods else [
        (m, {}) for m in vitlens.methods() if m not in SKIP]
    names, skipped = applicable(model, list(dict.fromkeys(m for m, _ in specs)))
    methods = [(m, {**REDUCED.get(m, {}), **o}) for m, o in specs if m in names]
    cfg = BenchConfig(model=a.model, data=data, methods=methods, metrics=metrics, n=a.n, batch_size=25)
    t0 = time.time()
    run_dir = run_benchmark(cfg, a.out or f"runs/all-{a.model}")
    table = (Path(run_dir) / "summary.md").read_text()
    cmd = "python benchmarks/all_methods.py " + " ".join(argv if argv is not None else sys.argv[1:])
    metric_text = {
        "insertion_deletion": "insertion/deletion with the `aha` preset (pixel level, 21 points, mean reference, "
                              "probability)",
        "pointing_game": "pointing game (4 px) and energy inside the object mask",
        "pos_neg_perturbation": "positive/negative perturbation (Chefer)",
        "faithfulness_violation": "faithfulness violation (top-1 patch)",
        "saco": "SaCo (10 pixel groups by salience, each replaced alone by the image's channel mean, probability)",
    }
    for m, settings in metrics:
        if m == "faithfulness_violation" and "patch_size" in settings:
            metric_text[m] = f"faithfulness violation (top-1 {settings['patch_size']}-px cell)"
    meta = (f"\nCommand: `{cmd.strip()}` ({time.time() - t0:.0f} s; vitlens {vitlens.__version__}, torch "
            f"{torch.__version__}, Python {platform.python_version()}, {time.strftime('%Y-%m-%d')}). Model "
            f"`{a.model}`, {min(a.n, 7) if data == 'photos' else a.n} images from {data_text}, predicted class. "
            f"Metrics: {'; '.join(metric_text[m] for m, _ in metrics)}.\n")
    if skipped:
        meta += "\nNot applicable to this model: " + "; ".join(f"{k} ({v})" for k, v in sorted(skipped.items())) + ".\n"
    print(table + meta)
    if a.doc and a.section:
        start, end = f"<!-- all_methods:{a.section}:start -->", f"<!-- all_methods:{a.section}:end -->"
        labels = ", ".join(m if not o else f"{m} ({', '.join(f'{k}={v}' for k, v in o.items())})" for m, o in specs)
        text = (f"{start}\n## Added rows: {labels}\n\nThe same images, protocol and metrics as the table above "
                f"(a row repeated from it reproduces its numbers).\n\n{table}{meta}{end}")
        page = Path(a.doc).read_text() if Path(a.doc).is_file() else f"# All methods on `{a.model}`\n"
        if start in page and end in page:
            head, _, rest = page.partition(start)
            page = head + text + rest.partition(end)[2]
        else:
            page = page.rstrip("\n") + "\n\n" + text + "\n"
        Path(a.doc).write_text(page)
    elif a.doc:
        Path(a.doc).parent.mkdir(parents=True, exist_ok=True)
        Path(a.doc).write_text(f"# All methods on `{a.model}`\n\n" + table + meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
