"""Deterministic synthetic scenes with pixel-exact ground truth (the proving ground's localisation benchmark).

Every image is a cluttered RGB scene containing exactly one *class-defining object* (one of :data:`CLASS_NAMES`)
drawn on top of a smooth random background and 1–3 *distractors* from a separate vocabulary (bars, dots, thin strokes)
that appear with the same statistics in every class. The ground truth of each image is its class label, the exact
mask of the object's visible pixels and the object's tight bounding box.

Design choices (so that only the object's *shape* carries class information):

* The object's colour and texture (solid, stripes or a linear gradient in random colours), position, rotation and
  scale are drawn from the same distributions for every class. Colours are only constrained to contrast with the
  background under the object, which does not depend on the class.
* The object's area is drawn directly (uniform in :data:`AREA_RANGE` of the image area) and the shape's size is solved
  from it, so area carries no class information either; the object always lies fully inside the image (1-px margin).
* Distractors are drawn *before* the object, so the object is never occluded and the mask is exactly what is drawn.
* No anti-aliasing: a pixel belongs to a shape if and only if its centre lies inside the shape, so masks are exact.

Generation is pure numpy and deterministic: image ``i`` of ``make_scenes(seed=s, start=k)`` is generated from its own
generator ``np.random.default_rng([s, k + i])``, so any slice of a data set can be generated on its own, e.g.
``make_scenes(n=5, start=3)`` equals images 3…7 of ``make_scenes(n=8)`` exactly. The arrays are converted to torch
tensors only at the end.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Sequence, Union

import numpy as np
import torch

from vitlens.errors import InputError

__all__ = [
    "SceneSet",
    "CLASS_NAMES",
    "DISTRACTOR_NAMES",
    "AREA_RANGE",
    "MIN_SIZE",
    "MAX_SIZE",
    "Scenes",
    "make_scenes",
]

#: The class-defining object types; the label of an image is the index of its object's type in this tuple.
CLASS_NAMES: tuple[str, ...] = ("disk", "square", "triangle", "cross", "ring", "star")
#: The distractor vocabulary (never class-defining; same statistics in every class).
DISTRACTOR_NAMES: tuple[str, ...] = ("bar", "dot", "stroke")
#: Range of the object's area as a fraction of the image area (drawn uniformly; the rasterised mask stays within
#: about ±1 percentage point of the drawn value, i.e. always inside 5–35% of the image).
AREA_RANGE: tuple[float, float] = (0.08, 0.30)
#: Smallest and largest supported image side in pixels.
MIN_SIZE, MAX_SIZE = 32, 224

# Shape parameters, in units of the shape's outer radius r.
RING_INNER = 0.55  # inner radius of the ring
CROSS_HALF_WIDTH = 0.32  # half-width of each arm of the cross (arms reach to r)
STAR_INNER = 0.45  # inner radius of the five-pointed star
MIN_CONTRAST = 0.5  # minimum RGB distance between an object colour and the mean background under the object
PIXEL_NOISE = 0.02
MAX_TILT = math.radians(20.0)  # objects are rotated by k * 90 degrees plus a tilt in [-20, 20] degrees  # std of the fine per-pixel noise added to the whole image


class SceneSet:
    """What the scene containers (:class:`Scenes`, :class:`~vitlens.data.multiscenes.MultiScenes`) share: ``images``
    ``(N, 3, H, W)`` with ``H == W``, their count and side, and the check of the other fields' shapes."""

    images: torch.Tensor
    indices: torch.Tensor | None

    def check_shapes(self, expected: Callable[[int, int, int], dict[str, tuple[int | str, ...]]]) -> None:
        """Raise :class:`InputError` unless ``images`` is ``(N, 3, H, W)`` and every field named in
        ``expected(N, H, W)`` has its shape (a ``str`` entry: any size, named so in the message); ``indices`` must be
        ``(N,)`` unless it is ``None``."""
        owner = type(self).__name__
        if self.images.ndim != 4 or self.images.shape[1] != 3:
            raise InputError(f"{owner}.images must have shape (N, 3, H, W), got {tuple(self.images.shape)}")
        n, _, h, w = (int(v) for v in self.images.shape)
        shapes = expected(n, h, w)
        if self.indices is not None:
            shapes["indices"] = (n,)
        for name, shape in shapes.items():
            got = tuple(getattr(self, name).shape)
            if len(got) != len(shape) or any(isinstance(e, int) and e != g for e, g in zip(shape, got)):
                text = "(" + ", ".join(str(e) for e in shape) + ("," if len(shape) == 1 else "") + ")"
                raise InputError(f"{owner}.{name} must have shape {text}, got {got}")

    def __len__(self) -> int:
        return int(self.images.shape[0])

    @property
    def size(self) -> int:
        """Image side in pixels (``H == W``)."""
        return int(self.images.shape[-1])


@dataclass(frozen=True, eq=False)
class Scenes(SceneSet):
    """A batch of synthetic scenes with ground truth.

    Attributes:
        images: ``(N, 3, H, W)`` float32 tensor, RGB values in ``[0, 1]`` (not normalised).
        labels: ``(N,)`` int64 tensor, index into :attr:`class_names` of the class-defining object.
        masks: ``(N, H, W)`` bool tensor, ``True`` exactly on the object's (visible) pixels.
        boxes: ``(N, 4)`` int64 tensor ``x0, y0, x1, y1``: the tight bounding box of the mask in pixel coordinates,
            ``x0, y0`` inclusive and ``x1, y1`` exclusive, so ``masks[i, y0:y1, x0:x1]`` holds the whole object.
        class_names: names of the classes, ``class_names[label]``.
        indices: ``(N,)`` int64 tensor, the global index of each image in its data set (``start + i``), or ``None``.
        seed: the data-set seed the scenes were generated from, or ``None``.
    """

    images: torch.Tensor
    labels: torch.Tensor
    masks: torch.Tensor
    boxes: torch.Tensor
    class_names: tuple[str, ...] = CLASS_NAMES
    indices: torch.Tensor | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        self.check_shapes(lambda n, h, w: {"labels": (n,), "masks": (n, h, w), "boxes": (n, 4)})

    def subset(self, idx: Union[int, slice, Sequence[int], np.ndarray, torch.Tensor]) -> "Scenes":
        """Return the scenes selected by ``idx`` (an int, a slice, a sequence/array/tensor of ints or a bool mask).

        The result always keeps the batch dimension (an int selects a batch of one).
        """
        sel = selection(idx, len(self))
        return Scenes(
            images=self.images[sel],
            labels=self.labels[sel],
            masks=self.masks[sel],
            boxes=self.boxes[sel],
            class_names=self.class_names,
            indices=None if self.indices is None else self.indices[sel],
            seed=self.seed,
        )


def selection(idx: Union[int, slice, Sequence[int], np.ndarray, torch.Tensor], n: int
              ) -> Union[slice, torch.Tensor]:
    """``idx`` (an int, a slice, a sequence/array/tensor of ints or a bool mask over ``n`` items) as a slice or a 1-d
    long tensor that selects along the batch dimension (an int selects a batch of one)."""
    if isinstance(idx, slice):
        return idx
    t = torch.as_tensor(np.asarray(idx) if not isinstance(idx, torch.Tensor) else idx)
    if t.dtype == torch.bool:
        if tuple(t.shape) != (n,):
            raise InputError(f"bool subset mask must have shape ({n},), got {tuple(t.shape)}")
        t = t.nonzero().flatten()
    elif t.is_floating_point() or t.is_complex():
        raise InputError(f"subset indices must be integers, got dtype {t.dtype}")
    return t.long().reshape(-1)


def check_int(name: str, value: object, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool):
        raise InputError(f"{name} must be an integer, got {value!r}")
    try:
        v = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise InputError(f"{name} must be an integer, got {type(value).__name__} {value!r}") from None
    if v < lo or (hi is not None and v > hi):
        rng = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise InputError(f"{name} must be {rng}, got {v}")
    return v


def make_scenes(n: int = 200, seed: int = 0, size: int = 64, start: int = 0) -> Scenes:
    """Generate ``n`` synthetic scenes (images ``start … start + n - 1`` of the data set with seed ``seed``).

    Args:
        n: number of images, ``>= 1``.
        seed: data-set seed, ``>= 0``. Different seeds give independent data sets (e.g. train vs. test).
        size: image side ``H == W`` in pixels, ``32 <= size <= 224``. Object and distractor sizes scale with it.
        start: global index of the first image, ``>= 0``.

    Returns:
        :class:`Scenes` with ``images (n, 3, size, size)`` float32 in ``[0, 1]``, ``labels (n,)`` int64,
        ``masks (n, size, size)`` bool, ``boxes (n, 4)`` int64 (x0, y0 inclusive; x1, y1 exclusive).

    Raises:
        vitlens.errors.InputError (a ``ValueError``): if an argument is not an integer or out of range.
    """
    n = check_int("n", n, 1)
    seed = check_int("seed", seed, 0)
    size = check_int("size", size, MIN_SIZE, MAX_SIZE)
    start = check_int("start", start, 0)

    images = np.empty((n, 3, size, size), dtype=np.float32)
    masks = np.empty((n, size, size), dtype=bool)
    labels = np.empty(n, dtype=np.int64)
    boxes = np.empty((n, 4), dtype=np.int64)
    for i in range(n):
        rng = np.random.default_rng([seed, start + i])
        img, mask, label = render_scene(rng, size)
        images[i] = img
        masks[i] = mask
        labels[i] = label
        boxes[i] = tight_box(mask)
    return Scenes(
        images=torch.from_numpy(images),
        labels=torch.from_numpy(labels),
        masks=torch.from_numpy(masks),
        boxes=torch.from_numpy(boxes),
        class_names=CLASS_NAMES,
        indices=torch.arange(start, start + n, dtype=torch.int64),
        seed=seed,
    )


# ----------------------------------------------------------------------------------------------------------------------
# Rendering (pure numpy)
# ----------------------------------------------------------------------------------------------------------------------


@lru_cache(maxsize=16)
def grid(size: int) -> tuple[np.ndarray, np.ndarray]:
    """Pixel-centre coordinates ``(X, Y)``, each ``(size, size)`` float64 (x = column + 0.5, y = row + 0.5)."""
    c = np.arange(size, dtype=np.float64) + 0.5
    y, x = np.meshgrid(c, c, indexing="ij")
    y.setflags(write=False)
    x.setflags(write=False)
    return x, y


@lru_cache(maxsize=64)
def upsample_matrix(size: int, cells: int) -> np.ndarray:
    """``(size, cells)`` bilinear interpolation weights from a ``cells``-point lattice spanning the image."""
    pos = (np.arange(size) + 0.5) / size * (cells - 1)
    lo = np.clip(np.floor(pos).astype(int), 0, cells - 2)
    frac = pos - lo
    m = np.zeros((size, cells))
    m[np.arange(size), lo] = 1.0 - frac
    m[np.arange(size), lo + 1] = frac
    m.setflags(write=False)
    return m


def smooth_noise(rng: np.random.Generator, size: int, cells: int, channels: int = 3) -> np.ndarray:
    """``(channels, size, size)`` smooth random field in ``[-1, 1]`` (bilinear upsampling of a coarse lattice)."""
    coarse = rng.uniform(-1.0, 1.0, size=(channels, cells, cells))
    m = upsample_matrix(size, cells)
    return m @ coarse @ m.T


def background(rng: np.random.Generator, size: int) -> np.ndarray:
    """``(3, size, size)`` cluttered background: colour gradient + two octaves of smooth noise."""
    x, y = grid(size)
    c0 = rng.uniform(0.05, 0.95, size=3)
    c1 = rng.uniform(0.05, 0.95, size=3)
    phi = rng.uniform(0.0, 2.0 * math.pi)
    proj = (x - size / 2) * math.cos(phi) + (y - size / 2) * math.sin(phi)
    t = (proj / (size * math.sqrt(2)) + 0.5)[None]
    bg = c0[:, None, None] + (c1 - c0)[:, None, None] * t
    bg = bg + rng.uniform(0.05, 0.18) * smooth_noise(rng, size, int(rng.integers(3, 6)))
    bg = bg + rng.uniform(0.02, 0.06) * smooth_noise(rng, size, int(rng.integers(8, 13)))
    return bg


def in_polygon(x: np.ndarray, y: np.ndarray, verts: np.ndarray) -> np.ndarray:
    """Even-odd point-in-polygon test of pixel centres; ``verts`` is ``(V, 2)`` (x, y). Returns a bool array."""
    inside = np.zeros(x.shape, dtype=bool)
    xj, yj = verts[-1]
    for xi, yi in verts:
        if yi != yj:
            crosses = (yi > y) != (yj > y)
            x_at = (xj - xi) * (y - yi) / (yj - yi) + xi
            inside ^= crosses & (x < x_at)
        xj, yj = xi, yi
    return inside


def rotate(pts: np.ndarray, theta: float) -> np.ndarray:
    c, s = math.cos(theta), math.sin(theta)
    return pts @ np.array([[c, s], [-s, c]])


def unit_polygon(label: int) -> np.ndarray | None:
    """Vertices ``(V, 2)`` of the class shape with outer radius 1 centred at 0 (``None`` for disk and ring)."""
    name = CLASS_NAMES[label]
    if name == "square":
        h = 1.0 / math.sqrt(2.0)
        return np.array([[-h, -h], [h, -h], [h, h], [-h, h]])
    if name == "triangle":
        a = -math.pi / 2 + np.arange(3) * 2 * math.pi / 3
        return np.stack([np.cos(a), np.sin(a)], axis=1)
    if name == "cross":
        w = CROSS_HALF_WIDTH
        return np.array(
            [[w, -1], [w, -w], [1, -w], [1, w], [w, w], [w, 1], [-w, 1], [-w, w], [-1, w], [-1, -w], [-w, -w], [-w, -1]],
            dtype=np.float64,
        )
    if name == "star":
        a = -math.pi / 2 + np.arange(10) * math.pi / 5
        r = np.where(np.arange(10) % 2 == 0, 1.0, STAR_INNER)
        return np.stack([r * np.cos(a), r * np.sin(a)], axis=1)
    return None


@lru_cache(maxsize=None)
def unit_area(label: int) -> float:
    """Area of the class shape with outer radius 1."""
    name = CLASS_NAMES[label]
    if name == "disk":
        return math.pi
    if name == "ring":
        return math.pi * (1.0 - RING_INNER**2)
    v = unit_polygon(label)
    assert v is not None
    xs, ys = v[:, 0], v[:, 1]
    return 0.5 * abs(float(np.dot(xs, np.roll(ys, -1)) - np.dot(ys, np.roll(xs, -1))))


def object_mask(rng: np.random.Generator, size: int, label: int,
                area_range: tuple[float, float] = AREA_RANGE) -> np.ndarray:
    """Draw scale (area uniform in ``area_range`` of the image), rotation and position of the class object, fully
    inside the image, and return its ``(size, size)`` bool mask."""
    x, y = grid(size)
    area = rng.uniform(*area_range) * size * size
    r = math.sqrt(area / unit_area(label))
    # a random multiple of 90 degrees plus a random tilt of up to MAX_TILT (disk and ring are rotation-invariant)
    theta = int(rng.integers(4)) * math.pi / 2 + rng.uniform(-MAX_TILT, MAX_TILT)
    verts = unit_polygon(label)
    if verts is not None:
        verts = rotate(verts, theta) * r
        lo, hi = verts.min(axis=0), verts.max(axis=0)
    else:
        lo, hi = np.array([-r, -r]), np.array([r, r])
    margin = 1.0
    cx = rng.uniform(margin - lo[0], max(margin - lo[0], size - margin - hi[0]))
    cy = rng.uniform(margin - lo[1], max(margin - lo[1], size - margin - hi[1]))
    if verts is not None:
        return in_polygon(x, y, verts + np.array([cx, cy]))
    d2 = (x - cx) ** 2 + (y - cy) ** 2
    mask = d2 <= r * r
    if CLASS_NAMES[label] == "ring":
        mask &= d2 >= (RING_INNER * r) ** 2
    return mask


def segment_distance(x: np.ndarray, y: np.ndarray, pts: np.ndarray) -> np.ndarray:
    """Distance of every pixel centre to the polyline through ``pts`` ``(P, 2)``."""
    a, b = pts[:-1], pts[1:]
    d = b - a  # (S, 2)
    px = x[None] - a[:, 0, None, None]
    py = y[None] - a[:, 1, None, None]
    ll = np.maximum((d**2).sum(1), 1e-12)[:, None, None]
    t = np.clip((px * d[:, 0, None, None] + py * d[:, 1, None, None]) / ll, 0.0, 1.0)
    dx = px - t * d[:, 0, None, None]
    dy = py - t * d[:, 1, None, None]
    return np.sqrt((dx**2 + dy**2).min(axis=0))


def distractor_mask(rng: np.random.Generator, size: int) -> np.ndarray:
    """One distractor (bar, dots or thin stroke) at a random place; returns its ``(size, size)`` bool mask."""
    x, y = grid(size)
    kind = DISTRACTOR_NAMES[int(rng.integers(len(DISTRACTOR_NAMES)))]
    if kind == "bar":
        length = rng.uniform(0.2, 0.4) * size
        width = rng.uniform(0.03, 0.05) * size
        c = rng.uniform(0.0, size, size=2)
        th = rng.uniform(0.0, math.pi)
        u = (x - c[0]) * math.cos(th) + (y - c[1]) * math.sin(th)
        v = -(x - c[0]) * math.sin(th) + (y - c[1]) * math.cos(th)
        return (np.abs(u) <= length / 2) & (np.abs(v) <= width / 2)
    if kind == "dot":
        k = int(rng.integers(1, 5))
        centre = rng.uniform(0.0, size, size=2)
        spread = 0.12 * size
        mask = np.zeros((size, size), dtype=bool)
        for _ in range(k):
            c = centre + rng.uniform(-spread, spread, size=2)
            rad = rng.uniform(0.02, 0.04) * size
            mask |= (x - c[0]) ** 2 + (y - c[1]) ** 2 <= rad * rad
        return mask
    # stroke: a thin quadratic Bezier curve
    p0 = rng.uniform(0.0, size, size=2)
    ang = rng.uniform(0.0, 2.0 * math.pi)
    length = rng.uniform(0.3, 0.6) * size
    p2 = p0 + length * np.array([math.cos(ang), math.sin(ang)])
    p1 = (p0 + p2) / 2 + rng.uniform(-0.25, 0.25, size=2) * length
    t = np.linspace(0.0, 1.0, 9)[:, None]
    pts = (1 - t) ** 2 * p0 + 2 * (1 - t) * t * p1 + t**2 * p2
    half_width = rng.uniform(0.5, 1.0) * size / 64.0
    return segment_distance(x, y, pts) <= max(half_width, 0.5)


def contrasting_colour(rng: np.random.Generator, ref: np.ndarray, avoid: np.ndarray | None = None) -> np.ndarray:
    """Random RGB colour at least ``MIN_CONTRAST`` away from ``ref`` (and, if given, ``avoid``); best of 16 draws."""
    cand = rng.uniform(0.0, 1.0, size=(16, 3))
    dist = np.linalg.norm(cand - ref, axis=1)
    if avoid is not None:
        dist = np.minimum(dist, 1.5 * np.linalg.norm(cand - avoid, axis=1))
    ok = np.flatnonzero(dist >= MIN_CONTRAST)
    return cand[ok[0]] if ok.size else cand[int(np.argmax(dist))]


def fill(rng: np.random.Generator, size: int, mask: np.ndarray, bg_ref: np.ndarray) -> np.ndarray:
    """``(3, K)`` colours of the ``K`` mask pixels: solid, stripes or a linear gradient in random colours."""
    x, y = grid(size)
    xm, ym = x[mask], y[mask]
    u = rng.uniform()
    kind = 0 if u < 0.5 else (2 if u < 0.8 else 1)  # solid 50%, gradient 30%, stripes 20%
    c1 = contrasting_colour(rng, bg_ref)
    if kind == 0:  # solid
        return np.broadcast_to(c1[:, None], (3, xm.size))
    c2 = contrasting_colour(rng, bg_ref, avoid=c1 if kind == 1 else None)
    psi = rng.uniform(0.0, 2.0 * math.pi)
    proj = xm * math.cos(psi) + ym * math.sin(psi)
    if kind == 1:  # stripes
        period = rng.uniform(0.16, 0.28) * size
        t = (np.floor(proj / (period / 2) + rng.uniform(0.0, 2.0)) % 2)[None]
    else:  # gradient across the object
        span = max(float(proj.max() - proj.min()), 1e-6)
        t = ((proj - proj.min()) / span)[None]
    return c1[:, None] + (c2 - c1)[:, None] * t


def render_scene(rng: np.random.Generator, size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Render one scene: ``(image (3, size, size) float32 in [0, 1], mask (size, size) bool, label)``."""
    return render_parts(rng, size)


def render_parts(rng: np.random.Generator, size: int, draw_object: bool = True
                 ) -> tuple[np.ndarray, np.ndarray, int]:
    """Render one scene from ``rng``: ``(image (3, size, size) float32 in [0, 1], object mask, label)``.

    With ``draw_object=False`` the object is left out of the image (everything else identical, the random stream
    consumed the same way); the returned mask is still where it would have been. Used by :mod:`vitlens.data.evidence`
    for counterfactual scenes.
    """
    label = int(rng.integers(len(CLASS_NAMES)))
    img = background(rng, size)
    for _ in range(int(rng.integers(1, 4))):
        dm = distractor_mask(rng, size)
        img[:, dm] = rng.uniform(0.0, 1.0, size=3)[:, None]
    mask = object_mask(rng, size, label)
    bg_ref = img[:, mask].mean(axis=1)
    colours = fill(rng, size, mask, bg_ref)
    if draw_object:
        img[:, mask] = colours
    out = img.astype(np.float32)
    out += PIXEL_NOISE * rng.standard_normal(size=out.shape, dtype=np.float32)
    np.clip(out, 0.0, 1.0, out=out)
    return out, mask, label


def tight_box(mask: np.ndarray) -> np.ndarray:
    """Tight bounding box ``[x0, y0, x1, y1]`` of a non-empty mask (x0, y0 inclusive; x1, y1 exclusive)."""
    rows = np.flatnonzero(mask.any(axis=1))
    cols = np.flatnonzero(mask.any(axis=0))
    return np.array([cols[0], rows[0], cols[-1] + 1, rows[-1] + 1], dtype=np.int64)
