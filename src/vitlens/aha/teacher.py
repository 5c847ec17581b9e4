"""A teacher for the first steps of an AHA training: the maps of a single-pass method (GradSkip by default) on the
training images, and the loss that pulls the explainer's maps towards them.

Why: on some targets (shapes-deit, planted-vit of docs/benchmarks/aha.md) the soft deletion/insertion objective
stops tracking the hard metric after a few dozen steps, and the explainer ends level with GradSkip instead of ahead
of it. Starting the decoder near GradSkip's ranking and letting the objective take over gives the objective a
better starting point than the zero-initialised head; the explainer still needs one forward pass at inference (the
teacher is used only in training).

:func:`teacher_maps` computes the teacher's maps once, before training (the training images are the same at every
epoch), pooled to a coarse grid; :func:`teacher_loss` is ``1 − Pearson correlation`` between each explainer map and
its teacher map on that grid (scale-free: only the ranking's shape matters); :func:`teacher_weight` fades the
term out linearly over the first ``teacher_frac`` of the steps.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import InputError

__all__ = ["TEACHERS", "teacher_grid", "teacher_loss", "teacher_maps", "teacher_weight"]

#: methods a training run may use as its teacher (single pass, defined for every supported target)
TEACHERS = ("gradskip", "chefer", "attnlrp", "gradcam")


def teacher_grid(hw: tuple[int, int], patch_size: int | tuple[int, int] | None) -> tuple[int, int]:
    """The grid both maps are compared on: the token grid of a ViT (``patch_size`` an int or ``(ph, pw)``), else
    8×8 (never finer than the image)."""
    if patch_size:
        ph, pw = (patch_size, patch_size) if isinstance(patch_size, int) else patch_size
        return max(1, hw[0] // int(ph)), max(1, hw[1] // int(pw))
    return min(8, hw[0]), min(8, hw[1])


def _pooled(maps: Tensor, grid: tuple[int, int]) -> Tensor:
    return F.adaptive_avg_pool2d(maps.to(torch.promote_types(maps.dtype, torch.float32)).unsqueeze(1), grid).flatten(1)


def teacher_maps(model: nn.Module, dataset: Any, method: str, grid: tuple[int, int], batch: int = 32,
                 progress: bool = False) -> Tensor:
    """The teacher's maps for the predicted class of every image of ``dataset``, pooled to ``grid``: ``(N, gh·gw)``.

    Raises:
        InputError: ``method`` is not one of :data:`TEACHERS`, or a teacher map is not finite.
    """
    from ..api import explain

    if method not in TEACHERS:
        raise InputError(f"unknown AHA teacher {method!r}; choose one of {', '.join(TEACHERS)}")
    n = len(dataset)
    dev = next((p.device for p in model.parameters()), torch.device("cpu"))
    out = []
    starts = range(0, n, batch)
    if progress:
        from tqdm.auto import tqdm

        starts = tqdm(starts, desc=f"teacher maps ({method})", unit="batch", dynamic_ncols=True)
    for s in starts:
        x = torch.stack([dataset[i][0] for i in range(s, min(n, s + batch))]).to(dev)
        out.append(_pooled(explain(model, x, method=method).maps.detach(), grid).cpu())
    maps = torch.cat(out) if out else torch.zeros(0, grid[0] * grid[1])
    if not bool(torch.isfinite(maps).all()):
        raise InputError(f"the teacher {method!r} gave non-finite maps on the training images")
    return maps


def teacher_loss(maps: Tensor, teacher: Tensor, grid: tuple[int, int]) -> Tensor:
    """``1 − r`` per map, ``r`` the Pearson correlation over ``grid`` between ``maps`` ``(N, H, W)`` and the rows of
    ``teacher`` ``(N, gh·gw)``; in ``[0, 2]``, 0 when the two rank the cells alike up to scale and shift."""
    a = _pooled(maps, grid)
    b = teacher.to(a.device, a.dtype)
    a = a - a.mean(1, keepdim=True)
    b = b - b.mean(1, keepdim=True)
    r = (a * b).sum(1) / (a.norm(dim=1) * b.norm(dim=1)).clamp_min(1e-12)
    return 1.0 - r


def teacher_weight(step: int, steps: int, weight: float, frac: float) -> float:
    """The teacher term's weight at ``step`` (0-based): ``weight`` fading linearly to 0 at ``frac·steps``."""
    if weight <= 0 or frac <= 0:
        return 0.0
    return float(weight) * max(0.0, 1.0 - step / (frac * steps))
