"""Hard, pixel-level deletion and insertion: the AHA authors' evaluation protocol (for comparable numbers).

Protocol (recorded in :data:`PROTOCOL`): pixels ranked by the map with a stable descending sort (ties broken by
pixel index, row-major), ``n_points = 21`` fractions ``0, 5 %, …, 100 %`` (``k = round(p·H·W)`` pixels), dataset-mean
reference (the data config's mean colour, 0 after normalisation), the class explained is the predicted class (or the
one given), score = softmax probability, AUC by the trapezoidal rule over ``p``.

* **Deletion** (lower is better): the ``k`` most important pixels replaced by the reference.
* **Insertion** (higher is better): the ``k`` most important pixels of ``x`` shown on the reference (all other pixels
  replaced). Read backwards, this is deleting the least important first, the ascending sort of the training loss.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ..models import get_adapter

__all__ = ["PROTOCOL", "deletion_insertion"]

#: The settings of :func:`deletion_insertion` that define its numbers.
PROTOCOL: dict[str, Any] = {
    "ranking": "pixel-level, stable descending sort of the map (ties: lower pixel index first)",
    "n_points": 21,
    "reference": "dataset-mean colour (0 after normalisation)",
    "class": "predicted",
    "score": "softmax probability",
    "auc": "trapezoidal over the deleted/inserted fraction in [0, 1]",
}


def deletion_insertion(model: nn.Module, x: Tensor, maps: Tensor, classes: Tensor | None = None,
                       n_points: int = 21, chunk: int = 256, ref: Tensor | None = None) -> dict[str, Tensor]:
    """Deletion and insertion curves and AUCs of ``maps`` ``(B, H, W)`` for images ``x`` ``(B, C, H, W)``.

    Args:
        model: the classifier (any module mapping ``x`` to logits).
        classes: ``(B,)`` classes to score; default the predicted class on ``x``.
        n_points: curve points (fractions ``linspace(0, 1, n_points)``).
        chunk: images per forward pass (memory knob; results do not depend on it).
        ref: reference images ``(B, C, H, W)`` (normalised); default the dataset mean (zeros).

    Returns:
        ``{"deletion": (B,), "insertion": (B,), "difference": insertion − deletion (B,), "classes": (B,),
        "fractions": (n,), "deletion_curve": (B, n), "insertion_curve": (B, n)}`` (float32, on ``x``'s device).
    """
    adapter = get_adapter(model)
    b, c, h, w = x.shape
    if maps.shape != (b, h, w):
        raise ValueError(f"maps must have shape {(b, h, w)}, got {tuple(maps.shape)}")
    ref = torch.zeros_like(x) if ref is None else ref
    fractions = torch.linspace(0.0, 1.0, n_points)
    ks = torch.round(fractions * (h * w)).long().to(x.device)  # (n,)
    order = torch.argsort(maps.reshape(b, -1).float(), dim=1, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(h * w, device=x.device).expand(b, -1).contiguous())
    top = rank[:, None, :] < ks[None, :, None]  # (B, n, HW): among the k most important
    top = top.reshape(b, n_points, 1, h, w)
    xd = torch.where(top, ref[:, None], x[:, None])  # deletion: top-k replaced
    xi = torch.where(top, x[:, None], ref[:, None])  # insertion: only the top-k shown
    imgs = torch.stack([xd, xi], dim=1).reshape(-1, c, h, w)  # (B·2·n, C, H, W)
    with adapter.session(capture=False), torch.no_grad():
        if classes is None:
            classes = adapter.forward(x).argmax(dim=-1)
        cls = classes.to(x.device).long()[:, None].expand(b, 2 * n_points).reshape(-1)
        probs = []
        for s in range(0, imgs.shape[0], chunk):
            logits = adapter.forward(imgs[s:s + chunk]).float()
            probs.append(logits.softmax(dim=-1).gather(1, cls[s:s + chunk, None])[:, 0])
        p = torch.cat(probs).reshape(b, 2, n_points)
    fr = fractions.to(p.device)
    dele = torch.trapezoid(p[:, 0], fr, dim=-1)
    ins = torch.trapezoid(p[:, 1], fr, dim=-1)
    return {"deletion": dele, "insertion": ins, "difference": ins - dele, "classes": classes.long(),
            "fractions": fr, "deletion_curve": p[:, 0], "insertion_curve": p[:, 1]}
