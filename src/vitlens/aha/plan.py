"""The random and scheduled choices of each AHA training step, as pure functions of the config and the step.

Every random draw comes from a generator keyed by a hash of ``(seed, "step", step)`` or ``(seed, "noise", step,
image index)``, never from a global RNG, so a run is reproducible, resumable and equal under any number of
processes: :func:`plan_step` (grid size, grid offset, reference, curve fractions), :func:`image_noise` (Gumbel noise
per image). Deterministic: :func:`choose_classes` (the classes each image is explained for), :func:`lr_factor`
(linear warm-up, then cosine decay; :func:`authors_lr_factor` the AHA authors' variant, :func:`schedule_factor`
the one a config names) and :func:`temperature` (the sorter's linear annealing).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .config import AHATrainConfig
from .soft_metrics import curve_fractions, default_grid_range
from .sorter import gumbel_noise

__all__ = ["StepPlan", "authors_lr_factor", "choose_classes", "image_noise", "lr_factor", "plan_step",
           "schedule_factor", "temperature"]



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
    if cfg.reference_weights is None:  # equal odds (the draw every earlier run made)
        ref = cfg.references[int(torch.randint(0, len(cfg.references), (1,), generator=g))]
    else:
        odds = torch.tensor(cfg.reference_weights, dtype=torch.float64)
        ref = cfg.references[int(torch.multinomial(odds, 1, generator=g))]
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


def lr_factor(step: int, steps: int, warmup_frac: float) -> float:
    """Linear warm-up over ``⌈warmup_frac·steps⌉`` steps, then cosine decay to 0 at ``steps``.

    Kept beside :func:`vitlens.runtime.warmup_cosine_steps` because the two differ past the end of a run whose
    warm-up covers it (``steps ≤ warm``: this holds 1.0, that one decays), and checkpoints store this schedule."""
    warm = max(1, math.ceil(warmup_frac * steps))
    if step < warm:
        return (step + 1) / warm
    if steps <= warm:
        return 1.0
    t = (step - warm) / (steps - warm)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, t)))


#: the AHA authors' schedule (their SchedulerConfig): it starts at ``lr / AUTHORS_DIV`` and ends at
#: ``lr / AUTHORS_DIV / AUTHORS_FINAL_DIV``
AUTHORS_DIV, AUTHORS_FINAL_DIV = 25.0, 1e4


def authors_lr_factor(step: int, steps: int, warmup_frac: float) -> float:
    """The AHA authors' learning-rate schedule as a factor of the peak ``lr``: with ``p = step / (steps − 1)``
    (capped at 1), linear from ``1/25`` to 1 while ``p ≤ warmup_frac``, then a half cosine from 1 down to
    ``1/25/10⁴`` at ``p = 1`` (the last step)."""
    start = 1.0 / AUTHORS_DIV
    end = start / AUTHORS_FINAL_DIV
    p = min(step / max(steps - 1, 1), 1.0)
    if warmup_frac > 0 and p <= warmup_frac:
        return start + (1.0 - start) * p / warmup_frac
    t = (p - warmup_frac) / (1.0 - warmup_frac) if warmup_frac < 1 else 1.0
    return end + (1.0 - end) * 0.5 * (math.cos(math.pi * t) + 1.0)


def schedule_factor(step: int, cfg: AHATrainConfig) -> float:
    """The learning-rate factor of ``step`` under ``cfg.lr_schedule`` (:func:`lr_factor` or
    :func:`authors_lr_factor`)."""
    if cfg.lr_schedule == "authors":
        return authors_lr_factor(step, cfg.steps, cfg.warmup_frac)
    return lr_factor(step, cfg.steps, cfg.warmup_frac)


def temperature(step: int, cfg: AHATrainConfig) -> float:
    """Linear annealing from ``tau_start`` (step 0) to ``tau_end`` (last step)."""
    t = step / max(1, cfg.steps - 1)
    return cfg.tau_start + (cfg.tau_end - cfg.tau_start) * t

