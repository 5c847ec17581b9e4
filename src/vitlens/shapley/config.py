"""Settings and result of a ViT-Shapley training run: :class:`ShapleyTrainConfig`, the fields a resumed run may change
(:data:`RESUMABLE_CHANGES`) and :class:`ShapleyTrainResult`."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import InputError

__all__ = ["EXPLAINER_FIELDS", "RESUMABLE_CHANGES", "SURROGATE_FIELDS", "ShapleyTrainConfig", "ShapleyTrainResult"]


@dataclass
class ShapleyTrainConfig:
    """Settings of one run (stored in the checkpoint and the metadata).

    Two phases of one step counter: ``surrogate_steps`` steps fine-tune the surrogate (one uniform-size random subset
    per image, KL to the original model's probabilities on the whole image), then ``steps`` steps train the explainer
    (``masks`` Shapley-kernel subsets per image, ``paired`` with their complements; loss ``n · mean((v(∅) + Σ_{i∈S} φ_i
    − v(S))²)`` over images, subsets and classes, the paper's eq. 5 with the additive efficient normalisation).
    ``batch_size`` images per step in both phases (global: all processes). AdamW with linear warm-up over
    ``warmup_frac`` of each phase, then cosine decay to 0; gradients clipped at ``clip``. ``tune_blocks``: how many of
    the surrogate's last blocks the explainer fine-tunes (the rest are shared; all of them: the paper's explainer).
    ``n_val`` held-out images measure both phases at their end.
    """

    steps: int = 600
    surrogate_steps: int = 400
    batch_size: int = 16
    lr: float = 2e-4
    surrogate_lr: float = 1e-4
    weight_decay: float = 1e-5
    warmup_frac: float = 0.05
    clip: float = 1.0
    masks: int = 8
    paired: bool = True
    tune_blocks: int = 2
    n_train: int | None = None
    n_val: int = 64
    ckpt_every: int = 25
    seed: int = 0

    def check(self) -> None:
        if self.steps < 1 or self.surrogate_steps < 0 or self.batch_size < 1:
            raise InputError("steps and batch_size must be >= 1 and surrogate_steps >= 0")
        for name in ("lr", "surrogate_lr"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise InputError(f"{name} must be a finite number > 0, got {v}")
        if not (self.weight_decay >= 0 and 0 <= self.warmup_frac < 1 and self.clip > 0):
            raise InputError("weight_decay must be >= 0, warmup_frac in [0, 1) and clip > 0")
        if self.masks < 1 or (self.paired and self.masks % 2):
            raise InputError(f"masks (--masks) must be >= 1, and even with paired sampling; got {self.masks}")
        if self.tune_blocks < 1:
            raise InputError(f"tune_blocks (--tune-blocks) must be >= 1, got {self.tune_blocks}")
        if self.n_val < 0 or self.ckpt_every < 0:
            raise InputError("n_val and ckpt_every must be >= 0")

    @property
    def total_steps(self) -> int:
        return self.surrogate_steps + self.steps

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


#: fields that may differ between a checkpoint and the run that resumes it (``n_train``: the resolved training set is
#: compared instead, so an explicit count equal to the default one resumes)
RESUMABLE_CHANGES = {"ckpt_every", "n_val", "n_train"}

#: the explainer phase's settings: they may also change while a checkpoint is still before that phase (its optimiser,
#: schedule and subsets start with it); its length (``steps``) also inside it, before the new end (the cosine schedule
#: then runs to the new end from the current step)
EXPLAINER_FIELDS = {"steps", "lr", "masks", "paired", "tune_blocks"}

#: the surrogate phase's length: it may change while a checkpoint is inside that phase, before the new end
#: (a shortened or lengthened budget; the cosine schedule then runs to the new end from the current step)
SURROGATE_FIELDS = {"surrogate_steps"}


@dataclass
class ShapleyTrainResult:
    """What :func:`vitlens.shapley.train_shapley` returns: the explainer (``None`` before the surrogate phase ends),
    the per-step history, the validations, the weights file (``None`` until finished), steps done, wall time."""

    net: Any
    history: list[dict[str, Any]]
    validation: dict[str, Any]
    weights: Path | None
    step: int
    seconds: float
    finished: bool
