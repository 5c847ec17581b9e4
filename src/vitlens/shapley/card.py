"""The model card of a trained ViT-Shapley explainer (:func:`model_card`), from the metadata saved beside its weights;
library versions and the target's name come from AHA's card helpers (:mod:`vitlens.aha.card`)."""

from __future__ import annotations

import json
import shlex
from typing import Any

import numpy as np

from .network import ShapleyExplainer

__all__ = ["model_card"]


def _mean_last(history: list[list[Any]], phase: str, k: int = 20) -> float:
    vals = [float(v) for p, v in history if p == phase][-k:]
    return float(np.mean(vals)) if vals else float("nan")


def model_card(meta: dict[str, Any], net: ShapleyExplainer) -> str:
    """The Markdown card of ``net`` from its metadata ``meta``."""
    t = meta["train"]
    command = meta.get("command") or "train_shapley(...) (Python API)"
    words = shlex.split(command) if meta.get("command") else []
    if "--resume" in words:
        command = shlex.join(w for w in words if w != "--resume")
    vs = (meta.get("validation") or {}).get("surrogate") or {}
    ve = (meta.get("validation") or {}).get("explainer") or {}
    trained = sum(p.numel() for p in net.head.parameters())
    hist = meta.get("loss_history") or []
    grid = meta.get("layout", {}).get("grid", list(net.layout.grid))
    lines = [
        f"# {meta['name']}",
        "",
        f"ViT-Shapley explainer (Covert, Lundberg & Lee, ICLR 2023) for `{meta['target']['name']}` (weights digest "
        f"`{meta['target']['sha']}`): every class's Shapley value of each of the {grid[0]}×{grid[1]} patches in one "
        "forward pass, for the game `v(S)` = the fine-tuned surrogate's softmax probability with only the patches `S` "
        "present. Use: `vitlens.explain(model, x, method=\"vit_shapley\")` (see docs/methods/vit_shapley.md).",
        "",
        "## Training",
        "",
        f"- Command: `{command}`" + (" (add `--resume` to continue an interrupted run)" if "--resume" in words else ""),
        f"- Seed {t['seed']}; {t['surrogate_steps']} surrogate steps then {t['steps']} explainer steps of "
        f"{t['batch_size']} images on {meta['processes']} process(es), {meta['device']}; wall time "
        f"{meta['seconds']:.0f} s; written {meta['written']}.",
        f"- Data: {json.dumps(meta['data'])}",
        f"- Surrogate: a copy of the model, every weight fine-tuned; held-out patches zeroed in pixels and masked out of "
        f"every attention; one uniform-size random subset per image; KL to the model's probabilities on the whole "
        f"image; AdamW lr {t['surrogate_lr']}, weight decay {t['weight_decay']}; stored in float16 (the explainer "
        "was trained against the rounded surrogate).",
        f"- Explainer: the surrogate's last {t['tune_blocks']} block(s) fine-tuned + one new attention block + "
        f"LayerNorm + MLP (D → 4D → 4D → K) + tanh, additive efficient normalisation; {trained:,} trained "
        f"parameters; {t['masks']} Shapley-kernel subsets per image{' (paired with their complements)' if t['paired'] else ''}; "
        f"AdamW lr {t['lr']}; warm-up {t['warmup_frac']:.0%} then cosine per phase, clip {t['clip']}.",
        f"- Final training losses (mean of the last 20 steps): surrogate KL {_mean_last(hist, 'surrogate'):.4f}, "
        f"explainer {_mean_last(hist, 'explainer'):.5f}.",
        "",
        "## Validation (held-out images)",
        "",
        "| measure | value |",
        "|---|---|",
        f"| images | {vs.get('n', ve.get('n', 0))} |",
        f"| KL(model on x ‖ model on x_S), random subsets S (no fine-tuning) | {vs.get('kl_model', float('nan')):.4f} |",
        f"| KL(model on x ‖ surrogate on x_S), same subsets | {vs.get('kl_surrogate', float('nan')):.4f} |",
        f"| surrogate top-1 = model top-1 on the whole image | {vs.get('top1_agreement', float('nan')):.3f} |",
        f"| explainer loss n·mean(v(∅) + Σ_S φ − v(S))², Shapley-kernel subsets | {ve.get('loss', float('nan')):.5f} |",
        f"| largest efficiency gap \\|Σφ − (v(1) − v(∅))\\| | {ve.get('efficiency_gap', float('nan')):.2e} |",
        "",
        "The error against a converged KernelSHAP of the same game is in docs/benchmarks/vit_shapley.md.",
        "",
        "## Notes",
        "",
        "- The explainer is tied to the model's weights (digest above; another model warns): retrain it with the "
        "command above when they change. The run also leaves `checkpoint.pt` (for `--resume`); it is not shipped.",
        *(f"- {note}" for note in meta.get("notes") or []),
        "",
        f"Versions: {json.dumps(meta['versions'])}",
        "",
    ]
    return "\n".join(lines)
