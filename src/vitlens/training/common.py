"""Pieces shared by the training commands of the bundled models (shapes, digits, segformer).

The utilities every long-running command shares (schedule, atomic writes, model cards, Gini, ``torch.distributed``)
live in :mod:`vitlens.runtime`; ``gini`` and ``lr_factor`` are re-exported here.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import importlib
import json
import math
import os
import platform
import shlex
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..models import get_adapter
from ..models.base import recorded
from ..runtime import atomic_write, gini, warmup_cosine

__all__ = [
    "BatchSampler",
    "ThreadChooser",
    "add_common_options",
    "export_weights",
    "log_classifier_result",
    "meta_head",
    "training_parser",
    "meta_schedule",
    "meta_timing",
    "meta_weights_and_software",
    "parse_with_common_options",
    "write_meta",
    "attention_gini",
    "cpu_has_bf16",
    "cpu_name",
    "describe_load",
    "card_class_table",
    "card_gini_table",
    "card_software_lines",
    "gini_record",
    "set_lr",
    "dihedral",
    "fmt_time",
    "gini",
    "load_average",
    "lr_factor",
    "make_scenes_parallel",
    "mimetic_init",
    "sincos_pos_init",
    "save_fp16_weights",
    "load_stored",
    "remeasure",
    "normalise",
    "param_groups",
]


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: weight decay on matrices only (not on biases, norms, the position embeddings or the CLS token)."""
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        if p.ndim <= 1 or n.endswith(".bias") or n in {"pos_embed", "cls_token"}:
            no_decay.append(p)
        else:
            decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


@torch.no_grad()
def attention_gini(model: torch.nn.Module, images: torch.Tensor, normalise: Callable[[torch.Tensor], torch.Tensor],
                   batch: int = 250) -> np.ndarray:
    """Per-layer, per-head Gini sparsity of the attention rows, averaged over rows and images.

    The attention probabilities are captured through the model's vitlens adapter, which restores the model when done.

    Args:
        model: a model whose adapter captures attention (the bundled ViTs).
        images: raw ``(N, 3, H, W)`` images in [0, 1]; ``normalise`` maps a batch of them to the model's input.

    Returns:
        ``(depth, heads)`` float64 array.
    """
    adapter = get_adapter(model, require="attention")
    total: torch.Tensor | None = None
    for i in range(0, len(images), batch):
        with adapter.session() as rec:
            adapter.forward(normalise(images[i : i + batch]))
            attns = [recorded(b.attn, "attention").detach().float() for b in rec.blocks]
            g = torch.stack([gini(a).mean(-1).sum(0) for a in attns])  # (depth, heads)
        total = g if total is None else total + g
    assert total is not None
    return (total / len(images)).double().numpy()


def cpu_has_bf16() -> bool:
    """Whether the CPU has native bf16 matrix instructions (AMX-BF16 or AVX512-BF16)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what :mod:`platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def fmt_time(s: float) -> str:
    return f"{int(s // 60)} min {s % 60:04.1f} s"


def _make(kind: str, n: int, seed: int, start: int = 0):  # -> vitlens.data.scenes.Scenes
    """``n`` scenes of data set ``kind`` (``shapes``, ``planted``, ``cues``) from ``(seed, start)``."""
    from vitlens.data.evidence import make_cue_scenes, make_planted_scenes
    from vitlens.data.scenes import make_scenes

    maker = {"shapes": make_scenes, "planted": make_planted_scenes, "cues": make_cue_scenes}[kind]
    return maker(n, seed=seed, start=start)


def _scenes_chunk(n: int, seed: int, start: int, kind: str = "shapes"
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    s = _make(kind, n, seed, start)
    return s.images.numpy(), s.labels.numpy(), s.masks.numpy(), s.boxes.numpy()


def make_scenes_parallel(n: int, seed: int, workers: int = 2, min_n: int = 2000, kind: str = "shapes"):  # -> Scenes
    """``make_scenes(n, seed=seed)`` (or, with ``kind``, the planted-cue / cue scenes of :mod:`vitlens.data.evidence`)
    generated in ``workers`` processes; the result is identical to the serial call.

    Every scene depends only on ``(seed, index)``, so the index range is split into contiguous chunks, each generated
    by its own process (``spawn``: the children never inherit the parent's OpenMP state) and concatenated in order.
    ``workers <= 1`` or ``n < min_n`` (where starting processes costs more than it saves) generate in this process.
    The result is a plain :class:`vitlens.data.scenes.Scenes` whose masks are the deciding evidence.
    """
    import concurrent.futures as cf
    import multiprocessing as mp

    from vitlens.data.scenes import Scenes

    if workers <= 1 or n < min_n:
        s = _make(kind, n, seed)
        return Scenes(images=s.images, labels=s.labels, masks=s.masks, boxes=s.boxes, class_names=s.class_names,
                      indices=s.indices, seed=seed)
    bounds = np.linspace(0, n, workers + 1).round().astype(int)
    with cf.ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as pool:
        futures = [pool.submit(_scenes_chunk, int(b - a), seed, int(a), kind) for a, b in zip(bounds[:-1], bounds[1:])]
        parts = [f.result() for f in futures]
    images, labels, masks, boxes = (torch.from_numpy(np.concatenate(p)) for p in zip(*parts))
    names = _make(kind, 1, seed).class_names
    return Scenes(images=images, labels=labels, masks=masks, boxes=boxes, class_names=names,
                  indices=torch.arange(n, dtype=torch.int64), seed=seed)


def dihedral(x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """Apply per-sample flips/transposition (an element of the dihedral group D4) to ``(B, ..., H, W)``.

    ``f`` is a ``(B, 3)`` bool tensor: horizontal flip, vertical flip, transpose (in that order).
    """
    shape = (-1,) + (1,) * (x.ndim - 1)
    x = torch.where(f[:, 0].view(shape), x.flip(-1), x)
    x = torch.where(f[:, 1].view(shape), x.flip(-2), x)
    return torch.where(f[:, 2].view(shape), x.transpose(-1, -2), x)


#: the warm-up + cosine schedule by fraction of training (:func:`vitlens.runtime.warmup_cosine`; name kept).
lr_factor = warmup_cosine


def load_average() -> float | None:
    """The 1-minute load average, or ``None`` where the OS does not report one."""
    try:
        return float(os.getloadavg()[0])
    except (AttributeError, OSError):
        return None


def describe_load(loads: list[float | None], threads: int, training_time: float, cpu_time: float) -> tuple[dict, str]:
    """Summarise the load averages sampled during training: ``(record for the JSON, sentence for the model card)``.

    A training time is only comparable with the budget when nothing else ran; the sentence says whether that held.
    """
    vals = [v for v in loads if v is not None]
    load: dict[str, Any] = {"min": min(vals) if vals else None, "max": max(vals) if vals else None, "samples": vals}
    cores = os.cpu_count() or 1
    share = cpu_time / max(training_time, 1e-9)
    if load["max"] is not None and load["max"] > cores + 0.5:
        text = (f"The machine was **shared with other jobs** during training (1-minute load average "
                f"{load['min']:.1f}–{load['max']:.1f} on {cores} cores; the process got {share:.2f} CPU-seconds per "
                f"second on {threads} thread(s)), so the time above is longer than on an idle machine.")
    elif load["max"] is not None and load["max"] > threads + 0.5:
        text = (f"Other jobs ran at the same time (1-minute load average {load['min']:.1f}–{load['max']:.1f} on "
                f"{cores} cores, not oversubscribed; the process got {share:.2f} CPU-seconds per second).")
    else:
        text = "The machine was otherwise idle during training."
    return load, text


def normalise(x: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """``(B, C, H, W)`` images in [0, 1] → ``(x - mean) / std`` per channel."""
    m = torch.tensor(mean, dtype=x.dtype).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=x.dtype).view(1, -1, 1, 1)
    return (x - m) / s


def add_common_options(p: argparse.ArgumentParser, *, out: Path, batch_size: int, lr: float,
                       weight_decay: float) -> None:
    """The options every training command shares (output folder, AdamW + warm-up/cosine schedule, precision,
    progress bar), with the command's own defaults."""
    p.add_argument("--out", type=Path, default=out, help="output folder (default: the package weights dir)")
    p.add_argument("--batch-size", type=int, default=batch_size)
    p.add_argument("--lr", type=float, default=lr, help="peak learning rate")
    p.add_argument("--min-lr-frac", type=float, default=0.01, help="final learning rate as a fraction of the peak")
    p.add_argument("--weight-decay", type=float, default=weight_decay)
    p.add_argument("--warmup-frac", type=float, default=0.05, help="warm-up length as a fraction of training")
    p.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto",
                   help="training compute precision: bf16 autocast (fp32 master weights) where the CPU has native "
                        "bf16 (AMX/AVX512-BF16), else fp32 (default: auto). Evaluation is always fp32.")
    p.add_argument("--no-progress", action="store_true", help="disable the tqdm progress bar")


def training_parser(module: str, description: str) -> argparse.ArgumentParser:
    """The argument parser of ``python -m vitlens.training.<module>``."""
    return argparse.ArgumentParser(prog=f"python -m vitlens.training.{module}", description=description)


def parse_with_common_options(p: argparse.ArgumentParser, argv: Sequence[str] | None, *, out: Path, batch_size: int,
                              lr: float, weight_decay: float, eval_every: str) -> argparse.Namespace:
    """Add ``--eval-every`` (help: "``eval_every`` every N steps (0: never)") and the options of
    :func:`add_common_options` to ``p``, then parse ``argv``."""
    p.add_argument("--eval-every", type=int, default=0, help=f"{eval_every} every N steps (0: never)")
    add_common_options(p, out=out, batch_size=batch_size, lr=lr, weight_decay=weight_decay)
    return p.parse_args(argv)


def gini_record(gini_lh: np.ndarray, definition: str, spread: bool = False) -> dict[str, Any]:
    """The JSON record of the heads' attention Gini ``(layers, heads)``: per layer min / mean / max (and the spread
    max − min with ``spread``), and the per-head values rounded to 5 digits."""
    per_layer = []
    for li, r in enumerate(gini_lh):
        row = {"layer": li, "min": float(r.min()), "mean": float(r.mean()), "max": float(r.max())}
        if spread:
            row["spread"] = float(r.max() - r.min())
        per_layer.append(row)
    return {"definition": definition, "per_layer": per_layer, "per_head": [[round(float(v), 5) for v in r]
                                                                             for r in gini_lh]}


# -- model-card sections the training commands share (written with vitlens.runtime.write_model_card) -------------
def card_class_table(per_class: dict[str, dict[str, Any]], names: Sequence[str], label: str = "class") -> list[str]:
    """Markdown table of per-class test accuracy: ``| <label> | accuracy | n |``, one row per class name."""
    return [f"| {label} | accuracy | n |", "|---|---|---|",
            *(f"| {c} | {per_class[c]['accuracy']:.2%} | {per_class[c]['n']} |" for c in names)]


def card_gini_table(gini_lh: np.ndarray) -> list[str]:
    """Markdown table of the per-layer min / mean / max / spread of the heads' attention Gini ``(layers, heads)``,
    then the per-head values as a code block."""
    return ["| layer | min | mean | max | spread (max − min) |", "|---|---|---|---|---|",
            *(f"| {li} | {row.min():.3f} | {row.mean():.3f} | {row.max():.3f} | {row.max() - row.min():.3f} |"
              for li, row in enumerate(gini_lh)),
            "", "Per-head values (layer × head):", "", "```", *(" ".join(f"{v:.3f}" for v in row) for row in gini_lh),
            "```", ""]


def card_software_lines(meta: dict[str, Any]) -> list[str]:
    """The two card bullets naming the software versions (torch, timm, numpy), the date and the stored weights."""
    return [f"- torch {meta['torch_version']}, timm {meta['timm_version']}, numpy {meta['numpy_version']}; "
            f"date {meta['date']}",
            f"- weights stored as {meta['weights_dtype']} safetensors ({meta['weights_bytes'] / 1e6:.1f} MB, "
            f"sha256 `{meta['weights_sha256'][:16]}…`)"]


# -- initialisers of the shapes ViTs (used by vitlens.training.shapes) ------------------------------------------
@torch.no_grad()
def mimetic_init(model: Any, g: torch.Generator, a1: float = 0.7, b1: float = 0.7,
                  a2: float = 0.4, b2: float = 0.4) -> None:
    """Mimetic initialisation of self-attention (Trockman & Kolter, 2023): per head, ``W_q W_k^T ≈ a1 Z + b1 I``
    and ``W_v W_o ≈ a2 Z - b2 I`` with ``Z ~ N(0, 1/d)``; factors from a truncated SVD. Changes only initial values."""
    for blk in model.blocks:
        attn = blk.attn
        d = attn.qkv.in_features
        h = attn.num_heads
        k = d // h
        wq, wk, wv = attn.qkv.weight.view(3, h, k, d).unbind(0)  # (h, k, d) each (out, in)
        wo = attn.proj.weight.view(d, h, k)  # (out d, h, k)
        for i in range(h):
            z = torch.randn(d, d, generator=g) / math.sqrt(d)
            u, s, vt = torch.linalg.svd(a1 * z + b1 * torch.eye(d))
            # q.k = x^T Wq^T Wk x ; want Wq^T Wk = M -> Wq^T = U_k sqrt(S_k), Wk = sqrt(S_k) Vt_k
            wq[i].copy_((u[:, :k] * s[:k].sqrt()).T)
            wk[i].copy_(s[:k].sqrt()[:, None] * vt[:k])
            z = torch.randn(d, d, generator=g) / math.sqrt(d)
            u, s, vt = torch.linalg.svd(a2 * z - b2 * torch.eye(d))
            # out = Wo Wv x ; want Wo Wv = M -> Wo = U_k sqrt(S_k), Wv = sqrt(S_k) Vt_k
            wo[:, i].copy_(u[:, :k] * s[:k].sqrt())
            wv[i].copy_(s[:k].sqrt()[:, None] * vt[:k])


@torch.no_grad()
def sincos_pos_init(model: Any, amplitude: float = 1.0) -> None:
    """Initialise the learned patch position embeddings with a 2-D sine/cosine code (CLS position left as is).

    Frequencies are spread geometrically between 2π/16 and 2π/2.5 radians per token, suited to a small grid, so the
    Gram matrix of the codes decays with token distance (attention starts out local)."""
    pe = model.pos_embed  # (1, prefix + gh * gw, D)
    d = pe.shape[-1]
    gh, gw = model.patch_embed.grid_size
    nf = d // 4
    omega = 2 * math.pi / torch.logspace(math.log10(16.0), math.log10(2.5), nf)
    yy, xx = torch.meshgrid(torch.arange(gh, dtype=torch.float32), torch.arange(gw, dtype=torch.float32),
                            indexing="ij")
    ay = yy.reshape(-1, 1) * omega
    ax = xx.reshape(-1, 1) * omega
    code = torch.cat([ay.sin(), ay.cos(), ax.sin(), ax.cos()], dim=1)  # (gh * gw, D)
    prefix = pe.shape[1] - gh * gw
    pe[0, prefix:] = amplitude * code


class ThreadChooser:
    """Pick the faster of ``threads`` and 1 intra-op threads, re-probing periodically.

    On a dedicated machine ``threads`` (2) is fastest; when other processes compete for the cores, a 2-thread
    OpenMP region can stall on a descheduled thread and one thread is often several times faster. Every
    ``every`` steps the other setting is timed for ``probe`` steps and the one with the lower median step time is kept.
    """

    def __init__(self, threads: int, adaptive: bool = True, every: int = 100, probe: int = 4) -> None:
        self.options = [threads, 1] if adaptive and threads > 1 else [threads]
        self.current = threads
        self.every, self.probe = every, probe
        self.times: dict[int, list[float]] = {o: [] for o in self.options}
        self._probing_until = -1
        self._base = threads
        torch.set_num_threads(threads)

    def start(self, step: int) -> float:
        if len(self.options) > 1:
            if step > 0 and step % self.every == 10 % self.every and self._probing_until < step:
                self._base = self.current
                other = self.options[1] if self.current == self.options[0] else self.options[0]
                self._set(other)
                self._probing_until = step + self.probe
                self.times[other] = []
            elif step == self._probing_until:
                probe_t = self.times[self.current]
                base_t = self.times[self._base][-8:]
                if not (probe_t and base_t and _median(probe_t[1:] or probe_t) < 0.9 * _median(base_t)):
                    self._set(self._base)
        return time.perf_counter()

    def stop(self, t_start: float) -> None:
        self.times[self.current].append(time.perf_counter() - t_start)
        self.times[self.current] = self.times[self.current][-16:]

    def _set(self, n: int) -> None:
        self.current = n
        torch.set_num_threads(n)


def _median(xs: list[float]) -> float:
    return float(np.median(xs))


# -- export of the trained weights ---------------------------------------------------------------------------------
def save_fp16_weights(model: torch.nn.Module, path: Path, name: str, seed: int, mode: int | None = None) -> None:
    """Store ``model``'s floating-point tensors as float16 safetensors (other tensors as they are) at ``path``,
    atomically, with ``name``/``format``/``seed`` metadata; ``mode`` sets the file's permissions (safetensors creates
    owner-only files; shipped package data must be world-readable: 0o644)."""
    from safetensors.torch import save_file

    state = {k: (v.detach().to(torch.float16) if v.is_floating_point() else v.detach()).contiguous()
             for k, v in model.state_dict().items()}
    atomic_write(path, lambda tmp: save_file(state, str(tmp), metadata={"name": name, "format": "pt",
                                                                      "seed": str(seed)}), mode=mode)


def export_weights(model: torch.nn.Module, out: Path, name: str, seed: int, mode: int | None = None) -> Path:
    """Create ``out`` and store ``model`` there as ``{name}.safetensors`` (:func:`save_fp16_weights`); returns the
    path."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.safetensors"
    save_fp16_weights(model, path, name, seed, mode=mode)
    return path


def write_meta(out: Path, name: str, meta: dict[str, Any]) -> None:
    """Write the training record ``{name}.json`` (indented JSON) into ``out``."""
    (out / f"{name}.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")


def meta_head(name: str, module: str, argv: Sequence[str], seed: int) -> dict[str, Any]:
    """The first entries of a training record: the model's name, the command that trained it and its seed."""
    return {"name": name, "command": f"python -m vitlens.training.{module} " + shlex.join(argv), "seed": seed}


def log_classifier_result(log: Callable[[str], None], test_acc: float, acc_fp32: float,
                          per_class: dict[str, dict[str, Any]], gini_lh: np.ndarray, digits: int) -> None:
    """Log a trained classifier's test accuracy (shipped weights, and fp32 before export), per class with ``digits``
    decimals, and each layer's head-Gini range."""
    log(f"test accuracy {test_acc:.4f} (fp32 before export {acc_fp32:.4f}); per class: "
        + ", ".join(f"{k} {v['accuracy']:.{digits}f}" for k, v in per_class.items()))
    for li, r in enumerate(gini_lh):
        log(f"layer {li}: head Gini min {r.min():.3f} mean {r.mean():.3f} max {r.max():.3f}")


def meta_schedule(args: argparse.Namespace) -> dict[str, Any]:
    """The optimiser/schedule entries of a training record, from the options of :func:`add_common_options`."""
    return {"batch_size": args.batch_size, "lr": args.lr, "min_lr_frac": args.min_lr_frac,
            "weight_decay": args.weight_decay, "warmup_frac": args.warmup_frac}


def meta_timing(training_time: float, total_time: float, cpu_time: float, load: dict, load_note: str
                ) -> dict[str, Any]:
    """The timing entries of a training record (seconds, rounded to 0.1 s) and the machine load it ran under."""
    return {"training_time_s": round(training_time, 1), "total_time_s": round(total_time, 1),
            "cpu_time_s": round(cpu_time, 1), "load_average": load, "load_note": load_note}


def meta_weights_and_software(weights: Path, n_params: int, threads: int, library: str) -> dict[str, Any]:
    """The entries of a training record that describe the stored weights file and the software and machine that
    made it; ``library`` is the model library (``"timm"`` or ``"transformers"``), whose version is recorded."""
    data = weights.read_bytes()
    return {
        "n_params": n_params,
        "weights_file": weights.name,
        "weights_dtype": "float16",
        "weights_bytes": len(data),
        "weights_sha256": hashlib.sha256(data).hexdigest(),
        "threads": threads,
        "cpu": cpu_name(),
        "torch_version": torch.__version__,
        f"{library}_version": importlib.import_module(library).__version__,
        "numpy_version": np.__version__,
        "python_version": platform.python_version(),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def load_stored(build: Callable[[], torch.nn.Module], path: Path) -> torch.nn.Module:
    """A freshly built model with the stored (float16) weights at ``path`` cast to its dtypes, in eval mode."""
    from safetensors.torch import load_file

    model = build()
    ref = model.state_dict()
    model.load_state_dict({k: v.to(ref[k].dtype) for k, v in load_file(str(path)).items()}, strict=True)
    return model.eval()


def remeasure(build: Callable[[], torch.nn.Module], path: Path, x_test: torch.Tensor, y_test: torch.Tensor,
              class_names: Sequence[str], predict: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]
              ) -> tuple[torch.nn.Module, float, dict[str, dict[str, Any]]]:
    """Load the stored weights into a freshly built model and measure it on the test set: ``(model in eval mode,
    test accuracy, per class {"accuracy", "n"})`` (a class absent from the test set gets accuracy NaN)."""
    shipped = load_stored(build, path)
    correct = predict(shipped, x_test) == y_test
    per_class = {
        name: {
            "accuracy": float(correct[y_test == c].float().mean().item()) if (y_test == c).any() else float("nan"),
            "n": int((y_test == c).sum().item()),
        }
        for c, name in enumerate(class_names)
    }
    return shipped, correct.float().mean().item(), per_class


# -- the training loop's bookkeeping ----------------------------------------------------------------------------------
class BatchSampler:
    """Batches of indices into ``n`` training images from seeded permutations: the first permutation is drawn when the
    sampler is made; a new one whenever the rest of the current one cannot fill a batch (so every epoch is a fresh
    order and a batch never straddles two permutations)."""

    def __init__(self, n: int, generator: torch.Generator) -> None:
        self.n = n
        self.generator = generator
        self.perm = torch.randperm(n, generator=generator)
        self.pos = 0

    def take(self, batch_size: int) -> torch.Tensor:
        """The next ``batch_size`` indices ``(batch_size,)`` long."""
        if self.pos + batch_size > self.n:
            self.perm = torch.randperm(self.n, generator=self.generator)
            self.pos = 0
        idx = self.perm[self.pos : self.pos + batch_size]
        self.pos += batch_size
        return idx


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    """Set the learning rate of every parameter group of ``opt``."""
    for grp in opt.param_groups:
        grp["lr"] = lr
