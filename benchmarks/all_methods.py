"""Every registered method × the quality metrics on the bundled shapes ViT, through ``vitlens bench``.

    python benchmarks/shapes_all_methods.py [--n 50] [--out runs/shapes-all] [--doc docs/benchmarks/shapes_all_methods.md]

Expensive perturbation methods run with reduced settings so the table finishes in minutes on 2 CPU cores; the
settings are printed in the table's method names (``rise[n_masks=500]``). The run is resumable (rerun the command).
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
    "smoothgrad": {"n": 16},
}
SKIP = {"aha"}  # needs a trained explainer for the model: evaluated in benchmarks/aha_eval.py

METRICS = [
    ("insertion_deletion", {"preset": "aha"}),
    ("pointing_game", {"tolerance": 4}),
    ("pos_neg_perturbation", {}),
    ("faithfulness_violation", {}),
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=50)
    p.add_argument("--out", default="runs/shapes-all")
    p.add_argument("--doc", default=None)
    a = p.parse_args(argv)
    names = [m for m in vitlens.methods() if m not in SKIP]
    methods = [(m, REDUCED.get(m, {})) for m in names]
    cfg = BenchConfig(model="shapes-vit", data="scenes:seed=2026", methods=methods, metrics=METRICS, n=a.n,
                      batch_size=25)
    t0 = time.time()
    run_dir = run_benchmark(cfg, a.out)
    table = (Path(run_dir) / "summary.md").read_text()
    cmd = "python benchmarks/shapes_all_methods.py " + " ".join(argv if argv is not None else sys.argv[1:])
    meta = (f"\nCommand: `{cmd.strip()}` ({time.time() - t0:.0f} s; vitlens {vitlens.__version__}, torch "
            f"{torch.__version__}, Python {platform.python_version()}, {time.strftime('%Y-%m-%d')}). Shapes ViT, "
            f"{a.n} fresh scenes (seed 2026), predicted class. Metrics: insertion/deletion with the `aha` preset "
            "(pixel level, 21 points, mean reference, probability), pointing game (4 px) and energy inside the object "
            "mask, positive/negative perturbation (Chefer), faithfulness violation (top-1 patch).\n")
    print(table + meta)
    if a.doc:
        Path(a.doc).write_text("# All methods on the shapes ViT\n\n" + table + meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
