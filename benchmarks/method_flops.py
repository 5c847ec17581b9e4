"""FLOPs of one attribution map per method, on ViT-B/16 at 224 px, at the papers' settings (each method's defaults).

Counted with ``torch.utils.flop_counter.FlopCounterMode`` (totals only, see :class:`TotalFlopCounter`: matrix
products, convolutions and attention kernels; it does not count element-wise work, SLIC, k-means' argmin or
scikit-learn's clustering) on timm's ``vit_base_patch16_224`` with random weights (``pretrained=False``; FLOPs do not
depend on the weights, except through the data-dependent counts noted below) and explicit attention (every
``blk.attn.fused_attn = False``), one image.

How each row is counted (the "counted" column):

- ``full run``: ``method.explain(model, x)`` runs entirely inside the counter.
- ``pieces``: methods with thousands of forwards would take hours on a CPU, so the distinct pieces are counted once
  each — by running exactly the code the method runs — and multiplied by how often the method runs them:
    * RISE: ``(1 + N)`` × one full forward, plus the saliency accumulation ``2·N·H·W``.
    * TIS: one forward with capture + the k-means at the paper's settings, run for real on that image's activations
      (its iteration count is data-dependent and reported) + ``n_masks`` × one forward on the kept ``⌊r·N⌋`` tokens
      + the coverage-normalised sum.
    * ViT-CX: one forward with capture + the mask construction and the cosine-similarity product, run for real
      (its cluster count is data-dependent and reported: random weights, random image) + ``n_clusters`` × the
      forwards of one cluster (2 with the noise correction) + the weighted sum.
    * MDA: the reference map (input × gradient, run for real) + one blur + the search forwards × one forward; the
      search length depends on the model's responses, so it is computed for ``R = 196`` regions, window 28, one blur
      trial and the insertion search stopping after ``R/4`` regions (5113–5308 forwards over all stopping points).
  ``--check`` verifies the pieces against full runs with small settings on a small model (exact match).
- ``passes``: other expensive methods: their declared forward/backward passes × the FLOPs of one counted forward /
  one counted input-gradient backward.

Usage::

    python benchmarks/method_flops.py                                   # all registered methods, ViT-B/16
    python benchmarks/method_flops.py --out docs/benchmarks/method_flops.md
    python benchmarks/method_flops.py --methods gradskip,mutex,tis
    python benchmarks/method_flops.py --check --model "vit_tiny_patch16_224:img_size=32,patch_size=8,depth=2"
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import math
import os
import platform
import sys
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

import vitlens
from vitlens.explainers import get_method
from vitlens.explainers.mda import gaussian_blur, search_window
from vitlens.explainers.registry import _METHODS
from vitlens.explainers.rise import image_generator
from vitlens.explainers.tis import block_outputs, kmeans
from vitlens.explainers.vitcx import cluster_masks, feature_masks
from vitlens.models import Adapter, get_adapter
from vitlens.models._readout import readout_only

#: the seed's figures (spec/gradskip.md, spec/baselines.md): GradSkip GFLOPs and the cost ratios to it
SEED_GRADSKIP = 69.39
SEED_RATIOS = {"mutex": 14.45, "tis": 256.66}
#: methods counted piece by piece (the rest are run fully when cheap, else scaled from declared passes)
PIECES = ("rise", "tis", "vitcx", "mda")
#: methods always run fully (MUTEX: 55 forwards on about half the tokens, a few minutes on a CPU)
ALWAYS_FULL = ("mutex",)
#: a method declaring at most this many passes (forward + backward) per image is run fully
FULL_LIMIT = 8


@dataclass
class Row:
    method: str
    gflops: float
    how: str
    note: str = ""


def build_model(spec: str) -> nn.Module:
    """``benchmarks/gradskip_cost.py``'s model for ``spec`` (timm, random weights, seed 0, eval mode, explicit
    attention everywhere), on the CPU."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import gradskip_cost

    return gradskip_cost.build_model(spec, torch.device("cpu"))


class _GlobalOnly:
    """Stands in for FlopCounterMode's module tracker: every FLOP goes to "Global"."""

    parents = {"Global"}

    def __enter__(self) -> "_GlobalOnly":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class TotalFlopCounter(FlopCounterMode):
    """``FlopCounterMode(display=False)`` counting totals only. Its per-module tracker installs gradient hooks on
    module inputs that make ``torch.autograd.grad`` with respect to a leaf model input fail ("A leaf node was passed
    to _will_engine_execute_node"), which every input-gradient method does; the totals are unaffected."""

    def __init__(self) -> None:
        super().__init__(display=False)
        self.mod_tracker = _GlobalOnly()


def count(fn: Callable[[], Any]) -> tuple[int, Any]:
    """FLOPs of ``fn()`` and its result."""
    with TotalFlopCounter() as fc:
        out = fn()
    return int(fc.get_total_flops()), out


# -- pieces ---------------------------------------------------------------------------------------------------------
def _forward(adapter: Adapter, x: Tensor, readout_path: bool = False) -> int:
    """FLOPs of one forward; ``readout_path``: as methods that read only logits run it (``models._readout``)."""
    def run():
        fast = readout_only(adapter, all_queries=False) if readout_path else contextlib.nullcontext()
        with fast, adapter.session(capture=False), torch.no_grad():
            return adapter.forward(x)

    return count(run)[0]


def _capture(adapter: Adapter, x: Tensor):
    def run():
        with adapter.session(capture=True) as rec, torch.no_grad():
            logits = adapter.forward(x)
            return logits, rec

    flops, (logits, rec) = count(run)
    return flops, logits, rec


def _keep_forward(adapter: Adapter, x: Tensor, k: int) -> int:
    def run():
        with adapter.session(capture=False), torch.no_grad(), adapter.keep_tokens(torch.arange(k)[None]):
            return adapter.forward(x)

    return count(run)[0]


def pieces(method, adapter: Adapter, x: Tensor) -> tuple[int, str]:
    """FLOPs of ``method.explain(adapter, x)`` (one image) from its counted pieces, and a note."""
    o = method.options
    h, w = x.shape[-2:]
    name = method.name
    if name == "rise":
        n = int(o["n_masks"])
        f = _forward(adapter, x, readout_path=method.readout_logit_only)
        return (1 + n) * f + 2 * n * h * w, f"(1 + {n}) forwards"
    gh, gw = adapter.grid((h, w))
    n_tok = gh * gw
    if name == "tis":
        f_cap, _, rec = _capture(adapter, x)
        acts = block_outputs(rec)[0, adapter.num_prefix_tokens:].float()
        f_km, (_, iters) = count(lambda: kmeans(acts.T.contiguous(), int(o["n_masks"]),
                                                image_generator(x[0], o["seed"]), int(o["max_iter"]), float(o["tol"])))
        k = max(1, int(float(o["token_ratio"]) * n_tok))
        m = int(o["n_masks"])
        total = f_cap + f_km + m * _keep_forward(adapter, x, k) + 2 * m * n_tok
        return total, (f"{m} forwards on {k}/{n_tok} tokens; k-means {f_km / 1e9:.1f} GFLOPs "
                       f"({iters} iterations, {acts.shape[1]} points)")
    if name == "mutex":
        f_cap, _, _ = _capture(adapter, x)
        k = max(1, n_tok - int(float(o["quantile"]) * n_tok))
        m = method.n_masks
        return f_cap + m * _keep_forward(adapter, x, k) + 2 * m * n_tok, f"{m} forwards on {k}/{n_tok} tokens"
    if name == "vitcx":
        f_cap, _, rec = _capture(adapter, x)
        feats = rec.blocks[int(o["layer"])].u[0, adapter.num_prefix_tokens:]
        f_cl, (_, masks) = count(lambda: cluster_masks(feature_masks(feats, (gh, gw), (h, w)),
                                                       float(o["distance_threshold"])))
        n = masks.shape[0]
        per = 2 if o["noise_correction"] else 1
        total = f_cap + f_cl + n * per * _forward(adapter, x) + 2 * n * h * w
        return total, (f"{n} clusters (random weights and image: data-dependent) × {per} forwards; "
                       f"clustering product {f_cl / 1e9:.1f} GFLOPs")
    if name == "mda":
        ref = o["reference"]
        f_ref = 0 if ref == "none" else count(lambda: get_method(ref).explain(adapter, x))[0]
        regions = int(o["n_regions"] or n_tok)
        win = int(o["window"] or search_window(regions))
        n_fwd = mda_search_forwards(regions, win, prefix=max(1, regions // 4))
        lo = min(mda_search_forwards(regions, win, p) for p in range(1, regions + 1))
        hi = max(mda_search_forwards(regions, win, p) for p in range(1, regions + 1))
        f_blur = count(lambda: gaussian_blur(x, int(o["blur_size"]), float(o["blur_sigma"])))[0]
        return f_ref + f_blur + n_fwd * _forward(adapter, x), (
            f"{n_fwd} search forwards (R = {regions}, window {win}, one blur trial, insertion stops after R/4; "
            f"{lo}–{hi} over all stops) + {ref} reference")
    raise ValueError(f"no piece recipe for {name!r}")


def mda_search_forwards(regions: int, window: int, prefix: int, blur_trials: int = 1) -> int:
    """Forwards of one MDA map (besides the reference method) when the insertion search keeps ``prefix`` regions:
    1 (image) + blur trials + 1 (fill image) + the candidates of both greedy searches + ``prefix − 1``."""
    ins = sum(min(window, regions - t) for t in range(prefix))
    rest = regions - prefix
    dele = sum(min(window, rest - t) for t in range(rest))
    return 1 + blur_trials + 1 + ins + dele + (prefix - 1)


def pass_flops(adapter: Adapter, x: Tensor) -> tuple[int, int]:
    """FLOPs of one forward and of one input-gradient backward (input × gradient minus its forward; input × gradient
    runs the readout fast path, so its forward is counted the same way)."""
    f = _forward(adapter, x)
    fb = count(lambda: get_method("inputxgradient").explain(adapter, x))[0]
    return f, fb - _forward(adapter, x, readout_path=get_method("inputxgradient").readout_logit_only)


# -- the table ------------------------------------------------------------------------------------------------------
#: learned explainers, counted with an untrained explainer of the architecture they ship with (FLOPs do not depend on
#: the weights; no explainer is trained for the random ViT-B here)
LEARNED = {"vit_shapley": {"explainer": "untrained"}}
LEARNED_NOTE = "an untrained explainer of the shipped architecture (FLOPs do not depend on the weights)"


def measure(method_name: str, adapter: Adapter, x: Tensor, passes: tuple[int, int] | None,
            options: dict | None = None) -> Row:
    method = get_method(method_name, **(options or {}))
    declared = method.declared_cost()
    n_passes = float(declared.get("forward", math.nan)) + float(declared.get("backward", math.nan))
    if method_name in PIECES:
        flops, note = pieces(method, adapter, x)
        return Row(method_name, flops / 1e9, "pieces", note)
    if method_name in ALWAYS_FULL or (math.isfinite(n_passes) and n_passes <= FULL_LIMIT):
        flops, exp = count(lambda: method.explain(adapter, x))
        c = exp.cost
        return Row(method_name, flops / 1e9, "full run",
                   f"{c.forward_passes:g} fwd + {c.backward_passes:g} bwd per image (measured)")
    if not math.isfinite(n_passes) or passes is None:
        return Row(method_name, math.nan, "—", f"declared cost {declared} cannot be scaled")
    f, b = passes
    fwd, bwd = float(declared["forward"]), float(declared["backward"])
    return Row(method_name, (fwd * f + bwd * b) / 1e9, "passes", f"{fwd:g} fwd × {f / 1e9:.2f} + {bwd:g} bwd × "
               f"{b / 1e9:.2f} GFLOPs (declared)")


def markdown(rows: list[Row], model_spec: str, argv: list[str], size: tuple[int, int]) -> str:
    by = {r.method: r for r in rows}
    gs = by.get("gradskip")
    lines = [
        "# FLOPs per attribution map",
        "",
        f"`{' '.join(['python', 'benchmarks/method_flops.py', *argv])}` — {_dt.date.today().isoformat()}, "
        f"torch {torch.__version__}, Python {platform.python_version()}, vitlens {vitlens.__version__}.",
        "",
        f"Model: timm `{model_spec}` (random weights, explicit attention), one {size[0]}×{size[1]} image; "
        "every method at its defaults (the papers' settings). FLOPs from `torch.utils.flop_counter.FlopCounterMode` "
        "(matrix products, convolutions, attention; element-wise work, SLIC and scikit-learn are not counted). "
        "\"pieces\": the distinct pieces counted once and multiplied by the declared counts; \"passes\": declared "
        "passes × counted FLOPs of one pass (only the target model's passes the method declares); see the "
        "script's docstring.",
        "",
        "| method | GFLOPs per map | × GradSkip | seed × GradSkip | counted | notes |",
        "|---|---:|---:|---:|---|---|",
    ]
    for r in rows:
        ratio = f"{r.gflops / gs.gflops:.2f}×" if gs and math.isfinite(r.gflops) else "—"
        seed = f"{SEED_RATIOS[r.method]:.2f}×" if r.method in SEED_RATIOS else ("1.00× (69.39)"
                                                                                if r.method == "gradskip" else "")
        val = f"{r.gflops:,.2f}" if math.isfinite(r.gflops) else "—"
        lines.append(f"| {r.method} | {val} | {ratio} | {seed} | {r.how} | {r.note} |")
    if gs:
        lines += ["", f"GradSkip: {gs.gflops:.2f} GFLOPs per map (seed: {SEED_GRADSKIP})."]
        for name, seed in SEED_RATIOS.items():
            if name in by and math.isfinite(by[name].gflops):
                lines.append(f"{name.upper()}/GradSkip: {by[name].gflops / gs.gflops:.2f}× (seed: {seed}×; "
                             f"seed's implied {name.upper()} cost {seed * SEED_GRADSKIP:,.0f} GFLOPs).")
    return "\n".join(lines) + "\n"


def check(adapter: Adapter, x: Tensor, tolerance: float = 1e-6) -> list[tuple[str, int, int]]:
    """Pieces vs full runs with small settings (on a small model): ``[(method, pieces, full)]``; raises if they
    differ by more than ``tolerance`` (relative). MDA's search length is data-dependent, so it is checked with the
    measured search forwards instead of the formula."""
    small = {"rise": {"n_masks": 6, "grid_size": 3, "batch_size": 4}, "tis": {"n_masks": 6, "batch_size": 4},
             "mutex": {"batch_size": 16}, "vitcx": {"batch_size": 8}}
    out = []
    for name, opts in small.items():
        method = get_method(name, **opts)
        est, _ = pieces(method, adapter, x)
        full, _ = count(lambda: get_method(name, **opts).explain(adapter, x))
        out.append((name, est, full))
    opts = {"n_regions": 9, "blur_size": 5, "blur_sigma": 2.0, "blur_max_size": 9}
    method = get_method("mda", **opts)
    full, exp = count(lambda: method.explain(adapter, x))
    ref = count(lambda: get_method("inputxgradient").explain(adapter, x))[0]
    f_blur = sum(count(lambda s=s, g=g: gaussian_blur(x, s, g))[0]
                 for s, g in zip(range(5, int(exp.extras["blur_size"][0]) + 1, 4), np.arange(2.0, 100.0, 4.0)))
    est = ref + f_blur + int(round(method.declared_cost()["search_forwards"])) * _forward(adapter, x)
    out.append(("mda", est, full))
    for name, est, full in out:
        if abs(est - full) > tolerance * max(full, 1):
            raise AssertionError(f"{name}: pieces give {est} FLOPs, a full run {full}")
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="vit_base_patch16_224", help="timm name[:k=v,...] (default ViT-B/16)")
    ap.add_argument("--methods", default="", help="comma-separated (default: every registered method)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (FLOPs do not depend on it)")
    ap.add_argument("--out", default="", help="also write the Markdown table to this file")
    ap.add_argument("--check", action="store_true", help="verify the pieces against full runs (small settings)")
    args = ap.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        model = build_model(args.model)
        adapter = get_adapter(model)
        size = tuple(model.patch_embed.img_size)
        x = torch.randn(1, 3, *size, generator=torch.Generator().manual_seed(0))
        if args.check:
            res = check(adapter, x)
            for name, est, full in res:
                print(f"{name:8s} pieces {est:>16,d}  full run {full:>16,d}  ok")
            return {"check": res}
        names = [m.strip() for m in args.methods.split(",") if m.strip()] or vitlens.methods()
        unknown = [n for n in names if n not in _METHODS]
        if unknown:
            raise SystemExit(f"unknown method(s): {', '.join(unknown)}")
        passes = None
        rows = []
        for name in names:
            if passes is None and name not in PIECES and name not in ALWAYS_FULL:
                passes = pass_flops(adapter, x)
            try:
                row = measure(name, adapter, x, passes, LEARNED.get(name))
                if name in LEARNED:
                    row = Row(row.method, row.gflops, row.how, row.note + "; " + LEARNED_NOTE)
            except Exception as e:  # a method that cannot run on this model gets a row saying why, not a crash
                row = Row(name, math.nan, "failed", f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")
            print(f"{row.method:24s} {row.gflops:>12,.2f} GFLOPs  {row.how:8s} {row.note}", flush=True)
            rows.append(row)
        md = markdown(rows, args.model, argv, size)
        print()
        print(md)
        if args.out:
            with open(args.out, "w") as fh:
                fh.write(md)
        return {"rows": rows, "markdown": md}
    finally:
        torch.set_num_threads(threads)


if __name__ == "__main__":
    main()
