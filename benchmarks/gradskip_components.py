"""Where one GradSkip map's time goes above the default-attention floor, measured in one process.

Rows, run one after another in every repeat (paired, like ``gradskip_cost.py``): (b′) the default-attention floor
(the model as timm builds it: fused attention on ViT/EVA02, explicit on Swin; forward + activation-only backward),
(b) the same with explicit attention everywhere, (c) GradSkip.
Inside (c) the per-block steps are timed (CPU time of this process): the attention step (``ω`` and ``W̃`` from
``A`` and ``∂y/∂A``: the product ``A ⊙ ∂y/∂A``, the flow score, the Gini sort, ``W̃``) and the skip-gate step, with
the Gini sort, the flow score and ``W̃`` also on their own. The timers wrap the functions for the duration of the
run only (restored afterwards); they add a few microseconds per call.

Usage::

    python benchmarks/gradskip_components.py --models eva02_tiny_patch14_224:num_classes=1000 --repeats 7
    python benchmarks/gradskip_components.py --models swin_tiny_patch4_window7_224 --batch 8 --threads 1
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import sys
import time
from typing import Any, Callable, Iterator

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gradskip_cost as gc  # noqa: E402
from _cost_helpers import attention_path  # noqa: E402

#: (module, attribute, label); nested labels are indented: their time is part of the step above them
TIMED = (("vitlens.explainers.gradskip:_BlockSteps", "_attn_step", "attention step (all)"),
         # blocks whose fused attention's backward hands A and A ⊙ ∂y/∂A over (ViT, EVA): the step after it
         ("vitlens.explainers.gradskip:_BlockSteps", "probabilities", "attention step (all)"),
         ("vitlens.explainers.gradskip_swin:_WindowSteps", "attn_step", "attention step (all)"),
         ("vitlens.explainers.gradskip:_BlockSteps", "_h_step", "skip-gate step"),
         ("vitlens.explainers.gradskip_swin:_WindowSteps", "h_step", "skip-gate step"))
TIMED_FUNCTIONS = (("probability_gini", "  of which Gini sort"), ("positive_flow", "  of which flow score"),
                   ("weighted_attention", "  of which W̃"))
FUNCTION_USERS = ("vitlens.explainers._gradskip_rules", "vitlens.explainers.gradskip",
                  "vitlens.explainers.gradskip_swin")


def _resolve(path: str) -> Any:
    mod, _, attr = path.partition(":")
    obj = __import__(mod, fromlist=["_"])
    return getattr(obj, attr) if attr else obj


@contextlib.contextmanager
def timers(acc: dict[str, float]) -> Iterator[None]:
    """Wrap the step methods and rule functions with CPU-time accumulators; restore them on exit."""
    saved: list[tuple[Any, str, Any]] = []

    def wrap(owner: Any, name: str, label: str) -> None:
        f = getattr(owner, name, None)
        if f is None:
            return

        @functools.wraps(f)
        def g(*a: Any, **k: Any) -> Any:
            t = time.process_time()
            try:
                return f(*a, **k)
            finally:
                acc[label] = acc.get(label, 0.0) + time.process_time() - t

        saved.append((owner, name, f))
        setattr(owner, name, g)

    try:
        for path, name, label in TIMED:
            wrap(_resolve(path), name, label)
        for mod in FUNCTION_USERS:
            for name, label in TIMED_FUNCTIONS:
                wrap(_resolve(mod), name, label)
        yield
    finally:
        for owner, name, f in reversed(saved):
            setattr(owner, name, f)


def measure(spec: str, batch: int, repeats: int) -> dict[str, Any]:
    model = gc.build_model(spec, torch.device("cpu"))  # as timm builds it: the default-attention floor
    x = gc.make_batch(model, batch, torch.device("cpu"))

    def explicit() -> None:
        with attention_path(model, False):
            gc.run_floor(model, x)

    rows: dict[str, Callable[[], Any]] = {"(b′) floor, default attention": lambda: gc.run_floor(model, x),
                                          "(b) floor, explicit attention": explicit,
                                          "(c′) GradSkip": lambda: gc.run_gradskip(model, x)}
    times: dict[str, list[float]] = {k: [] for k in rows}
    parts: list[dict[str, float]] = []
    acc: dict[str, float] = {}
    with timers(acc):
        for r in range(repeats + 1):  # one warm-up round
            for k, f in rows.items():
                acc.clear()
                t = time.process_time()
                f()
                d = time.process_time() - t
                if r:
                    times[k].append(d)
                    if k == "(c′) GradSkip":
                        parts.append(dict(acc))
    floor = times["(b′) floor, default attention"]
    out: dict[str, Any] = {"model": spec, "rows": [], "parts": []}
    for k, v in times.items():
        ratios = [a / b for a, b in zip(v, floor)]
        out["rows"].append({"row": k, "ms": statistics.median(v) * 1e3, "x_floor": statistics.median(ratios),
                            "spread": (min(ratios), max(ratios))})
    for label in (parts[0] if parts else {}):
        vals = [p.get(label, 0.0) for p in parts]
        out["parts"].append({"part": label, "ms": statistics.median(vals) * 1e3,
                             "x_floor": statistics.median(p.get(label, 0.0) / f for p, f in zip(parts, floor))})
    return out


def markdown(res: dict[str, Any], batch: int) -> str:
    lines = [f"`{res['model']}`, batch {batch}, CPU time per batch (medians over the repeats; × floor: paired)", "",
             "| row / part | ms | × (b′) | per-repeat × (b′) |", "|---|---:|---:|---:|"]
    for r in res["rows"]:
        lines.append(f"| {r['row']} | {r['ms']:.0f} | {r['x_floor']:.3f} | {r['spread'][0]:.3f}–{r['spread'][1]:.3f} |")
    for p in res["parts"]:
        lines.append(f"| {p['part']} | {p['ms']:.1f} | {p['x_floor']:.3f} | |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", required=True, help="timm names, each optionally 'name:key=value,...'")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    before = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        results = [measure(spec, args.batch, args.repeats) for spec in args.models]
    finally:
        torch.set_num_threads(before)
    for res in results:
        print(markdown(res, args.batch))
    return results


if __name__ == "__main__":
    main()
