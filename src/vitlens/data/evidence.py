"""Scenes whose evidence is known: planted cues and class-specific cue kinds (the proving ground's faithfulness tests).

The localisation scenes (:mod:`vitlens.data.scenes`) know where the object is, not what a model used. The two data
sets here plant the evidence, so that its use can be *verified causally* by removing it and re-running the model
(the counterfactual images are generated exactly, from the same seeds, without the evidence):

``make_planted_scenes`` — a shape scene (object of class A, as in :func:`vitlens.data.make_scenes`) that, in a known
    fraction of images (``cue_frac``), also carries a small *planted cue*: an 8×8-px two-colour checkerboard (at 64
    px; it scales with the image) whose colour pair names a class B, at a random place that does not overlap the
    object. The label is B when a cue is present (the cue decides; in 5 of 6 cue images B ≠ A: object and cue
    conflict) and A otherwise. The cue is a shortcut of the kind backdoor triggers are (Kim et al. 2021, "Sanity
    simulations for saliency methods"; Zhou et al., AAAI 2022, "Do feature attribution methods correctly attribute
    features?"). A checkerboard is unchanged by the flips and transposition used as training augmentation.
    ``without_cue()`` and ``without_object()`` give the same scenes with the cue / the object left out.

``make_cue_scenes`` — scenes with 8 classes, each decided by a different *kind* of evidence, so that heads can
    specialise: shape (``star``, ``cross``: solid objects in a random colour), texture (``stripes``, ``checker``: a
    disk filled with stripes / a checkerboard), colour (``red``, ``blue``: a square or triangle in saturated red /
    blue; no other element is ever near those colours) and count (``two``, ``four``: that many small squares of one
    colour). The same background clutter and distractors (bars, dots, strokes) appear in every class.
    ``without_evidence()`` leaves the class-defining elements out.

Both return :class:`EvidenceScenes`, a :class:`vitlens.data.Scenes` whose ``masks`` are the *deciding* evidence (the
cue when it decides, else the object) and which keeps the other element's mask too. Generation is pure numpy and
deterministic per ``(seed, index)`` like the shape scenes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence, Union

import numpy as np
import torch

from vitlens.data.scenes import (
    CLASS_NAMES,
    MAX_SIZE,
    MIN_SIZE,
    Scenes,
    check_int,
    tight_box,
    render_parts,
    selection,
)
from vitlens.errors import InputError

__all__ = [
    "CUE_CLASS_NAMES",
    "CUE_KINDS",
    "PLANTED_CUE_COLOURS",
    "EvidenceScenes",
    "make_cue_scenes",
    "make_planted_scenes",
]

#: Colour pair of the planted checkerboard cue of each class (index = class of :data:`vitlens.data.CLASS_NAMES`).
PLANTED_CUE_COLOURS: tuple[tuple[tuple[float, float, float], tuple[float, float, float]], ...] = (
    ((1.0, 0.0, 0.0), (0.0, 1.0, 0.0)),  # disk: red / green
    ((0.0, 0.0, 1.0), (1.0, 1.0, 0.0)),  # square: blue / yellow
    ((1.0, 0.0, 1.0), (0.0, 1.0, 1.0)),  # triangle: magenta / cyan
    ((0.0, 0.0, 0.0), (1.0, 1.0, 1.0)),  # cross: black / white
    ((1.0, 0.0, 0.0), (0.0, 0.0, 1.0)),  # ring: red / blue
    ((0.0, 1.0, 0.0), (1.0, 0.0, 1.0)),  # star: green / magenta
)
#: Classes of :func:`make_cue_scenes`.
CUE_CLASS_NAMES: tuple[str, ...] = ("star", "cross", "stripes", "checker", "red", "blue", "two", "four")
#: The kind of evidence that decides each class of :data:`CUE_CLASS_NAMES`.
CUE_KINDS: tuple[str, ...] = ("shape", "shape", "texture", "texture", "colour", "colour", "count", "count")

_KIND_PLANTED, _KIND_CUES = "planted", "cues"
_SALT_CUE = 7  # the cue's generator is default_rng([seed, index, _SALT_CUE]): adding or removing it changes nothing else


@dataclass(frozen=True, eq=False)
class EvidenceScenes(Scenes):
    """Scenes with planted, known evidence (:func:`make_planted_scenes`, :func:`make_cue_scenes`).

    Besides the :class:`vitlens.data.Scenes` fields (``masks``/``boxes``: the evidence that decides the label):

    Attributes:
        decided_by: ``(N,)`` int64: 1 where the planted cue decides the label, 0 where the object (or, for
            :func:`make_cue_scenes`, the class's evidence) does.
        object_labels: ``(N,)`` int64, class of the object (planted scenes; equals ``labels`` for cue scenes).
        object_masks: ``(N, H, W)`` bool, the object's pixels (all ``False`` in ``without_object()`` scenes).
        cue_labels: ``(N,)`` int64, class named by the planted cue, ``-1`` where there is none.
        cue_masks: ``(N, H, W)`` bool, the cue's pixels (all ``False`` without a cue).
        kind: ``"planted"`` or ``"cues"``; ``cue_frac``, ``draw_object``, ``draw_cue``: generation settings.
    """

    decided_by: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    object_labels: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    object_masks: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.bool))
    cue_labels: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    cue_masks: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.bool))
    kind: str = _KIND_PLANTED
    cue_frac: float = 0.5
    draw_object: bool = True
    draw_cue: bool = True

    def subset(self, idx: Union[int, slice, Sequence[int], np.ndarray, torch.Tensor]) -> "EvidenceScenes":
        base = Scenes.subset(self, idx)
        sel = selection(idx, len(self))
        return EvidenceScenes(
            images=base.images, labels=base.labels, masks=base.masks, boxes=base.boxes,
            class_names=self.class_names, indices=base.indices, seed=self.seed,
            decided_by=self.decided_by[sel], object_labels=self.object_labels[sel],
            object_masks=self.object_masks[sel], cue_labels=self.cue_labels[sel], cue_masks=self.cue_masks[sel],
            kind=self.kind, cue_frac=self.cue_frac, draw_object=self.draw_object, draw_cue=self.draw_cue,
        )

    def _regenerate(self, draw_object: bool, draw_cue: bool) -> "EvidenceScenes":
        if self.indices is None or self.seed is None:
            raise InputError("these scenes have no (seed, indices) to regenerate their counterfactuals from")
        parts = [_generate(self.kind, self.seed, int(i), self.size, self.cue_frac, draw_object, draw_cue)
                 for i in self.indices.tolist()]
        return _stack(parts, self.kind, self.seed, self.indices, self.cue_frac, draw_object, draw_cue)

    def without_cue(self) -> "EvidenceScenes":
        """The same scenes without the planted cue (pixel for pixel the scene it was planted on)."""
        return self._regenerate(self.draw_object, False)

    def without_object(self) -> "EvidenceScenes":
        """The same scenes without the object (background, distractors and cue unchanged)."""
        return self._regenerate(False, self.draw_cue)

    def without_evidence(self) -> "EvidenceScenes":
        """The same scenes without what decides each label (the cue where it decides, else the object)."""
        if self.kind == _KIND_CUES:
            return self.without_object()
        no_cue, no_obj = self.without_cue(), self.without_object()
        pick = self.decided_by.bool()
        images = torch.where(pick[:, None, None, None], no_cue.images, no_obj.images)
        return EvidenceScenes(
            images=images, labels=self.labels, masks=self.masks, boxes=self.boxes, class_names=self.class_names,
            indices=self.indices, seed=self.seed, decided_by=self.decided_by, object_labels=self.object_labels,
            object_masks=torch.where(pick[:, None, None], self.object_masks, torch.zeros_like(self.object_masks)),
            cue_labels=self.cue_labels, cue_masks=torch.where(pick[:, None, None], torch.zeros_like(self.cue_masks),
                                                              self.cue_masks),
            kind=self.kind, cue_frac=self.cue_frac, draw_object=self.draw_object, draw_cue=self.draw_cue,
        )


def make_planted_scenes(n: int = 200, seed: int = 0, size: int = 64, start: int = 0, cue_frac: float = 0.5
                        ) -> EvidenceScenes:
    """Generate ``n`` planted-cue scenes (images ``start … start + n - 1`` of the data set ``seed``).

    Args:
        n, seed, size, start: as :func:`vitlens.data.make_scenes` (the underlying shape scene of image ``i`` is
            image ``i`` of ``make_scenes(seed=seed)`` with the object drawn identically).
        cue_frac: probability, per image, that a cue is planted (then it decides the label), in ``[0, 1]``.

    Returns:
        :class:`EvidenceScenes` (``class_names`` = :data:`vitlens.data.CLASS_NAMES`).
    """
    n, seed, size, start = _check_args(n, seed, size, start)
    cue_frac = _check_frac(cue_frac)
    parts = [_generate(_KIND_PLANTED, seed, start + i, size, cue_frac, True, True) for i in range(n)]
    return _stack(parts, _KIND_PLANTED, seed, torch.arange(start, start + n), cue_frac, True, True)


def make_cue_scenes(n: int = 200, seed: int = 0, size: int = 64, start: int = 0) -> EvidenceScenes:
    """Generate ``n`` scenes whose 8 classes are decided by different kinds of evidence (:data:`CUE_KINDS`).

    Returns:
        :class:`EvidenceScenes` (``class_names`` = :data:`CUE_CLASS_NAMES`; ``masks`` = the class-defining
        elements; ``decided_by`` all 0, no planted cue).
    """
    n, seed, size, start = _check_args(n, seed, size, start)
    parts = [_generate(_KIND_CUES, seed, start + i, size, 0.0, True, False) for i in range(n)]
    return _stack(parts, _KIND_CUES, seed, torch.arange(start, start + n), 0.0, True, False)


def _check_args(n: object, seed: object, size: object, start: object) -> tuple[int, int, int, int]:
    return (check_int("n", n, 1), check_int("seed", seed, 0), check_int("size", size, MIN_SIZE, MAX_SIZE),
            check_int("start", start, 0))


def _check_frac(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)) \
            or not 0.0 <= float(value) <= 1.0:
        raise InputError(f"cue_frac must be a number in [0, 1], got {value!r}")
    return float(value)


# ----------------------------------------------------------------------------------------------------------------------
# Rendering
# ----------------------------------------------------------------------------------------------------------------------

_Part = tuple[np.ndarray, int, np.ndarray, int, np.ndarray, int]  # image, label, object mask, object label, cue, cue label


def _generate(kind: str, seed: int, index: int, size: int, cue_frac: float, draw_object: bool, draw_cue: bool
              ) -> _Part:
    if kind == _KIND_PLANTED:
        return _planted(seed, index, size, cue_frac, draw_object, draw_cue)
    return _cue_scene(seed, index, size, draw_object)


def _planted(seed: int, index: int, size: int, cue_frac: float, draw_object: bool, draw_cue: bool) -> _Part:
    img, obj_mask, obj_label = render_parts(np.random.default_rng([seed, index]), size, draw_object=draw_object)
    rng = np.random.default_rng([seed, index, _SALT_CUE])
    has_cue = bool(rng.uniform() < cue_frac)
    cue_label = int(rng.integers(len(CLASS_NAMES)))
    side = max(4, round(size / 8))
    # a place that does not touch the object (drawn whether or not the object is painted, so it never moves)
    grown = _dilate(obj_mask, 1)
    cands = rng.integers(0, size - side + 1, size=(64, 2))
    pos = cands[0]
    for cy, cx in cands:
        if not grown[cy:cy + side, cx:cx + side].any():
            pos = (cy, cx)
            break
    noise = 0.02 * rng.standard_normal(size=(3, side, side))
    cue_mask = np.zeros((size, size), dtype=bool)
    if has_cue:
        cy, cx = int(pos[0]), int(pos[1])
        cue_mask[cy:cy + side, cx:cx + side] = True
        if draw_cue:
            a, b = (np.asarray(c, dtype=np.float32) for c in PLANTED_CUE_COLOURS[cue_label])
            yy, xx = np.meshgrid(np.arange(side), np.arange(side), indexing="ij")
            checker = ((yy + xx) % 2).astype(np.float32)[None]
            patch = a[:, None, None] * (1 - checker) + b[:, None, None] * checker + noise
            img[:, cy:cy + side, cx:cx + side] = np.clip(patch, 0.0, 1.0)
    else:
        cue_label = -1
    label = cue_label if has_cue else obj_label
    # masks of what is drawn: an element left out has an empty mask
    return (img, label, obj_mask if draw_object else np.zeros_like(obj_mask), obj_label,
            cue_mask if draw_cue else np.zeros_like(cue_mask), cue_label)


def _dilate(mask: np.ndarray, r: int) -> np.ndarray:
    out = mask.copy()
    for dy in range(-r, r + 1):
        for dx in range(-r, r + 1):
            out |= np.roll(np.roll(mask, dy, axis=0), dx, axis=1)
    return out


_RED = np.array([0.92, 0.08, 0.08])
_BLUE = np.array([0.08, 0.16, 0.92])


def _plain_colour(rng: np.random.Generator) -> np.ndarray:
    """A random colour well away from the colour classes' red and blue (best of 16 draws)."""
    cand = rng.uniform(0.0, 1.0, size=(16, 3))
    dist = np.minimum(np.linalg.norm(cand - _RED, axis=1), np.linalg.norm(cand - _BLUE, axis=1))
    ok = np.flatnonzero(dist >= 0.55)
    return cand[ok[0]] if ok.size else cand[int(np.argmax(dist))]


def _cue_scene(seed: int, index: int, size: int, draw_object: bool) -> _Part:
    from vitlens.data.scenes import background, distractor_mask, grid, object_mask

    rng = np.random.default_rng([seed, index])
    label = int(rng.integers(len(CUE_CLASS_NAMES)))
    name = CUE_CLASS_NAMES[label]
    img = background(rng, size)
    # the background must not be red or blue either: pull it towards grey where it comes close
    for ref in (_RED, _BLUE):
        d = np.linalg.norm(img - ref[:, None, None], axis=0)
        near = d < 0.45
        img[:, near] = 0.5 * img[:, near] + 0.25
    for _ in range(int(rng.integers(1, 4))):
        dm = distractor_mask(rng, size)
        img[:, dm] = _plain_colour(rng)[:, None]
    x, y = grid(size)
    if name in ("star", "cross"):
        mask = object_mask(rng, size, CLASS_NAMES.index(name))
        colour = np.broadcast_to(_plain_colour(rng)[:, None], (3, int(mask.sum())))
    elif name in ("stripes", "checker"):
        mask = object_mask(rng, size, CLASS_NAMES.index("disk"))
        c1, c2 = _plain_colour(rng), _plain_colour(rng)
        while np.linalg.norm(c1 - c2) < 0.5:
            c2 = _plain_colour(rng)
        xm, ym = x[mask], y[mask]
        period = size / 16.0  # 4 px at 64 px
        if name == "stripes":
            psi = rng.uniform(0.0, math.pi)
            t = np.floor((xm * math.cos(psi) + ym * math.sin(psi)) / period) % 2
        else:
            t = (np.floor(xm / period) + np.floor(ym / period)) % 2
        colour = c1[:, None] + (c2 - c1)[:, None] * t[None]
    elif name in ("red", "blue"):
        shape = ("square", "triangle")[int(rng.integers(2))]
        mask = object_mask(rng, size, CLASS_NAMES.index(shape))
        base = _RED if name == "red" else _BLUE
        colour = np.broadcast_to(np.clip(base + rng.uniform(-0.06, 0.06, size=3), 0, 1)[:, None],
                                 (3, int(mask.sum())))
    else:  # count: that many small squares of one colour, apart from each other
        k = 2 if name == "two" else 4
        side = max(4, round(size * 0.11))  # 7 px at 64 px: larger than the round distractor dots
        mask = np.zeros((size, size), dtype=bool)
        placed = 0
        for _ in range(200):
            cy, cx = rng.integers(1, size - side - 1, size=2)
            if not mask[max(cy - side, 0):cy + 2 * side, max(cx - side, 0):cx + 2 * side].any():
                mask[cy:cy + side, cx:cx + side] = True
                placed += 1
                if placed == k:
                    break
        colour = np.broadcast_to(_plain_colour(rng)[:, None], (3, int(mask.sum())))
    if draw_object:
        img[:, mask] = colour
    out = img.astype(np.float32)
    out += 0.02 * rng.standard_normal(size=out.shape, dtype=np.float32)
    np.clip(out, 0.0, 1.0, out=out)
    if not draw_object:
        mask = np.zeros_like(mask)
    empty = np.zeros_like(mask)
    return out, label, mask, label, empty, -1


def _stack(parts: list[_Part], kind: str, seed: int, indices: torch.Tensor, cue_frac: float, draw_object: bool,
           draw_cue: bool) -> EvidenceScenes:
    images = torch.from_numpy(np.stack([p[0] for p in parts]).astype(np.float32))
    labels = torch.tensor([p[1] for p in parts], dtype=torch.int64)
    obj_masks = torch.from_numpy(np.stack([p[2] for p in parts]))
    obj_labels = torch.tensor([p[3] for p in parts], dtype=torch.int64)
    cue_masks = torch.from_numpy(np.stack([p[4] for p in parts]))
    cue_labels = torch.tensor([p[5] for p in parts], dtype=torch.int64)
    decided = (cue_labels >= 0).long() if kind == _KIND_PLANTED else torch.zeros(len(parts), dtype=torch.int64)
    masks = torch.where(decided.bool()[:, None, None], cue_masks, obj_masks)
    boxes = torch.from_numpy(np.stack([tight_box(m) if m.any() else np.zeros(4, dtype=np.int64)
                                       for m in masks.numpy()]))
    names = CLASS_NAMES if kind == _KIND_PLANTED else CUE_CLASS_NAMES
    return EvidenceScenes(
        images=images, labels=labels, masks=masks, boxes=boxes, class_names=names,
        indices=indices.to(torch.int64), seed=seed, decided_by=decided, object_labels=obj_labels,
        object_masks=obj_masks, cue_labels=cue_labels, cue_masks=cue_masks, kind=kind, cue_frac=cue_frac,
        draw_object=draw_object, draw_cue=draw_cue,
    )
