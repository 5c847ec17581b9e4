"""Wall time of vitlens' gradient and CAM baselines side by side with the peer libraries, in one run.

Pairs (same model, inputs, targets and settings on both sides):

  - ``gradcam``              vs pytorch-grad-cam ``GradCAM`` on the output of ``blocks[-2]`` (= the residual input of
                             the last block, which is what vitlens reads), with a reshape transform to the token grid;
  - ``finercam``             (``weighting="probability"``) vs pytorch-grad-cam ``FinerCAM`` (its default 3 references,
                             ``alpha = γ = 1``);
  - ``integrated_gradients`` vs Captum ``IntegratedGradients`` (same steps, rule, zero baseline, internal batch size).

Own references in the same run: a plain forward (no grad), the forward+backward floor (one forward and one backward
of the target logit to the input, parameters frozen), and vitlens ``gradient``, ``attn_gradcam`` and ``gradskip``.

Every repeat runs all rows back to back (after one warm-up round), so machine noise hits them alike; reported are the
median wall time and CPU time (of this process) per call and, for each pair, the medians of the per-repeat ratios
vitlens / peer. Before timing, the maps
of each pair are compared (maximum difference relative to the peer's largest value; for the CAM pairs the peers' raw,
un-normalised maps). Never used as a test: wall time depends on the machine.

The model is timm's ``vit_small_patch16_224`` with random weights (``pretrained=False``; nothing is downloaded).

Usage::

    python benchmarks/peer_speed_gradients.py                                   # batch 4, IG with 50 steps
    python benchmarks/peer_speed_gradients.py --ig-steps 10 --repeats 3 --out docs/benchmarks/peer_speed_gradients.md
    python benchmarks/peer_speed_gradients.py --quick                           # tiny model, smoke test
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
import time
from typing import Callable

import numpy as np
import torch
from torch import Tensor, nn

import vitlens


def build(args: argparse.Namespace) -> tuple[nn.Module, Tensor]:
    import timm

    torch.manual_seed(0)
    if args.quick:
        model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=64, depth=2, num_classes=10)
        size = 64
    else:
        model = timm.create_model(args.model, pretrained=False)
        size = model.patch_embed.img_size[0]
    model.eval()
    x = torch.randn(args.batch, 3, size, size, generator=torch.Generator().manual_seed(1))
    return model, x


def reshape_transform(prefix: int, grid: tuple[int, int]) -> Callable[[Tensor], Tensor]:
    def transform(t: Tensor) -> Tensor:
        b, _, d = t.shape
        return t[:, prefix:].reshape(b, *grid, d).permute(0, 3, 1, 2)

    return transform


def make_rows(model: nn.Module, x: Tensor, classes: list[int], args: argparse.Namespace
              ) -> dict[str, Callable[[], object]]:
    """Name → zero-argument call. Peer objects are built inside their call (as a user would) and released."""
    from captum.attr import IntegratedGradients as CaptumIG
    from pytorch_grad_cam import FinerCAM, GradCAM
    from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

    adapter = vitlens.get_adapter(model)
    rt = reshape_transform(adapter.num_prefix_tokens, adapter.grid(tuple(x.shape[-2:])))
    layer = model.blocks[-2]
    target = torch.tensor(classes)
    ig_opts = dict(n_steps=args.ig_steps, rule=args.ig_rule, baseline="zero", internal_batch_size=args.internal_batch)

    def forward():
        with torch.no_grad():
            return model(x)

    def floor():
        grads = {p: p.requires_grad for p in model.parameters()}
        try:
            for p in grads:
                p.requires_grad_(False)
            xg = x.clone().requires_grad_(True)
            y = model(xg).gather(1, target[:, None]).sum()
            return torch.autograd.grad(y, [xg])[0]
        finally:
            for p, flag in grads.items():
                p.requires_grad_(flag)

    def pgc_gradcam():
        with GradCAM(model, [layer], reshape_transform=rt) as cam:
            return cam(x, targets=[ClassifierOutputTarget(c) for c in classes])

    def pgc_finercam():
        with FinerCAM(model, [layer], reshape_transform=rt) as cam:
            return cam(x, targets=None, alpha=1.0)

    def captum_ig():
        return CaptumIG(model).attribute(x, baselines=torch.zeros_like(x), target=classes, n_steps=args.ig_steps,
                                         method=args.ig_rule, internal_batch_size=args.internal_batch)

    return {
        "forward": forward,
        "forward+backward": floor,
        "vitlens gradient": lambda: vitlens.explain(model, x, "gradient", target),
        "vitlens gradskip": lambda: vitlens.explain(model, x, "gradskip", target),
        "vitlens attn_gradcam": lambda: vitlens.explain(model, x, "attn_gradcam", target),
        "vitlens gradcam": lambda: vitlens.explain(model, x, "gradcam", target),
        "pytorch-grad-cam GradCAM": pgc_gradcam,
        "vitlens finercam": lambda: vitlens.explain(model, x, "finercam", weighting="probability"),
        "pytorch-grad-cam FinerCAM": pgc_finercam,
        "vitlens integrated_gradients": lambda: vitlens.explain(model, x, "integrated_gradients", target, **ig_opts),
        "Captum IntegratedGradients": captum_ig,
    }


PAIRS = [
    ("vitlens gradcam", "pytorch-grad-cam GradCAM"),
    ("vitlens finercam", "pytorch-grad-cam FinerCAM"),
    ("vitlens integrated_gradients", "Captum IntegratedGradients"),
]


def agreement(model: nn.Module, x: Tensor, classes: list[int], args: argparse.Namespace) -> dict[str, float]:
    """Max |vitlens − peer| / max |peer| for each pair (CAMs: the peers' raw maps, before their min-max scaling)."""
    from captum.attr import IntegratedGradients as CaptumIG
    from pytorch_grad_cam import FinerCAM, GradCAM
    from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

    adapter = vitlens.get_adapter(model)
    rt = reshape_transform(adapter.num_prefix_tokens, adapter.grid(tuple(x.shape[-2:])))
    layer = model.blocks[-2]

    def raw(cam) -> np.ndarray:
        acts = cam.activations_and_grads.activations[0].numpy()
        grads = cam.activations_and_grads.gradients[0].numpy()
        return np.maximum(cam.get_cam_image(x, layer, None, acts, grads), 0)

    def rel(ours: Tensor, ref) -> float:
        ref = torch.as_tensor(ref, dtype=torch.float64)
        return float((ours.double() - ref).abs().max() / ref.abs().max())

    out = {}
    with GradCAM(model, [layer], reshape_transform=rt) as cam:
        cam(x, targets=[ClassifierOutputTarget(c) for c in classes])
        out["vitlens gradcam"] = rel(vitlens.explain(model, x, "gradcam", classes).token_maps, raw(cam))
    with FinerCAM(model, [layer], reshape_transform=rt) as cam:
        cam(x, targets=None, alpha=1.0)
        out["vitlens finercam"] = rel(vitlens.explain(model, x, "finercam", weighting="probability").token_maps,
                                      raw(cam.base_cam))
    ours = vitlens.explain(model, x, "integrated_gradients", classes, n_steps=args.ig_steps, rule=args.ig_rule,
                           baseline="zero", internal_batch_size=args.internal_batch).maps
    ref = CaptumIG(model).attribute(x, baselines=torch.zeros_like(x), target=classes, n_steps=args.ig_steps,
                                    method=args.ig_rule, internal_batch_size=args.internal_batch).sum(1)
    out["vitlens integrated_gradients"] = rel(ours, ref.detach())
    model.zero_grad(set_to_none=True)
    return out


def time_rows(rows: dict[str, Callable[[], object]], repeats: int
              ) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Wall time and CPU time of this process (``time.process_time``) per call, rows interleaved."""
    for fn in rows.values():  # warm-up round
        fn()
    wall: dict[str, list[float]] = {name: [] for name in rows}
    cpu: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(repeats):
        for name, fn in rows.items():
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    return wall, cpu


def _paired(num: list[float], den: list[float]) -> float:
    return statistics.median(a / b for a, b in zip(num, den))


def render(times: dict[str, list[float]], cpu_times: dict[str, list[float]], agree: dict[str, float],
           args: argparse.Namespace, command: str, batch: int) -> str:
    import captum
    import timm

    cpu = platform.machine()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        if names:
            cpu = names[0]
    try:
        from importlib.metadata import version

        pgc_version = version("grad-cam")
    except Exception:  # pragma: no cover - metadata missing
        pgc_version = "?"
    med = {k: statistics.median(v) for k, v in times.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu_times.items()}
    peer_of = dict(PAIRS)
    lines = [
        "# Gradient and CAM baselines: vitlens next to Captum and pytorch-grad-cam",
        "",
        f"Command: `{command}`",
        "",
        f"- date: {_dt.datetime.now().astimezone().strftime('%Y-%m-%d %H:%M %Z')}",
        f"- torch {torch.__version__}, timm {timm.__version__}, captum {captum.__version__}, grad-cam {pgc_version}, "
        f"vitlens {vitlens.__version__}, python {platform.python_version()}",
        f"- device: cpu ({cpu}, {os.cpu_count()} logical cores, shared with other jobs); torch threads: "
        f"{torch.get_num_threads()}",
        f"- model: `{'vit_tiny_patch16_224 (64 px, depth 2)' if args.quick else args.model}` (timm, random weights), "
        f"batch {batch}; {args.repeats} timed repeats after 1 warm-up round, rows interleaved",
        f"- Integrated Gradients: {args.ig_steps} steps, `{args.ig_rule}`, zero baseline, internal batch "
        f"{args.internal_batch} on both sides",
        "",
        "| row | wall s / call | CPU s / call | × forward+backward (CPU) | vitlens / peer, wall "
        "| vitlens / peer, CPU | max rel. difference of the maps |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, t in med.items():
        ratio = ratio_cpu = diff = ""
        if name in peer_of:
            peer = peer_of[name]
            ratio = f"{_paired(times[name], times[peer]):.2f}"
            ratio_cpu = f"{_paired(cpu_times[name], cpu_times[peer]):.2f}"
            diff = f"{agree[name]:.1e}"
        x_floor = _paired(cpu_times[name], cpu_times["forward+backward"])
        lines.append(f"| {name} | {t:.3f} | {med_cpu[name]:.3f} | {x_floor:.2f} | {ratio} | {ratio_cpu} | {diff} |")
    lines += [
        "",
        "Times are medians over the repeats; ratios are medians of the per-repeat ratios (rows run back to back in "
        "every repeat). CPU time is this process's (`time.process_time`, one torch thread): on a machine shared with "
        "other jobs it is much steadier than wall time, which also counts time the process waited for a core.",
        "",
        "Notes: vitlens' CAM rows run the model with explicit attention (the adapter's capture path), the peers with "
        "timm's fused attention. pytorch-grad-cam calls `loss.backward()` on the model as is, so it also computes "
        "parameter gradients; vitlens and Captum take gradients of activations/inputs only. The peers' CAM calls "
        "include their min-max scaling and OpenCV resize to the input size; vitlens' include its bilinear upsampling. "
        "vitlens' Integrated Gradients makes one extra, gradient-free forward on the clean batch (for the logits and "
        "the target), i.e. n + 1 forwards; Captum's makes n. Absolute times depend on the machine and its load.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="vit_small_patch16_224")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--ig-steps", type=int, default=50)
    ap.add_argument("--ig-rule", default="riemann_right")
    ap.add_argument("--internal-batch", type=int, default=20, help="IG path points per model call (both sides)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="tiny model, 1 repeat, 4 IG steps (smoke test)")
    ap.add_argument("--out", default=None, help="write the Markdown page here")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.ig_steps = 1, 4
    torch.set_num_threads(args.threads)
    model, x = build(args)
    with torch.no_grad():
        classes = model(x).argmax(1).tolist()
    agree = agreement(model, x, classes, args)
    times, cpu_times = time_rows(make_rows(model, x, classes, args), args.repeats)
    model.zero_grad(set_to_none=True)
    command = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    page = render(times, cpu_times, agree, args, command, x.shape[0])
    print(page)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            f.write(page)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
