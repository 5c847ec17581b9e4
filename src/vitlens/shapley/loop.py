"""The ViT-Shapley training loop: :func:`train_shapley` (surrogate, then explainer; one step counter, one checkpoint).

One step, global batch of ``b`` images sharded over the processes (``DistributedSampler`` positions ``r, r+N, …``):

* surrogate phase — per image one subset ``S`` of uniform size (:func:`~.sampling.uniform_subsets`), loss
  ``KL(p_f(x) ‖ p_g(x_S))`` (``f`` the frozen original model, ``g`` the surrogate; batch mean);
* explainer phase — the surrogate rounded to float16 and frozen, ``v(∅)`` computed; per image ``masks`` subsets from
  the Shapley kernel (paired with their complements); loss ``n · mean_{images, subsets, classes}(v(∅) + Σ_{i∈S} φ_i −
  v(S))²`` with ``v(S) = softmax(g(x_S))`` and ``φ`` the normalised explainer values.

Every subset comes from a generator keyed by ``(seed, phase, step, image index)`` (:func:`~.sampling.generator`), the
data order from the sampler's seed and epoch, so a resumed run continues bit for bit and any process count draws the
same subsets. Under ``torchrun`` the trained module (the surrogate's masked forward, then the explainer branch) is
wrapped in :class:`~torch.nn.parallel.DistributedDataParallel`; every process averages its local batch and DDP
averages the gradients (the global mean). ``checkpoint.pt`` (every ``ckpt_every`` steps, at each phase's end, at the
end and after the last whole step on Ctrl-C) holds tensors and plain containers only and is read with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime as _dt
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import DamagedFileError, InputError
from ..pause import pause_point
from ..runtime import DistributedRun, atomic_torch_save, init_distributed, warmup_cosine_steps
from .config import EXPLAINER_FIELDS, RESUMABLE_CHANGES, SURROGATE_FIELDS, ShapleyTrainConfig, ShapleyTrainResult
from .network import ShapleyExplainer, round_half, save_shapley
from .sampling import generator, shapley_subsets, uniform_subsets
from .surrogate import MaskedClassifier, masked_logits, patch_layout

__all__ = ["explainer_loss", "surrogate_loss", "train_shapley", "validate_explainer", "validate_surrogate"]

CHECKPOINT = "checkpoint.pt"


def surrogate_loss(surrogate: nn.Module, teacher_probs: Tensor, x: Tensor, keep: Tensor) -> Tensor:
    """``KL(teacher ‖ surrogate on x_S)``, batch mean; ``surrogate(x, keep)`` is a :class:`MaskedClassifier` (or its
    DDP wrapper)."""
    logp = surrogate(x, keep).float().log_softmax(-1)
    return F.kl_div(logp, teacher_probs.float(), reduction="batchmean")


def explainer_loss(net: ShapleyExplainer, head: nn.Module, x: Tensor, masks: Tensor) -> tuple[Tensor, Tensor]:
    """The explainer's loss on images ``x`` ``(b, C, H, W)`` and subsets ``masks`` ``(b, M, n)``, and its values
    ``(b, n, K)``; ``head``: ``net.head`` or its DDP wrapper. The surrogate passes run without gradients."""
    b, m, n = masks.shape
    with torch.no_grad():
        tokens = net.trunk(x)
        grand = net.surrogate_logits(tokens).float().softmax(-1)
        xs = x.repeat_interleave(m, dim=0)
        v_s = masked_logits(net.surrogate, xs, masks.reshape(b * m, n), net.layout).float().softmax(-1)
    phi = net.values_from(tokens, grand, head)
    pred = net.null.float()[None, None] + masks.to(phi.dtype) @ phi  # (b, M, K)
    return n * F.mse_loss(pred, v_s.view(b, m, -1)), phi


@torch.no_grad()
def validate_surrogate(model: nn.Module, surrogate: nn.Module, data: Any, seed: int, batch: int = 32) -> dict[str, float]:
    """On ``data`` (held-out images): the mean KL of the original model on a subset (uniform size, keyed per image) to
    its probabilities on the whole image, the same for the surrogate, and how often the surrogate's top-1 on the whole
    image is the model's."""
    lay = patch_layout(surrogate)
    kl_model, kl_sur, agree, count = 0.0, 0.0, 0, 0
    for s in range(0, len(data), batch):
        idx = range(s, min(len(data), s + batch))
        x = torch.stack([data[i][0] for i in idx]).to(next(surrogate.parameters()).device)
        keep = torch.cat([uniform_subsets(lay.n, 1, generator(seed, "validation", 0, i)) for i in idx]).to(x.device)
        p = model(x).float().softmax(-1)
        for name, net in (("model", model), ("surrogate", surrogate)):
            kl = F.kl_div(masked_logits(net, x, keep, lay).float().log_softmax(-1), p, reduction="sum").item()
            if name == "model":
                kl_model += kl
            else:
                kl_sur += kl
        agree += int((surrogate(x).argmax(-1) == p.argmax(-1)).sum())
        count += x.shape[0]
    return {"n": count, "kl_model": kl_model / max(count, 1), "kl_surrogate": kl_sur / max(count, 1),
            "top1_agreement": agree / max(count, 1)}


@torch.no_grad()
def validate_explainer(net: ShapleyExplainer, data: Any, cfg: ShapleyTrainConfig, batch: int = 16) -> dict[str, float]:
    """On ``data``: the explainer's loss on subsets keyed per image (as in training), and the largest efficiency gap
    ``|Σ_i φ_i − (v(1) − v(∅))|`` (0 up to rounding by construction)."""
    total, gap, count = 0.0, 0.0, 0
    dev = net.null.device
    for s in range(0, len(data), batch):
        idx = range(s, min(len(data), s + batch))
        x = torch.stack([data[i][0] for i in idx]).to(dev)
        masks = torch.stack([shapley_subsets(net.n, cfg.masks, generator(cfg.seed, "validation", 1, i), cfg.paired)
                             for i in idx]).to(dev)
        loss, phi = explainer_loss(net, net.head, x, masks)
        out = net(x)
        gap = max(gap, float((phi.sum(1) - (out.grand - out.null[None])).abs().max()))
        total += float(loss) * x.shape[0]
        count += x.shape[0]
    return {"n": count, "loss": total / max(count, 1), "efficiency_gap": gap}


@dataclass
class _Run:
    cfg: ShapleyTrainConfig
    model: nn.Module
    surrogate: nn.Module
    dev: torch.device
    dist: DistributedRun
    train_set: Any
    val_set: Any
    data_info: dict[str, Any]
    out: Path | None
    target: dict[str, Any]
    net: ShapleyExplainer | None = None
    module: nn.Module | None = None  # what the current phase trains (DDP-wrapped under torchrun)
    opt: torch.optim.Optimizer | None = None
    sched: Any = None
    step: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    validation: dict[str, Any] = field(default_factory=dict)
    elapsed0: float = 0.0
    t_start: float = 0.0
    whole: bool = True  # False while a step is between its optimiser update and its bookkeeping

    def seconds(self) -> float:
        return self.elapsed0 + time.perf_counter() - self.t_start

    @property
    def local_batch(self) -> int:
        return self.cfg.batch_size // self.dist.world


def _optimiser(run: _Run, params: Any, lr: float, steps: int) -> None:
    run.opt = torch.optim.AdamW(params, lr=lr, weight_decay=run.cfg.weight_decay)
    warm = max(1, int(round(run.cfg.warmup_frac * steps)))
    run.sched = torch.optim.lr_scheduler.LambdaLR(run.opt, lambda s: warmup_cosine_steps(s, steps, warm))


def _wrap(run: _Run, module: nn.Module) -> nn.Module:
    if not run.dist.active:
        return module
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(module, device_ids=[run.dev.index] if run.dev.type == "cuda" else None)


def _start_surrogate(run: _Run) -> None:
    for p in run.surrogate.parameters():
        p.requires_grad_(True)
    run.module = _wrap(run, MaskedClassifier(run.surrogate))
    _optimiser(run, run.surrogate.parameters(), run.cfg.surrogate_lr, max(1, run.cfg.surrogate_steps))


def _start_explainer(run: _Run) -> None:
    """Freeze and round the surrogate, build the explainer on it, compute ``v(∅)``, a fresh optimiser."""
    for p in run.surrogate.parameters():
        p.requires_grad_(False)
    round_half(run.surrogate)
    run.net = ShapleyExplainer(run.surrogate, run.cfg.tune_blocks, run.cfg.seed).to(run.dev).eval()
    run.net.set_null(run.train_set[0][0][None].to(run.dev))
    run.module = _wrap(run, run.net.head)
    _optimiser(run, run.net.head.parameters(), run.cfg.lr, run.cfg.steps)


def _config(config: ShapleyTrainConfig | None, overrides: dict[str, Any]) -> ShapleyTrainConfig:
    cfg = dataclasses.replace(config or ShapleyTrainConfig(), **overrides)
    cfg.check()
    return cfg


def _datasets(data: Any, model: nn.Module, cfg: ShapleyTrainConfig) -> tuple[Any, Any, dict[str, Any]]:
    """The training and validation sets of AHA's training (:func:`vitlens.aha.data.datasets`: scenes, planted, cues,
    digits, an image folder or tensors), one pass of fresh scenes by default."""
    from ..aha.config import AHATrainConfig
    from ..aha.data import datasets

    shim = AHATrainConfig(steps=cfg.total_steps, batch_size=cfg.batch_size, n_train=cfg.n_train, n_val=cfg.n_val,
                          seed=cfg.seed)
    return datasets(data, model, shim, int(getattr(model, "num_classes", 0)))


def _setup(model: nn.Module, data: Any, out_dir: Any, cfg: ShapleyTrainConfig, name: str, resume: bool,
           overwrite: bool, device: Any) -> _Run:
    from ..aha.card import model_name
    from ..aha.network import model_digest
    from ..devices import check_device

    check_device(device)
    patch_layout(model)  # refuse an unsupported model before anything is written
    n_blocks = len(model.blocks)  # type: ignore[arg-type]
    if cfg.tune_blocks > n_blocks:
        raise InputError(f"tune_blocks (--tune-blocks) must be at most the model's {n_blocks} blocks, got "
                         f"{cfg.tune_blocks}")
    out = Path(out_dir) if out_dir is not None else None
    if out is not None and int(os.environ.get("RANK", "0")) == 0:
        from ..options import check_file_name
        from ..run_folders import guard_run_folder

        check_file_name("--name", name)
        guard_run_folder(out, out / CHECKPOINT, [out / f"{name}{e}" for e in (".safetensors", ".json", ".md")],
                         resume, overwrite)
    dev = torch.device(device) if device is not None else next((p.device for p in model.parameters()),
                                                                 torch.device("cpu"))
    dist = init_distributed(dev) if int(os.environ.get("WORLD_SIZE", "1")) > 1 else DistributedRun()
    if dist.active and dev.type == "cuda":
        dev = torch.device("cuda", dist.local_rank)
    if cfg.batch_size % dist.world:
        raise InputError(f"batch_size {cfg.batch_size} is not divisible by the {dist.world} processes")
    model.to(dev)
    train_set, val_set, info = _datasets(data, model, cfg)
    surrogate = copy.deepcopy(model).eval()
    target = {"name": model_name(model), "sha": model_digest(model), "num_classes": int(model.num_classes)}  # type: ignore[arg-type]
    return _Run(cfg=cfg, model=model, surrogate=surrogate, dev=dev, dist=dist, train_set=train_set,
                val_set=val_set, data_info=info, out=out, target=target)


def _checkpoint_state(run: _Run, seconds: float) -> dict[str, Any]:
    assert run.opt is not None and run.sched is not None
    state = {"surrogate": run.surrogate.state_dict(), "optimizer": run.opt.state_dict(),
             "scheduler": run.sched.state_dict(),
             "step": run.step, "config": run.cfg.to_dict(), "history": run.history, "validation": run.validation,
             "seconds": seconds, "target": run.target, "data": run.data_info}
    if run.net is not None:
        state["head"] = run.net.head.state_dict()
        state["null"] = run.net.null.detach().clone()
    return state


def _save_checkpoint(run: _Run, seconds: float) -> None:
    if run.out is None or run.dist.rank != 0 or run.opt is None:
        return
    atomic_torch_save(_checkpoint_state(run, seconds), run.out / CHECKPOINT)


def _read_checkpoint(path: Path) -> dict[str, Any]:
    """``torch.load(weights_only=True)`` of ``path`` (tensors and plain containers only; never unpickles objects); a
    damaged or foreign file is one :class:`DamagedFileError` line."""
    try:
        ck = torch.load(path, map_location="cpu", weights_only=True)
        missing = sorted({"surrogate", "optimizer", "scheduler", "step", "config"} - set(ck))
        if missing:
            raise ValueError(f"not a ViT-Shapley checkpoint: no {', '.join(missing)}")
        return dict(ck)
    except (Exception, MemoryError) as e:
        why = (str(e).splitlines() or ["unreadable"])[0][:120]
        raise DamagedFileError(f"checkpoint {path} is damaged ({type(e).__name__}: {why}); delete it to restart, or "
                               "rerun with --overwrite") from None


def _resume(run: _Run, resume: bool) -> None:
    """Continue from the checkpoint when asked (its config, target and data must match), else start phase 1."""
    path = run.out / CHECKPOINT if run.out is not None else None
    if not (resume and path is not None and path.is_file()):
        if run.out is not None and run.dist.rank == 0:
            run.out.mkdir(parents=True, exist_ok=True)
        _start_surrogate(run) if run.cfg.surrogate_steps else _start_explainer(run)
        return
    ck = _read_checkpoint(path)
    mine, default = run.cfg.to_dict(), ShapleyTrainConfig().to_dict()
    free = RESUMABLE_CHANGES | (EXPLAINER_FIELDS if "head" not in ck else set())
    if int(ck["step"]) < min(run.cfg.surrogate_steps, int(ck["config"]["surrogate_steps"])):
        free |= SURROGATE_FIELDS
    if "head" in ck and int(ck["step"]) < run.cfg.total_steps:  # inside the explainer phase: its length may change
        free |= {"steps"}
    diff = sorted(k for k in mine if k not in free and ck["config"].get(k, default[k]) != mine[k])
    if diff:
        raise InputError(f"cannot resume {path}: its config differs in {', '.join(diff)}")
    if (ck.get("target") or {}).get("sha") != run.target["sha"]:
        raise InputError(f"cannot resume {path}: it was trained for another model ({ck.get('target')}); pass the "
                         "checkpoint's --model")
    if {k: v for k, v in (ck.get("data") or {}).items() if k != "n_val"} != \
            {k: v for k, v in run.data_info.items() if k != "n_val"}:
        raise InputError(f"cannot resume {path}: it was trained on other data ({ck.get('data')})")
    run.surrogate.load_state_dict(ck["surrogate"])
    run.step = int(ck["step"])
    run.history = list(ck.get("history") or [])
    run.validation = dict(ck.get("validation") or {})
    run.elapsed0 = float(ck.get("seconds", 0.0))
    if run.step >= run.cfg.surrogate_steps and "head" not in ck:  # stopped between the phases
        run.t_start = time.perf_counter()
        _end_of_phase(run, "surrogate")
        return
    if run.step < run.cfg.surrogate_steps:
        _start_surrogate(run)
    else:
        _start_explainer(run)  # rounds the (already rounded) surrogate again: a no-op
        assert run.net is not None
        run.net.head.load_state_dict(ck["head"])
        run.net.null.copy_(ck["null"])
    assert run.opt is not None and run.sched is not None
    run.opt.load_state_dict(ck["optimizer"])
    run.sched.load_state_dict(ck["scheduler"])


def _batch(run: _Run, sampler: Any, per_epoch: int, cache: dict[str, Any]) -> list[int]:
    """This process's image indices of the current step (the sampler's shuffled order of its epoch)."""
    e, j = divmod(run.step, per_epoch)
    if cache.get("epoch") != e:
        sampler.set_epoch(e)
        cache["order"], cache["epoch"] = list(sampler), e
    order: list[int] = cache["order"]
    return order[j * run.local_batch:(j + 1) * run.local_batch]


def _train_step(run: _Run, idx: list[int]) -> dict[str, Any]:
    """One optimiser step of the current phase on the local batch ``idx``."""
    from ..aha.validation import all_reduce_sum

    cfg, dev = run.cfg, run.dev
    assert run.module is not None and run.opt is not None and run.sched is not None
    x = torch.stack([run.train_set[i][0] for i in idx]).to(dev)
    phase = "surrogate" if run.step < cfg.surrogate_steps else "explainer"
    lay = patch_layout(run.surrogate)
    if phase == "surrogate":
        keep = torch.cat([uniform_subsets(lay.n, 1, generator(cfg.seed, phase, run.step, i)) for i in idx]).to(dev)
        with torch.no_grad():
            teacher = run.model(x).float().softmax(-1)
        loss = surrogate_loss(run.module, teacher, x, keep)
    else:
        assert run.net is not None
        masks = torch.stack([shapley_subsets(lay.n, cfg.masks, generator(cfg.seed, phase, run.step, i), cfg.paired)
                             for i in idx]).to(dev)
        loss, _ = explainer_loss(run.net, run.module, x, masks)
    run.opt.zero_grad(set_to_none=True)
    loss.backward()
    params = [p for g in run.opt.param_groups for p in g["params"]]
    gnorm = float(torch.nn.utils.clip_grad_norm_(params, cfg.clip))
    run.whole = False
    run.opt.step()
    run.sched.step()
    run.step += 1
    mean = all_reduce_sum(loss.detach().to(dev, torch.float64).reshape(1), run.dist) / run.dist.world
    rec = {"step": run.step, "phase": phase, "loss": float(mean), "lr": float(run.sched.get_last_lr()[0]),
           "grad_norm": gnorm}
    run.history.append(rec)
    run.whole = True
    return rec


def _end_of_phase(run: _Run, phase: str) -> None:
    """Validate the phase that just ended (rank 0) and, after the surrogate's, switch to the explainer."""
    if phase == "surrogate":
        if run.dist.rank == 0 and len(run.val_set):
            run.validation["surrogate"] = validate_surrogate(run.model, run.surrogate, run.val_set, run.cfg.seed)
        _start_explainer(run)
    elif run.dist.rank == 0 and len(run.val_set):
        assert run.net is not None
        run.validation["explainer"] = validate_explainer(run.net, run.val_set, run.cfg)
    _save_checkpoint(run, run.seconds())


def _steps(run: _Run, stop_after: int | None, on_step: Callable[[int, dict[str, Any]], None] | None,
           pbar: Any) -> bool:
    """Run the steps from ``run.step`` on; returns whether all are done."""
    cfg = run.cfg
    samplers: dict[str, Any] = {}
    ema: float | None = None
    while run.step < cfg.total_steps:
        if stop_after is not None and run.step >= stop_after:
            break
        if "sampler" not in samplers:
            samplers["sampler"] = torch.utils.data.DistributedSampler(
                run.train_set, num_replicas=run.dist.world, rank=run.dist.rank, shuffle=True, seed=cfg.seed,
                drop_last=True)
        per_epoch = len(samplers["sampler"]) // run.local_batch
        if per_epoch < 1:
            raise InputError(f"{len(run.train_set)} training images are fewer than one batch of {cfg.batch_size}")
        rec = _train_step(run, _batch(run, samplers["sampler"], per_epoch, samplers))
        ema = rec["loss"] if ema is None or run.step == cfg.surrogate_steps + 1 else 0.9 * ema + 0.1 * rec["loss"]
        if on_step is not None:
            on_step(run.step, rec)
        if pbar is not None:
            pbar.set_postfix({"phase": rec["phase"], "loss": f"{ema:.4f}"})
            pbar.update(1)
        if run.step == cfg.surrogate_steps or run.step == cfg.total_steps:
            _end_of_phase(run, rec["phase"])
        elif run.out is not None and cfg.ckpt_every and run.step % cfg.ckpt_every == 0:
            _save_checkpoint(run, run.seconds())
        if run.out is not None and cfg.ckpt_every and run.step % cfg.ckpt_every == 0:
            pause_point(f"train.step.{run.step}")
    return run.step >= cfg.total_steps


def _write_outputs(run: _Run, name: str, command: str | None, card: bool, seconds: float) -> Path:
    from ..aha.card import versions
    from ..atomic import write_text
    from .card import model_card

    assert run.out is not None and run.net is not None
    meta = {"name": name, "target": run.target, "train": run.cfg.to_dict(), "data": run.data_info,
            "command": command, "processes": run.dist.world, "device": str(run.dev), "seconds": round(seconds, 1),
            "steps": run.step, "validation": run.validation, "null": [round(float(v), 6) for v in run.net.null],
            "layout": {"grid": list(run.net.layout.grid), "patch": list(run.net.layout.patch)},
            "loss_history": [[h["phase"], round(h["loss"], 6)] for h in run.history],
            "written": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "versions": versions()}
    weights, _ = save_shapley(run.net, run.out / f"{name}.safetensors", meta)
    if card:
        write_text(run.out / f"{name}.md", model_card(meta, run.net))
    return weights


def train_shapley(model: nn.Module, data: Any = "scenes", out_dir: str | os.PathLike | None = None, *,
                  config: ShapleyTrainConfig | None = None, name: str = "vit-shapley", resume: bool = False,
                  stop_after: int | None = None, progress: bool = True, device: str | torch.device | None = None,
                  command: str | None = None, card: bool = True, overwrite: bool = False,
                  on_step: Callable[[int, dict[str, Any]], None] | None = None,
                  **overrides: Any) -> ShapleyTrainResult:
    """Train ViT-Shapley's surrogate and explainer for the frozen ``model`` (a timm ViT/DeiT).

    Args:
        model: the classifier to explain (never changed: the surrogate is a copy).
        data: as :func:`vitlens.aha.train_aha`'s (``"scenes"``, ``"digits"``, an image folder, or tensors
            ``(train_images, train_labels, val_images, val_labels)``).
        out_dir: folder of ``checkpoint.pt`` and the outputs ``<name>.safetensors/.json/.md`` (``None``: no files).
        config: :class:`ShapleyTrainConfig`; ``**overrides`` replace its fields.
        resume: continue from ``out_dir/checkpoint.pt``; overwrite: replace an earlier run there.
        stop_after: stop once this many steps (both phases counted) are done, after a checkpoint.
        progress: a progress bar (rank 0); command: the command line recorded in the metadata; card: write the card.
    """
    cfg = _config(config, overrides)
    run = _setup(model, data, out_dir, cfg, name, resume, overwrite, device)
    was_training = model.training
    model.eval()
    pbar = None
    try:
        _resume(run, resume)
        if progress and run.dist.rank == 0:
            from tqdm.auto import tqdm

            pbar = tqdm(total=cfg.total_steps, initial=run.step, desc=f"train-shapley {name}", unit="step",
                        dynamic_ncols=True)
        run.t_start = time.perf_counter()
        try:
            finished = _steps(run, stop_after, on_step, pbar)
        except KeyboardInterrupt:
            if run.whole:
                _save_checkpoint(run, run.seconds())
            raise
        seconds = run.seconds()
        if not finished:
            _save_checkpoint(run, seconds)
        weights = None
        if finished and run.out is not None and run.dist.rank == 0:
            weights = _write_outputs(run, name, command, card, seconds)
        run.dist.finish()
    finally:
        if pbar is not None:
            pbar.close()
        model.train(was_training)
    return ShapleyTrainResult(net=run.net, history=run.history, validation=run.validation, weights=weights,
                              step=run.step, seconds=seconds, finished=finished)
