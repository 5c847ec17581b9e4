"""vitlens next to LXT on the same model and batch, in one run: time, peak memory, and map agreement.

Rows (one map per image for the predicted class, the same images, the same weights):

  floor            forward + activation-only backward of the timm ViT as timm builds it (fused attention;
                   ``benchmarks/gradskip_cost.py`` row b′), the model every vitlens row explains;
  vitlens attnlrp  ``vitlens.explain(timm_vit, x, method="attnlrp")``;
  vitlens cplrp    ``vitlens.explain(timm_vit, x, method="cplrp")``;
  vitlens gradskip ``vitlens.explain(timm_vit, x, method="gradskip")``;
  LXT AttnLRP      HF ``ViTForImageClassification`` (transformers 4.x) with the timm weights, patched with LXT's own
                   functions (``patch_attention``, ``layer_norm_forward``, ``non_linear_forward`` on GELU), relevance =
                   gradient × input at the embeddings' output, summed over channels;
  LXT CP-LRP       the same with ``patch_cp_attention``.

LXT 2.x needs ``transformers<5`` and patches library classes process-wide (they cannot be undone), so every side
runs in its own interpreter of LXT's environment (``VITLENS_LXT_PYTHON``, else ``.venv-lxt`` of the checkout, as
``tests/test_lxt_crosscheck.py``): one vitlens process and one per LXT rule. The parent drives them over pipes and
runs the rows in turn, repeat after repeat, so machine noise hits them alike; each row's time is the CPU time of
its process (one thread: the compute, not the wait for a core on a loaded machine); time ratios are medians of the
per-repeat ratios. Peak memory: peak RSS above the RSS before the call (``/proc/self/clear_refs``), one fresh process per
row after a batch-1 warm-up forward (as ``benchmarks/gradskip_cost.py``). Agreement: vitlens' token relevance (CLS first) against LXT's, max
absolute difference relative to LXT's largest value, and Pearson correlation.

Usage::

    python benchmarks/lxt_side_by_side.py                                  # ViT-S/16, batch 8, 3 repeats
    python benchmarks/lxt_side_by_side.py --out docs/benchmarks/lxt_side_by_side.md
    python benchmarks/lxt_side_by_side.py --model "vit_tiny_patch16_224:img_size=64" --batch 2 --repeats 1
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SIDES = {"vitlens": ("floor", "vitlens attnlrp", "vitlens cplrp", "vitlens gradskip"),
         "lxt-attnlrp": ("LXT AttnLRP",), "lxt-cp": ("LXT CP-LRP",)}
#: which vitlens row each LXT row is compared with
PAIRS = {"LXT AttnLRP": "vitlens attnlrp", "LXT CP-LRP": "vitlens cplrp"}


def lxt_python() -> str | None:
    env = os.environ.get("VITLENS_LXT_PYTHON")
    default = ROOT / ".venv-lxt" / "bin" / "python"
    return env or (str(default) if default.exists() else None)


# ---------------------------------------------------------------------------------------------------------------------
# child side (runs inside LXT's environment)
# ---------------------------------------------------------------------------------------------------------------------
def timm_to_hf4(tm: Any) -> Any:
    """HF ``ViTForImageClassification`` (eager attention) with exactly the weights of a CLS-readout timm ViT
    (``tests/timm_to_hf.py``, the converter the LXT cross-check uses)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from timm_to_hf import timm_to_hf_vit

    return timm_to_hf_vit(tm, attn_implementation="eager")


def _patch_lxt(rule: str) -> None:
    """LXT's process-wide patches of HF ViT, LayerNorm and GELU for ``rule`` (``attnlrp`` or ``cp``)."""
    from functools import partial

    import torch
    import lxt.efficient
    from lxt.efficient.patches import (layer_norm_forward, non_linear_forward, patch_attention, patch_cp_attention,
                                       patch_method)
    from transformers.activations import GELUActivation
    from transformers.models.vit import modeling_vit

    lxt.efficient.monkey_patch(modeling_vit, patch_map={
        modeling_vit: patch_attention if rule == "attnlrp" else patch_cp_attention,
        torch.nn.LayerNorm: partial(patch_method, layer_norm_forward),
        GELUActivation: partial(patch_method, non_linear_forward, keep_original=True),
    })


def _child_rows(side: str, spec: str, batch: int) -> tuple[dict[str, Any], Any]:
    """Callables ``row → () -> token relevance (B, 1 + N)`` for this side's rows, all on the same model and batch,
    and a warm-up callable (a batch-1 forward without gradients)."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gradskip_cost as gc
    import vitlens

    # the vitlens side runs the model as timm builds it (fused attention); LXT needs HF's eager attention
    model = gc.build_model(spec, torch.device("cpu"), fused=side == "vitlens")
    x = gc.make_batch(model, batch, torch.device("cpu"))
    if side == "vitlens":
        def method(name: str):
            def run():
                e = vitlens.explain(model, x, method=name)
                return torch.cat([e.remainder[:, None], e.token_maps.flatten(1)], dim=1)
            return run

        return ({"floor": lambda: gc.run_floor(model, x) and None, "vitlens attnlrp": method("attnlrp"),
                 "vitlens cplrp": method("cplrp"), "vitlens gradskip": method("gradskip")},
                lambda: gc.run_forward(model, x[:1]))
    hf = timm_to_hf4(model)
    _patch_lxt("attnlrp" if side == "lxt-attnlrp" else "cp")
    for p in hf.parameters():
        p.requires_grad_(False)

    def lxt() -> Any:
        box = {}

        def leaf(module, args, out):
            box["u"] = out.detach().requires_grad_(True)
            return box["u"]

        handle = hf.vit.embeddings.register_forward_hook(leaf)
        try:
            logits = hf(pixel_values=x).logits
        finally:
            handle.remove()
        y = logits.gather(1, logits.argmax(-1, keepdim=True)).sum()
        (g,) = torch.autograd.grad(y, [box["u"]])
        return (box["u"] * g).sum(-1).detach()

    def warm() -> None:
        with torch.no_grad():
            hf(pixel_values=x[:1])

    return {SIDES[side][0]: lxt}, warm


def child(side: str, spec: str, batch: int, threads: int, mem_row: str | None = None) -> None:
    """Serve ``time`` / ``maps`` requests (JSON lines on stdin) for this side's rows; with ``mem_row``: measure the
    peak memory of that one row after a batch-1 warm-up, print it and exit."""
    import torch

    torch.set_num_threads(threads)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gradskip_cost as gc

    rows, warm = _child_rows(side, spec, batch)
    if mem_row is not None:  # a fresh process per row: the allocator has not kept memory from earlier calls
        warm()
        reset = gc._reset_peak_rss()
        base = gc._rss_bytes()
        rows[mem_row]()
        print(json.dumps({"mib": max(gc._peak_rss_bytes() - base, 0) / 2**20, "reset": reset}), flush=True)
        return
    print(json.dumps({"ready": list(rows), "torch": torch.__version__}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        fn = rows.get(req.get("row"))
        if req["op"] == "quit":
            break
        if req["op"] == "time":  # this process's CPU time: robust to waiting for a core on a loaded machine
            t0 = time.process_time()
            fn()
            print(json.dumps({"s": time.process_time() - t0}), flush=True)
        elif req["op"] == "maps":
            torch.save(fn(), req["path"])
            print(json.dumps({"ok": True}), flush=True)


# ---------------------------------------------------------------------------------------------------------------------
# parent side
# ---------------------------------------------------------------------------------------------------------------------
class Side:
    def __init__(self, python: str, side: str, args: argparse.Namespace, mem_row: str | None = None) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS=str(args.threads))
        extra = ["--_mem-row", mem_row] if mem_row else []
        self.proc = subprocess.Popen([python, os.path.abspath(__file__), "--_child", side, "--model", args.model,
                                      "--batch", str(args.batch), "--threads", str(args.threads), *extra],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.hello = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"a side of the comparison exited with code {self.proc.wait()} (see stderr above)")
        return json.loads(line)

    def ask(self, **req: Any) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def agreement(ours: Any, ref: Any) -> dict[str, float]:
    import torch

    diff = float((ours - ref).abs().max())
    scale = float(ref.abs().max()) or 1.0
    corr = float(torch.corrcoef(torch.stack([ours.flatten(), ref.flatten()]))[0, 1])
    return {"rel_max_diff": diff / scale, "pearson": corr}


def measure(args: argparse.Namespace, python: str) -> dict[str, Any]:
    import torch

    sides = {name: Side(python, name, args) for name in SIDES}
    try:
        order = [(s, r) for s, rows in SIDES.items() for r in rows]
        times: dict[str, list[float]] = {r: [] for _, r in order}
        for i in range(args.repeats + 1):  # round 0 warms up
            for s, r in order:
                t = sides[s].ask(op="time", row=r)["s"]
                if i:
                    times[r].append(t)
        with tempfile.TemporaryDirectory() as tmp:
            maps = {}
            for s, r in order:
                if r == "floor":
                    continue
                path = os.path.join(tmp, f"{len(maps)}.pt")
                sides[s].ask(op="maps", row=r, path=path)
                maps[r] = torch.load(path)
        versions = sides["lxt-attnlrp"].hello
    finally:
        for s in sides.values():
            s.close()
    mem = {}
    for s, r in order:  # one fresh process per row
        side = Side(python, s, args, mem_row=r)
        mem[r] = side.hello["mib"]
        side.proc.stdin.close()
        side.proc.wait(timeout=60)
    agree = {lxt: agreement(maps[ours], maps[lxt]) for lxt, ours in PAIRS.items()}
    agree["vitlens gradskip vs LXT AttnLRP"] = agreement(maps["vitlens gradskip"], maps["LXT AttnLRP"])
    return {"times": times, "mem": mem, "agreement": agree, "torch": versions["torch"]}


def _ratio(times: dict[str, list[float]], a: str, b: str) -> float:
    return statistics.median(x / y for x, y in zip(times[a], times[b]))


def _paired(times: dict[str, list[float]], a: str, b: str) -> str:
    """``a ÷ b``: the median of the per-repeat ratios, bold, and their spread (smallest–largest)."""
    ratios = [x / y for x, y in zip(times[a], times[b])]
    return f"**{statistics.median(ratios):.3f}** (per-repeat {min(ratios):.3f}–{max(ratios):.3f})"


def render(res: dict[str, Any], args: argparse.Namespace, command: str, seconds: float) -> str:
    t, mem = res["times"], res["mem"]
    rows = [r for rs in SIDES.values() for r in rs]
    lines = ["# vitlens next to LXT: time, memory, map agreement", "", f"Command: `{command}` ({seconds:.0f} s)", "",
             f"- date: {_dt.datetime.now().astimezone().strftime('%Y-%m-%d %H:%M %Z')}",
             f"- torch {res['torch']} (LXT's environment for every side), python {platform.python_version()}, "
             f"CPU, {args.threads} thread(s), times = process CPU time",
             f"- model `{args.model}` (timm, random weights, seed 0; LXT on the HF ViT with the same weights), "
             f"batch {args.batch}, {args.repeats} timed repeats after one warm-up round, rows in turn", "",
             "| row | ms / image (median) | × floor (paired) | × LXT AttnLRP (paired) | peak MiB | × floor memory |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        ms = 1e3 * statistics.median(t[r]) / args.batch
        mx = mem[r] / mem["floor"] if mem["floor"] > 0 else float("nan")
        lines.append(f"| {r} | {ms:.1f} | {_ratio(t, r, 'floor'):.3f} | {_ratio(t, r, 'LXT AttnLRP'):.3f} "
                     f"| {mem[r]:.1f} | {mx:.3f} |")
    lines += ["", "Paired time ratios (medians of per-repeat ratios):", "",
              f"- vitlens attnlrp ÷ LXT AttnLRP = {_paired(t, 'vitlens attnlrp', 'LXT AttnLRP')}",
              f"- vitlens cplrp ÷ LXT CP-LRP = {_paired(t, 'vitlens cplrp', 'LXT CP-LRP')}",
              f"- vitlens gradskip ÷ LXT AttnLRP = {_paired(t, 'vitlens gradskip', 'LXT AttnLRP')}",
              f"- vitlens attnlrp ÷ floor = {_paired(t, 'vitlens attnlrp', 'floor')}; "
              f"LXT AttnLRP ÷ floor = {_paired(t, 'LXT AttnLRP', 'floor')}", "",
              "Map agreement (token relevance, CLS first; max |difference| ÷ max |LXT|, Pearson r):", ""]
    for name, a in res["agreement"].items():
        label = f"{PAIRS[name]} vs {name}" if name in PAIRS else name
        lines.append(f"- {label}: {a['rel_max_diff']:.2e}, r = {a['pearson']:.6f}")
    return "\n".join(lines + [""])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--model", default="vit_small_patch16_224", help="timm name, optionally 'name:key=value,...'")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None, help="also write the Markdown report here")
    p.add_argument("--_child", dest="child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_mem-row", dest="mem_row", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args.child, args.model, args.batch, args.threads, args.mem_row)
        return {}
    python = lxt_python()
    if python is None:
        raise SystemExit("no LXT environment: set VITLENS_LXT_PYTHON or create .venv-lxt (scripts/setup.sh)")
    command = shlex.join(["python", "benchmarks/lxt_side_by_side.py", *(sys.argv[1:] if argv is None else argv)])
    t0 = time.perf_counter()
    res = measure(args, python)
    md = render(res, args, command, time.perf_counter() - t0)
    print(md)
    if args.out:
        Path(args.out).write_text(md)
    res["markdown"] = md
    return res


if __name__ == "__main__":
    main()
