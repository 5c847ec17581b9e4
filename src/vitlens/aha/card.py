"""What an AHA run writes about itself: the Markdown model card (:func:`model_card`, with the learning curve as a
table, :func:`curve_lines`), the library versions (:func:`versions`) and the target's name (:func:`model_name`)."""

from __future__ import annotations

import contextlib
import json
import platform
import shlex
from typing import Any

import numpy as np
import torch

from ..models import get_adapter
from .network import AHANet

__all__ = ["curve_lines", "model_card", "model_name", "spread_lines", "versions"]


def model_name(model: Any) -> str:
    """The target's name in the metadata: its adapter's :meth:`~vitlens.models.Adapter.architecture` (timm's
    ``pretrained_cfg["architecture"]``, else the class name)."""
    return get_adapter(model).architecture()



def versions() -> dict[str, str]:
    """Versions of Python, torch, vitlens and timm (those installed), for the metadata and the card."""
    out = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        from .. import __version__

        out["vitlens"] = __version__
    except ImportError:  # pragma: no cover
        pass
    with contextlib.suppress(ImportError):
        import timm

        out["timm"] = timm.__version__
    return out


def model_card(meta: dict[str, Any], net: AHANet) -> str:
    """The Markdown model card of the explainer ``net`` from its metadata ``meta`` (as saved beside the weights)."""
    t = meta["train"]
    sorting = " (straight-through: hard ranking forward)" if t.get("straight_through") else ""
    sharp = "" if t.get("mask_sigma", 1.0) == 1.0 else f"; mask blur σ {t['mask_sigma']} px"
    # the recorded command may be the invocation that resumed the run: shown as the one that starts it afresh
    # (``--resume`` on an empty folder is refused)
    command = meta.get("command") or "train_aha(...) (Python API)"
    words = shlex.split(command) if meta.get("command") else []
    resumed = "--resume" in words
    if resumed:
        command = shlex.join(w for w in words if w != "--resume")
    odds = f" drawn with odds {t['reference_weights']}" if t.get("reference_weights") else ""
    teacher = (f"; teacher `{t['teacher']}` (weight {t.get('w_teacher', 1.0)}, fading to 0 at "
               f"{t.get('teacher_frac', 0.5):.0%} of the steps"
               + _teacher_file_words(t, meta.get("teacher_file"))
               + (f", on the first {t['teacher_images']:,} training images" if t.get("teacher_images") else "")
               + ")" if t.get("teacher") else "")
    v = meta.get("validation") or {}
    sfx = "" if v.get("output_pool", t.get("pool", "none")) == t.get("pool", "none") else f"_{v['output_pool']}"
    n_params = sum(p.numel() for p in net.decoder.parameters())
    lines = [
        f"# {meta['name']}",
        "",
        f"AHA explainer (amortised deletion/insertion-trained attribution network) for `{meta['target']['name']}` "
        f"(weights digest `{meta['target']['sha']}`). Use: "
        "`vitlens.explain(model, x, method=\"aha\", explainer=PATH)` (see docs/methods/aha.md).",
        "",
        "## Training",
        "",
        f"- Command: `{command}`" + (" (add `--resume` to continue an interrupted run)" if resumed else ""),
        f"- Seed {meta['seed']}; {meta['steps']} steps of {t['batch_size']} images on {meta['processes']} "
        f"process(es), {meta['device']}; wall time {meta['seconds']:.0f} s; written {meta['written']}.",
        f"- Data: {json.dumps(meta['data'])}",
        f"- Decoder: width {t['width']}, {len(net.arch['depths'])} levels (backbone {net.arch['backbone']}, depths "
        f"{net.arch['depths']}), {n_params:,} trained parameters.",
        f"- Recipe: `{t.get('recipe', 'authors')}` (docs/methods/aha.md §4).",
        f"- Loss: w_del {t['w_del']}, w_ins {t['w_ins']}, w_peak {t['w_peak']} (pool {t['peak_kernel']}); "
        f"m = {t['m']} ({t['step_sampling']}); grid range {t['grid_range'] or 'default'}, offset {t['grid_offset']}; "
        f"references {t['references']}{odds}; τ {t['tau_start']} → {t['tau_end']}, Gumbel noise × {t.get('noise_scale', 1.0)}, "
        f"{t['n_iters']} Sinkhorn iterations{sorting}{sharp}; "
        f"{t['classes_per_image']} class(es) per image{teacher}.",
        f"- Optimiser: AdamW lr {t['lr']}, weight decay {t['weight_decay']}, clip {t['clip']}, warm-up "
        f"{t['warmup_frac']:.0%} then cosine.",
        f"- Final training loss (mean of the last 10 steps): "
        f"{np.mean(meta['loss_history'][-10:]) if meta['loss_history'] else float('nan'):.4f}.",
        "",
        "## Validation (held-out, hard pixel-level deletion/insertion, T = 0)",
        "",
        f"Protocol: {meta['validation_protocol']['n_points']} points, "
        + (f"the mean over the deletion references {', '.join(v['references'])} (each below)"
           if v.get("references") else "mean reference")
        + ", predicted class, softmax probability, trapezoidal AUC."
        + (f" Shipped: the checkpoint of step {v['selected_step']}, the best of the validations."
           if v.get("selected_step") not in (None, meta["steps"]) else ""),
        "",
        f"Output pooling chosen on these images: `{v.get('output_pool', 'none')}` (docs/methods/aha.md §1)"
        + (f"; pixel map {v['difference']:.4f}, token-pooled {v['difference_tokens']:.4f} insertion − deletion."
           if "difference_tokens" in v else "."),
        "",
        *spread_lines(v),
        "| images | deletion ↓ | insertion ↑ | insertion − deletion ↑ |",
        "|---|---|---|---|",
        f"| {v.get('n', 0)} | {v.get('deletion' + sfx, float('nan')):.4f} | "
        f"{v.get('insertion' + sfx, float('nan')):.4f} | {v.get('difference' + sfx, float('nan')):.4f} |",
        "",
        *([("| reference | " + " | ".join(v["references"]) + " |"),
           "|---|" + "---|" * len(v["references"]),
           "| insertion − deletion ↑ | " + " | ".join(f"{v.get(f'difference{sfx}@{r}', float('nan')):.4f}"
                                                   for r in v["references"]) + " |", ""]
          if v.get("references") else []),
        *curve_lines(meta.get("learning_curve") or []),
        "## Notes",
        "",
        "- The explainer is tied to the target's weights (digest above; loading it for other weights warns): retrain "
        "it with the command above whenever they change. The command also leaves `checkpoint.pt` (optimiser state, "
        "for `--resume`) in the output folder; it is not part of the shipped files.",
        "- Any number of processes gives the same weights up to float rounding (the batch is sharded, every random "
        "draw is keyed by step and image); the same process count reproduces them bit for bit.",
        *(f"- {note}" for note in meta.get("notes") or []),  # what a maintainer added to the JSON after training
        "",
        f"Versions: {json.dumps(meta['versions'])}",
        "",
    ]
    return "\n".join(lines)


def spread_lines(v: dict[str, Any]) -> list[str]:
    """The card's paragraph on the spread of the token scores (:attr:`AHANet.spread`), where it was chosen."""
    if not v.get("spread_scores"):
        return []
    scores = ", ".join(f"λ = {k}: {val:.4f}" for k, val in v["spread_scores"].items())
    what = "insertion − deletion, mean of the references" if len(v.get("references") or []) > 1 \
        else "insertion − deletion"
    line = (f"Spread of the token scores chosen on these images: λ = {v['spread']:g} ({what}: {scores}; "
            "docs/methods/aha.md §1).")
    if v.get("spread") and v.get("spread_refs"):
        line += (" At the chosen λ, by reference: "
                 + ", ".join(f"{r} {val:.4f}" for r, val in v["spread_refs"].items())
                 + ". The tables below are the constant token scores (λ = 0) the checkpoint was chosen on.")
    return [line, ""]


def curve_lines(curve: list[dict[str, Any]]) -> list[str]:
    """The learning curve as a Markdown table (empty without ``--val-every``)."""
    if not curve:
        return []
    tok = "difference_tokens" in curve[-1]
    lines = ["## Learning curve (held-out, hard metric as above; soft: the training objective on 50 of the same images)",
             "", "| step | images seen | wall time (s) | deletion ↓ | insertion ↑ | insertion − deletion ↑ | "
             + ("ins − del, token-pooled ↑ | " if tok else "") + "soft ins − del |",
             "|---|---|---|---|---|---|" + ("---|" if tok else "") + "---|"]
    for v in curve:
        soft = v.get("soft_difference")
        extra = f"{v.get('difference_tokens', float('nan')):.4f} | " if tok else ""
        lines.append(f"| {v['step']} | {v.get('images_seen', 0):,} | {v.get('seconds', 0):.0f} | {v['deletion']:.4f} | "
                     f"{v['insertion']:.4f} | {v['difference']:.4f} | {extra}{'' if soft is None else f'{soft:.4f}'} |")
    return lines + [""]


def _teacher_file_words(t: dict[str, Any], file: dict[str, str] | None) -> str:
    """The card's words for the ``aha`` teacher's explainer: the file the run read, with its SHA-256 (cards written
    before it was recorded: the option as given)."""
    if file:
        return f", refined maps of `{file['path']}` (SHA-256 `{file['sha256'][:16]}…`)"
    return f", refined maps of `{t['teacher_explainer']}`" if t.get("teacher_explainer") else ""
