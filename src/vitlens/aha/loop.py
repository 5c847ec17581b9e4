"""The AHA training loop (the flow is described in :mod:`vitlens.aha.train`): :func:`train_aha` and its parts.

:func:`training_loss` is one batch's loss, :func:`target_probs` the target's differentiable class probabilities,
:func:`validate` / :func:`soft_validate` the hard held-out metric / the training objective on the same images.
:func:`train_aha` sets a run up (config, folder, device, process group, network, data, optimiser), resumes it from
``checkpoint.pt``, runs its steps, validates, checkpoints (atomically; also on Ctrl-C after the last whole step) and
writes the explainer, its metadata and its model card.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import Tensor, nn

from ..atomic import save_torch, write_text
from ..errors import InputError
from ..models import get_adapter
from ..models.base import int_pair
from ..pause import pause_point
from ..runtime import DistributedRun, init_distributed
from ..runtime import rng_state as _rng_state
from ..runtime import set_rng_state as _set_rng_state
from .card import model_card, model_name, versions
from .config import RESUMABLE_CHANGES, AHATrainConfig, TrainResult
from .data import datasets, mean_image, mean_std
from .evaluation import PROTOCOL
from .network import OUTPUT_POOLS, AHANet, model_digest, save_explainer
from .plan import StepPlan, choose_classes, image_noise, plan_step, schedule_factor, temperature
from .soft_metrics import RegionGrid, curve_fractions, default_grid_range, map_loss, reference, soft_curves
from .teacher import teacher_grid, teacher_loss, teacher_weight, training_teacher
from .validation import LabelledImages, all_reduce_sum, best_pool, choose_spread, validate

__all__ = ["reference_logits", "soft_validate", "target_probs", "train_aha", "training_loss", "validate"]

#: the file in a training's output folder that holds the ``aha`` teacher's maps computed so far (read on resume)
TEACHER_CACHE = "teacher-maps.pt"


# --------------------------------------------------------------------------------------------------------------------
# Helpers: distributed, precision, RNG state
# --------------------------------------------------------------------------------------------------------------------


def _init_distributed(device: torch.device | None) -> DistributedRun:
    """:func:`vitlens.runtime.init_distributed`, with ``RANK`` required when ``WORLD_SIZE > 1`` (``torchrun`` sets
    both; a bare ``KeyError`` as before otherwise)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return DistributedRun()
    int(os.environ["RANK"])
    return init_distributed(device)


@contextlib.contextmanager
def _grad_checkpointing(model: nn.Module, on: bool) -> Iterator[None]:
    """timm's per-block gradient checkpointing for the duration (restored after)."""
    switch = getattr(model, "set_grad_checkpointing", None)
    if not on or switch is None:
        yield
        return
    before = bool(getattr(model, "grad_checkpointing", False))
    try:
        switch(True)
        yield
    finally:
        switch(before)


def soft_validate(net: AHANet, data: LabelledImages, cfg: AHATrainConfig, tau: float, n: int = 50,
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
            p1 = reference_logits(adapter, ref).softmax(-1).gather(1, cls[:, None])[:, 0]
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
        c = classes[s:s + chunk]  # (n,) or (n, K): K classes of each image
        parts.append(logits.float().softmax(-1).gather(1, c.reshape(c.shape[0], -1)).reshape(c.shape))
    return torch.cat(parts)


def reference_logits(adapter: Any, ref: Tensor) -> Tensor:
    """The target's float logits ``(B, K)`` on the references ``ref`` ``(B, C, H, W)``: one forward of one image when
    every image has the same reference (the mean colour, black, the mean image), of the batch otherwise (blur)."""
    if ref.shape[0] > 1 and bool((ref == ref[:1]).all()):
        return adapter.forward(ref[:1]).float().expand(ref.shape[0], -1)
    return adapter.forward(ref).float()


def _cached_reference_logits(adapter: Any, ref: Tensor, kind: str, cache: dict[str, tuple[Tensor, Tensor]] | None,
                             amp: bool) -> Tensor:
    """:func:`reference_logits`, kept in ``cache[kind]`` as ``(image, logits)`` when one image serves the batch and
    reused while the reference is that image (the target is frozen, so its logits on it do not change)."""
    if cache is not None and kind in cache:
        image, logits = cache[kind]
        if image.shape == ref.shape[1:] and bool((ref == image).all()):
            return logits.expand(ref.shape[0], -1)
    with torch.no_grad(), torch.autocast(ref.device.type, dtype=torch.bfloat16, enabled=amp):
        out = reference_logits(adapter, ref)
    if cache is not None and out.stride(0) == 0:
        cache[kind] = (ref[0].clone(), out[:1])
    return out


def training_loss(net: AHANet, decoder: nn.Module, x: Tensor, labels: Tensor, indices: Sequence[int], step: int,
                  cfg: AHATrainConfig, tau: float, mean_std: tuple[Sequence[float], Sequence[float]],
                  amp: bool = False, mean_img: Tensor | None = None,
                  ref_cache: dict[str, tuple[Tensor, Tensor]] | None = None,
                  teacher: tuple[Tensor, tuple[int, int], float] | None = None
                  ) -> tuple[Tensor, dict[str, Tensor], StepPlan]:
    """The AHA loss of one (local) batch, averaged over its images and classes.

    Args:
        net: the explainer (its backbone gives features and the target's logits); ``decoder``: ``net.decoder`` or
            its DDP wrapper. ``x`` ``(b, C, H, W)`` normalised images, ``labels`` ``(b,)`` (−1: unknown),
            ``indices``: their dataset indices (keys of the per-image noise). ``tau``: sorter temperature.
        mean_std: the target's normalisation (for the black reference); ``mean_img``: the training images' mean
            (for the ``meanimage`` reference). ``teacher``: ``(maps of these images, grid, weight)`` of the
            teacher term (:mod:`vitlens.aha.teacher`; ``None``: none).
        ref_cache: where the target's logits on a reference that is the same for every image and every step (mean
            colour, black, mean image) are kept between steps (the run's dict; ``None``: computed every step).

    Call inside ``adapter.session()`` of the target (eval mode, frozen parameters). Returns ``(loss, parts, plan)``
    with per-map ``del_auc``, ``ins_auc``, ``peak`` ``(b·k,)``.
    """
    adapter = net.target_adapter
    hw = (int(x.shape[-2]), int(x.shape[-1]))
    plan = plan_step(cfg, step, hw)
    grid = RegionGrid(hw, plan.grid, plan.offset, device=x.device, pooling=cfg.pooling)
    feats, logits = net.features(x)
    classes = choose_classes(logits, labels, cfg.classes_per_image)  # (b, k)
    k = 1 if (shared := cfg.classes == "authors") else classes.shape[1]  # shared: one map (the prediction's)
    ref = reference(x, plan.reference, mean_std[0], mean_std[1], mean_image=mean_img, style=cfg.reference_style)
    ref_logits = _cached_reference_logits(adapter, ref, plan.reference, ref_cache, amp)
    p0 = logits.float().softmax(-1).gather(1, classes)  # (b, k): nothing deleted
    p1 = ref_logits.softmax(-1).gather(1, classes)  # everything deleted

    def rep(t: Tensor) -> Tensor:  # image-major (b·k, ...)
        return t if k == 1 else t.repeat_interleave(k, dim=0)

    cls = classes[:, 0] if shared else classes.reshape(-1)
    maps = net.finish(decoder([rep(f) for f in feats], cls, hw), cfg.pool)
    noise = None
    if cfg.noise_scale:
        noise = torch.cat([image_noise(cfg, step, i, k, grid.d) for i in indices]).to(x.device)
    ends = (p0.mean(1), p1.mean(1)) if shared else (p0.reshape(-1), p1.reshape(-1))
    loss_items, parts = map_loss(lambda im, c: target_probs(adapter, im, c, cfg.chunk, amp), rep(x), rep(ref), maps,
                                 classes if shared else cls, grid, plan.fractions, tau, cfg, noise, ends)
    if teacher is not None and teacher[2] > 0:
        parts["teacher"] = teacher_loss(maps, rep(teacher[0]), teacher[1])
        loss_items = loss_items + teacher[2] * parts["teacher"]
    return loss_items.mean(), parts, plan


# --------------------------------------------------------------------------------------------------------------------
# train_aha and its parts
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class _Run:
    """The state of one training run, shared by the parts of :func:`train_aha` (``step``, the histories and the last
    validation are what a checkpoint stores besides the optimiser)."""

    cfg: AHATrainConfig
    model: nn.Module
    adapter: Any
    net: AHANet
    dev: torch.device
    dist_info: DistributedRun
    local_batch: int
    amp: bool
    ckpting: bool
    train_set: Any
    val_set: Any
    data_info: dict[str, Any]
    opt: torch.optim.Optimizer
    sched: Any
    out: Path | None
    ckpt_path: Path | None
    step: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    validation: dict[str, Any] | None = None
    val_history: list[dict[str, Any]] = field(default_factory=list)
    elapsed0: float = 0.0
    t_start: float = 0.0
    pools: list[str] = field(default_factory=list)
    mean_img: Tensor | None = None
    mean_std: tuple[Sequence[float], Sequence[float]] = ((0.0, 0.0, 0.0), (1.0, 1.0, 1.0))
    best: dict[str, Any] | None = None  # the best validation so far: step, score, pool, decoder state
    target_id: str = ""
    ref_logits: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)  # see training_loss(ref_cache=)
    teacher: Tensor | None = None  # the teacher's maps of the training images (cfg.teacher), on teacher_grid
    teacher_file: dict[str, str] | None = None  # the aha teacher's explainer: its path and SHA-256
    show_progress: bool = False  # progress bars (rank 0, unless --no-progress): the validations get their own

    def seconds(self) -> float:
        """Training wall time so far, including the runs this one resumes."""
        return self.elapsed0 + time.perf_counter() - self.t_start


def _config(config: AHATrainConfig | None, overrides: dict[str, Any]) -> AHATrainConfig:
    """``config`` (default :class:`AHATrainConfig`) with ``overrides``, its sequences as tuples, checked."""
    cfg = dataclasses.replace(config or AHATrainConfig(), **overrides)
    if cfg.grid_range is not None:
        if len(cfg.grid_range) != 2:
            raise InputError(f"grid_range must be two grid sizes (low, high); got {cfg.grid_range!r}")
        cfg.grid_range = int_pair(cfg.grid_range)
    cfg.references = tuple(cfg.references)
    cfg.val_references = tuple(cfg.val_references)
    if cfg.reference_weights is not None:
        cfg.reference_weights = tuple(float(v) for v in cfg.reference_weights)
    if cfg.depths is not None:
        cfg.depths = tuple(int(v) for v in cfg.depths)
    cfg.check()
    return cfg


def _setup(model: nn.Module, data: Any, out_dir: str | os.PathLike | None, cfg: AHATrainConfig, name: str,
           resume: bool, overwrite: bool, device: str | torch.device | None, threads: int | None) -> _Run:
    """Guard the run folder, choose the device, join the process group, build the network, data and optimiser."""
    from ..devices import check_device

    check_device(device)
    if cfg.grid_range is not None and not 1 <= cfg.grid_range[0] <= cfg.grid_range[1]:
        raise InputError(f"grid_range (--grid-range MIN MAX) needs 1 <= MIN <= MAX; got {cfg.grid_range[0]} "
                         f"{cfg.grid_range[1]}")
    if isinstance(data, str) and data.partition(":")[0] in ("scenes", "planted", "cues"):
        from ..options import check_known

        kind, _, settings = data.partition(":")
        for part in filter(None, (p.strip() for p in settings.split(","))):
            key, _, value = part.partition("=")
            check_known("setting", f"--data {kind}", [key], ["size"])
            if not value.isdigit() or int(value) < 1:
                raise InputError(f"--data {kind}: size must be an integer >= 1; got {value!r}")
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
    train_set, val_set, data_info = datasets(data, model, cfg, net.num_classes)
    needs_mean_image = "meanimage" in cfg.references or "meanimage" in cfg.val_references
    mean_img = mean_image(train_set) if needs_mean_image else None
    if needs_mean_image and mean_img is None:
        raise InputError("the 'meanimage' reference needs training images of one size; drop it from references / "
                         "val_references for this data")
    opt = torch.optim.AdamW(net.decoder.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: schedule_factor(s, cfg))
    out = Path(out_dir) if out_dir is not None else None
    with torch.no_grad():  # which target: its class, size and a checksum of its weights (resume refuses another)
        params = [p.detach().double() for p in model.parameters()]
        checksum = sum(float((p * (1 + torch.arange(p.numel(), dtype=p.dtype, device=p.device).reshape(p.shape)
                                    % 7)).sum()) for p in params)
    target_id = f"{type(model).__name__}:{sum(p.numel() for p in params)}:{checksum:.10g}"
    return _Run(cfg=cfg, model=model, adapter=adapter, net=net, dev=dev, dist_info=dist_info, local_batch=local_batch,
                amp=amp, ckpting=ckpting, train_set=train_set, val_set=val_set, data_info=data_info, opt=opt,
                sched=sched, out=out, ckpt_path=out / "checkpoint.pt" if out is not None else None,
                mean_img=mean_img, mean_std=mean_std(model), target_id=target_id)


def _resume(run: _Run, resume: bool) -> None:
    """Continue from ``checkpoint.pt`` when asked and present (its config must match up to
    :data:`~vitlens.aha.config.RESUMABLE_CHANGES`); otherwise create the output folder (rank 0)."""
    if resume and run.ckpt_path is not None and run.ckpt_path.is_file():
        from ..run_folders import load_checkpoint

        ck = load_checkpoint(run.ckpt_path, ("decoder", "optimizer", "scheduler", "step", "rng", "config"))
        saved = dict(ck["config"])
        mine = run.cfg.to_dict()
        default = AHATrainConfig().to_dict()  # a field newer than the checkpoint: its default
        diff = sorted(k for k in mine if k not in RESUMABLE_CHANGES and saved.get(k, default[k]) != mine[k])
        if diff:
            raise InputError(f"cannot resume {run.ckpt_path}: its config differs in {', '.join(diff)}")
        if ck.get("target", run.target_id) != run.target_id:
            raise InputError(f"cannot resume {run.ckpt_path}: it was trained for another target model "
                             f"({ck['target']}, this one is {run.target_id}); pass the checkpoint's --model")
        theirs, mine_d = ck.get("data", run.data_info), run.data_info  # the counts follow config, checked above
        keys = sorted(k for k in set(theirs) | set(mine_d) if k not in ("n_train", "n_val")
                      and theirs.get(k) != mine_d.get(k))
        if keys:
            raise InputError(f"cannot resume {run.ckpt_path}: it was trained on other data (differs in "
                             f"{', '.join(keys)}: {theirs.get(keys[0])!r} there, {mine_d.get(keys[0])!r} now)")
        try:
            run.net.decoder.load_state_dict(ck["decoder"])
        except RuntimeError as e:
            why = next((ln.strip() for ln in str(e).splitlines() if "size mismatch" in ln or "Missing" in ln
                        or "Unexpected" in ln), str(e).splitlines()[0])[:160]
            raise InputError(f"cannot resume {run.ckpt_path}: its decoder does not fit this model ({why}); pass "
                             "the checkpoint's --model, or --overwrite to train a new run") from None
        run.opt.load_state_dict(ck["optimizer"])
        run.sched.load_state_dict(ck["scheduler"])
        run.step = int(ck["step"])
        run.history = list(ck.get("history", []))
        run.validation = ck.get("validation")
        run.val_history = list(ck.get("val_history", []))
        run.elapsed0 = float(ck.get("seconds", 0.0))
        run.best = ck.get("best")
        _set_rng_state(ck["rng"])
    elif run.out is not None and run.dist_info.rank == 0:
        run.out.mkdir(parents=True, exist_ok=True)


def _distribute(run: _Run) -> tuple[nn.Module, torch.utils.data.DistributedSampler, int]:
    """The decoder (DDP-wrapped under ``torchrun``), the sampler that shards the shuffled order, batches per epoch."""
    decoder: nn.Module = run.net.decoder
    if run.dist_info.active:
        from torch.nn.parallel import DistributedDataParallel as DDP

        decoder = DDP(run.net.decoder, device_ids=[run.dev.index] if run.dev.type == "cuda" else None)
    sampler: torch.utils.data.DistributedSampler[int] = torch.utils.data.DistributedSampler(
        run.train_set, num_replicas=run.dist_info.world, rank=run.dist_info.rank, shuffle=True, seed=run.cfg.seed,
        drop_last=True)
    per_epoch = len(sampler) // run.local_batch
    if per_epoch < 1:
        raise InputError(f"{len(run.train_set)} training images are fewer than one batch of {run.cfg.batch_size}")
    return decoder, sampler, per_epoch


def _save_checkpoint(run: _Run, seconds: float) -> None:
    """Write ``checkpoint.pt`` atomically (rank 0; nothing without an output folder)."""
    if run.ckpt_path is None or run.dist_info.rank != 0:
        return
    save_torch({"decoder": run.net.decoder.state_dict(), "optimizer": run.opt.state_dict(),
                "scheduler": run.sched.state_dict(), "step": run.step, "rng": _rng_state(),
                "config": run.cfg.to_dict(), "history": run.history, "validation": run.validation,
                "val_history": run.val_history, "seconds": seconds, "arch": run.net.arch, "best": run.best,
                "target": run.target_id, "data": run.data_info}, run.ckpt_path)


def _val_kw(run: _Run) -> dict[str, Any]:  # what every validation of the run passes to validate()
    return dict(chunk=run.cfg.chunk, references=run.cfg.val_references, mean_std=run.mean_std, mean_img=run.mean_img)


def _run_validation(run: _Run) -> dict[str, Any]:
    """Hard validation (and the soft objective on the same images); appended to the learning curve."""
    cfg = run.cfg
    v = {"step": run.step, "pool": cfg.pool, **validate(run.net, run.val_set, run.dist_info, pools=run.pools,
                                                        progress=run.show_progress, **_val_kw(run))}
    if run.dist_info.rank == 0 and cfg.val_every:
        v["soft_difference"] = soft_validate(run.net, run.val_set, cfg, temperature(max(0, run.step - 1), cfg))
    v["images_seen"] = run.step * cfg.batch_size
    v["seconds"] = round(run.seconds(), 1)
    run.val_history.append(v)
    if cfg.select == "best" and run.step > 0:
        pool = best_pool(v, run.pools)
        score = v["difference" if pool == run.pools[0] else f"difference_{pool}"]
        if run.best is None or score > run.best["score"]:  # every process sees the same reduced numbers
            run.best = {"step": run.step, "score": score, "pool": pool,
                        "decoder": {k: t.detach().clone() for k, t in run.net.decoder.state_dict().items()}}
    return v


def _train_step(run: _Run, decoder: nn.Module, idx: list[int],
                mean_std: tuple[Sequence[float], Sequence[float]]) -> dict[str, Any]:
    """One optimiser step on the local batch ``idx``; returns its record (appended to the history)."""
    cfg, dev = run.cfg, run.dev
    items = [run.train_set[i] for i in idx]
    x = torch.stack([it[0] for it in items]).to(dev)
    labels = torch.tensor([it[1] for it in items], device=dev)
    tau = temperature(run.step, cfg)
    teacher = None
    if run.teacher is not None and (w_t := teacher_weight(run.step, cfg.steps, cfg.w_teacher, cfg.teacher_frac)):
        teacher = (run.teacher[idx], teacher_grid((x.shape[-2], x.shape[-1]), run.adapter.patch_size), w_t)
    loss, parts, plan = training_loss(run.net, decoder, x, labels, idx, run.step, cfg, tau, mean_std, run.amp,
                                      run.mean_img, ref_cache=run.ref_logits, teacher=teacher)
    run.opt.zero_grad(set_to_none=True)
    loss.backward()
    gnorm = torch.nn.utils.clip_grad_norm_(run.net.decoder.parameters(), cfg.clip)
    run.opt.step()
    run.sched.step()
    run.step += 1
    stats = torch.stack([loss.detach(), parts["del_auc"].detach().mean(),
                         parts["ins_auc"].detach().mean(), parts["peak"].detach().mean()])
    stats = stats.to(dev, torch.float64)
    stats = (all_reduce_sum(stats, run.dist_info) / run.dist_info.world).cpu()
    rec = {"step": run.step, "loss": float(stats[0]), "soft_del": float(stats[1]),
           "soft_ins": float(stats[2]), "peak": float(stats[3]), "tau": tau,
           "lr": float(run.sched.get_last_lr()[0]), "grid": plan.grid, "reference": plan.reference,
           "grad_norm": float(gnorm)}
    if teacher is not None and bool((has := torch.isfinite(teacher[0]).all(1)).any()):
        t_loss = parts["teacher"].detach()
        rec["teacher"] = float(t_loss[has.to(t_loss.device)].mean())  # this process's images that have a teacher
    run.history.append(rec)
    return rec


def _steps(run: _Run, decoder: nn.Module, sampler: torch.utils.data.DistributedSampler, per_epoch: int,
           mean_std: tuple[Sequence[float], Sequence[float]], stop_after: int | None,
           on_step: Callable[[int, dict[str, float]], None] | None, pbar: Any) -> bool:
    """The steps from ``run.step`` on (validating and checkpointing as configured), then the final validation, which
    also chooses the output pooling; returns whether all ``cfg.steps`` are done."""
    cfg = run.cfg
    ema: dict[str, float] = {}
    epoch = -1
    order: list[int] = []
    if cfg.val_every and run.step == 0 and len(run.val_set):
        run.validation = _run_validation(run)  # the untrained explainer: the first point of the learning curve
    while run.step < cfg.steps:
        if stop_after is not None and run.step >= stop_after:
            break
        e, j = divmod(run.step, per_epoch)
        if e != epoch:
            sampler.set_epoch(e)
            order, epoch = list(sampler), e
        rec = _train_step(run, decoder, order[j * run.local_batch:(j + 1) * run.local_batch], mean_std)
        for key in ("loss", "soft_del", "soft_ins"):
            ema[key] = rec[key] if key not in ema else 0.9 * ema[key] + 0.1 * rec[key]
        if on_step is not None:
            on_step(run.step, rec)
        if cfg.val_every and run.step % cfg.val_every == 0 and run.step < cfg.steps:
            run.validation = _run_validation(run)
        if pbar is not None:
            post = {"loss": f"{ema['loss']:.3f}", "del": f"{ema['soft_del']:.3f}",
                    "ins": f"{ema['soft_ins']:.3f}", "tau": f"{rec['tau']:.2f}"}
            if run.validation is not None:
                post["val ins-del"] = f"{run.validation['difference']:.3f}"
            pbar.set_postfix(post)
            pbar.update(1)
        if run.ckpt_path is not None and cfg.ckpt_every and run.step % cfg.ckpt_every == 0:
            _save_checkpoint(run, run.seconds())
            pause_point(f"train.step.{run.step}")
    finished = run.step >= cfg.steps
    if pbar is not None:  # closed here: its time per step is the steps', not the final validation's
        pbar.close()
    if finished and len(run.val_set):
        run.validation = _run_validation(run)
        run.net.output_pool = best_pool(run.validation, run.pools)
        if run.best is not None and run.best["step"] != run.step:  # an earlier validation was better: ship that
            run.net.decoder.load_state_dict(run.best["decoder"])
            run.net.output_pool = run.best["pool"]
            run.validation = dict(next(v for v in run.val_history if v["step"] == run.best["step"]))
        run.validation["output_pool"] = run.net.output_pool
        run.validation["selected_step"] = run.best["step"] if run.best is not None else run.step
        if run.net.output_pool == "tokens" and len(run.pools) > 1:  # choose_pool: the spread too
            run.validation.update(choose_spread(run.net, run.val_set, run.dist_info, run.validation if run.pools[0]
                                                == "tokens" else None, **_val_kw(run)))
    return finished


def _write_outputs(run: _Run, name: str, command: str | None, card: bool, seconds: float) -> Path:
    """``<name>.safetensors`` + ``<name>.json`` (metadata) and, with ``card``, ``<name>.md``; returns the weights."""
    cfg, net, model = run.cfg, run.net, run.model
    out = run.out
    assert out is not None  # train_aha writes its outputs only into an output folder
    meta = {
        "name": name,
        "target": {"name": model_name(model), "sha": model_digest(model), "num_classes": net.num_classes},
        "train": cfg.to_dict(),
        "data": run.data_info,
        "command": command,
        "seed": cfg.seed,
        "processes": run.dist_info.world,
        "device": str(run.dev),
        "seconds": round(seconds, 1),
        "steps": run.step,
        "validation": run.validation,
        "learning_curve": run.val_history,
        "validation_protocol": PROTOCOL,
        **({"teacher_file": run.teacher_file} if run.teacher_file else {}),
        "loss_history": [round(h["loss"], 6) for h in run.history],
        "written": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "versions": versions(),
    }
    weights, _ = save_explainer(net, out / f"{name}.safetensors", meta)
    if card:
        write_text(out / f"{name}.md", model_card(meta, net))
    return weights


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
        config: :class:`~vitlens.aha.config.AHATrainConfig`; ``**overrides`` replace its fields (``steps=200, m=6``).
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
        :class:`~vitlens.aha.config.TrainResult`.
    """
    cfg = _config(config, overrides)
    run = _setup(model, data, out_dir, cfg, name, resume, overwrite, device, threads)
    _resume(run, resume)
    if cfg.teacher is not None and run.step < cfg.steps:
        run.teacher, run.teacher_file = training_teacher(
            model, run.train_set, cfg, run.adapter.patch_size, progress and run.dist_info.rank == 0,
            run.out / TEACHER_CACHE if run.out is not None else None,
            {"data": run.data_info, "target": run.target_id}, run.dist_info)
    decoder, sampler, per_epoch = _distribute(run)
    pbar = None
    if progress and run.dist_info.rank == 0:
        from tqdm.auto import tqdm

        pbar = tqdm(total=cfg.steps, initial=run.step, desc=f"train-aha {name}", unit="step", dynamic_ncols=True)
        run.show_progress = True
    run.t_start = time.perf_counter()
    finished = False
    run.pools = [cfg.pool] + ([p for p in OUTPUT_POOLS if p != cfg.pool]
                              if cfg.choose_pool and run.adapter.patch_size is not None else [])
    try:
        with run.adapter.session(capture=False), _grad_checkpointing(model, run.ckpting):
            finished = _steps(run, decoder, sampler, per_epoch, run.mean_std, stop_after, on_step, pbar)
    except KeyboardInterrupt:  # keep the whole steps done: a checkpoint if the state is between two steps
        from ..run_folders import optimizer_at_step

        if optimizer_at_step(run.opt, run.sched, run.history, run.step):
            _save_checkpoint(run, run.seconds())
        raise
    finally:
        if pbar is not None:
            pbar.close()
    seconds = run.seconds()
    _save_checkpoint(run, seconds)
    weights = None
    if finished and run.out is not None and run.dist_info.rank == 0:
        weights = _write_outputs(run, name, command, card, seconds)
    run.dist_info.finish()
    return TrainResult(net=run.net, history=run.history, validation=run.validation, weights=weights, step=run.step,
                       seconds=seconds, finished=finished)
