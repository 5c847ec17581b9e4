"""The ``train-aha`` command: its options (:func:`add_train_aha_parser` adds it to ``vitlens``; :func:`main` is
``python -m vitlens.aha.train``), turned into an :class:`~vitlens.aha.config.AHATrainConfig` and a call of
:func:`vitlens.aha.loop.train_aha` (:func:`cmd_train_aha`)."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path
from typing import Any, Sequence

import torch

from ..errors import InputError
from .config import OPTION_VALUES, RECIPES, AHATrainConfig
from .loop import train_aha
from .network import OUTPUT_POOLS
from .soft_metrics import REFERENCES
from .teacher import TEACHERS

__all__ = ["DESCRIPTION", "add_train_aha_parser", "cmd_train_aha", "main"]

#: the commands' description (the first paragraph of :mod:`vitlens.aha.train`'s docstring)
DESCRIPTION = ("Train an AHA explainer for a frozen target model: a small decoder learns to rank the image's regions "
               "so that deleting the highest-ranked ones first lowers the target's score fastest and inserting them "
               "raises it fastest (soft, differentiable deletion and insertion curves). Writes <name>.safetensors, "
               ".json and a model card .md in --out; resumable (--resume) and runs under torchrun. The Python API "
               "is vitlens.aha.train_aha.")


def _name_list(flag: str, text: str | None) -> tuple[str, ...] | None:
    """``a,b`` → ``("a", "b")``; ``None`` when the flag is not given; an empty list is an error (not the default)."""
    if text is None:
        return None
    names = tuple(r.strip() for r in text.split(",") if r.strip())
    if not names:
        raise InputError(f"{flag} is empty; give one or more of {','.join(REFERENCES)}, or leave it out for the "
                         "recipe's default")
    return names


def _weights(flag: str, text: str | None) -> tuple[float, ...] | None:
    """``2,1,1,2`` → ``(2.0, 1.0, 1.0, 2.0)``; ``None`` when the flag is not given."""
    if text is None:
        return None
    try:
        return tuple(float(v) for v in text.split(","))
    except ValueError:
        raise InputError(f"{flag} must be comma-separated numbers, e.g. 2,1,1,2; got {text!r}") from None


def _depths(text: str | None) -> tuple[int, ...] | None:
    """``4,11,17,23`` → ``(4, 11, 17, 23)``; ``None`` when ``--depths`` is not given."""
    if text is None:
        return None
    try:
        depths = tuple(int(v) for v in text.split(","))
    except ValueError:
        depths = ()
    if not depths or any(d < 0 for d in depths):
        raise InputError(f"--depths must be comma-separated block indices >= 0, e.g. 4,11,17,23; got {text!r}")
    return depths


def _recipe_options(items: Sequence[str]) -> dict[str, str]:
    """``["pooling=adaptive", ...]`` → ``{"pooling": "adaptive", ...}``, each key and value checked."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key, value = key.strip().replace("-", "_"), value.strip()
        if not sep or key not in OPTION_VALUES or value not in OPTION_VALUES[key]:
            raise InputError(f"--recipe-option {item!r}: give KEY=VALUE with one of "
                             + "; ".join(f"{k}={'|'.join(v)}" for k, v in OPTION_VALUES.items()))
        out[key] = value
    return out


def _add_arguments(p: argparse.ArgumentParser) -> None:
    from ..options import nonnegative_float, nonnegative_int, positive_float, positive_int, seed_int
    from ..runtime import add_process_arguments, add_run_folder_arguments

    d = AHATrainConfig()
    add_run_folder_arguments(p, models="bundled name (shapes-vit), timm:<arch> or hf:<dir>", suffix="aha")
    p.add_argument("--recipe", choices=sorted(RECIPES), default="tracked",
                   help="training recipe whose values the options below default to: 'tracked' (learns; default) or "
                        "'authors' (the AHA authors' code: tau 1->0.3, Gumbel noise on raw scores, one map scored on 2 "
                        "classes, their references and schedule, m=16)")
    p.add_argument("--steps", type=positive_int, default=d.steps, help="optimiser steps")
    p.add_argument("--batch-size", type=positive_int, default=d.batch_size, help="global batch (all processes)")
    p.add_argument("--lr", type=positive_float, default=None, help=f"AdamW learning rate (tracked: {d.lr:g})")
    p.add_argument("--weight-decay", type=nonnegative_float, default=d.weight_decay, help="AdamW weight decay")
    p.add_argument("--curve-points", dest="m", type=positive_int, default=None,
                   help=f"m: curve points incl. both endpoints (tracked: {d.m})")
    p.add_argument("--step-sampling", choices=["fixed", "random"], default=None,
                   help=f"curve fractions per step (tracked: {d.step_sampling})")
    p.add_argument("--grid-range", type=positive_int, nargs=2, default=None, metavar=("MIN", "MAX"),
                   help="region grid sizes drawn per step, MIN..MAX regions per side (default: 7..28 at 224 px, "
                        "scaled to the image, at least 4..16)")
    p.add_argument("--no-grid-offset", action="store_true",
                   help="keep the region grid aligned to the image corner (default: a random offset per step)")
    p.add_argument("--classes-per-image", type=int, choices=[1, 2], default=None,
                   help=f"1: the predicted class; 2: also the runner-up / true label (tracked: {d.classes_per_image})")
    p.add_argument("--references", default=None,
                   help=f"comma-separated deletion references drawn per step, of {','.join(REFERENCES)} "
                        f"(tracked: {','.join(d.references)})")
    p.add_argument("--reference-weights", default=None, metavar="W1,W2,...",
                   help="comma-separated odds of drawing each of --references (default: equal)")
    p.add_argument("--val-references", default=None,
                   help="comma-separated references every validation measures; the headline is their mean "
                        f"(tracked: {','.join(d.val_references)})")
    p.add_argument("--select", choices=["best", "last"], default=None,
                   help="ship the decoder of the best validation or of the last step (tracked: best)")
    p.add_argument("--tau", type=positive_float, nargs=2, default=None, metavar=("START", "END"),
                   help=f"sorter temperature, annealed linearly (tracked: {d.tau_start:g} {d.tau_end:g})")
    p.add_argument("--n-iters", type=positive_int, default=d.n_iters, help="Sinkhorn iterations")
    p.add_argument("--noise-scale", type=nonnegative_float, default=None,
                   help=f"Gumbel noise multiplier, 0: none (tracked: {d.noise_scale:g})")
    p.add_argument("--straight-through", action="store_true",
                   help="training curves use the hard ranking of the regions, gradients the sorter's")
    p.add_argument("--mask-sigma", type=nonnegative_float, default=d.mask_sigma,
                   help="Gaussian blur of the training masks' edges, in pixels (0: hard edges, as the metric's)")
    p.add_argument("--teacher", choices=list(TEACHERS), default=None,
                   help="pull the maps towards this method's maps in the first steps (default: none); 'aha': the "
                        "refined maps of a trained explainer (--teacher-explainer)")
    p.add_argument("--teacher-explainer", default=None, metavar="PATH",
                   help="the trained explainer whose refined maps the 'aha' teacher gives (default: the model's "
                        "bundled one)")
    p.add_argument("--teacher-images", type=int, default=None, metavar="N",
                   help="teacher maps for the first N training images only (default: all)")
    p.add_argument("--teacher-weight", dest="w_teacher", type=nonnegative_float, default=d.w_teacher,
                   help="weight of the teacher term (1 - correlation on the token grid) at step 0")
    p.add_argument("--teacher-frac", type=positive_float, default=d.teacher_frac,
                   help="fraction of the steps over which the teacher term fades linearly to 0")
    p.add_argument("--w-peak", type=nonnegative_float, default=d.w_peak,
                   help="weight of the peak penalty in the loss")
    p.add_argument("--w-del", type=nonnegative_float, default=d.w_del,
                   help="weight of the soft deletion AUC in the loss")
    p.add_argument("--w-ins", type=nonnegative_float, default=d.w_ins,
                   help="weight of 1 - the soft insertion AUC in the loss")
    p.add_argument("--recipe-option", action="append", default=[], metavar="KEY=VALUE",
                   help="one item of the AHA authors' code on its own, repeatable: "
                        + "; ".join(f"{k}={'|'.join(v)}" for k, v in OPTION_VALUES.items())
                        + " (default: the recipe's; docs/methods/aha.md §4)")
    p.add_argument("--width", type=positive_int, default=d.width, help="decoder width")
    p.add_argument("--backbone", default=None, help="timm model name (default: the target itself), e.g. "
                   "vit_large_patch16_dinov3 (the AHA authors' frozen DINOv3 ViT-L/16, with --depths 4,11,17,23)")
    p.add_argument("--depths", default=None, metavar="D1,D2,...",
                   help="backbone blocks (or timm feature levels) to read, 0-based (default: 4 evenly spaced)")
    p.add_argument("--pool", choices=list(OUTPUT_POOLS), default="none",
                   help="output pooling applied in training ('tokens': one score per patch)")
    p.add_argument("--no-choose-pool", action="store_true",
                   help="keep --pool as the explainer's output pooling instead of choosing it on the validation set")
    p.add_argument("--n-train", type=positive_int, default=None, help="training images (default: steps x batch)")
    p.add_argument("--n-val", type=nonnegative_int, default=d.n_val, help="held-out validation images")
    p.add_argument("--val-every", type=nonnegative_int, default=d.val_every,
                   help="validate every N steps as well as after the last one (0: after the last step only)")
    p.add_argument("--ckpt-every", type=nonnegative_int, default=d.ckpt_every,
                   help="write OUT/checkpoint.pt every N steps (0: never; --resume continues from it)")
    p.add_argument("--chunk", type=positive_int, default=d.chunk, help="images per target forward (memory knob)")
    p.add_argument("--amp", choices=["auto", "bf16", "off"], default=d.amp,
                   help="bfloat16 autocast of the target's forward passes (auto: on CUDA)")
    p.add_argument("--grad-checkpointing", choices=["auto", "on", "off"], default=d.grad_checkpointing,
                   help="recompute the target's activations in the backward pass to save memory (auto: on CUDA)")
    p.add_argument("--seed", type=seed_int, default=d.seed, help="seed of the data order, the decoder's weights and the "
                                                                "training scenes")
    add_process_arguments(p, positive_int)


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
              "references": _name_list("--references", args.references),
              "val_references": _name_list("--val-references", args.val_references), "select": args.select,
              "reference_weights": _weights("--reference-weights", args.reference_weights),
              "tau_start": args.tau[0] if args.tau else None, "tau_end": args.tau[1] if args.tau else None,
              "grid_offset": False if args.no_grid_offset else None, **_recipe_options(args.recipe_option)}
    cfg = AHATrainConfig.preset(
        args.recipe, **{k: v for k, v in chosen.items() if v is not None},
        steps=args.steps, batch_size=args.batch_size, weight_decay=args.weight_decay,
        grid_range=tuple(args.grid_range) if args.grid_range else None, n_iters=args.n_iters, w_peak=args.w_peak,
        w_del=args.w_del, w_ins=args.w_ins,
        straight_through=args.straight_through, mask_sigma=args.mask_sigma, teacher=args.teacher, w_teacher=args.w_teacher,
        teacher_frac=args.teacher_frac, teacher_explainer=args.teacher_explainer,
        teacher_images=args.teacher_images,
        width=args.width, backbone=args.backbone, depths=_depths(args.depths), pool=args.pool,
        choose_pool=not args.no_choose_pool,
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
    from contextlib import nullcontext

    from ..run_folders import folder_lock

    # one run per folder: a second train-aha into a folder in use is refused (rank 0 holds the lock for all ranks)
    lock = folder_lock(Path(args.out), "train-aha") if int(os.environ.get("RANK", "0")) == 0 else nullcontext()
    with lock:
        res = train_aha(model, args.data, args.out, config=cfg, name=name, resume=args.resume,
                        progress=not args.no_progress, device=device, command=command,
                        overwrite=getattr(args, "overwrite", False))
    if int(os.environ.get("RANK", "0")) == 0 and res.finished:
        v = res.validation or {}
        # the numbers the model card shows: those of the output pooling the run chose (and the step it shipped)
        sfx = "" if v.get("output_pool", cfg.pool) == cfg.pool else f"_{v['output_pool']}"
        keys = [f"{k}{sfx}" for k in ("deletion", "insertion", "difference")]
        shipped = f" (step {v['selected_step']}, pooling {v.get('output_pool', cfg.pool)})" \
            if v.get("selected_step") is not None else ""
        measured = (f"validation{shipped} deletion {v[keys[0]]:.4f} insertion {v[keys[1]]:.4f} difference "
                    f"{v[keys[2]]:.4f}" if v.get("n", 1) and all(k in v for k in keys)
                    else "no validation (--n-val 0)")
        print(f"train-aha: {res.step} steps in {res.seconds:.0f} s; {measured}; wrote {res.weights}")
    return 0


def add_train_aha_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``train-aha`` sub-command to a ``vitlens`` sub-parser set; returns the new parser."""
    p = subparsers.add_parser("train-aha", help="train an AHA explainer for a model (resumable; works under torchrun)",
                              description=DESCRIPTION)
    _add_arguments(p)
    p.set_defaults(func=cmd_train_aha, argv=None)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m vitlens.aha.train ...`` (the same options as ``vitlens train-aha``)."""
    p = argparse.ArgumentParser(prog="python -m vitlens.aha.train", description=DESCRIPTION)
    _add_arguments(p)
    args = p.parse_args(argv)
    args.argv = None if argv is None else list(argv)
    return cmd_train_aha(args)

