"""Multi-object synthetic scenes with a per-pixel label map (the proving ground's segmentation data).

Each image holds 2–4 (configurable) class-defining objects of **different** classes (:data:`CLASS_NAMES`) on the same
cluttered backgrounds, with the same distractors, textures and colour rules as the single-object scenes of
:mod:`vitlens.data.scenes` (whose rendering helpers are reused; the single-object generator itself is unchanged).

Ground truth per image:

* ``label_maps (H, W)`` int64: ``0`` = background (distractors included), ``k + 1`` = class ``CLASS_NAMES[k]``;
  it shows what is **visible**: objects are drawn back to front and later objects occlude earlier ones;
* ``present (K,)`` bool: the classes whose object is in the image (exactly the non-zero labels of the label map);
* ``objects (max_objects,)`` int64: the classes in drawing order (back to front), padded with ``-1``.

Rules of a scene:

* The number of objects is uniform in ``[min_objects, max_objects]``; their classes are drawn without replacement,
  so every class appears at most once (the per-class mask ``label_map == k + 1`` is also the object's visible mask).
* Each object's area is drawn uniformly in ``[MULTI_AREA_RANGE[0], min(MULTI_AREA_RANGE[1], MULTI_MAX_COVER / m)]``
  of the image area for ``m`` objects (so up to 4 objects fit without hiding each other), with the shape's size
  solved from it as in the single-object scenes; rotation, position, colour and texture follow the same
  class-independent distributions. Objects lie fully inside the image (1-px margin).
* Occlusion is bounded: an object is re-drawn (new size, rotation and position) while it would leave any earlier
  object with less than :data:`MIN_VISIBLE_FRACTION` of that object's own drawn area visible. If no placement is
  found within :data:`_MAX_TRIES` draws, the scene is re-drawn from scratch (same generator, so still deterministic).
  Hence every present class keeps at least ``MIN_VISIBLE_FRACTION`` of its object visible.
* An object's colour contrasts with the mean of what lies under it (background, distractors and earlier objects).

Generation is pure numpy and deterministic: image ``i`` of ``make_multi_scenes(seed=s, start=k)`` comes from its own
generator ``np.random.default_rng([s, k + i, MULTI_STREAM])``; the extra stream tag keeps these scenes independent of
the single-object scenes with the same seed and index.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Sequence, Union

import numpy as np
import torch

from vitlens.errors import InputError

from .scenes import (
    CLASS_NAMES,
    MAX_SIZE,
    MIN_SIZE,
    PIXEL_NOISE,
    SceneSet,
    background,
    check_int,
    distractor_mask,
    fill,
    object_mask,
    selection,
)

__all__ = [
    "BACKGROUND",
    "MIN_VISIBLE_FRACTION",
    "MULTI_AREA_RANGE",
    "MULTI_MAX_COVER",
    "MULTI_STREAM",
    "MultiScenes",
    "TWIN_STREAM",
    "make_multi_scene_pairs",
    "make_multi_scenes",
]

#: Label of background pixels (distractors included) in the label maps; class ``k`` has label ``k + 1``.
BACKGROUND: int = 0
#: Range of each object's drawn area as a fraction of the image area (upper end also capped at MULTI_MAX_COVER / m).
MULTI_AREA_RANGE: tuple[float, float] = (0.08, 0.25)
#: Bound on the summed drawn areas of the ``m`` objects: each object's area is at most ``MULTI_MAX_COVER / m``.
MULTI_MAX_COVER: float = 0.8
#: Every object keeps at least this fraction of its own drawn area visible (not occluded by later objects).
MIN_VISIBLE_FRACTION: float = 0.6
#: Stream tag mixed into the per-image generator seed (ASCII "MULT").
MULTI_STREAM: int = 0x4D554C54

#: Stream tag of the generator that picks which object a scene's twin leaves out (ASCII "TWIN").
TWIN_STREAM: int = 0x5457494E

_MAX_TRIES = 60  # placements tried per object before the whole scene is re-drawn


@dataclass(frozen=True, eq=False)
class MultiScenes(SceneSet):
    """A batch of multi-object scenes with per-pixel ground truth.

    Attributes:
        images: ``(N, 3, H, W)`` float32 tensor, RGB in ``[0, 1]`` (not normalised).
        label_maps: ``(N, H, W)`` int64 tensor: ``0`` background, ``k + 1`` class ``class_names[k]`` (visible pixels).
        present: ``(N, K)`` bool tensor, ``present[i, k]`` iff class ``k`` is in image ``i`` (``K = len(class_names)``);
            always equal to ``label_maps[i] == k + 1`` being non-empty.
        objects: ``(N, M)`` int64 tensor, the classes of each image in drawing order (back to front), padded with
            ``-1`` (``M`` = the ``max_objects`` the scenes were made with).
        class_names: names of the object classes (label ``k + 1`` ↔ ``class_names[k]``).
        indices: ``(N,)`` int64 global index of each image in its data set, or ``None``.
        seed: the data-set seed, or ``None``.
    """

    images: torch.Tensor
    label_maps: torch.Tensor
    present: torch.Tensor
    objects: torch.Tensor
    class_names: tuple[str, ...] = CLASS_NAMES
    indices: torch.Tensor | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        k = len(self.class_names)
        self.check_shapes(lambda n, h, w: {"label_maps": (n, h, w), "present": (n, k), "objects": (n, "M")})

    @property
    def num_labels(self) -> int:
        """Number of labels in the label maps: background + ``len(class_names)``."""
        return len(self.class_names) + 1

    @property
    def masks(self) -> torch.Tensor:
        """``(N, K, H, W)`` bool visible mask of each class's object (all ``False`` where the class is absent).

        Computed from :attr:`label_maps` on access (not stored): ``masks[:, k] == (label_maps == k + 1)``. Each class
        appears at most once per image, so this is also the per-object mask.
        """
        labels = torch.arange(1, self.num_labels, dtype=self.label_maps.dtype)
        return self.label_maps[:, None] == labels[None, :, None, None]

    @property
    def boxes(self) -> torch.Tensor:
        """``(N, K, 4)`` int64 tight boxes ``x0, y0, x1, y1`` of each class's visible pixels (``x1, y1`` exclusive);
        ``-1`` for absent classes."""
        m = self.masks
        rows, cols = m.any(dim=3), m.any(dim=2)  # (N, K, H), (N, K, W)
        h, w = m.shape[-2:]
        ar_h = torch.arange(h).expand_as(rows)
        ar_w = torch.arange(w).expand_as(cols)
        big = max(h, w) + 1
        y0 = torch.where(rows, ar_h, big).amin(-1)
        y1 = torch.where(rows, ar_h, -1).amax(-1) + 1
        x0 = torch.where(cols, ar_w, big).amin(-1)
        x1 = torch.where(cols, ar_w, -1).amax(-1) + 1
        out = torch.stack([x0, y0, x1, y1], dim=-1)
        return torch.where(self.present[..., None], out, torch.full_like(out, -1))

    def subset(self, idx: Union[int, slice, Sequence[int], np.ndarray, torch.Tensor]) -> "MultiScenes":
        """The scenes selected by ``idx`` (int, slice, sequence/array/tensor of ints or a bool mask); keeps the batch
        dimension."""
        sel = selection(idx, len(self))
        return MultiScenes(
            images=self.images[sel],
            label_maps=self.label_maps[sel],
            present=self.present[sel],
            objects=self.objects[sel],
            class_names=self.class_names,
            indices=None if self.indices is None else self.indices[sel],
            seed=self.seed,
        )


def make_multi_scenes(n: int, seed: int = 0, size: int = 64, min_objects: int = 2, max_objects: int = 4,
                      start: int = 0) -> MultiScenes:
    """Generate ``n`` multi-object scenes (images ``start … start + n - 1`` of the data set with seed ``seed``).

    Args:
        n: number of images, ``>= 1``.
        seed: data-set seed, ``>= 0``; different seeds give independent data sets (train vs. held-out).
        size: image side ``H == W`` in pixels, ``32 <= size <= 224``; objects and distractors scale with it.
        min_objects: fewest objects per image, ``1 <= min_objects <= max_objects``.
        max_objects: most objects per image, ``<= len(CLASS_NAMES)`` (every object has a different class).
        start: global index of the first image, ``>= 0`` (``make_multi_scenes(5, start=3)`` equals images 3…7 of
            ``make_multi_scenes(8)``).

    Returns:
        :class:`MultiScenes`: ``images (n, 3, size, size)`` float32 in ``[0, 1]``, ``label_maps (n, size, size)``
        int64 (0 = background, ``k + 1`` = class ``k``), ``present (n, K)`` bool, ``objects (n, max_objects)`` int64.

    Raises:
        vitlens.errors.InputError (a ``ValueError``): an argument is not an integer or is out of range.
    """
    return _generate(*_checked(n, seed, size, min_objects, max_objects, start))[0]


def _checked(n: int, seed: int, size: int, min_objects: int, max_objects: int, start: int
             ) -> tuple[int, int, int, int, int, int]:
    """The arguments of :func:`make_multi_scenes`, checked (one-line :class:`~vitlens.errors.InputError`) and as
    ints, in its order."""
    n = check_int("n", n, 1)
    seed = check_int("seed", seed, 0)
    size = check_int("size", size, MIN_SIZE, MAX_SIZE)
    k = len(CLASS_NAMES)
    min_objects = check_int("min_objects", min_objects, 1, k)
    max_objects = check_int("max_objects", max_objects, 1, k)
    if max_objects < min_objects:
        raise InputError(f"max_objects must be >= min_objects, got min_objects={min_objects}, max_objects={max_objects}")
    start = check_int("start", start, 0)
    return n, seed, size, min_objects, max_objects, start


def _generate(n: int, seed: int, size: int, min_objects: int, max_objects: int, start: int,
              leave_out: Callable[[int, int], int] | None = None) -> tuple[MultiScenes, MultiScenes | None]:
    """Render scenes ``start … start + n - 1`` once (arguments already checked) and, with ``leave_out(i, m)`` (the
    drawing position to leave out of scene ``i`` of ``m`` objects, ``-1`` for none), their twins too."""
    shape = ((n, 3, size, size), (n, size, size), (n, max_objects))
    sets = [(np.empty(shape[0], np.float32), np.empty(shape[1], np.int64), np.full(shape[2], -1, np.int64))
            for _ in range(1 if leave_out is None else 2)]
    for i in range(n):
        rng = np.random.default_rng([seed, start + i, MULTI_STREAM])
        rendered = _render_multi_scene(rng, size, min_objects, max_objects,
                                       None if leave_out is None else functools.partial(leave_out, i))
        for (images, label_maps, objects), (img, lab, order) in zip(sets, rendered):
            images[i], label_maps[i] = img, lab
            objects[i, : len(order)] = order
    out = [_scene_set(*arrays, seed, start) for arrays in sets]
    return out[0], (out[1] if len(out) > 1 else None)


def _scene_set(images: np.ndarray, label_maps: np.ndarray, objects: np.ndarray, seed: int, start: int) -> MultiScenes:
    n = len(images)
    present = np.zeros((n, len(CLASS_NAMES)), dtype=bool)
    rows, cols = np.nonzero(objects >= 0)
    present[rows, objects[rows, cols]] = True
    return MultiScenes(
        images=torch.from_numpy(images),
        label_maps=torch.from_numpy(label_maps),
        present=torch.from_numpy(present),
        objects=torch.from_numpy(objects),
        class_names=CLASS_NAMES,
        indices=torch.arange(start, start + n, dtype=torch.int64),
        seed=seed,
    )


def make_multi_scene_pairs(n: int, seed: int = 0, size: int = 64, min_objects: int = 2, max_objects: int = 4,
                           start: int = 0, position: int | None = None) -> tuple[MultiScenes, MultiScenes]:
    """Each scene of :func:`make_multi_scenes` (same arguments, identical scenes) and its **twin with one object left
    out**: the same background, distractors, other objects (colours, textures, positions) and pixel noise, without
    the object at a random drawing position (drawn from a generator of its own, so the scenes are unchanged) or, with
    ``position``, at that drawing position (0 = the backmost; a scene with no object there is its own twin). What
    the left-out object hid of earlier objects is visible in the twin, and the twin's label map, ``present`` and
    ``objects`` say so. Scenes of one object are their own twin (nothing is left out).

    Shapes-clip's training uses the pairs so that the one difference between two images of a batch is one object
    and one word of their captions: the model learns to take a class's evidence from that object's pixels.

    Returns:
        ``(scenes, twins)``, two :class:`MultiScenes` of ``n`` images each, index-aligned.

    Raises:
        vitlens.errors.InputError (a ``ValueError``): as :func:`make_multi_scenes`.
    """
    n, seed, size, min_objects, max_objects, start = _checked(n, seed, size, min_objects, max_objects, start)
    if position is not None:
        position = check_int("position", position, 0, max_objects - 1)

    def leave_out(i: int, m: int) -> int:
        if m < 2:  # a one-object scene is its own twin
            return -1
        if position is not None:
            return position if position < m else -1
        return int(np.random.default_rng([seed, start + i, MULTI_STREAM, TWIN_STREAM]).random() * m)

    full, twins = _generate(n, seed, size, min_objects, max_objects, start, leave_out)
    assert twins is not None  # leave_out given: the twins are rendered
    return full, twins


# ----------------------------------------------------------------------------------------------------------------------
# Rendering (pure numpy; the building blocks come from vitlens.data.scenes)
# ----------------------------------------------------------------------------------------------------------------------


def _place_objects(rng: np.random.Generator, size: int, classes: np.ndarray) -> list[np.ndarray] | None:
    """Full masks of the objects in drawing order such that every object keeps ``MIN_VISIBLE_FRACTION`` of its area
    visible under the later ones; ``None`` if some object found no placement in ``_MAX_TRIES`` draws."""
    m = len(classes)
    area_range = (MULTI_AREA_RANGE[0], max(MULTI_AREA_RANGE[0], min(MULTI_AREA_RANGE[1], MULTI_MAX_COVER / m)))
    full: list[np.ndarray] = []
    visible: list[np.ndarray] = []
    for c in classes:
        for _ in range(_MAX_TRIES):
            mask = object_mask(rng, size, int(c), area_range)
            ok = all((vis & ~mask).sum() >= MIN_VISIBLE_FRACTION * f.sum() for vis, f in zip(visible, full))
            if ok:
                break
        else:
            return None
        visible = [vis & ~mask for vis in visible]
        full.append(mask)
        visible.append(mask.copy())
    return full


def _render_multi_scene(rng: np.random.Generator, size: int, min_objects: int, max_objects: int,
                        leave_out: Callable[[int], int] | None = None
                        ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Render one scene: ``[(image (3, size, size) float32 in [0, 1], label map (size, size) int64, classes in drawing
    order (m,) int64)]``, and with ``leave_out`` a second entry, its twin: the same scene without the object at
    drawing position ``leave_out(m)`` (``-1``: none; everything else identical, the left-out object's colours are
    still drawn from ``rng``)."""
    while True:
        m = int(rng.integers(min_objects, max_objects + 1))
        classes = rng.permutation(len(CLASS_NAMES))[:m].astype(np.int64)
        img = background(rng, size)
        for _ in range(int(rng.integers(1, 4))):
            dm = distractor_mask(rng, size)
            img[:, dm] = rng.uniform(0.0, 1.0, size=3)[:, None]
        masks = _place_objects(rng, size, classes)
        if masks is not None:
            break
    skip = -1 if leave_out is None else leave_out(m)
    label_map = np.full((size, size), BACKGROUND, dtype=np.int64)
    twin_img, twin_lab = (None, None) if leave_out is None else (img.copy(), label_map.copy())
    for j, (c, mask) in enumerate(zip(classes, masks)):
        bg_ref = img[:, mask].mean(axis=1)
        colours = fill(rng, size, mask, bg_ref)
        img[:, mask] = colours
        label_map[mask] = int(c) + 1
        if twin_img is not None and twin_lab is not None and j != skip:
            twin_img[:, mask] = colours
            twin_lab[mask] = int(c) + 1
    noise = PIXEL_NOISE * rng.standard_normal(size=img.shape, dtype=np.float32)
    out = img.astype(np.float32)
    out += noise
    np.clip(out, 0.0, 1.0, out=out)
    if twin_img is None or twin_lab is None:
        return [(out, label_map, classes)]
    twin = twin_img.astype(np.float32)
    twin += noise
    np.clip(twin, 0.0, 1.0, out=twin)
    return [(out, label_map, classes), (twin, twin_lab, classes if skip < 0 else np.delete(classes, skip))]
