"""The ``train-shapley`` command (:func:`add_train_shapley_parser` adds it to ``vitlens``; :func:`main` is
``python -m vitlens.shapley.cli``): options → :class:`~vitlens.shapley.config.ShapleyTrainConfig` →
:func:`vitlens.shapley.loop.train_shapley`."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Sequence

import torch

from .config import ShapleyTrainConfig

__all__ = ["DESCRIPTION", "add_train_shapley_parser", "cmd_train_shapley", "main"]

DESCRIPTION = ("Train a ViT-Shapley explainer (Covert et al., ICLR 2023) for a timm ViT/DeiT: first a surrogate (a copy "
               "of the model fine-tuned to match its predictions with random patches held out), then an explainer "
               "that outputs every class's patch Shapley values of the surrogate's game in one forward pass. Writes "
               "<name>.safetensors, .json and a model card .md in --out; resumable (--resume) and runs under "
               "torchrun. The Python API is vitlens.shapley.train_shapley.")


def _add_arguments(p: argparse.ArgumentParser) -> None:
    from ..options import nonnegative_float, nonnegative_int, positive_float, positive_int, seed_int
    from ..runtime import add_process_arguments, add_run_folder_arguments

    d = ShapleyTrainConfig()
    add_run_folder_arguments(p, models="bundled name (shapes-vit), timm:<arch> (a ViT/DeiT)", suffix="shapley")
    p.add_argument("--steps", type=positive_int, default=d.steps, help="explainer optimiser steps")
    p.add_argument("--surrogate-steps", type=nonnegative_int, default=d.surrogate_steps,
                   help="surrogate fine-tuning steps, before the explainer's")
    p.add_argument("--batch-size", type=positive_int, default=d.batch_size, help="global batch (all processes)")
    p.add_argument("--lr", type=positive_float, default=d.lr, help="explainer AdamW learning rate")
    p.add_argument("--surrogate-lr", type=positive_float, default=d.surrogate_lr, help="surrogate AdamW learning rate")
    p.add_argument("--weight-decay", type=nonnegative_float, default=d.weight_decay, help="AdamW weight decay")
    p.add_argument("--masks", type=positive_int, default=d.masks,
                   help="Shapley-kernel patch subsets per image per explainer step (even when paired)")
    p.add_argument("--no-paired", action="store_true", help="no complement subsets (default: paired sampling)")
    p.add_argument("--tune-blocks", type=positive_int, default=d.tune_blocks,
                   help="the surrogate's last blocks the explainer fine-tunes (all: the paper's explainer)")
    p.add_argument("--n-train", type=positive_int, default=None, help="training images (default: one pass of scenes)")
    p.add_argument("--n-val", type=nonnegative_int, default=d.n_val, help="held-out validation images")
    p.add_argument("--ckpt-every", type=nonnegative_int, default=d.ckpt_every,
                   help="write OUT/checkpoint.pt every N steps (0: only at the phases' ends)")
    p.add_argument("--seed", type=seed_int, default=d.seed, help="seed of the data order, subsets and new weights")
    add_process_arguments(p, positive_int)


def cmd_train_shapley(args: argparse.Namespace) -> int:
    """Run ``train-shapley`` from parsed arguments."""
    from ..options import check_device, check_file_name, load_model_with_options, parse_key_values
    from ..run_folders import folder_lock
    from .loop import train_shapley

    world = int(os.environ.get("WORLD_SIZE", "1"))
    check_device(args.device)
    if args.name is not None:
        check_file_name("--name", args.name)
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // world))
    torch.manual_seed(args.seed)  # random-weight models are identical in every process
    model = load_model_with_options(args.model, parse_key_values(args.model_option, "--model-option"))
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and world > 1:
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    name = args.name or f"{args.model.split(':')[-1].replace('/', '_')}-shapley"
    cfg = ShapleyTrainConfig(steps=args.steps, surrogate_steps=args.surrogate_steps, batch_size=args.batch_size,
                             lr=args.lr, surrogate_lr=args.surrogate_lr, weight_decay=args.weight_decay,
                             masks=args.masks, paired=not args.no_paired, tune_blocks=args.tune_blocks,
                             n_train=args.n_train, n_val=args.n_val, ckpt_every=args.ckpt_every, seed=args.seed)
    argv = sys.argv[1:] if getattr(args, "argv", None) is None else args.argv
    text = " ".join(shlex.quote(a) for a in argv)
    command = f"vitlens {text}" if Path(sys.argv[0]).name == "vitlens" else f"python -m vitlens.cli {text}"
    if world > 1:
        command = f"torchrun --nproc_per_node {world} " + command.replace("python ", "", 1)
    lock = folder_lock(Path(args.out), "train-shapley") if int(os.environ.get("RANK", "0")) == 0 else nullcontext()
    with lock:
        res = train_shapley(model, args.data, args.out, config=cfg, name=name, resume=args.resume,
                            progress=not args.no_progress, device=device, command=command,
                            overwrite=args.overwrite)
    if int(os.environ.get("RANK", "0")) == 0 and res.finished:
        ve = res.validation.get("explainer") or {}
        vs = res.validation.get("surrogate") or {}
        measured = (f"surrogate KL {vs.get('kl_surrogate', float('nan')):.4f} (model {vs.get('kl_model', float('nan')):.4f}); "
                    f"explainer loss {ve.get('loss', float('nan')):.5f}") if ve else "no validation (--n-val 0)"
        print(f"train-shapley: {res.step} steps in {res.seconds:.0f} s; {measured}; wrote {res.weights}")
    return 0


def add_train_shapley_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``train-shapley`` sub-command to a ``vitlens`` sub-parser set; returns the new parser."""
    p = subparsers.add_parser("train-shapley", description=DESCRIPTION,
                              help="train a ViT-Shapley surrogate and explainer for a ViT (resumable; torchrun)")
    _add_arguments(p)
    p.set_defaults(func=cmd_train_shapley, argv=None)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m vitlens.shapley.cli ...``: through the command line's wrapper (one-line errors, exit codes)."""
    import importlib

    cli: Any = importlib.import_module("vitlens.cli")
    return int(cli.main(["train-shapley", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
