"""Settings and result of an AHA training run: :class:`AHATrainConfig`, the named :data:`RECIPES`, the fields a
resumed run may change (:data:`RESUMABLE_CHANGES`) and :class:`TrainResult` (what :func:`vitlens.aha.train.train_aha`
returns)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import InputError
from .network import OUTPUT_POOLS, AHANet
from .soft_metrics import REFERENCES

__all__ = ["AHATrainConfig", "AUTHORS_OPTIONS", "OPTION_VALUES", "RECIPES", "RESUMABLE_CHANGES", "TrainResult"]


@dataclass
class AHATrainConfig:
    """Settings of one training run (all stored in the checkpoint and the metadata).

    Data and schedule: ``steps`` optimiser steps of ``batch_size`` images (global, over all processes);
    ``n_train`` training images (default ``steps·batch_size``: one pass, as the authors' one epoch), ``n_val``
    held-out images for validation.

    Protocols: ``references`` are the deletion references one of which is drawn per step; ``val_references`` the
    references every validation measures (its headline is their mean, so the explainer is chosen on a matrix of
    protocols, not on the one it trains with); ``reference_weights`` (one non-negative number per reference, default
    equal) the odds of each reference's draw; ``select`` ``"best"`` ships the decoder of the best validation,
    ``"last"`` the last one.

    Sorting: ``straight_through`` evaluates the training curves with the hard ranking of the regions and
    back-propagates through the sorter (:func:`~vitlens.aha.soft_metrics.soft_curves`), so the objective's value
    is the hard metric's at the grid's resolution instead of its relaxation's.

    Teacher: ``teacher`` (a method of :data:`~vitlens.aha.teacher.TEACHERS`, default none) adds
    ``w_teacher · (1 − r)`` to the loss, ``r`` the correlation of each map with that method's map of the image on the
    token grid, fading linearly to 0 at ``teacher_frac · steps`` (:mod:`vitlens.aha.teacher`). ``teacher="aha"``:
    the refined maps of the trained explainer ``teacher_explainer`` (a file; default the one bundled for the model);
    ``teacher_images``: only the first that many training images get a teacher map (default all).

    The AHA authors' code, item by item (each alone, or all with ``recipe="authors"``; :data:`AUTHORS_OPTIONS`
    lists the values, docs/methods/aha.md §4 the table): ``sorter_input`` ``"minmax"`` (scores scaled per image
    before the sorter) or ``"raw"``; ``pooling`` ``"partition"`` or ``"adaptive"`` (``F.adaptive_avg_pool2d``,
    overlapping windows; needs ``grid_offset=False``); ``mask_clamp`` ``"after"`` (the blurred masks) or ``"both"``
    (the region memberships before the blur too); ``reference_style`` ``"vitlens"`` or ``"authors"`` (ImageNet mean
    colour, 37-tap σ 37 blur); ``lr_schedule`` ``"warmup_cosine"`` (from ~0 to 0) or ``"authors"`` (from lr/25 up,
    down to lr/25/10⁴); ``peak_penalty_on`` ``"minmax"`` or ``"raw"``; ``classes`` ``"maps"`` (each of the
    ``classes_per_image`` classes its own map) or ``"authors"`` (one map, of the prediction, its curves scored on the
    prediction and the runner-up / label, averaged; needs ``classes_per_image=2``); ``endpoints`` ``"exact"`` (the
    curves' ends from no-grad passes) or ``"model"`` (every curve point through the soft masks, the authors' code).
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
    references: tuple[str, ...] = ("mean", "black", "blur", "meanimage")
    reference_weights: tuple[float, ...] | None = None
    val_references: tuple[str, ...] = ("mean", "black", "blur", "meanimage")
    select: str = "best"
    classes_per_image: int = 1
    w_del: float = 1.0
    w_ins: float = 1.0
    w_peak: float = 0.0025
    peak_kernel: int = 15
    mask_sigma: float = 1.0
    straight_through: bool = False
    teacher: str | None = None
    w_teacher: float = 1.0
    teacher_frac: float = 0.5
    teacher_explainer: str | None = None
    teacher_images: int | None = None
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
    sorter_input: str = "minmax"
    pooling: str = "partition"
    mask_clamp: str = "after"
    reference_style: str = "vitlens"
    lr_schedule: str = "warmup_cosine"
    peak_penalty_on: str = "minmax"
    classes: str = "maps"
    endpoints: str = "exact"

    @classmethod
    def preset(cls, recipe: str = "tracked", **overrides: Any) -> "AHATrainConfig":
        """The config of a named recipe (:data:`RECIPES`), with ``overrides`` on top."""
        if recipe not in RECIPES:
            raise InputError(f"unknown AHA recipe {recipe!r}; choose one of {', '.join(RECIPES)}")
        return cls(**{**RECIPES[recipe], "recipe": recipe, **overrides})

    def check(self) -> None:
        if self.steps < 1 or self.batch_size < 1:
            raise InputError("steps and batch_size must be >= 1")
        if not (self.w_del >= 0 and self.w_ins >= 0):
            raise InputError(f"w_del and w_ins (--w-del, --w-ins) must be >= 0; got {self.w_del}, {self.w_ins}")
        if self.step_sampling not in ("fixed", "random"):
            raise InputError(f"step_sampling must be 'fixed' or 'random', got {self.step_sampling!r}")
        if self.m < 3:  # the endpoints (nothing / everything deleted) are exact and do not depend on the map
            raise InputError(f"m (curve points, --curve-points) must be >= 3, got {self.m}: with only the two "
                             "endpoints no curve point depends on the map, so nothing would be learned")
        if self.classes_per_image not in (1, 2):
            raise InputError("classes_per_image must be 1 or 2")
        for field_name in ("references", "val_references"):
            refs = getattr(self, field_name)
            bad = [r for r in refs if r not in REFERENCES]
            if bad or not refs or len(set(refs)) != len(refs):
                raise InputError(f"{field_name} must be a non-empty list of distinct names from "
                                 f"{', '.join(REFERENCES)}; got {', '.join(map(repr, refs)) or 'none'}")
        w = self.reference_weights
        if w is not None and (len(w) != len(self.references) or any(not math.isfinite(v) or v < 0 for v in w)
                              or not sum(w) > 0):
            raise InputError(f"reference_weights must be one finite number >= 0 per reference "
                             f"({len(self.references)}: {', '.join(self.references)}), not all 0; got {list(w)}")
        if self.teacher is not None:
            from .teacher import TEACHERS

            if self.teacher not in TEACHERS:
                raise InputError(f"unknown AHA teacher {self.teacher!r}; choose one of {', '.join(TEACHERS)}")
            if self.classes_per_image != 1:
                raise InputError("a teacher needs classes_per_image = 1 (its maps are of the predicted class)")
            if not (math.isfinite(self.w_teacher) and self.w_teacher >= 0 and 0 < self.teacher_frac <= 1):
                raise InputError(f"w_teacher must be >= 0 and teacher_frac in (0, 1]; got {self.w_teacher}, "
                                 f"{self.teacher_frac}")
            if self.teacher_images is not None and int(self.teacher_images) < 1:
                raise InputError(f"teacher_images (--teacher-images) must be >= 1, got {self.teacher_images}")
        if self.teacher_explainer is not None and self.teacher != "aha":
            raise InputError("teacher_explainer (--teacher-explainer) is the explainer of the 'aha' teacher; "
                             f"this run's teacher is {self.teacher!r}")
        if self.teacher_images is not None and self.teacher is None:
            raise InputError("teacher_images (--teacher-images) needs a teacher (--teacher)")
        if self.select not in ("best", "last"):
            raise InputError(f"select must be 'best' or 'last', got {self.select!r}")
        if self.pool not in OUTPUT_POOLS:
            raise InputError(f"pool must be one of {', '.join(OUTPUT_POOLS)}, got {self.pool!r}")
        if self.recipe not in RECIPES:
            raise InputError(f"unknown AHA recipe {self.recipe!r}; choose one of {', '.join(RECIPES)}")
        if self.amp not in ("auto", "bf16", "off") or self.grad_checkpointing not in ("auto", "on", "off"):
            raise InputError("amp must be auto|bf16|off and grad_checkpointing auto|on|off")
        for field_name, options in OPTION_VALUES.items():
            if getattr(self, field_name) not in options:
                raise InputError(f"{field_name} must be one of {', '.join(options)}; got {getattr(self, field_name)!r}")
        if self.pooling == "adaptive" and self.grid_offset:
            raise InputError("pooling 'adaptive' (the authors' grid, aligned to the image corner) needs grid_offset "
                             "off (--no-grid-offset)")
        if self.classes == "authors" and self.classes_per_image != 2:
            raise InputError("classes 'authors' scores one map on two classes: it needs classes_per_image = 2")
        if self.classes == "authors" and self.straight_through:
            raise InputError("classes 'authors' is not combined with straight_through")

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
#: images for the same compute), and since the protocol matrix of docs/benchmarks/aha.md: one of four deletion
#: references drawn per step (mean colour, black, blur, per-pixel mean image; trained on the mean colour alone the
#: explainer won only under that reference) with validation, and the choice of the shipped checkpoint, on all four.
#: ``tracked-mean`` is the earlier tracked recipe (mean colour only), kept to measure what the references are worth.
#: ``authors`` is the AHA authors' code's recipe (GitHub dschinagl/AHA), every item of it, kept for comparison.
#: the values each option of the authors' code may take (the first is vitlens's default)
OPTION_VALUES: dict[str, tuple[str, ...]] = {
    "sorter_input": ("minmax", "raw"),
    "pooling": ("partition", "adaptive"),
    "mask_clamp": ("after", "both"),
    "reference_style": ("vitlens", "authors"),
    "lr_schedule": ("warmup_cosine", "authors"),
    "peak_penalty_on": ("minmax", "raw"),
    "classes": ("maps", "authors"),
    "endpoints": ("exact", "model"),
}

#: the options of the AHA authors' code (GitHub dschinagl/AHA: src/aha/config.py, scripts/train.py) where they
#: differ from vitlens's defaults: raw scores into the sorter, adaptive average pooling on a grid aligned to the
#: corner (their grid shift is off by default), the cell masks clamped before and after the blur, their references
#: (ImageNet mean colour, 37-tap σ 37 blur), their learning-rate schedule, the peak penalty on the raw map, one map
#: per image scored on two classes, and every curve point through the soft masks.
AUTHORS_OPTIONS: dict[str, Any] = {
    "sorter_input": "raw", "pooling": "adaptive", "grid_offset": False, "mask_clamp": "both",
    "reference_style": "authors", "lr_schedule": "authors", "peak_penalty_on": "raw", "classes": "authors",
    "endpoints": "model",
}

RECIPES: dict[str, dict[str, Any]] = {
    "tracked": {},
    "tracked-mean": {"references": ("mean",), "val_references": ("mean",), "select": "last"},
    "authors": {"lr": 3e-4, "tau_start": 1.0, "tau_end": 0.3, "noise_scale": 1.0, "m": 16, "step_sampling": "fixed",
                "references": ("black", "mean", "blur"), "val_references": ("mean",), "select": "last",
                "classes_per_image": 2, **AUTHORS_OPTIONS},
}


#: fields that may differ between a checkpoint and the run that resumes it
RESUMABLE_CHANGES = {"val_every", "ckpt_every", "chunk", "n_val"}


@dataclass
class TrainResult:
    """What :func:`vitlens.aha.train.train_aha` returns: the trained network, the per-step loss history, the last validation, files."""

    net: AHANet
    history: list[dict[str, Any]]
    validation: dict[str, Any] | None
    weights: Path | None
    step: int
    seconds: float
    finished: bool
