"""Localisation metrics against ground-truth regions: pointing game and energy inside the region.

Both score direction: higher is better.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import InputError
from .base import Metric, MetricResult, check_maps, register_metric

__all__ = ["pointing_game", "energy_inside", "boxes_to_masks", "PointingGame"]


def _check(maps: Tensor, masks: Tensor) -> tuple[Tensor, Tensor]:
    maps = check_maps(maps)
    if masks.shape != maps.shape:
        raise InputError(f"masks must have the maps' shape {tuple(maps.shape)}; got {tuple(masks.shape)}")
    return maps, masks.to(device=maps.device, dtype=torch.bool)


def boxes_to_masks(boxes: Tensor, size: tuple[int, int]) -> Tensor:
    """Boxes ``(B, 4)`` as ``x0, y0, x1, y1`` (x1, y1 exclusive, clipped to the image) → masks ``(B, H, W)``."""
    h, w = size
    ys = torch.arange(h, device=boxes.device)[None, :, None]
    xs = torch.arange(w, device=boxes.device)[None, None, :]
    x0, y0, x1, y1 = (boxes[:, i, None, None] for i in range(4))
    return (xs >= x0) & (xs < x1) & (ys >= y0) & (ys < y1)


def _dilate(masks: Tensor, radius: float) -> Tensor:
    """Dilate boolean masks ``(B, H, W)`` by a Euclidean disk of ``radius`` pixels."""
    r = int(math.floor(radius))
    if r <= 0:
        return masks
    yy, xx = torch.meshgrid(torch.arange(-r, r + 1), torch.arange(-r, r + 1), indexing="ij")
    disk = ((yy**2 + xx**2) <= radius**2).float().to(masks.device)
    out = F.conv2d(masks[:, None].float(), disk[None, None], padding=r)[:, 0]
    return out > 0


def pointing_game(maps: Tensor, masks: Tensor, tolerance: float = 0.0) -> Tensor:
    """Pointing game (Zhang et al., ECCV 2016): per image, 1.0 if the map's maximum lies in the region, else 0.0.

    Args:
        maps: ``(B, H, W)`` attribution maps. masks: ``(B, H, W)`` bool ground-truth regions of the target class.
        tolerance: a maximum within this many pixels (Euclidean) of the region counts as a hit (original: 15 px at
            224 px; scale with the image size).

    Ties: every pixel that attains the maximum is checked and the image is a hit if any of them is inside. A
    constant map points nowhere and is a miss. Returns ``(B,)`` float hits (mean = accuracy).
    """
    maps, masks = _check(maps, masks)
    region = _dilate(masks, tolerance)
    flat = maps.flatten(1)
    mx = flat.amax(dim=1, keepdim=True)
    is_max = flat == mx
    hit = (is_max & region.flatten(1)).any(dim=1)
    constant = flat.amin(dim=1) == mx[:, 0]
    return (hit & ~constant).float()


def energy_inside(maps: Tensor, masks: Tensor) -> Tensor:
    """Share of the positive attribution mass inside the region, ``Σ_in m⁺ / Σ m⁺``, per image ``(B,)``.

    A map with no positive mass scores 0.
    """
    maps, masks = _check(maps, masks)
    pos = maps.clamp_min(0).flatten(1)
    total = pos.sum(dim=1)
    inside = (pos * masks.flatten(1)).sum(dim=1)
    return torch.where(total > 0, inside / total.clamp_min(1e-30), torch.zeros_like(total))


@register_metric
class PointingGame(Metric):
    """Pointing game against masks (or boxes, turned into masks), plus the energy variant.

    Settings: ``tolerance`` (pixels), ``skip_large`` (TIS rule: images whose region covers at least this fraction of
    the image are skipped, NaN; ``None`` keeps all).
    """

    name = "pointing_game"
    outputs = {"pointing_game": True, "energy_inside": True}

    needs_any = frozenset({"masks", "boxes"})

    def __init__(self, tolerance: float = 0.0, skip_large: float | None = None) -> None:
        from ..options import check_number

        tolerance = check_number("tolerance", tolerance, low=0, owner="metric 'pointing_game'")
        if skip_large is not None:
            skip_large = check_number("skip_large", skip_large, low=0, high=1, low_open=True,
                                      owner="metric 'pointing_game'")
        super().__init__(tolerance=tolerance, skip_large=skip_large)

    def compute(self, maps: Tensor, *, masks: Tensor | None = None, boxes: Tensor | None = None,
                **_: object) -> MetricResult:
        if masks is None:
            if boxes is None:
                raise InputError("pointing_game needs masks or boxes")
            masks = boxes_to_masks(boxes.to(maps.device), (int(maps.shape[-2]), int(maps.shape[-1])))
        hits = pointing_game(maps, masks, self.settings["tolerance"])
        energy = energy_inside(maps, masks)
        skip = self.settings["skip_large"]
        if skip is not None:
            large = masks.flatten(1).float().mean(1).to(hits.device) >= skip
            hits = torch.where(large, torch.full_like(hits, float("nan")), hits)
            energy = torch.where(large, torch.full_like(energy, float("nan")), energy)
        return self.result({"pointing_game": hits, "energy_inside": energy})
