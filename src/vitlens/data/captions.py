"""Captions of the multi-object scenes, from their exact ground truth (what ``shapes-clip`` is trained on).

A caption names every object of a scene, in random order, with a random template::

    a ring and a triangle
    a picture of a star, a disk and a cross
    a scene with a square on the left and a ring at the top right

With probability ``position_prob`` every object also gets its position: the centroid of its visible pixels in the
3×3 grid of image thirds (``at the top left``, ``at the top``, ``on the left``, ``in the centre``, …). Positions are
computed from the label map as given, so a flipped scene gets the flipped positions.

:func:`caption_positives` says which captions are true of which scenes (a caption is true of a scene when it names
exactly the scene's objects and, if it gives positions, the scene's positions): the contrastive loss treats every
true caption of a batch as a positive, not only the scene's own.
"""

from __future__ import annotations

import numpy as np
import torch

from .scenes import CLASS_NAMES

__all__ = ["CAPTION_PREFIXES", "POSITION_PHRASES", "caption_positives", "object_positions", "scene_captions"]

#: The templates' openings (one drawn uniformly per caption).
CAPTION_PREFIXES: tuple[str, ...] = ("", "a picture of ", "a photo of ", "a scene with ")
#: Phrase of each position code ``3 * row + col`` (rows top → bottom, columns left → right, thirds of the image).
POSITION_PHRASES: tuple[str, ...] = (
    "at the top left", "at the top", "at the top right",
    "on the left", "in the centre", "on the right",
    "at the bottom left", "at the bottom", "at the bottom right",
)


def object_positions(label_maps: torch.Tensor, num_classes: int = len(CLASS_NAMES)) -> torch.Tensor:
    """Position code (``3 * row + col`` of the thirds holding the centroid) of each class's visible pixels.

    Args:
        label_maps: ``(N, H, W)`` integer label maps (0 background, ``k + 1`` class ``k``).

    Returns:
        ``(N, num_classes)`` int64 codes in ``0 … 8``; ``-1`` where the class is absent.
    """
    n, h, w = label_maps.shape
    masks = label_maps[:, None] == torch.arange(1, num_classes + 1, dtype=label_maps.dtype)[None, :, None, None]
    area = masks.sum((2, 3))
    ys = (masks.sum(3) * torch.arange(h)).sum(-1) / area.clamp(min=1)  # (N, K) centroid rows (pixel indices)
    xs = (masks.sum(2) * torch.arange(w)).sum(-1) / area.clamp(min=1)
    row = ((ys + 0.5) * 3 / h).long().clamp(0, 2)
    col = ((xs + 0.5) * 3 / w).long().clamp(0, 2)
    return torch.where(area > 0, 3 * row + col, torch.full_like(row, -1))


def scene_captions(label_maps: torch.Tensor, rng: np.random.Generator, position_prob: float = 0.5,
                   class_names: tuple[str, ...] = CLASS_NAMES) -> tuple[list[str], torch.Tensor]:
    """One random caption per scene.

    Args:
        label_maps: ``(N, H, W)`` label maps (:attr:`vitlens.data.MultiScenes.label_maps`, possibly flipped).
        rng: the generator drawing templates, orders and whether positions are given.
        position_prob: probability that a caption gives every object's position.

    Returns:
        ``(captions, with_positions)``: ``N`` strings and an ``(N,)`` bool tensor (the caption gives positions).
    """
    pos = object_positions(label_maps, len(class_names))
    captions, with_pos = [], []
    for row in pos.tolist():
        classes = [k for k, p in enumerate(row) if p >= 0]
        order = rng.permutation(len(classes))
        give = bool(rng.random() < position_prob)
        parts = [f"a {class_names[classes[i]]}" + (f" {POSITION_PHRASES[row[classes[i]]]}" if give else "")
                 for i in order]
        body = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
        captions.append(CAPTION_PREFIXES[int(rng.integers(len(CAPTION_PREFIXES)))] + body)
        with_pos.append(give)
    return captions, torch.tensor(with_pos, dtype=torch.bool)


def caption_positives(label_maps: torch.Tensor, with_positions: torch.Tensor,
                      num_classes: int = len(CLASS_NAMES)) -> torch.Tensor:
    """``(N, N)`` bool: ``[i, j]`` iff caption ``j`` (of scene ``j``, from :func:`scene_captions`) is true of scene
    ``i``: the same set of classes and, when caption ``j`` gives positions, the same position of every object."""
    pos = object_positions(label_maps, num_classes)  # (N, K), -1 absent
    same_set = ((pos >= 0)[:, None] == (pos >= 0)[None, :]).all(-1)
    same_pos = (pos[:, None] == pos[None, :]).all(-1)
    return same_set & (~with_positions[None, :] | same_pos)
