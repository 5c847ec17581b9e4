"""AHA on the bundled ``shapes-vit``: deletion / insertion against other methods, and what one map costs.

Faithfulness (the AHA authors' protocol, :mod:`vitlens.aha.evaluation`): held-out synthetic scenes (a data seed used
by no training run), the predicted class, hard pixel-level ranking of each method's map (stable sort), 21 points
(0, 5 %, …, 100 %), dataset-mean reference, softmax probability, trapezoidal AUC. Rows: AHA without refinement
(T = 0) and with T = 3 steps, GradSkip, input × gradient and a random map, all through
``vitlens.explain(model, x, method=...)``. Means over images with their standard errors.

Cost, measured in the same run on the same batches: the median over interleaved repeats of (AHA map with T = 0) /
(one no-grad forward of the target), both for the whole batch; the refinement's cost per step in target passes
(from the cost the call counts) and its time per step relative to one forward.

Usage::

    python benchmarks/aha_eval.py                                   # 200 scenes, prints the tables
    python benchmarks/aha_eval.py --out docs/benchmarks/aha.md      # and writes its section of that page
    python benchmarks/aha_eval.py --n 50 --methods aha random       # quicker
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

import vitlens
from vitlens.aha.evaluation import PROTOCOL, deletion_insertion

sys.path.insert(0, str(Path(__file__).resolve().parent))
from aha_sorter_error import print_section  # noqa: E402

START, END = "<!-- aha_eval:start -->", "<!-- aha_eval:end -->"
DEFAULT_METHODS = ("aha", "gradskip", "inputxgradient", "random")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="shapes-vit")
    p.add_argument("--explainer", default=None, help="AHA explainer file (default: the shipped one)")
    p.add_argument("--n", type=int, default=200, help="held-out scenes")
    p.add_argument("--seed", type=int, default=30_000, help="scene seed (no training run uses it)")
    p.add_argument("--batch", type=int, default=25)
    p.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS))
    p.add_argument("--refine-steps", type=int, nargs="+", default=[0, 3], help="AHA rows (T values)")
    p.add_argument("--aha-option", action="append", default=[], metavar="KEY=VALUE",
                   help="extra AHA option for the refined rows (e.g. tau=0.1), repeatable")
    p.add_argument("--repeats", type=int, default=7, help="timing repeats")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--section", default="aha_eval", help="name of the section of --out this run writes")
    p.add_argument("--title", default=None, help="section heading (default: AHA on MODEL: deletion / insertion and cost)")
    args = p.parse_args(argv)
    start, end = f"<!-- {args.section}:start -->", f"<!-- {args.section}:end -->"
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()

    model = vitlens.load_model(args.model)
    scenes = vitlens.data.make_scenes(args.n, seed=args.seed, size=vitlens.images.data_config(model).size_hw[0])
    x_all = vitlens.load_images(scenes.images, model)
    with torch.no_grad():
        acc = float((model(x_all).argmax(-1) == scenes.labels).float().mean())
    aha_extra = {}
    for pair in args.aha_option:
        k, _, v = pair.partition("=")
        try:
            aha_extra[k] = json.loads(v)
        except json.JSONDecodeError:
            aha_extra[k] = v

    rows: list[tuple[str, str, dict]] = []  # (label, method, options)
    for m in args.methods:
        if m == "aha":
            for t in args.refine_steps:
                opts = {"explainer": args.explainer, "refine_steps": t, **(aha_extra if t else {})}
                rows.append((f"AHA (T = {t})", "aha", opts))
        else:
            rows.append(({"gradskip": "GradSkip", "inputxgradient": "input × gradient",
                          "random": "random"}.get(m, m), m, {}))

    results = []
    crosscheck = None
    for label, method, opts in rows:
        dele, ins, secs, fwd, bwd = [], [], 0.0, 0.0, 0.0
        for s in range(0, args.n, args.batch):
            x = x_all[s:s + args.batch]
            t0 = time.perf_counter()
            exp = vitlens.explain(model, x, method=method, **opts)
            secs += time.perf_counter() - t0
            fwd += exp.cost.forward_passes * len(x)
            bwd += exp.cost.backward_passes * len(x)
            r = deletion_insertion(model, x, exp.maps, exp.targets)
            if crosscheck is None:  # the project's metric with the same protocol must give the same numbers
                from vitlens.metrics.perturbation import InsertionDeletion

                mr = InsertionDeletion(preset="aha").compute(exp.maps, model=model, x=x, targets=exp.targets)
                crosscheck = (
                    max(float((mr.curves["deletion"] - r["deletion_curve"]).abs().max()),
                        float((mr.curves["insertion"] - r["insertion_curve"]).abs().max())),
                    max(float((mr.values["deletion"] - r["deletion"]).abs().max()),
                        float((mr.values["insertion"] - r["insertion"]).abs().max())))
            dele.append(r["deletion"])
            ins.append(r["insertion"])
        d, i = torch.cat(dele).double(), torch.cat(ins).double()
        diff = i - d
        sem = lambda t: float(t.std() / len(t) ** 0.5)  # noqa: E731
        results.append({"label": label, "method": method, "options": {k: v for k, v in opts.items() if v is not None},
                        "deletion": float(d.mean()), "deletion_sem": sem(d), "insertion": float(i.mean()),
                        "insertion_sem": sem(i), "difference": float(diff.mean()), "difference_sem": sem(diff),
                        "ms_per_image": 1000 * secs / args.n, "forward": fwd / args.n, "backward": bwd / args.n,
                        "_diff": diff})
        print(f"{label:>20}: deletion {d.mean():.4f}  insertion {i.mean():.4f}  ins-del {diff.mean():.4f}  "
              f"{1000 * secs / args.n:.1f} ms/img", flush=True)

    # paired comparison of AHA (T=0) with the best other method on ins − del
    paired = []
    base = next((r for r in results if r["method"] == "aha" and r["options"].get("refine_steps") == 0), None)
    if base is not None:
        for r in results:
            if r is base:
                continue
            delta = base["_diff"] - r["_diff"]
            paired.append((r["label"], float(delta.mean()), float(delta.std() / len(delta) ** 0.5)))
    paired_refined = []  # the first refined AHA row against the non-AHA rows
    refined = next((r for r in results if r["method"] == "aha" and r["options"].get("refine_steps", 0) > 0), None)
    if refined is not None:
        for r in results:
            if r["method"] != "aha":
                delta = refined["_diff"] - r["_diff"]
                paired_refined.append((r["label"], float(delta.mean()), float(delta.std() / len(delta) ** 0.5)))

    # cost: AHA T=0 vs one target forward, interleaved on the same batch
    x = x_all[: args.batch]
    aha = vitlens.explainers.get_method("aha", explainer=args.explainer, refine_steps=0)
    aha.explain(model, x)  # warm-up (loads the explainer)
    with torch.no_grad():
        model(x)
    ratios, t_fwd, t_aha = [], [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        with torch.no_grad():
            model(x)
        t1 = time.perf_counter()
        aha.explain(model, x)
        t2 = time.perf_counter()
        t_fwd.append(t1 - t0)
        t_aha.append(t2 - t1)
        ratios.append((t2 - t1) / (t1 - t0))
    refine_rows = [r for r in results if r["method"] == "aha" and r["options"].get("refine_steps", 0) > 0]
    refine_note = ""
    if refine_rows and base is not None:
        r = refine_rows[0]
        t = r["options"]["refine_steps"]
        per_step_fwd = (r["forward"] - base["forward"] - 1) / t
        per_step_ms = (r["ms_per_image"] - base["ms_per_image"]) / t
        fwd_ms = 1000 * statistics.median(t_fwd) / len(x)
        refine_note = (f"Refinement (T = {t}, m = {r['options'].get('m', 16)}): {per_step_fwd:g} forward + "
                       f"{r['backward'] / t:g} backward target passes per image per step (plus one forward on the "
                       f"reference per call); {per_step_ms:.1f} ms per image per step = "
                       f"{per_step_ms / fwd_ms:.0f}× one forward ({fwd_ms:.2f} ms per image).")

    cmd = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    lines = [
        start,
        f"## {args.title or f'AHA on {args.model}: deletion / insertion and cost'}",
        "",
        f"Command: `{cmd}` — {_dt.date.today().isoformat()}, torch {torch.__version__}, {platform.machine()}, "
        f"{torch.get_num_threads()} thread(s), {time.perf_counter() - t_start:.0f} s.",
        "",
        f"{args.n} held-out scenes (seed {args.seed}; model accuracy on them {acc:.3f}). Protocol: "
        f"{PROTOCOL['ranking']}; {PROTOCOL['n_points']} points; {PROTOCOL['reference']}; the predicted class; "
        f"{PROTOCOL['score']}; {PROTOCOL['auc']}. Mean ± standard error over images.",
        "",
        "| method | deletion ↓ | insertion ↑ | insertion − deletion ↑ | target passes per image (fwd/bwd) | "
        "ms per image |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(f"| {r['label']} | {r['deletion']:.4f} ± {r['deletion_sem']:.4f} | "
                     f"{r['insertion']:.4f} ± {r['insertion_sem']:.4f} | {r['difference']:.4f} ± "
                     f"{r['difference_sem']:.4f} | {r['forward']:g}/{r['backward']:g} | {r['ms_per_image']:.1f} |")
    if crosscheck is not None:
        lines += ["", f"Cross-check on the first batch: `vitlens.metrics.InsertionDeletion(preset=\"aha\")` gives the "
                      f"same curves as `vitlens.aha.evaluation.deletion_insertion` (max difference "
                      f"{crosscheck[0]:.1e}); the AUCs differ by at most {crosscheck[1]:.1e} because the metric "
                      "integrates over the exact fraction k/N of pixels (e.g. 205/4096) and this script over the "
                      "nominal 0, 5 %, …, 100 %."]
    if paired:
        lines += ["", "Paired difference of insertion − deletion, AHA (T = 0) minus each row (mean ± s.e.; "
                  "95 % interval = mean ± 1.96 s.e.): " +
                  "; ".join(f"{lab}: {m:+.4f} ± {s:.4f} [{m - 1.96 * s:+.4f}, {m + 1.96 * s:+.4f}]"
                            for lab, m, s in paired) + "."]
    if paired_refined and refined is not None:
        lines += ["", f"Paired difference of insertion − deletion, {refined['label']} minus each row (mean ± s.e. "
                  "[95 % interval]): " + "; ".join(f"{lab}: {m:+.4f} ± {s:.4f} [{m - 1.96 * s:+.4f}, {m + 1.96 * s:+.4f}]"
                                                   for lab, m, s in paired_refined) + "."]
    lines += [
        "",
        f"Inference cost: an AHA map (T = 0: one target forward for features and logits + the decoder) takes "
        f"**{statistics.median(ratios):.2f}×** the time of one no-grad target forward (median of {args.repeats} "
        f"interleaved repeats on a batch of {len(x)}; forward {1000 * statistics.median(t_fwd) / len(x):.2f} ms, "
        f"AHA {1000 * statistics.median(t_aha) / len(x):.2f} ms per image). {refine_note}",
        "",
        end,
    ]
    print_section(lines, args.out, start, end)
    return 0


if __name__ == "__main__":
    sys.exit(main())
