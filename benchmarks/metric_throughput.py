"""Insertion + deletion throughput: vitlens next to its peers and next to the floor of plain forward passes.

Everything is measured side by side in one run, on the same model, images, maps and targets, at the same number of
steps, with the same baseline for both curves (black, i.e. pixel 0; the data config has mean = std = 0.5, so black is
-1 in every channel of the model input — the value Quantus is given):

  vitlens      ``InsertionDeletion(steps=S, deletion_baseline="black", insertion_baseline="black")``: both curves,
               ``2·S`` forwards per image (the all-black input is shared), all steps and images batched,
               ``--batch-size`` images per forward;
  floor        the same number of image-forwards (``B·2·S``) as plain ``model(chunk)`` calls on a prepared batch of
               ``--batch-size`` images under ``torch.no_grad()`` — what any implementation must at least spend;
  torchcam     ``torchcam.metrics.DeletionInsertionMetric`` (both curves, same schedule, ``batch_size`` perturbed
               inputs per forward) with a stand-in CAM extractor returning our maps;
  Quantus      ``quantus.PixelFlipping`` — deletion only (Quantus has no insertion metric); one step per forward of
               the ``B`` images, numpy in between. ``features_in_step = 3·H·W/S`` (Quantus ranks the map broadcast to
               the three channels, and needs the step to divide ``H·W``; hence 96 px and S = 48: 192 pixels per
               step; at 224 px, S = 96 is accepted too, with steps of 1568 channel values that are not whole
               pixels — the same cost, another curve). Its time for an insertion+deletion pair is counted as
               **twice** its deletion time (an insertion curve needs as many forwards).

Each implementation also runs on a zero-cost model (a module returning zero logits): that time is everything it
spends *besides* the forwards, a noise-robust measure of its overhead.

All run one after another in every repeat (interleaved, in a rotating order, so machine noise hits them alike); the
table reports the median over ``--repeats`` repeats after one warm-up, and ratios as medians of per-repeat paired
ratios. The results are cross-checked in the same run (vitlens vs
torchcam AUCs, vitlens vs Quantus deletion curves) and the largest differences are printed under the table.

The model is timm's ``vit_tiny_patch16_224`` architecture built at ``--img-size`` px with random weights
(``pretrained=False``; nothing is downloaded).

Usage::

    python benchmarks/metric_throughput.py                       # 96 px, S = 48, 4 images, 5 repeats, CPU
    python benchmarks/metric_throughput.py --out docs/benchmarks/metric_throughput.md
    python benchmarks/metric_throughput.py --img-size 224 --steps 96 --images 2 --repeats 3 \
        --out docs/benchmarks/metric_throughput.md --append
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import functools
import os
import platform
import shlex
import statistics
import sys
import time
import warnings
from typing import Any, Callable

import torch
from torch import Tensor, nn

from vitlens.metrics.perturbation import InsertionDeletion

HALF = {"mean": (0.5, 0.5, 0.5), "std": (0.5, 0.5, 0.5)}


def build(arch: str, img_size: int, n: int, device: torch.device) -> tuple[nn.Module, Tensor, Tensor, Tensor]:
    import timm

    torch.manual_seed(0)
    model = timm.create_model(arch, pretrained=False, img_size=img_size, num_classes=1000).eval().to(device)
    model.vitlens_data_config = {"input_size": (3, img_size, img_size), **HALF}
    x = torch.randn(n, 3, img_size, img_size, device=device)
    maps = torch.randn(n, img_size, img_size, device=device)
    with torch.no_grad():
        targets = model(x).argmax(1)
    return model, x, maps, targets


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, out


class MapsAsCAM:
    """Stand-in for a torchcam CAM extractor that returns the given maps."""

    def __init__(self, model: nn.Module, maps: Tensor) -> None:
        self.model, self.maps = model, maps

    def __call__(self, class_idx=None, scores=None, normalized=True, **kwargs):
        return [self.maps]

    def fuse_cams(self, cams):
        return cams[0]

    @contextlib.contextmanager
    def _hooks_off(self):
        yield


class NullModel(nn.Module):
    """Returns zero logits at no cost: running an implementation on it times everything *but* the forwards."""

    def __init__(self, num_classes: int, data_cfg: dict) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.vitlens_data_config = data_cfg

    def forward(self, x: Tensor) -> Tensor:
        return x.new_zeros(x.shape[0], self.num_classes)


def make_runners(model: nn.Module, x: Tensor, maps: Tensor, targets: Tensor, args: argparse.Namespace,
                 versions: dict[str, str]) -> dict[str, Callable[[], Any]]:
    """The implementations to time on ``model`` (vitlens, torchcam and Quantus where installed)."""
    b, s, hw = args.images, args.steps, args.img_size * args.img_size
    device = x.device
    metric = InsertionDeletion(steps=s, deletion_baseline="black", insertion_baseline="black",
                               batch_size=args.batch_size)
    runners: dict[str, Callable[[], Any]] = {"vitlens": lambda: metric(maps, model=model, x=x, targets=targets)}
    try:
        import torchcam
        from torchcam.metrics import DeletionInsertionMetric

        versions["torchcam"] = torchcam.__version__

        def run_torchcam():
            out = []
            for i in range(b):  # the CAM extractor stand-in holds one image's map
                m = DeletionInsertionMetric(MapsAsCAM(model, maps[i : i + 1]), functools.partial(torch.softmax, dim=-1),
                                            steps=s, baseline=torch.full((1, 3, 1, 1), -1.0, device=device),
                                            batch_size=args.batch_size)
                m.update(x[i : i + 1], class_idx=[int(targets[i])])
                out.append(m.summary())
            return out

        runners["torchcam"] = run_torchcam
    except ImportError:
        print("torchcam not installed: skipped", file=sys.stderr)
    try:
        import quantus

        versions["quantus"] = quantus.__version__
        pf = quantus.PixelFlipping(features_in_step=3 * hw // s, perturb_baseline=-1.0, normalise=False, abs=False,
                                   disable_warnings=True)
        xn, an, yn = x.cpu().numpy(), maps[:, None].cpu().numpy(), targets.cpu().numpy()
        runners["quantus"] = lambda: pf(model=model, x_batch=xn, y_batch=yn, a_batch=an, channel_first=True,
                                        softmax=True, device=str(device), batch_size=b)
    except ImportError:
        print("quantus not installed: skipped", file=sys.stderr)
    return runners


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="vit_tiny_patch16_224")
    ap.add_argument("--img-size", type=int, default=96)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--images", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=64, help="images per forward for vitlens, floor, torchcam")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steadier on a shared machine)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None, help="write the Markdown report here")
    ap.add_argument("--append", action="store_true", help="append a section to --out instead of overwriting it")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)

    model, x, maps, targets = build(args.arch, args.img_size, args.images, device)
    b, s, hw = args.images, args.steps, args.img_size * args.img_size
    fis = 3 * hw // s
    if 3 * hw % s or hw % fis:
        raise SystemExit(f"Quantus needs 3*H*W/steps = {3 * hw / s:g} to be an integer dividing H*W = {hw}; "
                         "pick other --img-size/--steps")
    whole_pixels = fis % 3 == 0  # otherwise a Quantus step ends inside a pixel's channels: same cost, other curve
    forwards = b * 2 * s  # image-forwards of one insertion+deletion evaluation of the batch
    versions = {"torch": torch.__version__}
    try:
        import timm

        versions["timm"] = timm.__version__
    except ImportError:  # pragma: no cover
        pass

    chunks = [x[torch.arange(i, min(forwards, i + args.batch_size), device=device) % b]
              for i in range(0, forwards, args.batch_size)]

    def run_floor():
        with torch.no_grad():
            for c in chunks:
                model(c)

    runners = {"floor": run_floor, **make_runners(model, x, maps, targets, args, versions)}
    null = NullModel(int(model.num_classes), model.vitlens_data_config).eval()
    runners.update({f"{k}/null": fn for k, fn in make_runners(null, x, maps, targets, args, {}).items()})

    times: dict[str, list[float]] = {k: [] for k in runners}
    outputs: dict[str, Any] = {}
    names = list(runners)
    for rep in range(args.repeats + 1):  # repeat 0 is the warm-up
        order = names[rep % len(names):] + names[: rep % len(names)]  # rotate so no row always runs first
        for name in order:
            dt, out = timed(runners[name], device)
            if name.startswith("quantus"):
                dt *= 2  # deletion only: an insertion curve costs as many forwards
            if rep:
                times[name].append(dt)
            outputs[name] = out
        if rep:
            print(f"repeat {rep}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()), file=sys.stderr)

    impls = [k for k in ("vitlens", "floor", "torchcam", "quantus") if k in times]
    med = {k: statistics.median(v) for k, v in times.items()}  # seconds per insertion+deletion of the batch
    # paired ratios: each repeat's time over vitlens' (or the floor's) time in the same repeat, then the median
    rel = {k: statistics.median(t / v for t, v in zip(times[k], times["vitlens"])) for k in impls}
    over_floor = {k: statistics.median(t / f for t, f in zip(times[k], times["floor"])) for k in impls}
    # overhead beyond the forwards: the same implementation on the zero-cost model, over the floor
    extra = {k: statistics.median(t / f for t, f in zip(times[f"{k}/null"], times["floor"]))
             for k in impls if f"{k}/null" in times}

    checks = []
    r = outputs["vitlens"]
    if "torchcam" in outputs:
        tc = torch.tensor([[o["insertion_auc"], o["deletion_auc"]] for o in outputs["torchcam"]])
        ours = torch.stack([r.values["insertion"], r.values["deletion"]], 1).cpu()
        same = hw % s == 0
        diff = float((ours - tc).abs().max())
        checks.append(f"vitlens vs torchcam, insertion/deletion AUC: max |diff| = {diff:.1e}"
                      + ("" if same else f" (H·W/S = {hw / s:.2f} is not an integer: torchcam steps by "
                                         f"{-(-hw // s)} pixels, vitlens rounds i·N/S, so the schedules differ)"))
    if "quantus" in outputs and not whole_pixels:
        checks.append(f"Quantus steps of {fis} channel values are not whole pixels ({fis / 3:.2f} px): same number "
                      "of steps and forwards, but its curve is not the same protocol, so it is not compared")
    elif "quantus" in outputs:
        import numpy as np

        q = np.asarray(outputs["quantus"])
        d = r.curves["deletion"][:, 1:].cpu().numpy()
        checks.append(f"vitlens vs Quantus, deletion curve points: max |diff| = {float(np.abs(q - d).max()):.1e}")

    labels = {
        "vitlens": ("vitlens `InsertionDeletion`", f"{2 * s}", f"≤ {args.batch_size}"),
        "floor": ("plain batched forwards (floor)", f"{2 * s}", f"≤ {args.batch_size}"),
        "torchcam": (f"torchcam {versions.get('torchcam', '')} `DeletionInsertionMetric`", f"{2 * s}",
                     f"≤ {args.batch_size}"),
        "quantus": (f"Quantus {versions.get('quantus', '')} `PixelFlipping` (deletion only; its time doubled)",
                    f"2 × {s}", f"{b}"),
    }
    lines = [
        f"| implementation | forwards / image | images / forward | s per batch of {b} (median) | ins+del pairs / s "
        "| time ÷ vitlens time | time ÷ floor time | overhead ÷ floor time |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for k in impls:
        name, fw, bs = labels[k]
        ov = f"{extra[k]:.3f}" if k in extra else "0 (by definition)"
        lines.append(f"| {name} | {fw} | {bs} | {med[k]:.3f} | {b / med[k]:.2f} | {rel[k]:.2f} | "
                     f"{over_floor[k]:.3f} | {ov} |")
    table = "\n".join(lines)
    settings = (f"model `{args.arch}` architecture at {args.img_size} px (random weights), {b} images, "
                f"S = {s} steps ({hw / s:.4g} pixels per step, pixel granularity), black baseline for both curves, "
                f"softmax probability of the model's predicted class, device `{device}`, "
                f"{args.repeats} interleaved repeats after a warm-up (median times; ratios are medians of the "
                f"per-repeat paired ratios); torch threads {torch.get_num_threads()}, {os.cpu_count()} CPUs; "
                + ", ".join(f"{k} {v}" for k, v in versions.items()))
    goals = (f"Goals (from the issue): ≥ 10× Quantus → measured {rel.get('quantus', float('nan')):.2f}× "
             f"(Quantus' time ÷ vitlens' time); ≤ 1.1× the forward floor → measured "
             f"{over_floor['vitlens']:.3f}× (paired), overhead beyond the forwards "
             f"{extra.get('vitlens', float('nan')):.3f}× the floor time.")
    print(table)
    print()
    print(settings)
    print(goals)
    for c in checks:
        print(c)
    if args.out:
        cmd = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
        now = _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
        head = "\n## Another configuration\n\n" if args.append else "# Insertion/deletion throughput\n\n"
        with open(args.out, "a" if args.append else "w", encoding="utf-8") as f:
            f.write(f"{head}Command: `{cmd}`  \nDate: {now}  \n"
                    f"Machine: {platform.platform()}, {platform.processor() or platform.machine()}\n\n"
                    f"Settings: {settings}.\n\n{table}\n\n{goals}\n\nCross-checks in the same run:\n\n"
                    + "\n".join(f"- {c}" for c in checks) + "\n\n" + ("" if args.append else NOTES))
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


NOTES = """How to read it: *forwards / image* is what each implementation spends for one insertion and one deletion
curve. *time ÷ vitlens time* > 1 means slower than vitlens (for Quantus: vitlens' speed-up). *time ÷ floor time* is
the time over the time of the same number of plain batched forward passes of the model (for vitlens: its overhead
ratio). *overhead ÷ floor time* is the implementation's time on a zero-cost model (a module returning zero logits),
i.e. everything but the forwards, over the floor's time: a noise-robust estimate of (overhead ratio − 1). Ratios are
medians of per-repeat paired ratios, so load changes between repeats cancel out. See
`benchmarks/metric_throughput.py` for what each row runs, and `docs/metrics.md` for the protocols. The machine is
shared (2 CPU cores used by other jobs too), so absolute times are noisy; the rows of one repeat run back to back
(in a rotating order), which keeps the paired ratios meaningful.
"""

if __name__ == "__main__":
    raise SystemExit(main())
