"""GPU check, ready for when a GPU is lent: three throughput figures in one run of under five minutes.

1. GradSkip ÷ floor on ViT-B/16 (timm, random weights) at batch 64, in fp32 and in bf16 (model and input cast to
   ``torch.bfloat16``): paired medians of interleaved repeats of the rows of ``benchmarks/gradskip_cost.py
   --attention both`` (forward, forward + activation backward = the floor, GradSkip; each on the attention timm
   builds the model with, fused for ViT-B, and on explicit attention), and the peak CUDA memory of each row above
   what the model and input hold.
2. AHA training images per second (``vitlens.aha.train.train_aha`` on synthetic scenes, no files written), timed
   from the end of the first step to the end of the last one (the first step pays for warm-up).
3. Bench throughput: images per second of ``vitlens.bench.run_benchmark`` (GradSkip maps + insertion/deletion) on
   synthetic scenes, into a temporary folder.

Usage::

    python benchmarks/gpu_check.py                 # on the GPU: ViT-B/16, batch 64 (documented in docs/benchmarks/)
    python benchmarks/gpu_check.py --smoke         # tiny sizes, any device (CPU): checks the script end to end
    python benchmarks/gpu_check.py --out docs/benchmarks/gpu_check.md

Prints a Markdown report (and writes it with ``--out``); ``main`` also returns the numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gradskip_cost as gc  # noqa: E402  (the three rows and the model builder live there once)

FULL = {"model": "vit_base_patch16_224", "batch": 64, "repeats": 10,
        "aha": {"model": "vit_base_patch16_224", "steps": 6, "batch_size": 16, "m": 16},
        "bench": {"model": "vit_base_patch16_224", "n": 128, "batch": 64}}
SMOKE = {"model": "vit_tiny_patch16_224:img_size=32,patch_size=8,depth=2", "batch": 2, "repeats": 2,
         "aha": {"model": "vit_tiny_patch16_224:img_size=32,patch_size=8,depth=2,num_classes=6", "steps": 3,
                 "batch_size": 2, "m": 4, "width": 8, "grid_range": (2, 4)},
         "bench": {"model": "vit_tiny_patch16_224:img_size=32,patch_size=8,depth=2,num_classes=6", "n": 4,
                   "batch": 2}}
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_bytes(fn, device: torch.device) -> float:
    """Peak CUDA memory of ``fn()`` above what was allocated before it (NaN off CUDA)."""
    if device.type != "cuda":
        fn()
        return float("nan")
    _sync(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    _sync(device)
    return float(torch.cuda.max_memory_allocated(device) - base)


def gradskip_vs_floor(spec: str, batch: int, repeats: int, device: torch.device, dtype: torch.dtype) -> dict:
    """Paired median ratios for one precision: GradSkip on the model as timm builds it (default attention) ÷ the
    default-attention floor and ÷ its forward; GradSkip ÷ the floor with explicit attention on both; the explicit
    floor ÷ the default one; peak memory of the rows and GradSkip's ÷ the default floor's."""
    model = gc.build_model(spec, device).to(dtype)
    x = gc.make_batch(model, batch, device).to(dtype)
    rows = gc.ATTENTION_ROWS["both"]
    times, _ = gc.time_rows(model, x, repeats, warmup=1, rows=rows)
    mem = {row: _peak_bytes(lambda row=row: gc.RUNNERS[row](model, x), device) for row in rows}
    per_img = {row: 1e3 * statistics.median(times[row]) / batch for row in rows}
    f = gc.DEFAULT
    return {
        "ms_per_image": per_img,
        "gradskip_x_floor": gc._paired_ratio(times["gradskip" + f], times["forward+backward" + f]),
        "gradskip_x_forward": gc._paired_ratio(times["gradskip" + f], times["forward" + f]),
        "floor_x_forward": gc._paired_ratio(times["forward+backward" + f], times["forward" + f]),
        "gradskip_x_explicit_floor": gc._paired_ratio(times["gradskip"], times["forward+backward"]),
        "explicit_floor_x_floor": gc._paired_ratio(times["forward+backward"], times["forward+backward" + f]),
        "peak_mib": {row: v / 2**20 for row, v in mem.items()},
        "mem_x_floor": (mem["gradskip" + f] / mem["forward+backward" + f] if mem["forward+backward" + f] > 0
                        else float("nan")),
    }


def _target(spec: str, device: torch.device) -> torch.nn.Module:
    model = gc.build_model(spec, device)
    c, h, w = gc.input_size(model)
    # the data config of the synthetic scenes (random weights: no pretrained normalisation to honour)
    model.vitlens_data_config = {"input_size": (c, h, w), "mean": (0.5,) * 3, "std": (0.25,) * 3, "crop_pct": 1.0}
    return model


def aha_training(cfg: dict, device: torch.device) -> dict:
    """AHA training images per second after the first step."""
    from vitlens.aha.train import train_aha

    model = _target(cfg["model"], device)
    stamps: list[float] = []

    def on_step(step: int, record: dict) -> None:
        _sync(device)
        stamps.append(time.perf_counter())

    extra = {k: v for k, v in cfg.items() if k not in ("model", "steps", "batch_size")}
    res = train_aha(model, "scenes", None, steps=cfg["steps"], batch_size=cfg["batch_size"], progress=False,
                    device=device, card=False, on_step=on_step, n_val=2, val_every=0, **extra)
    steps = len(stamps) - 1
    ips = steps * cfg["batch_size"] / (stamps[-1] - stamps[0]) if steps > 0 else float("nan")
    return {"images_per_s": ips, "timed_steps": steps, "batch_size": cfg["batch_size"], "finished": res.finished}


def bench_throughput(cfg: dict, device: torch.device) -> dict:
    """Images per second of the bench harness (GradSkip + insertion/deletion), files in a temporary folder."""
    from vitlens.bench import BenchConfig, run_benchmark

    model = _target(cfg["model"], device)
    config = BenchConfig(model=cfg["model"], data="scenes:seed=5", methods=[("gradskip", {})],
                         metrics=[("insertion_deletion", {})], n=cfg["n"], batch_size=cfg["batch"])
    with tempfile.TemporaryDirectory() as tmp:
        _sync(device)
        t0 = time.perf_counter()
        run_benchmark(config, os.path.join(tmp, "run"), model=model, progress=False)
        _sync(device)
        seconds = time.perf_counter() - t0
    return {"images_per_s": cfg["n"] / seconds, "n": cfg["n"], "batch": cfg["batch"], "seconds": seconds}


def render(res: dict, args: argparse.Namespace, sizes: dict, command: str, seconds: float) -> str:
    dev = res["device"]
    lines = ["# GPU check: GradSkip ÷ floor, AHA training, bench throughput", "", f"Command: `{command}` "
             f"({seconds:.0f} s)", "",
             f"- date: {_dt.datetime.now().astimezone().strftime('%Y-%m-%d %H:%M %Z')}",
             f"- torch {torch.__version__}, python {platform.python_version()}; device: {dev}",
             f"- GradSkip rows: `{sizes['model']}` (random weights), batch {sizes['batch']}, "
             f"{sizes['repeats']} interleaved repeats after one warm-up round; ratios are paired medians. Default "
             "floor: forward + activation backward of the model as timm builds it (fused attention on ViT); explicit "
             "floor: the same with `fused_attn=False`; GradSkip on the fused model (probabilities recomputed in "
             "the backward) and on the explicit one", "",
             "| precision | default floor ms/img | explicit floor ms/img | GradSkip ms/img | GradSkip ÷ default floor "
             "| GradSkip ÷ forward | explicit GradSkip ÷ explicit floor | explicit ÷ default floor "
             "| peak MiB default floor | peak MiB GradSkip | memory ÷ default floor |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    f = gc.DEFAULT
    for name, r in res["gradskip"].items():
        ms, pk = r["ms_per_image"], r["peak_mib"]
        lines.append(f"| {name} | {ms['forward+backward' + f]:.2f} | {ms['forward+backward']:.2f} "
                     f"| {ms['gradskip' + f]:.2f} | **{r['gradskip_x_floor']:.3f}** | {r['gradskip_x_forward']:.3f} "
                     f"| {r['gradskip_x_explicit_floor']:.3f} | {r['explicit_floor_x_floor']:.3f} "
                     f"| {gc._fmt(pk['forward+backward' + f], 1)} | {gc._fmt(pk['gradskip' + f], 1)} "
                     f"| {gc._fmt(r['mem_x_floor'], 3)} |")
    a, b = res["aha"], res["bench"]
    lines += ["", f"- AHA training (`{sizes['aha']['model']}`, batch {a['batch_size']}, m = {sizes['aha']['m']}): "
              f"**{a['images_per_s']:.1f} images/s** over {a['timed_steps']} timed steps",
              f"- bench (`{sizes['bench']['model']}`, GradSkip + insertion/deletion, {b['n']} scenes, batch "
              f"{b['batch']}): **{b['images_per_s']:.1f} images/s** ({b['seconds']:.1f} s)", ""]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes (CPU is fine): checks the script end to end")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats of the GradSkip rows")
    p.add_argument("--precisions", nargs="+", choices=sorted(PRECISIONS), default=["fp32", "bf16"])
    p.add_argument("--out", default=None, help="also write the Markdown report here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    sizes = dict(SMOKE if args.smoke else FULL)
    if args.repeats:
        sizes["repeats"] = args.repeats
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but CUDA is not available")
    if device.type != "cuda" and not args.smoke:
        print("warning: no GPU; the full-size check on a CPU takes far longer than five minutes", file=sys.stderr)
    command = shlex.join(["python", "benchmarks/gpu_check.py", *(sys.argv[1:] if argv is None else argv)])
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    t0 = time.perf_counter()
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                           "gradskip": {}}
    for name in args.precisions:
        log(f"GradSkip vs floor, {name} ...")
        res["gradskip"][name] = gradskip_vs_floor(sizes["model"], sizes["batch"], sizes["repeats"], device,
                                                  PRECISIONS[name])
    log("AHA training ...")
    res["aha"] = aha_training(sizes["aha"], device)
    log("bench ...")
    res["bench"] = bench_throughput(sizes["bench"], device)
    seconds = time.perf_counter() - t0
    md = render(res, args, sizes, command, seconds)
    print(md)
    if args.out:
        with contextlib.suppress(FileExistsError):
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(md)
    res["markdown"], res["seconds"] = md, seconds
    return res


if __name__ == "__main__":
    main()
