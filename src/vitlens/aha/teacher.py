"""A teacher for an AHA training: the maps of another method on the training images (a single-pass method such as
GradSkip, or ``"aha"``: the refined maps of an already trained explainer), and the loss that pulls the explainer's
maps towards them.

Why: on some targets (shapes-deit, planted-vit of docs/benchmarks/aha.md) the soft deletion/insertion objective
stops tracking the hard metric after a few dozen steps, and the explainer ends level with GradSkip instead of ahead
of it. Starting the decoder near GradSkip's ranking and letting the objective take over gives the objective a
better starting point than the zero-initialised head; the explainer still needs one forward pass at inference (the
teacher is used only in training).

:func:`teacher_maps` computes the teacher's maps once, before training (the training images are the same at every
epoch), pooled to a coarse grid; :func:`teacher_loss` is ``1 − Pearson correlation`` between each explainer map and
its teacher map on that grid (scale-free: only the ranking's shape matters); :func:`teacher_weight` fades the
term out linearly over the first ``teacher_frac`` of the steps.

``"aha"`` distils test-time refinement into the network: its maps are the AHA method's own output with its default
``T`` refinement steps (``explain(model, x, method="aha")``; ``teacher_explainer``: which trained explainer, default
the one bundled for the model). Refinement costs ``2·m·T`` target passes an image (about 2.4 s an image for the
64-pixel shapes-deit on one CPU thread), so ``teacher_images`` bounds the images that get a teacher map; the rows of
the others are NaN and :func:`teacher_loss` gives them neither loss nor gradient. Its maps are written to a cache
file after every batch (the training's output folder), so a resumed run does not compute them again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..atomic import save_torch
from ..errors import InputError
from ..runtime import DistributedRun

__all__ = ["TEACHERS", "teacher_grid", "teacher_loss", "teacher_maps", "teacher_weight", "training_teacher"]

#: methods a training run may use as its teacher: single-pass methods defined for every supported target, and
#: ``"aha"`` (the refined maps of a trained explainer, see the module)
TEACHERS = ("gradskip", "chefer", "attnlrp", "gradcam", "aha")


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
                 progress: bool = False, count: int | None = None, options: dict[str, Any] | None = None,
                 cache: str | Path | None = None, identity: dict[str, Any] | None = None,
                 dist_info: DistributedRun | None = None) -> Tensor:
    """The teacher's maps for the predicted class of every image of ``dataset``, pooled to ``grid``: ``(N, gh·gw)``.

    ``count``: only the first ``count`` images get a map; the other rows are NaN (no teacher). ``options``: passed
    to the method (``"aha"``: e.g. ``explainer``). ``cache``: a file holding the rows computed so far, rewritten after
    every batch and read back first; its rows are reused only for the same method, grid, options (an explainer
    file by its contents), dataset size and ``identity`` (what else names the run's data and target).

    ``dist_info``: under ``torchrun`` the processes share the work: the batches go round in rounds of one batch per
    process, each round's rows are summed over the processes (every row is computed by exactly one of them), and the
    first process reads and writes ``cache`` (the others get what it read): every process returns all the maps, and
    a resumed run goes on after the last whole round.

    Raises:
        InputError: ``method`` is not one of :data:`TEACHERS`, or a teacher map is not finite (on any process).
    """
    from ..api import explain

    if method not in TEACHERS:
        raise InputError(f"unknown AHA teacher {method!r}; choose one of {', '.join(TEACHERS)}")
    n = len(dataset)
    todo = n if count is None else max(0, min(n, int(count)))
    key = {"method": method, "grid": list(grid),
           "options": {k: _identify(v) for k, v in sorted((options or {}).items())},
           "n": n, "identity": repr(identity)}
    maps = torch.full((n, grid[0] * grid[1]), float("nan"))
    dist_info = dist_info or DistributedRun()
    lead = dist_info.rank == 0
    dev = next((p.device for p in model.parameters()), torch.device("cpu"))
    done = 0
    if lead and cache is not None and Path(cache).exists():
        done = _cached_rows(Path(cache), key, maps, todo)
    if dist_info.active:  # what the first process read, for all of them
        done = int(_summed(torch.tensor(float(done) if lead else 0.0), dev, dist_info))
        maps[:done] = _summed(maps[:done] if lead else torch.zeros_like(maps[:done]), dev, dist_info)
    span = batch * dist_info.world  # one round: one batch per process
    rounds = range(done, todo, span)
    if progress and lead:
        from tqdm.auto import tqdm

        rounds = tqdm(rounds, desc=f"teacher maps ({method})", unit="round" if dist_info.active else "batch",
                      dynamic_ncols=True)
    for r0 in rounds:
        r1 = min(todo, r0 + span)
        part = torch.zeros((r1 - r0 + 1, maps.shape[1]))  # the round's rows and a last row for "non-finite"
        s, e = r0 + dist_info.rank * batch, min(r1, r0 + (dist_info.rank + 1) * batch)
        if s < e:
            x = torch.stack([dataset[i][0] for i in range(s, e)]).to(dev)
            mine = _pooled(explain(model, x, method=method, **(options or {})).maps.detach(), grid).cpu()
            if bool(torch.isfinite(mine).all()):
                part[s - r0:e - r0] = mine
            else:
                part[-1] = 1.0
        part = _summed(part, dev, dist_info)  # every row is computed by exactly one process
        if bool(part[-1].any()):
            raise InputError(f"the teacher {method!r} gave non-finite maps on training images {r0}–{r1 - 1}")
        maps[r0:r1] = part[:-1]
        if cache is not None and lead:
            save_torch({"key": key, "done": r1, "maps": maps[:r1].clone()}, cache)
    return maps


def _cached_rows(cache: Path, key: dict[str, Any], maps: Tensor, todo: int) -> int:
    """Fill ``maps`` with the rows ``cache`` holds for ``key``; how many. The cache is read without unpickling
    (tensors and plain values only); a damaged file, or one that asks for any other object, is one line naming it."""
    from ..errors import DamagedFileError
    from ..files import load_torch_plain

    label = f"teacher-map cache {cache}"
    saved = load_torch_plain(cache, label)
    if not isinstance(saved, dict) or saved.get("key") != key:
        return 0  # a cache of other settings: recomputed (and replaced after the first batch)
    rows, done = saved.get("maps"), saved.get("done")
    if not isinstance(rows, Tensor) or not isinstance(done, int) or rows.ndim != 2 \
            or rows.shape[1] != maps.shape[1] or not 0 <= done <= rows.shape[0]:
        raise DamagedFileError(f"{label} is damaged (its maps do not fit its key); delete it to recompute the maps")
    done = min(todo, done)
    maps[:done] = rows[:done].to(maps.dtype)
    return done


def training_teacher(model: nn.Module, train_set: Any, cfg: Any, patch_size: Any, progress: bool,
                     cache: Path | None, identity: dict[str, Any],
                     dist_info: DistributedRun) -> tuple[Tensor, dict[str, str] | None]:
    """A training's teacher (``cfg.teacher``, an :class:`~vitlens.aha.config.AHATrainConfig`): the maps of its
    training images (:func:`teacher_maps` on the token grid; ``"aha"``: 16 images a batch, kept in ``cache``) and,
    for ``"aha"``, which explainer file they are the refined maps of (:func:`teacher_file`; the default is whichever
    explainer is bundled when the run starts, so the card names it by its contents)."""
    assert cfg.teacher is not None  # the training asks for maps only when it has a teacher
    first = train_set[0][0]
    grid = teacher_grid((first.shape[-2], first.shape[-1]), patch_size)
    refined = cfg.teacher == "aha"  # minutes of refinement: cached in the output folder
    maps = teacher_maps(model, train_set, cfg.teacher, grid, batch=16 if refined else 32, progress=progress,
                        count=cfg.teacher_images,
                        options={"explainer": cfg.teacher_explainer} if cfg.teacher_explainer else None,
                        cache=cache if refined else None, identity=identity, dist_info=dist_info)
    return maps, teacher_file(model, cfg.teacher_explainer) if refined else None


def teacher_file(model: nn.Module, path: str | None) -> dict[str, str] | None:
    """``{"path", "sha256"}`` of the ``aha`` teacher's explainer: ``path``, or the one bundled for ``model``
    (``None`` where there is none: the method itself then names what is missing)."""
    from . import shipped_explainer

    if path is None:
        found = shipped_explainer(model)
        if found is None or not found[1].is_file():
            return None
        file = found[1]
        shown = f"{file.parent.name}/{file.name} (bundled)"
    else:
        file, shown = Path(path), str(path)
    return {"path": shown, "sha256": _sha256(file)}


def _summed(t: Tensor, device: torch.device, dist_info: DistributedRun) -> Tensor:
    """``t`` (on the CPU) summed over the processes (``t`` itself for one), through ``device`` (nccl takes only
    CUDA tensors)."""
    if not dist_info.active:
        return t
    import torch.distributed as dist

    out = t.to(device).contiguous()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out.cpu()


def _identify(value: Any) -> str:
    """An option value as the teacher cache's key holds it: a file by the SHA-256 of its contents."""
    if isinstance(value, (str, Path)) and Path(value).is_file():
        return "sha256:" + _sha256(Path(value))
    return repr(value)


def _sha256(file: Path) -> str:
    import hashlib

    return hashlib.sha256(file.read_bytes()).hexdigest()


def teacher_loss(maps: Tensor, teacher: Tensor, grid: tuple[int, int]) -> Tensor:
    """``1 − r`` per map, ``r`` the Pearson correlation over ``grid`` between ``maps`` ``(N, H, W)`` and the rows of
    ``teacher`` ``(N, gh·gw)``; in ``[0, 2]``, 0 when the two rank the cells alike up to scale and shift. A NaN
    teacher row (no teacher map for that image) gives 0 and no gradient."""
    a = _pooled(maps, grid)
    b = teacher.to(a.device, a.dtype)
    a = a - a.mean(1, keepdim=True)
    b = b - b.mean(1, keepdim=True)
    has = torch.isfinite(b).all(1)  # rows without a teacher map (NaN: beyond ``count``) add nothing
    b = torch.where(has[:, None], b, torch.zeros_like(b))
    r = (a * b).sum(1) / (a.norm(dim=1) * b.norm(dim=1)).clamp_min(1e-12)
    return torch.where(has, 1.0 - r, torch.zeros_like(r))


def teacher_weight(step: int, steps: int, weight: float, frac: float) -> float:
    """The teacher term's weight at ``step`` (0-based): ``weight`` fading linearly to 0 at ``frac·steps``."""
    if weight <= 0 or frac <= 0:
        return 0.0
    return float(weight) * max(0.0, 1.0 - step / (frac * steps))
