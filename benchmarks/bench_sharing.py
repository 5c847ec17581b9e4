"""What a bench of k methods on the same images saves by sharing (issue #26), against k separate runs of one method.

Per repeat, side by side in one process: the k separate runs (``vitlens bench`` with one method each), one run of
the k methods with nothing shared (``BenchConfig(share=False)``: what a bench did before), and one run that shares
per batch what does not depend on the method — the batch itself and the perturbation metrics' scores of the
unperturbed and the fully perturbed images (``SharedScores``). Times are the process's CPU time (``--clock cpu``,
one thread by default), medians over ``--repeats``; the images the model was run on are counted by a forward hook.
The run's results are compared with the separate runs' (largest difference; float rounding only).

Usage: ``python benchmarks/bench_sharing.py [--out docs/benchmarks/bench_sharing.md]``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import platform
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import vitlens
from vitlens.bench.runner import BenchConfig, run_benchmark
from vitlens.bench.specs import split_specs


def one_run(model: Any, out: Path, methods: list, metrics: list, args: argparse.Namespace, share: bool,
            clock: Any) -> tuple[float, int, dict[tuple, float]]:
    seen = [0]
    handle = model.register_forward_hook(lambda mod, a, res: seen.__setitem__(0, seen[0] + a[0].shape[0]))
    try:
        cfg = BenchConfig(model=args.model, data=args.data, methods=methods, metrics=metrics, n=args.n,
                          batch_size=args.batch, show=0, share=share)
        t0 = clock()
        run_benchmark(cfg, out, model=model, progress=False)
        seconds = clock() - t0
    finally:
        handle.remove()
    con = sqlite3.connect(out / "results.sqlite")
    try:
        rows = {r[:4]: r[4] for r in con.execute("SELECT image, method, metric, output, value FROM results")}
    finally:
        con.close()
    return seconds, seen[0], rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="shapes-vit")
    p.add_argument("--data", default="scenes:seed=7")
    p.add_argument("--methods", default="gradskip,gae,rollout,inputxgradient,random")
    p.add_argument("--metrics", action="append",
                   help="a metric list as in `vitlens bench --metrics` (repeat for several tables rows)")
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    p.add_argument("--out", default=None, help="also write the table to this Markdown file")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    model = vitlens.load_model(args.model)
    methods = split_specs(args.methods)
    metric_sets = args.metrics or ["insertion_deletion:preset='aha'",
                                   "insertion_deletion:preset='rise';steps=32,pos_neg_perturbation"]
    lines = ["| metrics | k methods | images | separate runs (s) | one run, nothing shared (s) | one run, shared (s) | "
             "shared ÷ separate | model images: separate → shared | largest result difference |",
             "|---|---|---|---|---|---|---|---|---|"]
    for spec in metric_sets:
        metrics = split_specs(spec)
        t: dict[str, list[float]] = {"separate": [], "unshared": [], "shared": []}
        counts: dict[str, int] = {}
        diff = 0.0
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(args.repeats):
                sep_s, sep_n, sep_rows = 0.0, 0, {}
                for j, m in enumerate(methods):
                    s, n, rows = one_run(model, Path(tmp) / f"sep-{r}-{j}", [m], metrics, args, False, clock)
                    sep_s, sep_n = sep_s + s, sep_n + n
                    sep_rows.update(rows)
                un_s, un_n, _ = one_run(model, Path(tmp) / f"unshared-{r}", methods, metrics, args, False, clock)
                sh_s, sh_n, sh_rows = one_run(model, Path(tmp) / f"shared-{r}", methods, metrics, args, True, clock)
                t["separate"].append(sep_s)
                t["unshared"].append(un_s)
                t["shared"].append(sh_s)
                counts = {"separate": sep_n, "shared": sh_n}
                diff = max([diff] + [abs(sh_rows[k] - v) for k, v in sep_rows.items() if v == v])
        med = {k: statistics.median(v) for k, v in t.items()}
        ratio = statistics.median([s / q for s, q in zip(t["shared"], t["separate"])])
        lines.append(f"| `{spec}` | {len(methods)} | {args.n} | {med['separate']:.2f} | {med['unshared']:.2f} | "
                     f"{med['shared']:.2f} | {ratio:.3f} | {counts['separate']} → {counts['shared']} | {diff:.1e} |")
        print(lines[-1], flush=True)
    head = (f"Command: `python benchmarks/bench_sharing.py --repeats {args.repeats} --threads {args.threads}` — "
            f"{_dt.date.today().isoformat()}, {platform.machine()} CPU, {args.threads} thread(s), {args.clock} time, "
            f"model {args.model}, data {args.data}, batch {args.batch}, methods {args.methods}.")
    text = "\n".join([head, "", *lines]) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
