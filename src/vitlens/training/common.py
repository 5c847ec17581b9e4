"""Pieces shared by the training commands of the bundled models (shapes, digits)."""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Callable

import numpy as np
import torch

__all__ = ["attention_gini", "cpu_has_bf16", "cpu_name", "fmt_time", "gini", "param_groups"]


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: weight decay on matrices only (not on biases, norms, the position embeddings or the CLS token)."""
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        if p.ndim <= 1 or n.endswith(".bias") or n in {"pos_embed", "cls_token"}:
            no_decay.append(p)
        else:
            decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def gini(p: torch.Tensor) -> torch.Tensor:
    """Gini coefficient along the last dim of non-negative ``(..., n)``: 0 = uniform, (n-1)/n = one-hot.

    For ``p`` sorted ascending, ``G = 2 * sum_i i * p_(i) / (n * sum p) - (n + 1) / n`` with ``i = 1..n``.
    """
    n = p.shape[-1]
    s, _ = torch.sort(p, dim=-1)
    i = torch.arange(1, n + 1, dtype=p.dtype, device=p.device)
    return 2.0 * (s * i).sum(-1) / (n * s.sum(-1).clamp_min(1e-12)) - (n + 1.0) / n


@torch.no_grad()
def attention_gini(model: torch.nn.Module, images: torch.Tensor, normalise: Callable[[torch.Tensor], torch.Tensor],
                   batch: int = 250) -> np.ndarray:
    """Per-layer, per-head Gini sparsity of the attention rows, averaged over rows and images.

    The attention probabilities are captured through the model's vitlens adapter, which restores the model when done.

    Args:
        model: a model whose adapter captures attention (the bundled ViTs).
        images: raw ``(N, 3, H, W)`` images in [0, 1]; ``normalise`` maps a batch of them to the model's input.

    Returns:
        ``(depth, heads)`` float64 array.
    """
    from vitlens.models import get_adapter

    adapter = get_adapter(model, require="attention")
    total: torch.Tensor | None = None
    for i in range(0, len(images), batch):
        with adapter.session() as rec:
            adapter.forward(normalise(images[i : i + batch]))
            g = torch.stack([gini(b.attn.detach().float()).mean(-1).sum(0) for b in rec.blocks])  # (depth, heads)
        total = g if total is None else total + g
    assert total is not None
    return (total / len(images)).double().numpy()


def cpu_has_bf16() -> bool:
    """Whether the CPU has native bf16 matrix instructions (AMX-BF16 or AVX512-BF16)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what :mod:`platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def fmt_time(s: float) -> str:
    return f"{int(s // 60)} min {s % 60:04.1f} s"
