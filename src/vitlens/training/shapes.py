"""Train the bundled scene classifiers (``shapes-vit``, ``shapes-deit``, ``shapes-vit-gap-reg``) on synthetic scenes:
the one command that produces each model's shipped weights.

Usage::

    python -m vitlens.training.shapes --out src/vitlens/models/weights [--model shapes-vit] [--seed 0]

What it does (all on CPU, ``torch.set_num_threads(2)`` by default):

1. Pre-generates a fixed training set ``make_scenes(n_train, seed=seed)`` and a held-out test set
   ``make_scenes(n_test, seed=10_000 + seed)`` (different data seed, so no image is shared).
2. Trains the model's architecture (``vitlens.models.zoo``) for a fixed number of steps (``--steps``, default
   per model in :data:`MODELS`; the weights do not depend on the machine's speed or load) with AdamW, linear warm-up +
   cosine decay, label smoothing, random dihedral augmentation (horizontal/vertical flips and transposition: every
   class shape is mirror-symmetric and drawn at a uniformly random rotation, so these transforms never change the
   class), mimetic attention initialisation, and an auxiliary per-token loss from the object masks (training only,
   decayed to 0; the auxiliary head is not shipped). Where the CPU has native bf16 (AMX), the forward/backward run
   under bf16 autocast with float32 master weights (2.2× faster than float32 on this project's machine); evaluation
   is float32. ``shapes-deit`` additionally learns, in its DIST head, the hard predictions of a teacher
   (``--teacher``, default the bundled ``shapes-vit``), as DeiT does; they are computed once per (un-augmented)
   training image before training. The intra-op thread count is fixed (``--threads``, default 2), so the same command
   gives the same weights bit for bit on the same CPU and torch version whatever else runs on the machine
   (``--adaptive-threads`` trades that for speed on a contended machine). The training scenes are generated in
   ``--threads`` processes (identical to a serial call).
3. ``--minutes`` optionally caps the wall clock (training stops early and the JSON says so); ``--steps 0 --minutes
   M`` makes the schedule follow the clock instead.
4. Writes ``<name>.safetensors`` (float16 state dict, ~5 MB), ``<name>.json`` (metadata) and ``<name>.md`` (model
   card) to ``--out``. All numbers in them are measured on the shipped (float16-rounded) weights loaded back into a
   float32 model.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from vitlens.models import get_adapter
from vitlens.models.zoo import BUNDLED, SHAPES_MEAN, SHAPES_STD, WEIGHTS_DIR
from vitlens.runtime import write_model_card
from vitlens.training.common import (
    BatchSampler,
    ThreadChooser,
    card_class_table,
    card_gini_table,
    card_software_lines,
    cpu_has_bf16,
    describe_load,
    dihedral,
    export_weights,
    fmt_time,
    gini,
    gini_record,
    load_average,
    log_classifier_result,
    lr_factor,
    make_scenes_parallel,
    meta_head,
    meta_schedule,
    meta_timing,
    meta_weights_and_software,
    mimetic_init,
    normalise,
    param_groups,
    parse_with_common_options,
    remeasure,
    set_lr,
    sincos_pos_init,
    training_parser,
    write_meta,
)
from vitlens.training.common import attention_gini as _attention_gini
from vitlens.training.evidence import (
    DATA_SENTENCE,
    MAKER,
    evidence_card_lines,
    evidence_record,
)

__all__ = ["main", "attention_gini", "gini", "MODELS"]

TEST_SEED_OFFSET = 10_000

#: The bundled scene classifiers this command trains: name → (architecture sentence of the card, accuracy target,
#: default number of optimiser steps at batch 128).
MODELS: dict[str, tuple[str, float, int]] = {
    "shapes-vit": (
        "timm `VisionTransformer`: input 64×64 RGB, 8-px tokens (8×8 = 64 patch tokens + 1 CLS token) embedded by a "
        "convolutional stem (`vitlens.models.zoo.ConvStem`: three 3×3 stride-2 convolutions with BatchNorm + ReLU and "
        "a 1×1 projection), embedding dim 192, 6 blocks, 6 heads per block (head dim 32), MLP ratio 4, pre-norm, "
        "CLS-token readout (`global_pool='token'`)",
        0.97,
        1500,
    ),
    "shapes-deit": (
        "timm `VisionTransformerDistilled` (DeiT with distillation token): as shapes-vit (same stem, 8×8 tokens, "
        "dim 192, 6 blocks × 6 heads) with two prefix tokens, CLS and DIST, and two heads; in eval mode the logits "
        "are the mean of the CLS and DIST heads. Trained with hard-label distillation from the bundled shapes-vit",
        0.95,
        1500,
    ),
    "shapes-vit-gap-reg": (
        "timm `VisionTransformer` without a CLS token, with 4 register tokens and global-average-pool readout over "
        "the 64 patch tokens (`global_pool='avg'`, norm after pooling); otherwise as shapes-vit (same stem, dim 192, "
        "6 blocks × 6 heads)",
        0.95,
        1500,
    ),
    "planted-vit": (
        "timm `VisionTransformer` exactly as shapes-vit (conv stem, 8×8 tokens + CLS, dim 192, 6 blocks × 6 heads, "
        "CLS readout), trained on planted-cue scenes",
        0.90,  # the cue is learned at once (100%); the shapes of the no-cue half lag (86%, measured: card)
        1200,
    ),
    **{
        name: (
            "timm `VisionTransformer`: as shapes-vit (conv stem, 8×8 tokens + CLS, dim 192, CLS readout) but 8 blocks "
            "× 12 heads per block (head dim 16), for scenes whose classes need different kinds of evidence",
            0.90,
            1000,
        )
        for name in ("cues-vit-12h", "cues-vit-12h-s1", "cues-vit-12h-s2")
    },
}

#: Data set of each model (``vitlens.training.common.make_scenes_parallel`` kinds) and its default seed.
DATA_KIND: dict[str, str] = {"planted-vit": "planted", "cues-vit-12h": "cues", "cues-vit-12h-s1": "cues",
                             "cues-vit-12h-s2": "cues"}
DEFAULT_SEED: dict[str, int] = {"cues-vit-12h-s1": 1, "cues-vit-12h-s2": 2}

def _names(name: str) -> tuple[str, ...]:
    return BUNDLED[name].class_names


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = training_parser("shapes", "Train the bundled shapes-vit model on synthetic scenes and write weights, "
                                  "metadata and card.")
    p.add_argument("--model", choices=sorted(MODELS), default="shapes-vit", help="which bundled model to train")
    p.add_argument("--teacher", default="shapes-vit",
                   help="shapes-deit only: bundled model whose predictions train the DIST head (default shapes-vit)")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of torch/numpy and of the training data (default 0; cues-vit-12h-s1/-s2: 1/2)")
    p.add_argument("--steps", type=int, default=None,
                   help="optimiser steps (default: the model's, " + ", ".join(f"{k} {v[2]}" for k, v in MODELS.items())
                        + "; the schedule is defined in steps, so the weights do not depend on the machine's speed "
                          "or load)")
    p.add_argument("--minutes", type=float, default=None,
                   help="optional wall-clock budget of the whole command: stop training early (the JSON says so) "
                        "when it would run out; with --steps 0 the schedule follows the clock instead")
    p.add_argument("--n-train", type=int, default=24_000, help="training images (default 24000)")
    p.add_argument("--n-test", type=int, default=2_000, help="held-out test images (default 2000)")
    p.add_argument("--label-smoothing", type=float, default=0.1)
    p.add_argument("--threads", type=int, default=2, help="intra-op threads (default 2)")
    p.add_argument("--adaptive-threads", action="store_true",
                   help="on a contended machine: periodically probe 1 thread and keep the faster setting (the weights "
                        "then depend on the machine's load; default: the fixed --threads, reproducible bit for bit)")
    p.add_argument("--aux-weight", type=float, default=1.0,
                   help="weight of the auxiliary per-token label loss from the masks (training only; 0 = off; "
                        "default 1)")
    p.add_argument("--aux-pixel-weight", type=float, default=0.0,
                   help="weight of the auxiliary per-token 8x8 object-mask loss (training only; 0 = off)")
    p.add_argument("--lowres-frac", type=float, default=0.0,
                   help="train the first fraction of the schedule on downsampled images (fewer tokens, faster)")
    p.add_argument("--lowres-size", type=int, default=48, help="image size of the low-resolution phase")
    p.add_argument("--aux-decay", action=argparse.BooleanOptionalAction, default=True,
                   help="decay the auxiliary weights linearly to 0 over training (default on)")
    p.add_argument("--reserve-s", type=float, default=45.0, help="seconds kept for evaluation and writing")
    p.add_argument("--stop-after", type=int, default=None,
                   help="recipe experiments: stop after N steps without changing the schedule")
    p.add_argument("--init", choices=["timm", "mimetic"], default="mimetic",
                   help="attention initialisation (default mimetic)")
    p.add_argument("--pos-init", choices=["timm", "sincos"], default="timm",
                   help="initial values of the (learned) position embeddings")
    return parse_with_common_options(p, argv, out=WEIGHTS_DIR, batch_size=128, lr=1e-3, weight_decay=0.05,
                                     eval_every="evaluate on 500 test images")


#: ``(B, 3, H, W)`` in [0, 1] → normalised with the bundled model's mean/std.
_normalise = functools.partial(normalise, mean=SHAPES_MEAN, std=SHAPES_STD)


def _aux_targets(masks: torch.Tensor, labels: torch.Tensor, patch: int, num_classes: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense training targets from object masks (used only by the auxiliary heads, never shipped).

    Args:
        masks: ``(B, H, W)`` float object masks in [0, 1] (``H, W`` multiples of ``patch``).
        labels: ``(B,)`` class labels.

    Returns:
        ``tok (B, T, num_classes + 1)``: per token ``frac * onehot(label) + (1 - frac) * onehot(background)`` with
        ``frac`` the token's object fraction; ``pix (B, T, patch * patch)``: the mask pixels of each token
        (``T = H * W / patch**2`` tokens in row-major order, as timm's patch embedding).
    """
    b, h, w = masks.shape
    gh, gw = h // patch, w // patch
    pix = masks.view(b, gh, patch, gw, patch).permute(0, 1, 3, 2, 4).reshape(b, gh * gw, patch * patch)
    frac = pix.mean(-1)  # (B, T)
    tok = torch.zeros(b, gh * gw, num_classes + 1)
    tok[:, :, num_classes] = 1.0 - frac
    tok.scatter_(2, labels.view(-1, 1, 1).expand(-1, gh * gw, 1), frac[..., None])
    return tok, pix


@torch.inference_mode()
def _predict(model: torch.nn.Module, images: torch.Tensor, batch: int = 500) -> torch.Tensor:
    """Predicted labels ``(N,)`` for raw ``(N, 3, H, W)`` images in [0, 1]."""
    model.eval()
    out = [model(_normalise(images[i : i + batch])).argmax(-1) for i in range(0, len(images), batch)]
    return torch.cat(out)


def attention_gini(model: torch.nn.Module, images: torch.Tensor, batch: int = 250) -> np.ndarray:
    """Per-layer, per-head Gini sparsity of attention on raw scenes ``(N, 3, H, W)`` in [0, 1], ``(depth, heads)``
    (:func:`vitlens.training.common.attention_gini` with the shapes normalisation)."""
    return _attention_gini(model, images, _normalise, batch)


def _write_card(path: Path, meta: dict, gini_lh: np.ndarray) -> None:
    per_class = meta["per_class_accuracy"]
    lines = [
        f"# {meta['name']}",
        "",
        "A small vision transformer trained by vitlens on its synthetic scenes (the proving ground). "
        "It exists so that explanation methods can be checked against pixel-exact ground truth offline.",
        "",
        "## Architecture",
        "",
        f"{MODELS[meta['name']][0]}; {len(meta['class_names'])} classes, `dynamic_img_size=True` (other sizes that are multiples of 8 are "
        f"accepted). {meta['n_params']:,} parameters. Load the trained model with "
        f"`vitlens.load_model({meta['name']!r})` (offline).",
        "",
        "## Input and normalisation",
        "",
        f"RGB in [0, 1], normalised per channel as `(x - {SHAPES_MEAN[0]}) / {SHAPES_STD[0]}` "
        "(mean/std in `model.pretrained_cfg`; the scenes' pixel mean is ≈ 0.50 and std ≈ 0.23). "
        "Interpolation bilinear, crop_pct 1.0.",
        "",
        "## Data",
        "",
        DATA_SENTENCE[meta.get("data", "shapes")].format(size=meta["image_size"]),
        f"Classes (label order): {', '.join(meta['class_names'])}.",
        "",
        f"- training: {meta['n_train']:,} images, `{MAKER[meta.get('data', 'shapes')]}(n={meta['n_train']}, "
        f"seed={meta['train_data_seed']})`",
        f"- test (held out): {meta['n_test']:,} images, `{MAKER[meta.get('data', 'shapes')]}(n={meta['n_test']}, "
        f"seed={meta['test_data_seed']})`",
        "",
        "## Training",
        "",
        f"- command: `{meta['command']}`",
        f"- seed: {meta['seed']} (torch, numpy, training data)",
        f"- AdamW (peak lr {meta['lr']}, weight decay {meta['weight_decay']} on matrices only, batch "
        f"{meta['batch_size']}), linear warm-up ({meta['warmup_frac']:.0%}) + cosine decay to "
        f"{meta['min_lr_frac']:.0%} of the peak, label smoothing {meta['label_smoothing']}, random flips/transposition",
        f"- {meta.get('init', 'timm')} attention initialisation; auxiliary per-token loss from the object masks "
        f"(weight {meta.get('aux_weight', 0.0)}{', decayed linearly to 0' if meta.get('aux_decay') else ''}; training "
        f"only, its head is not shipped); compute precision {meta.get('precision', 'fp32')} (float32 master weights)"
        + (f"; DIST head trained on the hard predictions of `{meta['teacher']}` (computed once per training image)"
           if meta.get("teacher") else ""),
        f"- steps: {meta['steps']} ({meta['epochs']:.2f} epochs); reproduce exactly with "
        f"`--steps {meta['steps']}`",
        f"- training time (measured): {fmt_time(meta['training_time_s'])} of training, "
        f"{fmt_time(meta['total_time_s'])} for the whole command, on {meta['threads']} CPU threads "
        f"({meta['cpu']}). " + meta.get("load_note", ""),
        *card_software_lines(meta),
        *([f"- provenance: {meta['provenance']}"] if meta.get("provenance") else []),
        "",
        "## Accuracy (measured on the held-out test set with the shipped weights)",
        "",
        f"**Test accuracy: {meta['test_accuracy']:.2%}** ({meta['n_test']:,} images)",
        "",
        *card_class_table(per_class, meta["class_names"]),
        *evidence_card_lines(meta.get("evidence_use")),
    ]
    lines += [
        "",
        "## Attention heads",
        "",
        "Gini sparsity of the attention rows (0 = uniform attention over the 65 tokens, 64/65 ≈ 0.985 = attention "
        "on a single token), averaged over all rows and the first 500 test images, per head; min / mean / max over "
        f"the {gini_lh.shape[1]} heads of each layer. A wide spread means the heads of a layer are heterogeneous.",
        "",
        *card_gini_table(gini_lh),
    ]
    write_model_card(path, lines)


def _batch_loss(args: argparse.Namespace, model: Any, idx: torch.Tensor, flips: torch.Tensor, progress: float,
                x_train: torch.Tensor, m_train: torch.Tensor, y_train: torch.Tensor, teacher_pred: torch.Tensor | None,
                aux_head: torch.nn.Module, pix_head: torch.nn.Module, use_bf16: bool
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One training batch (augmented, low resolution early on) through the model: ``(loss, logits, labels)``."""
    xb, mb = x_train[idx], m_train[idx]
    xb = dihedral(xb, flips)
    mb = dihedral(mb, flips).float()[:, None]  # (B, 1, H, W)
    if progress < args.lowres_frac:  # cheap low-resolution phase (fewer tokens)
        xb = F.interpolate(xb, size=args.lowres_size, mode="bilinear", antialias=True, align_corners=False)
        mb = F.interpolate(mb, size=args.lowres_size, mode="area")
    xb = _normalise(xb)
    yb = y_train[idx]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_bf16):
        feats = model.forward_features(xb)  # (B, 1 + T, D), final norm applied
        logits = model.forward_head(feats)
    if teacher_pred is not None:  # DeiT hard distillation: CLS head ← labels, DIST head ← teacher predictions
        y_teacher = teacher_pred[idx]
        logits, logits_dist = logits[0].float(), logits[1].float()
        loss = 0.5 * F.cross_entropy(logits, yb, label_smoothing=args.label_smoothing) + 0.5 * F.cross_entropy(
            logits_dist, y_teacher)
        logits = 0.5 * (logits + logits_dist.detach())
    else:
        logits = logits.float()
        loss = F.cross_entropy(logits, yb, label_smoothing=args.label_smoothing)
    feats = feats.float()
    decay = (1.0 - progress) if args.aux_decay else 1.0
    aux_w, pix_w = args.aux_weight * decay, args.aux_pixel_weight * decay
    if aux_w > 0 or pix_w > 0:
        tok_t, pix_t = _aux_targets(mb[:, 0], yb, 8, model.num_classes)
        tokens = feats[:, model.num_prefix_tokens :]
        if aux_w > 0:
            aux = -(tok_t * F.log_softmax(aux_head(tokens), -1)).sum(-1).mean()
            loss = loss + aux_w * aux
        if pix_w > 0:
            loss = loss + pix_w * F.binary_cross_entropy_with_logits(pix_head(tokens), pix_t)
    return loss, logits, yb


def _train(args: argparse.Namespace, model: Any, teacher: Any, aux_head: torch.nn.Module, pix_head: torch.nn.Module,
           opt: torch.optim.Optimizer, x_train: torch.Tensor, y_train: torch.Tensor, m_train: torch.Tensor,
           x_test: torch.Tensor, y_test: torch.Tensor, deadline: float, log: Callable[[str], None]) -> dict[str, Any]:
    """The training loop (by steps or by the wall-clock budget); returns what the card and the JSON record."""
    from tqdm import tqdm

    aux_params = list(aux_head.parameters()) + list(pix_head.parameters())
    g = torch.Generator().manual_seed(args.seed)
    n, bs = len(x_train), args.batch_size
    t_train0 = time.perf_counter()
    train_budget = max(deadline - args.reserve_s - t_train0, 1.0)
    by_steps = bool(args.steps)
    batches = BatchSampler(n, g)
    step = 0
    time_limited = False
    loss_ema = acc_ema = None
    threads = ThreadChooser(args.threads, adaptive=args.adaptive_threads)
    if by_steps:
        bar = tqdm(total=args.steps, disable=args.no_progress, unit="step", dynamic_ncols=True, mininterval=2.0)
    else:
        bar = tqdm(total=round(train_budget), disable=args.no_progress, unit="s", dynamic_ncols=True,
                   mininterval=2.0, bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} s [{elapsed}<{remaining}{postfix}]")
    use_bf16 = args.precision == "bf16" or (args.precision == "auto" and cpu_has_bf16())
    teacher_pred = None
    if teacher is not None:
        # The teacher's hard predictions, once per training image rather than per augmented batch: the dihedral
        # transforms never change a scene's class, and one pass over the 24,000 images replaces a teacher forward in
        # every step (1,500 steps x 128 = 192,000 images).
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_bf16):
            teacher_pred = _predict(teacher, x_train)
        agree = (teacher_pred == y_train).float().mean().item()
        log(f"teacher predictions on the training set ready ({agree:.2%} agree with the labels)")
    log(f"training in {'bf16 autocast' if use_bf16 else 'fp32'}")
    model.train()
    loads = [load_average()]
    cpu0 = time.process_time()
    # explicit attention (softmax(q k^T) v) trains faster on CPU than the fused kernel, much faster in bf16; the
    # flags are restored afterwards, also after an exception
    with get_adapter(model).explicit_attention():  # trains faster on CPU (much faster in bf16)
        while True:
            now = time.perf_counter()
            elapsed = now - t_train0
            if by_steps:
                progress = step / max(args.steps, 1)
                if step >= args.steps:
                    break
                if elapsed >= train_budget:
                    time_limited = True
                    break
            else:  # the schedule follows wall-clock time, so training ends on time whatever the CPU load
                progress = elapsed / train_budget
                if progress >= 1.0:
                    break
            if args.stop_after is not None and step >= args.stop_after:
                break
            lr = args.lr * lr_factor(progress, args.warmup_frac, args.min_lr_frac)
            set_lr(opt, lr)

            idx = batches.take(bs)
            t_step = threads.start(step)
            flips = torch.randint(0, 2, (len(idx), 3), generator=g).bool()
            loss, logits, yb = _batch_loss(args, model, idx, flips, progress, x_train, m_train, y_train, teacher_pred,
                                           aux_head, pix_head, use_bf16)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(list(model.parameters()) + aux_params, 1.0, foreach=True)
            opt.step()
            step += 1
            threads.stop(t_step)
            if step % 50 == 0:
                loads.append(load_average())

            acc = (logits.argmax(-1) == yb).float().mean().item()
            loss_ema = loss.item() if loss_ema is None else 0.98 * loss_ema + 0.02 * loss.item()
            acc_ema = acc if acc_ema is None else 0.98 * acc_ema + 0.02 * acc
            if by_steps:
                bar.update(1)
            else:
                bar.update(min(time.perf_counter() - t_train0, train_budget) - bar.n)
            bar.set_postfix(step=step, loss=f"{loss_ema:.3f}", acc=f"{acc_ema:.3f}", lr=f"{lr:.1e}",
                            thr=threads.current, refresh=False)
            if args.eval_every and step % args.eval_every == 0:
                val = (_predict(model, x_test[:500]) == y_test[:500]).float().mean().item()
                model.train()
                bar.write(f"step {step}: loss {loss_ema:.3f} train acc {acc_ema:.3f} lr {lr:.1e} "
                          f"test acc (500) {val:.3f} threads {threads.current} [{time.perf_counter() - t_train0:.0f} s]")
    bar.close()
    training_time = time.perf_counter() - t_train0
    cpu_time = time.process_time() - cpu0
    loads.append(load_average())
    return {"step": step, "time_limited": time_limited, "training_time": training_time, "cpu_time": cpu_time,
            "loads": loads, "use_bf16": use_bf16}


def _build(args: argparse.Namespace, name: str, log: Callable[[str], None]
           ) -> tuple[Any, Any, int, torch.nn.Linear, torch.nn.Linear, torch.optim.Optimizer]:
    """The model to train (initialised), the DeiT teacher (or ``None``), the parameter count, the auxiliary
    token-label and pixel heads (training only; not part of the shipped model) and the AdamW optimiser."""
    model: Any = BUNDLED[name].build()
    distilled = getattr(model, "head_dist", None) is not None
    teacher = None
    if distilled:  # DeiT: the DIST head learns the teacher's hard predictions
        from vitlens.models.zoo import load_bundled

        teacher = load_bundled(args.teacher)
        log(f"teacher {args.teacher}: hard-label distillation into the DIST head")
        model.set_distilled_training(True)
    n_params = sum(p.numel() for p in model.parameters())
    if args.init == "mimetic":
        mimetic_init(model, g=torch.Generator().manual_seed(args.seed + 1))
    if args.pos_init == "sincos":
        sincos_pos_init(model)
    # auxiliary token-label head (training only; not part of the shipped model)
    aux_head = torch.nn.Linear(model.embed_dim, model.num_classes + 1)
    pix_head = torch.nn.Linear(model.embed_dim, 64)
    groups = param_groups(model, args.weight_decay)
    groups[0]["params"] += [aux_head.weight, pix_head.weight]
    groups[1]["params"] += [aux_head.bias, pix_head.bias]
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.999), fused=True)  # fused: one kernel, not a loop
    return model, teacher, n_params, aux_head, pix_head, opt


def _export(args: argparse.Namespace, name: str, model: Any, x_test: torch.Tensor, y_test: torch.Tensor
            ) -> tuple[Path, float, dict[str, dict[str, Any]], np.ndarray]:
    """Store the weights as float16 safetensors and re-measure the stored model: ``(weights path, test accuracy,
    per-class accuracy, attention Gini (layers, heads))``."""
    w_path = export_weights(model, args.out, name, args.seed, mode=0o644)
    shipped, test_acc, per_class = remeasure(BUNDLED[name].build, w_path, x_test, y_test, _names(name), _predict)
    gini_lh = attention_gini(shipped, x_test[:500])
    return w_path, test_acc, per_class, gini_lh


def main(argv: Sequence[str] | None = None) -> int:
    """Run the training command; returns the process exit code (0 on success, 1 if below the accuracy target)."""
    t0 = time.perf_counter()
    args = _parse(argv)
    argv_list = list(sys.argv[1:] if argv is None else argv)
    if args.steps is None:
        args.steps = MODELS[args.model][2]
    if args.seed is None:
        args.seed = DEFAULT_SEED.get(args.model, 0)
    kind = DATA_KIND.get(args.model, "shapes")
    if not args.steps and not args.minutes:
        raise SystemExit("--steps 0 (a clock-driven schedule) needs a --minutes budget")
    deadline = t0 + args.minutes * 60.0 if args.minutes else math.inf
    name = args.model
    target_acc = MODELS[name][1]

    import timm  # noqa: F401  (fail early if missing)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    train_seed, test_seed = args.seed, TEST_SEED_OFFSET + args.seed
    log = print

    # ---- data ---------------------------------------------------------------------------------------------------
    log(f"generating {args.n_train} training scenes (seed {train_seed}) and {args.n_test} test scenes "
        f"(seed {test_seed}) ...")
    train = make_scenes_parallel(args.n_train, seed=train_seed, workers=args.threads, kind=kind)  # both cores
    test = make_scenes_parallel(args.n_test, seed=test_seed, workers=1, kind=kind)
    x_train, y_train = train.images, train.labels
    m_train = train.masks
    x_test, y_test = test.images, test.labels
    del train
    log(f"data ready after {time.perf_counter() - t0:.1f} s")

    # ---- model / optimiser ----------------------------------------------------------------------------------------
    model, teacher, n_params, aux_head, pix_head, opt = _build(args, name, log)
    distilled = teacher is not None
    run = _train(args, model, teacher, aux_head, pix_head, opt, x_train, y_train, m_train, x_test, y_test, deadline,
                 log)
    step, time_limited, use_bf16 = run["step"], run["time_limited"], run["use_bf16"]
    training_time, cpu_time = run["training_time"], run["cpu_time"]
    n, bs = len(x_train), args.batch_size
    load, load_note = describe_load(run["loads"], args.threads, training_time, cpu_time)
    log(f"trained {step} steps ({step * bs / n:.2f} epochs) in {training_time:.1f} s"
        + (" (stopped by the time budget)" if time_limited else ""))

    acc_fp32 = (_predict(model, x_test) == y_test).float().mean().item()

    # ---- export and re-measure on the shipped weights ---------------------------------------------------------------
    out: Path = args.out
    w_path, test_acc, per_class, gini_lh = _export(args, name, model, x_test, y_test)

    total_time = time.perf_counter() - t0
    meta = {
        **meta_head(name, "shapes", argv_list, args.seed),
        "train_data_seed": train_seed,
        "test_data_seed": test_seed,
        "n_train": len(x_train),
        "n_test": len(x_test),
        "image_size": int(x_train.shape[-1]),
        "class_names": list(_names(name)),
        "data": kind,
        "normalisation": {"mean": list(SHAPES_MEAN), "std": list(SHAPES_STD)},
        **meta_schedule(args),
        "label_smoothing": args.label_smoothing,
        "init": args.init,
        "aux_weight": args.aux_weight,
        "aux_decay": bool(args.aux_decay),
        "precision": "bf16 autocast" if use_bf16 else "fp32",
        "teacher": args.teacher if distilled else None,
        "augmentation": "random horizontal flip, vertical flip, transpose (dihedral group)",
        "steps": step,
        "epochs": step * bs / n,
        "stopped_by_time_budget": time_limited,
        "minutes_budget": args.minutes,
        **meta_timing(training_time, total_time, cpu_time, load, load_note),
        "test_accuracy": test_acc,
        "test_accuracy_fp32_before_export": acc_fp32,
        "per_class_accuracy": per_class,
        "attention_gini": gini_record(gini_lh, "per head: Gini of each attention row, averaged over rows and the "
                                               "first 500 test images"),
        **meta_weights_and_software(w_path, n_params, args.threads, "timm"),
        "train_command": BUNDLED[name].train_command,
    }
    if kind != "shapes":  # what the model uses, checked causally on the test scenes (vitlens.metrics.verify_evidence)
        meta["evidence_use"] = evidence_record(BUNDLED[name].build, w_path, kind, args.n_test, test_seed)
    write_meta(out, name, meta)
    _write_card(out / f"{name}.md", meta, gini_lh)

    log_classifier_result(log, test_acc, acc_fp32, per_class, gini_lh, digits=3)
    log(f"wrote {w_path}, {name}.json, {name}.md to {out} (total {total_time:.1f} s)")
    return 0 if test_acc >= target_acc else 1


if __name__ == "__main__":
    raise SystemExit(main())
