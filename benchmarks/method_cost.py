"""Every method's cost in one table: ms per map and × a forward, next to the passes it declares, in one run.

For each model (default: timm ViT-S/16 at 224 px with random weights, and the bundled ``shapes-vit``) and each
registered method, the method and a plain forward (``torch.no_grad()``) of the same batch run in turn, repeat after
repeat; reported are the median ms per map and the median of the per-repeat ratios method ÷ forward, next to the
passes per image the method declares (``Explainer.declared_cost()``) and those counted during the call
(``Explanation.cost``: forwards and backwards of the target model, per image).

Methods whose declared forwards at their defaults would not fit ``--budget`` seconds per repeat (thousands of
forwards: RISE, MDA, TIS; tens: integrated gradients, SmoothGrad, MUTEX, ViT-CX) are measured with their cheap
settings (``Explainer.fast_options``, the settings of the shared property tests), stated in the "options" column;
their "ms per pass" column (ms per map ÷ counted forward + backward passes) is what carries over to the defaults.
``aha`` without a shipped explainer for the model runs an untrained explainer of the same architecture (the same
cost). Times are this process's CPU time (one thread: the compute, not the wait for a core on a loaded machine);
they depend on the machine, the ratios are the claim.

With ``--floor`` every repeat also runs the forward + backward floor of ``gradskip_cost.py`` (one forward and an
activation-only backward from the predicted logit to the first block's input: what any gradient method must at least
do) on the same batch, and the table gets "× floor", the median of the per-repeat ratios method ÷ floor. With
``--memory`` each method and the floor also run once more in a fresh subprocess that reports the peak extra
resident memory of the call (``_cost_helpers``: peak RSS after a batch-1 warm-up, reset with ``clear_refs``) and the
table gets "peak MiB" and "mem × floor".

Usage::

    python benchmarks/method_cost.py --out docs/benchmarks/method_cost.md
    python benchmarks/method_cost.py --models timm:vit_small_patch16_224 --batch 8 --repeats 5 --floor --memory \\
        --methods legrad,libragrad_inputxgradient --out docs/benchmarks/method_cost_new_methods.md
    python benchmarks/method_cost.py --models shapes-vit --methods gradskip,rise --repeats 2
    python benchmarks/method_cost.py --models "timm:vit_tiny_patch16_224:img_size=32,patch_size=8,depth=2"
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
from torch import nn

import vitlens
from vitlens.explainers import get_method
from vitlens.explainers.registry import _METHODS

DEFAULT_MODELS = ("timm:vit_small_patch16_224", "shapes-vit")


def load(name: str) -> nn.Module:
    """A bundled model by name, or ``timm:<arch>[:key=value,...]`` with random weights (seed 0)."""
    if name.startswith("timm:"):
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from gradskip_cost import parse_model_spec

        arch, kwargs = parse_model_spec(name[len("timm:"):])
        torch.manual_seed(0)
        return vitlens.load_model("timm:" + arch, pretrained=False, **kwargs)
    return vitlens.load_model(name)


def batch_for(model: nn.Module, n: int) -> torch.Tensor:
    adapter = vitlens.get_adapter(model)
    hw = getattr(adapter, "default_size", None) or (224, 224)
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, adapter.in_chans if hasattr(adapter, "in_chans") else 3, *hw, generator=g)


def _floor_seconds(model: nn.Module, x: torch.Tensor) -> float:
    """CPU time of the forward + backward floor (``gradskip_cost.run_floor``) on ``x``."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gradskip_cost import run_floor

    t0 = time.process_time()
    run_floor(model, x)
    return time.process_time() - t0


FLOOR = "forward+backward"


def _memory_child(spec: dict[str, Any]) -> dict[str, Any]:
    """In a fresh process: the peak extra resident memory of one call of ``spec["method"]`` (or the floor)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _cost_helpers import _peak_rss_bytes, _reset_peak_rss, _rss_bytes

    torch.set_num_threads(int(spec["threads"]))
    model = load(spec["model"])
    x = batch_for(model, int(spec["batch"]))
    with torch.no_grad():
        model(x[:1])
    call = (lambda: _floor_seconds(model, x)) if spec["method"] == FLOOR else (
        lambda: get_method(spec["method"], **spec["options"]).explain(model, x))
    reset = _reset_peak_rss()
    base = _rss_bytes()
    call()
    return {"peak_bytes": float(max(_peak_rss_bytes() - base, 0)), "peak_reset": reset}


def peak_memory(model_name: str, method: str, options: dict, batch: int, threads: int) -> float:
    """Peak extra resident memory (bytes) of one call, measured in a fresh subprocess (see :func:`_memory_child`)."""
    arg = json.dumps({"model": model_name, "method": method, "options": options, "batch": batch, "threads": threads})
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--_memory-child", arg], check=True,
                         capture_output=True, text=True)
    return float(json.loads(out.stdout.strip().splitlines()[-1])["peak_bytes"])


def _forward_seconds(model: nn.Module, x: torch.Tensor) -> float:
    t0 = time.process_time()
    with torch.no_grad():
        model(x)
    return time.process_time() - t0


def choose_options(name: str, model: nn.Module, fwd_s: float, batch: int, budget: float) -> tuple[dict, str]:
    """The method's defaults if their declared passes fit the budget, else its ``fast_options``."""
    cls = _METHODS[name]
    opts: dict[str, Any] = {}
    if name == "aha":
        from vitlens.aha import shipped_explainer

        if shipped_explainer(model) is None:
            opts["explainer"] = "untrained"
    declared = get_method(name, **opts).declared_cost()
    passes = float(declared.get("forward", 1.0)) + float(declared.get("backward", 0.0))
    if not math.isfinite(passes):  # declared only after a call (MDA): decide by its search length at defaults
        passes = 5000.0
    if passes * fwd_s > budget and cls.fast_options:
        return {**cls.fast_options, **opts}, "fast_options"
    return opts, "defaults" if not opts else "defaults (untrained explainer)"


def measure_model(model_name: str, methods: list[str], batch: int, repeats: int, budget: float,
                  log=print, floor: bool = False, memory: bool = False, threads: int = 1) -> list[dict[str, Any]]:
    model = load(model_name)
    x = batch_for(model, batch)
    _forward_seconds(model, x)
    fwd_s = statistics.median(_forward_seconds(model, x) for _ in range(3))
    rows = []
    for name in methods:
        opts, which = choose_options(name, model, fwd_s, batch, budget)
        method = get_method(name, **opts)
        log(f"  {model_name}: {name} ({which}) ...")
        t_m, t_f, t_b, exp = [], [], [], None
        for i in range(repeats + 1):
            t0 = time.process_time()
            exp = method.explain(model, x)
            dt = time.process_time() - t0
            df = _forward_seconds(model, x)
            db = _floor_seconds(model, x) if floor else float("nan")
            if i:
                t_m.append(dt)
                t_f.append(df)
                t_b.append(db)
        declared = method.declared_cost()
        counted = exp.cost.forward_passes + exp.cost.backward_passes
        ms = 1e3 * statistics.median(t_m) / batch
        rows.append({
            "model": model_name, "method": name, "options": opts, "which": which,
            "declared_fwd": float(declared.get("forward", float("nan"))),
            "declared_bwd": float(declared.get("backward", float("nan"))),
            "counted_fwd": exp.cost.forward_passes, "counted_bwd": exp.cost.backward_passes,
            "ms_per_map": ms, "x_forward": statistics.median(a / b for a, b in zip(t_m, t_f)),
            "ms_per_pass": ms / counted if counted else float("nan"),
            "forward_ms": 1e3 * statistics.median(t_f) / batch,
            "x_floor": statistics.median(a / c for a, c in zip(t_m, t_b)) if floor else float("nan"),
            "floor_ms": 1e3 * statistics.median(t_b) / batch if floor else float("nan"),
        })
    if memory:
        floor_mem = peak_memory(model_name, FLOOR, {}, batch, threads)
        log(f"  {model_name}: peak memory of the floor {floor_mem / 2**20:.1f} MiB")
        for r in rows:
            r["peak_mib"] = peak_memory(model_name, r["method"], r["options"], batch, threads) / 2**20
            r["mem_x_floor"] = r["peak_mib"] * 2**20 / floor_mem if floor_mem > 0 else float("nan")
            r["floor_peak_mib"] = floor_mem / 2**20
    return rows


def _g(v: float) -> str:
    return "n/a" if v != v else f"{v:g}"


def render(rows: list[dict[str, Any]], args: argparse.Namespace, command: str, seconds: float) -> str:
    lines = ["# Every method's cost: ms per map and × forward, next to the declared passes", "",
             f"Command: `{command}` ({seconds:.0f} s)", "",
             f"- date: {_dt.datetime.now().astimezone().strftime('%Y-%m-%d %H:%M %Z')}",
             f"- torch {torch.__version__}, vitlens {vitlens.__version__}, python {platform.python_version()}; CPU, "
             f"torch threads: {torch.get_num_threads()}",
             f"- batch {args.batch}, {args.repeats} timed repeats after one warm-up, method and a plain forward of the "
             f"same batch in turn; budget {args.budget:g} s per call at the defaults (else `fast_options`)", ""]
    floor, memory = getattr(args, "floor", False), getattr(args, "memory", False)
    for model in dict.fromkeys(r["model"] for r in rows):
        sub = [r for r in rows if r["model"] == model]
        title = f"## `{model}` (plain forward: {statistics.median(r['forward_ms'] for r in sub):.1f} ms per image"
        if floor:
            title += f"; forward + backward floor: {statistics.median(r['floor_ms'] for r in sub):.1f} ms per image"
        if memory:
            title += f", peak {sub[0]['floor_peak_mib']:.1f} MiB per batch"
        extra = (" × floor |" if floor else "") + (" peak MiB | mem × floor |" if memory else "")
        lines += [title + ")", "", "| method | options | declared fwd / bwd | counted fwd / bwd | ms per map "
                  "| × forward | ms per pass |" + extra, "|---|---|---:|---:|---:|---:|---:|" + "---:|" * extra.count("|")]
        for r in sorted(sub, key=lambda r: r["x_forward"]):
            opt = r["which"] if r["which"] != "fast_options" else "fast: " + ", ".join(
                f"{k}={v}" for k, v in r["options"].items())
            cells = (f" {r['x_floor']:.2f} |" if floor else "") + (
                f" {r['peak_mib']:.1f} | {r['mem_x_floor']:.2f} |" if memory else "")
            lines.append(f"| {r['method']} | {opt} | {_g(r['declared_fwd'])} / {_g(r['declared_bwd'])} "
                         f"| {r['counted_fwd']:g} / {r['counted_bwd']:g} | {r['ms_per_map']:.1f} "
                         f"| {r['x_forward']:.2f} | {r['ms_per_pass']:.1f} |" + cells)
        lines.append("")
    lines += ["\"× forward\": median over repeats of (method time ÷ the plain forward's time in the same repeat). "
              "\"ms per pass\": ms per map ÷ (counted forwards + backwards per image); a backward costs about two "
              "forwards, and forwards on a subset of tokens (TIS, MUTEX) cost less than one."
              + (" \"× floor\": median over repeats of (method time ÷ the forward + backward floor's time in the same "
                 "repeat); the floor is one forward and an activation-only backward from the predicted logit to the "
                 "first block's input (`gradskip_cost.py`, row (b′))." if floor else "")
              + (" \"peak MiB\": peak extra resident memory of one call at this batch in a fresh subprocess (peak "
                 "RSS after a batch-1 warm-up forward, reset with `clear_refs`; weights and input excluded); \"mem × "
                 "floor\": against the floor's, measured the same way." if memory else ""), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS))
    p.add_argument("--methods", default=None, help="comma-separated (default: every registered method)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--budget", type=float, default=10.0, help="seconds per call at the defaults before fast_options")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--floor", action="store_true", help="also time the forward + backward floor in every repeat")
    p.add_argument("--memory", action="store_true", help="also measure peak memory per method (fresh subprocesses)")
    p.add_argument("--out", default=None)
    p.add_argument("--_memory-child", dest="memory_child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.memory_child is not None:
        child = _memory_child(json.loads(args.memory_child))
        print(json.dumps(child))
        return child
    methods = sorted(_METHODS) if not args.methods else [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in _METHODS]
    if unknown:
        p.error(f"unknown method(s): {', '.join(unknown)}")
    before = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    command = shlex.join(["python", "benchmarks/method_cost.py", *(sys.argv[1:] if argv is None else argv)])
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    try:
        t0 = time.perf_counter()
        rows = [r for m in args.models for r in measure_model(m, methods, args.batch, args.repeats, args.budget,
                                                                log, args.floor, args.memory, args.threads)]
        md = render(rows, args, command, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    print(md)
    if args.out:
        with open(args.out, "w") as f:
            f.write(md)
    return {"rows": rows, "markdown": md}


if __name__ == "__main__":
    main()
