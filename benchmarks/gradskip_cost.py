"""Cost of one GradSkip map next to two references on the same model, measured in one run.

Rows, per model, with ``--attention explicit`` (``blk.attn.fused_attn = False`` in every row):

  (a) ``forward``          a plain forward pass under ``torch.no_grad()``;
  (b) ``forward+backward`` the physical floor of any gradient method: a forward and an activation-only backward
                           ``torch.autograd.grad(logit_of_predicted_class.sum(), input_of_first_block)``, parameters
                           frozen, the first block's input made a leaf by a forward pre-hook;
  (c) ``gradskip``         ``vitlens.explain(model, x, method="gradskip")``;
  (d) ``gradskip-reference`` (with ``--reference``) the implementation before the cost work of issue #15, kept in
                           ``tests/gradskip_reference.py`` (the tests compare the maps): before and after side by
                           side in one run.

With ``--attention default`` the rows (a′) ``forward (default)``, (b′) ``forward+backward (default)`` and (c′)
``gradskip (default)`` run the model as ``timm.create_model`` builds it: every attention module keeps the path timm
chose for it (``fused_attn``: timm's fused ``scaled_dot_product_attention`` for ViT, DeiT, EVA02; *explicit* for
Swin's window attention, whose fused path timm marks experimental and leaves off unless ``TIMM_FUSED_ATTN=2``);
(b′) is the *default-attention floor*, the one a user's model really runs. ``--attention fused`` forces the fused path
on in every module that has one (rows ``… (fused)``; on Swin that is the experimental path), ``--attention explicit``
forces it off. ``--attention both`` (the default) runs the default and the explicit rows in the same interleaved
repeats, so "GradSkip ÷ default-attention floor" and "÷ explicit floor" are paired in one run.

Columns: GFLOPs per image (``torch.utils.flop_counter.FlopCounterMode``, batch 1) and their ratio to the forward;
median wall time per image over ``--repeats`` interleaved repeats after a warm-up (a, b, c run one after another in
every repeat, so machine noise hits them alike) and the paired ratios c/a and c/b; peak memory (CUDA: max allocated
above what the model and input hold; CPU: peak RSS increase measured in a fresh subprocess per model and row); the
forward/backward passes per image as counted by the call itself.

The models are timm's ViT-Ti/S/B 16 at 224 px with random weights (``pretrained=False``): the papers' architectures,
nothing is downloaded. FLOPs do not depend on the weights; wall time and memory barely do.

Usage::

    python benchmarks/gradskip_cost.py                        # ViT-Ti/S/B, batch 8, CPU
    python benchmarks/gradskip_cost.py --out docs/benchmarks/gradskip_cost.md
    python benchmarks/gradskip_cost.py --quick                # ViT-Ti only, 3 repeats
    python benchmarks/gradskip_cost.py --reference            # add row (d), the pre-#15 implementation
    python benchmarks/gradskip_cost.py --attention default    # only the default-attention rows (a′, b′, c′)
    python benchmarks/gradskip_cost.py --attention fused      # fused attention forced on everywhere (a″, b″, c″)
    python benchmarks/gradskip_cost.py --models "vit_tiny_patch16_224:img_size=64,depth=2" --batch 2

``--models`` takes timm names, each optionally followed by ``:key=value,key=value`` keyword arguments for
``timm.create_model`` (values are Python literals).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime as _dt
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor, nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _cost_helpers import (FOOTNOTES, _peak_rss_bytes, _reset_peak_rss, _rss_bytes, attention_path,  # noqa: E402
                           custom_flops)

DEFAULT_MODELS = ("vit_tiny_patch16_224", "vit_small_patch16_224", "vit_base_patch16_224")
QUICK_MODELS = ("vit_tiny_patch16_224",)
ROWS = ("forward", "forward+backward", "gradskip")
DEFAULT = " (default)"  # each attention module on the path timm built it with
FUSED = " (fused)"  # the fused path forced on wherever a module has one
#: the row-name suffix of each attention path, the model as built first ("": explicit forced on)
PATHS = (DEFAULT, FUSED, "")
DEFAULT_ROWS = tuple(r + DEFAULT for r in ROWS)
FUSED_ROWS = tuple(r + FUSED for r in ROWS)
#: the floors a user's model may run, first the one it runs as built: the ratio column "time × user floor"
USER_FLOORS = tuple("forward+backward" + s for s in PATHS if s)
REFERENCE_ROW = "gradskip-reference"
ROW_LABELS = {"forward": "(a) forward", "forward+backward": "(b) forward+backward", "gradskip": "(c) GradSkip",
              REFERENCE_ROW: "(d) GradSkip before #15", "forward (default)": "(a′) forward, default attention",
              "forward+backward (default)": "(b′) forward+backward, default attention",
              "gradskip (default)": "(c′) GradSkip, default attention",
              "forward (fused)": "(a″) forward, fused attention forced",
              "forward+backward (fused)": "(b″) forward+backward, fused forced",
              "gradskip (fused)": "(c″) GradSkip, fused forced"}
ATTENTION_ROWS = {"explicit": ROWS, "default": DEFAULT_ROWS, "fused": FUSED_ROWS, "both": DEFAULT_ROWS + ROWS}
#: the seed's figure for one GradSkip map on ViT-B/16 at 224 px (spec/gradskip.md, "Cost")
SEED_MODEL = "vit_base_patch16_224"
SEED_GFLOPS = 69.39


# ---------------------------------------------------------------------------------------------------------------------
# models and the three rows
# ---------------------------------------------------------------------------------------------------------------------
def parse_model_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``"name"`` or ``"name:k=v,k=v"`` → ``(name, kwargs)``; values are Python literals (``depth=2``), else strings
    (``vitlens.runtime.parse_value``)."""
    from vitlens.runtime import parse_value

    name, _, rest = spec.partition(":")
    kwargs: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"model kwarg {item!r} in {spec!r} is not key=value")
        kwargs[key.strip()] = parse_value(value.strip())
    return name.strip(), kwargs


def build_model(spec: str, device: torch.device, fused: bool | None = None) -> nn.Module:
    """A timm model with random weights (seeded), in eval mode, with every attention module on the path
    ``timm.create_model`` chose for it (``fused=None``), or with the fused (``True``) or explicit (``False``) path
    forced on everywhere. The rows of this script set the path themselves (:func:`attention_path`)."""
    import timm

    name, kwargs = parse_model_spec(spec)
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, **kwargs).eval().to(device)
    for m in model.modules():
        if fused is not None and hasattr(m, "fused_attn"):
            m.fused_attn = fused
    return model


def input_size(model: nn.Module) -> tuple[int, int, int]:
    """``(C, H, W)`` the model expects (its patch embedding's image size)."""
    pe = model.patch_embed
    return int(pe.proj.in_channels), int(pe.img_size[0]), int(pe.img_size[1])


def make_batch(model: nn.Module, batch: int, device: torch.device, seed: int = 1) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, *input_size(model), generator=g).to(device)


@contextlib.contextmanager
def frozen(model: nn.Module):
    """Parameters frozen (activation gradients only) for the duration; restored afterwards."""
    flags = {p: p.requires_grad for p in model.parameters()}
    try:
        for p in flags:
            p.requires_grad_(False)
        yield
    finally:
        for p, f in flags.items():
            p.requires_grad_(f)


def run_forward(model: nn.Module, x: Tensor) -> dict:
    """Row (a): a plain forward without autograd."""
    with torch.no_grad():
        model(x)
    return {"forward_passes": 1.0, "backward_passes": 0.0}


def first_block(model: nn.Module) -> nn.Module:
    """The first transformer block: ``model.blocks[0]`` (ViT, EVA, ...), ``model.layers[0].blocks[0]`` (Swin)."""
    if hasattr(model, "blocks"):
        return model.blocks[0]
    return model.layers[0].blocks[0]


def run_floor(model: nn.Module, x: Tensor) -> dict:
    """Row (b): forward + activation-only backward from the predicted logit to the first block's input."""
    box: dict[str, Tensor] = {}

    def leaf(module: nn.Module, args: tuple):
        u = args[0].detach().requires_grad_(True)
        # Differentiate with respect to a view of the leaf: the same computation, but FlopCounterMode's module
        # tracker (multi-grad hooks) refuses torch.autograd.grad with respect to a leaf tensor.
        box["u"] = u.view_as(u)
        return (box["u"], *args[1:])

    handle = first_block(model).register_forward_pre_hook(leaf)
    try:
        with frozen(model):
            logits = model(x)
            y = logits.gather(1, logits.argmax(dim=1, keepdim=True)).sum()
            (grad,) = torch.autograd.grad(y, box["u"])
    finally:
        handle.remove()
    assert grad.shape == box["u"].shape
    return {"forward_passes": 1.0, "backward_passes": 1.0}


def run_gradskip(model: nn.Module, x: Tensor) -> dict:
    """Row (c): one GradSkip map per image."""
    import vitlens

    exp = vitlens.explain(model, x, method="gradskip")
    assert exp.maps.shape[0] == x.shape[0]
    return {"forward_passes": exp.cost.forward_passes, "backward_passes": exp.cost.backward_passes}


def run_gradskip_reference(model: nn.Module, x: Tensor) -> dict:
    """Row (d): the pre-#15 GradSkip (``tests/gradskip_reference.py``): one forward, one backward per image."""
    tests = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    from gradskip_reference import reference_gradskip

    out = reference_gradskip(model, x)
    assert out["token_maps"].shape[0] == x.shape[0]
    return {"forward_passes": 1.0, "backward_passes": 1.0}


def _on_path(run: Callable[[nn.Module, Tensor], dict], fused: bool | None) -> Callable[[nn.Module, Tensor], dict]:
    def runner(model: nn.Module, x: Tensor) -> dict:
        with attention_path(model, fused):
            return run(model, x)

    return runner


_RUN = {"forward": run_forward, "forward+backward": run_floor, "gradskip": run_gradskip}
RUNNERS: dict[str, Callable[[nn.Module, Tensor], dict]] = {
    **{row: _on_path(fn, False) for row, fn in _RUN.items()},
    **{row + DEFAULT: _on_path(fn, None) for row, fn in _RUN.items()},
    **{row + FUSED: _on_path(fn, True) for row, fn in _RUN.items()},
    REFERENCE_ROW: _on_path(run_gradskip_reference, False),
}


def _suffix(row: str) -> str:
    """The attention path of ``row``: ``DEFAULT``, ``FUSED`` or ``""`` (explicit)."""
    return next(s for s in PATHS if row.endswith(s))  # "" ends every row: explicit


def _floor_of(row: str) -> str:
    """The floor row on the same attention path as ``row``."""
    return "forward+backward" + _suffix(row)


def _forward_of(row: str) -> str:
    return "forward" + _suffix(row)


# ---------------------------------------------------------------------------------------------------------------------
# measurements
# ---------------------------------------------------------------------------------------------------------------------
def count_flops(model: nn.Module, x: Tensor, row: str) -> tuple[float, dict[str, float]]:
    """FLOPs of one call of ``row`` on ``x`` per image, and their split by ATen operator."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False, custom_mapping=custom_flops())
    with counter:
        RUNNERS[row](model, x)
    n = x.shape[0]
    by_op = {str(op): v / n for op, v in counter.get_flop_counts().get("Global", {}).items()}
    return counter.get_total_flops() / n, by_op


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def _minor_faults() -> int:
    """This process's minor page faults so far (0 where ``resource`` is missing)."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not on Linux/macOS
        return 0
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)


def time_rows(model: nn.Module, x: Tensor, repeats: int, warmup: int = 1, rows: tuple[str, ...] = ROWS,
              clock: str = "wall", faults: dict[str, list[int]] | None = None
              ) -> tuple[dict[str, list[float]], dict[str, dict]]:
    """Seconds per call for each row, measured interleaved: every repeat runs a, b, c one after another.

    Also returns what each row's last call reported (forward/backward passes per image). ``clock="cpu"`` measures
    this process's CPU time instead of wall time (with one thread: the compute itself, not the time spent waiting
    for a core on a loaded machine). ``faults``: filled with each timed call's minor page faults per row (memory the
    call touched for the first time since the allocator last returned it; on a virtual machine each can cost
    microseconds, so a row whose calls fault is slower by that, not by its arithmetic).
    """
    now = CLOCKS[clock]
    device = x.device
    times: dict[str, list[float]] = {r: [] for r in rows}
    info: dict[str, dict] = {}
    for i in range(warmup + repeats):
        for row in rows:
            _sync(device)
            f0, t0 = _minor_faults(), now()
            info[row] = RUNNERS[row](model, x)
            _sync(device)
            if i >= warmup:
                times[row].append(now() - t0)
                if faults is not None:
                    faults.setdefault(row, []).append(_minor_faults() - f0)
    return times, info


def peak_memory_child(spec: str, row: str, batch: int, device_name: str, threads: int | None) -> dict:
    """Peak memory of one call of ``row`` in *this* process, in bytes (see :func:`peak_memory`)."""
    if threads:
        torch.set_num_threads(threads)
    device = torch.device(device_name)
    model = build_model(spec, device)
    x = make_batch(model, batch, device)
    run_forward(model, x[:1])  # warm-up (batch 1): allocator, thread pool, lazy initialisation
    if device.type == "cuda":
        _sync(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        RUNNERS[row](model, x)
        _sync(device)
        return {"peak_bytes": float(torch.cuda.max_memory_allocated(device) - base), "peak_reset": True}
    reset = _reset_peak_rss()  # else ru_maxrss still holds the peak of imports and model creation
    base = _rss_bytes()
    RUNNERS[row](model, x)
    return {"peak_bytes": float(max(_peak_rss_bytes() - base, 0)), "peak_reset": reset}


def peak_memory(spec: str, row: str, batch: int, device: str, threads: int | None) -> tuple[float, bool]:
    """Peak memory of one call of ``row`` at ``batch``, in bytes, measured in a fresh subprocess.

    CPU: after model creation, input creation and a batch-1 warm-up forward, the process's peak RSS is reset to its
    current RSS (Linux ``/proc/self/clear_refs``); reported is the peak RSS after the call (``VmHWM``, see
    :func:`_peak_rss_bytes`; ``ru_maxrss`` where there is no ``/proc``) minus that RSS. CUDA: ``max_memory_allocated`` after a reset minus the memory allocated before the call (weights
    and input excluded). Also returns whether the peak could be reset (if not, imports and model creation may hide
    the call's peak and the number is a lower bound).
    """
    cmd = [sys.executable, os.path.abspath(__file__), "--_memory-child", json.dumps(
        {"spec": spec, "row": row, "batch": batch, "device": device, "threads": threads})]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    rep = json.loads(out.stdout.strip().splitlines()[-1])
    return float(rep["peak_bytes"]), bool(rep["peak_reset"])


# ---------------------------------------------------------------------------------------------------------------------
# the benchmark
# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class Result:
    model: str
    row: str
    gflops: float
    gflops_by_op: dict[str, float]
    ms_per_image: list[float]
    peak_mib: float
    forward_passes: float
    backward_passes: float
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.ms_per_image)


def _paired_ratio(num: list[float], den: list[float]) -> float:
    return statistics.median(a / b for a, b in zip(num, den))


def _paired_spread(num: list[float], den: list[float]) -> tuple[float, float]:
    """Smallest and largest per-repeat ratio (the spread behind :func:`_paired_ratio`'s median)."""
    ratios = [a / b for a, b in zip(num, den)]
    return min(ratios), max(ratios)


def benchmark_model(spec: str, batch: int, repeats: int, device: str, threads: int | None,
                    memory: bool = True, log: Callable[[str], None] = print,
                    rows: tuple[str, ...] = ROWS, clock: str = "wall") -> list[Result]:
    dev = torch.device(device)
    model = build_model(spec, dev)
    x1 = make_batch(model, 1, dev)
    xb = make_batch(model, batch, dev)
    log(f"  {spec}: counting FLOPs ...")
    flops, by_op = {}, {}
    for row in rows:
        flops[row], by_op[row] = count_flops(model, x1, row)
    log(f"  {spec}: timing {repeats} interleaved repeats at batch {batch} ...")
    faults: dict[str, list[int]] = {}
    times, passes = time_rows(model, xb, repeats, rows=rows, clock=clock, faults=faults)
    mem = {}
    for row in rows:
        if memory:
            log(f"  {spec}: peak memory of {row} (subprocess) ...")
            peak, reset = peak_memory(spec, row, batch, device, threads)
            mem[row] = peak / 2**20
            if not reset:
                log(f"  warning: could not reset the peak RSS; {spec} {row} memory is a lower bound")
        else:
            mem[row] = float("nan")
    results = []
    for row in rows:
        r = Result(
            model=spec, row=row, gflops=flops[row] / 1e9,
            gflops_by_op={k: v / 1e9 for k, v in by_op[row].items()},
            ms_per_image=[1e3 * t / batch for t in times[row]], peak_mib=mem[row],
            forward_passes=float(passes[row]["forward_passes"]), backward_passes=float(passes[row]["backward_passes"]),
        )
        fwd, floor = _forward_of(row), _floor_of(row)
        user = next((f for f in USER_FLOORS if f in times), None)
        r.extra["flops_x_forward"] = flops[row] / flops[fwd]
        r.extra["flops_x_floor"] = flops[row] / flops[floor]
        r.extra["time_x_forward"] = _paired_ratio(times[row], times[fwd])
        r.extra["time_x_floor"] = _paired_ratio(times[row], times[floor])
        r.extra["time_x_floor_min"], r.extra["time_x_floor_max"] = _paired_spread(times[row], times[floor])
        r.extra["time_x_user_floor"] = _paired_ratio(times[row], times[user]) if user else float("nan")
        r.extra["mem_x_floor"] = mem[row] / mem[floor] if mem[floor] > 0 else float("nan")
        if faults.get(row):
            r.extra["minor_faults"] = float(statistics.median(faults[row]))
            r.extra["minor_faults_max"] = float(max(faults[row]))
        if REFERENCE_ROW in times:
            r.extra["time_x_reference"] = _paired_ratio(times[row], times[REFERENCE_ROW])
        results.append(r)
    return results


def header(args: argparse.Namespace) -> list[str]:
    import timm

    import vitlens

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        if names:
            cpu = names[0]
    dev = args.device
    if dev == "cuda":
        dev = f"cuda ({torch.cuda.get_device_name(0)})"
    else:
        dev = f"cpu ({cpu}, {os.cpu_count()} logical cores)"
    return [
        f"- date: {_dt.datetime.now().astimezone().strftime('%Y-%m-%d %H:%M %Z')}",
        f"- torch {torch.__version__}, timm {timm.__version__}, vitlens {vitlens.__version__}, "
        f"python {platform.python_version()}",
        f"- device: {dev}; torch threads: {torch.get_num_threads()}",
        f"- batch {args.batch} for time and memory, batch 1 for FLOPs; {args.repeats} timed repeats after 1 warm-up "
        f"round, rows interleaved; clock: {args.clock}" + (" (process CPU time)" if args.clock == "cpu" else ""),
        "- models: " + ", ".join(f"`{m}`" for m in args.models) + " (timm, random weights, `pretrained=False`); "
        + {"explicit": "explicit attention `fused_attn=False` in all rows",
           "default": "every attention module on the path timm built it with (fused `scaled_dot_product_attention` "
                      "for ViT/DeiT/EVA02, explicit for Swin's window attention: the model as a user builds it)",
           "fused": "timm's fused attention forced on (`fused_attn=True`) in every module that has it, Swin's "
                    "experimental path included",
           "both": "rows (a′–c′) with every attention module on the path timm built it with (fused for "
                   "ViT/DeiT/EVA02, explicit for Swin: the model as a user builds it), rows (a–d) with explicit "
                   "attention (`fused_attn=False`), all in the same repeats"}[
            getattr(args, "attention", "explicit")],
    ]


def _fmt(v: float, nd: int = 2) -> str:
    return "n/a" if v != v else f"{v:.{nd}f}"


def markdown_table(results: list[Result], device: str) -> list[str]:
    mem_col = "peak mem (MiB)" + ("¹" if device == "cpu" else "²")
    lines = [
        f"| model | row | GFLOPs / image | FLOPs × fwd | ms / image (median) | time × fwd | time × floor "
        f"| time × user floor | {mem_col} | mem × floor | fwd / bwd passes per image |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| `{r.model}` | {ROW_LABELS[r.row]} | {r.gflops:.3f} | {r.extra['flops_x_forward']:.3f} "
            f"| {r.median_ms:.1f} | {r.extra['time_x_forward']:.3f} | {r.extra['time_x_floor']:.3f} "
            f"| {_fmt(r.extra['time_x_user_floor'], 3)} | {_fmt(r.peak_mib, 1)} | {_fmt(r.extra['mem_x_floor'])} "
            f"| {r.forward_passes:g} / {r.backward_passes:g} |"
        )
    return lines


def _spread(r: Result) -> str:
    return f"{r.extra['time_x_floor_min']:.3f}–{r.extra['time_x_floor_max']:.3f}"


def _faults(floor: Result, r: Result) -> str:
    """``; minor page faults per call …`` of a row and its floor (median, largest), where they were counted."""
    if "minor_faults" not in r.extra or "minor_faults" not in floor.extra:
        return ""
    return (f"; minor page faults per call (median, largest) {r.extra['minor_faults']:.0f}, "
            f"{r.extra['minor_faults_max']:.0f} against the floor's {floor.extra['minor_faults']:.0f}, "
            f"{floor.extra['minor_faults_max']:.0f}")


def summary_lines(results: list[Result]) -> list[str]:
    out = []
    by = {(r.model, r.row): r for r in results}
    for model in dict.fromkeys(r.model for r in results):
        for suffix, what, floor in ((DEFAULT, "default attention (as timm builds the model)", "default-attention"),
                                    (FUSED, "fused attention forced on", "fused-attention")):
            bf, cf = by.get((model, "forward+backward" + suffix)), by.get((model, "gradskip" + suffix))
            if bf is None or cf is None:
                continue
            line = (f"- `{model}`, {what}: GradSkip ÷ {floor} floor "
                    f"**{cf.extra['time_x_floor']:.3f}** in time (per-repeat {_spread(cf)}), "
                    f"{cf.gflops / bf.gflops:.4f} in FLOPs, "
                    f"{_fmt(cf.extra['mem_x_floor'], 3)} in peak memory{_faults(bf, cf)}")
            b = by.get((model, "forward+backward"))
            if b is not None:
                line += (f"; explicit floor ÷ {floor} floor {b.extra['time_x_user_floor']:.3f} in time, "
                         f"{_fmt(b.peak_mib / bf.peak_mib if bf.peak_mib > 0 else float('nan'), 3)} in memory")
            out.append(line + ".")
        if (model, "gradskip") not in by:
            continue
        a, b, c = (by[(model, row)] for row in ROWS)
        d = by.get((model, REFERENCE_ROW))
        if d is not None:
            out.append(
                f"- `{model}` before/after (#15), paired in one run: GradSkip ÷ floor {d.extra['time_x_floor']:.3f} "
                f"→ {c.extra['time_x_floor']:.3f} in time, {_fmt(d.extra['mem_x_floor'], 3)} → "
                f"{_fmt(c.extra['mem_x_floor'], 3)} in peak memory, {d.gflops:.3f} → {c.gflops:.3f} GFLOPs; "
                f"new ÷ old time {c.extra['time_x_reference']:.3f}."
            )
        out.append(
            f"- `{model}`, explicit attention: GradSkip / forward+backward = {c.gflops / b.gflops:.4f} in FLOPs "
            f"({c.gflops - b.gflops:+.3f} GFLOPs), **{c.extra['time_x_floor']:.3f}** in time (per-repeat "
            f"{_spread(c)}); "
            f"GradSkip / forward = {c.gflops / a.gflops:.3f} in FLOPs, {c.extra['time_x_forward']:.2f} in time."
        )
    for model, suffix in ((m, f) for m in dict.fromkeys(r.model for r in results) for f in PATHS):
        if (model, "gradskip" + suffix) not in by:
            continue
        b, c = by[(model, "forward+backward" + suffix)], by[(model, "gradskip" + suffix)]
        ops = sorted(set(b.gflops_by_op) | set(c.gflops_by_op))
        diff = [f"`{op}` {c.gflops_by_op.get(op, 0.0) - b.gflops_by_op.get(op, 0.0):+.4f}" for op in ops
                if abs(c.gflops_by_op.get(op, 0.0) - b.gflops_by_op.get(op, 0.0)) > 5e-5]
        out.append(f"- `{model}`{suffix}: GradSkip − forward+backward by operator (GFLOPs / image): "
                   + (", ".join(diff) if diff else "none"))
    seed = next((by[(SEED_MODEL, "gradskip" + s)] for s in PATHS if (SEED_MODEL, "gradskip" + s) in by), None)
    if seed is not None:
        floor = by[(SEED_MODEL, _floor_of(seed.row))]
        out.append(
            f"- seed reference (ViT-B/16, 224 px, one GradSkip map): {SEED_GFLOPS:.2f} GFLOPs; ours "
            f"{seed.gflops:.2f} GFLOPs (ours / seed = {seed.gflops / SEED_GFLOPS:.4f}); "
            f"our forward+backward floor {floor.gflops:.2f} GFLOPs (floor / seed = {floor.gflops / SEED_GFLOPS:.4f})."
        )
    return out


def op_breakdown_lines(results: list[Result]) -> list[str]:
    lines = ["| model | row | " + " | ".join(("aten op", "GFLOPs / image")) + " |", "|---|---|---|---:|"]
    for r in results:
        for op, v in sorted(r.gflops_by_op.items()):
            lines.append(f"| `{r.model}` | {ROW_LABELS[r.row]} | `{op}` | {v:.4f} |")
    return lines




def render(results: list[Result], args: argparse.Namespace, command: str) -> str:
    lines = ["# GradSkip cost: one map vs a forward and the forward+backward floor", ""]
    lines += [f"Command: `{command}`", ""]
    lines += header(args) + [""]
    lines += markdown_table(results, args.device) + [""]
    lines += summary_lines(results) + [""]
    lines += [FOOTNOTES[0], ""]
    lines += [FOOTNOTES[1] if args.device == "cpu" else FOOTNOTES[2], ""]
    lines += ["FLOPs by operator (per image):", ""] + op_breakdown_lines(results) + [""]
    return "\n".join(lines)


def write_csv(path: str, results: list[Result], args: argparse.Namespace) -> None:
    cols = ["model", "row", "gflops_per_image", "flops_x_forward", "flops_x_floor", "median_ms_per_image",
            "time_x_forward", "time_x_floor", "peak_mem_mib", "forward_passes", "backward_passes", "batch",
            "repeats", "device", "threads", "torch", "ms_per_image_all"]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        for r in results:
            w.writerow([r.model, r.row, f"{r.gflops:.6f}", f"{r.extra['flops_x_forward']:.6f}",
                        f"{r.extra['flops_x_floor']:.6f}", f"{r.median_ms:.3f}", f"{r.extra['time_x_forward']:.4f}",
                        f"{r.extra['time_x_floor']:.4f}", f"{r.peak_mib:.2f}", r.forward_passes, r.backward_passes,
                        args.batch, args.repeats, args.device, torch.get_num_threads(), torch.__version__,
                        " ".join(f"{t:.3f}" for t in r.ms_per_image)])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=None,
                   help="timm model names, each optionally 'name:key=value,...' (default: ViT-Ti/S/B 16 at 224)")
    p.add_argument("--batch", type=int, default=None, help="batch size for time and memory (default 8)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats after one warm-up round (default 5)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's default)")
    p.add_argument("--quick", action="store_true", help="vit_tiny only, 3 repeats (unless overridden)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                   help="wall time (default) or this process's CPU time (one thread, loaded machine; CPU only)")
    p.add_argument("--attention", choices=sorted(ATTENTION_ROWS), default="both",
                   help="floor(s) to measure against: the attention each module was built with (default), fused "
                        "forced on, explicit forced on, or default and explicit in the same repeats ('both', the "
                        "default)")
    p.add_argument("--reference", action="store_true",
                   help="add row (d): the pre-#15 GradSkip (tests/gradskip_reference.py), before/after in one run")
    p.add_argument("--out", default=None, help="write the Markdown report here and a CSV next to it")
    p.add_argument("--_memory-child", dest="memory_child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.models is None:
        args.models = list(QUICK_MODELS if args.quick else DEFAULT_MODELS)
    if args.batch is None:
        args.batch = 8
    if args.repeats is None:
        args.repeats = 3 if args.quick else 5
    if args.batch < 1 or args.repeats < 1:
        p.error("--batch and --repeats must be positive")
    if args.device == "cuda" and args.clock == "cpu":
        p.error("--clock cpu measures CPU time; use the wall clock on CUDA")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print (and optionally write) the report. Returns ``{"results", "markdown"}``."""
    args = parse_args(argv)
    if args.memory_child is not None:
        job = json.loads(args.memory_child)
        rep = peak_memory_child(job["spec"], job["row"], job["batch"], job["device"], job["threads"])
        print(json.dumps(rep))
        return rep
    threads_before = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return _run(args, argv)
    finally:
        torch.set_num_threads(threads_before)  # main() may be called in-process (tests)


def _run(args: argparse.Namespace, argv: list[str] | None) -> dict[str, Any]:
    command = shlex.join(["python", "benchmarks/gradskip_cost.py", *(sys.argv[1:] if argv is None else argv)])
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731 - progress goes to stderr
    results: list[Result] = []
    t0 = time.perf_counter()
    for spec in args.models:
        rows = ATTENTION_ROWS[args.attention] + ((REFERENCE_ROW,) if args.reference else ())
        results += benchmark_model(spec, args.batch, args.repeats, args.device, args.threads,
                                   memory=not args.no_memory, log=log, rows=rows, clock=args.clock)
    log(f"  done in {time.perf_counter() - t0:.0f} s")
    md = render(results, args, command)
    print(md)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(md)
        write_csv(os.path.splitext(args.out)[0] + ".csv", results, args)
    return {"results": results, "markdown": md}


if __name__ == "__main__":
    main()
