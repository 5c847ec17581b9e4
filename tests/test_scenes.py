"""Tests of the synthetic scenes (vitlens.data.scenes): shapes, determinism, exact ground truth, argument checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vitlens.data import CLASS_NAMES, Scenes, make_scenes
from vitlens.errors import InputError, VitlensError


@pytest.fixture(scope="module")
def scenes() -> Scenes:
    return make_scenes(n=200, seed=0)


def test_shapes_dtypes_ranges(scenes: Scenes) -> None:
    assert len(scenes) == 200
    assert scenes.images.shape == (200, 3, 64, 64) and scenes.images.dtype == torch.float32
    assert scenes.labels.shape == (200,) and scenes.labels.dtype == torch.int64
    assert scenes.masks.shape == (200, 64, 64) and scenes.masks.dtype == torch.bool
    assert scenes.boxes.shape == (200, 4) and scenes.boxes.dtype == torch.int64
    assert scenes.class_names == CLASS_NAMES and len(CLASS_NAMES) >= 6
    assert float(scenes.images.min()) >= 0.0 and float(scenes.images.max()) <= 1.0
    assert torch.isfinite(scenes.images).all()
    assert int(scenes.labels.min()) >= 0 and int(scenes.labels.max()) < len(CLASS_NAMES)
    assert torch.equal(scenes.indices, torch.arange(200))


@pytest.mark.parametrize("size", [32, 48, 100, 224])
def test_other_sizes(size: int) -> None:
    s = make_scenes(n=6, seed=3, size=size)
    assert s.images.shape == (6, 3, size, size)
    assert s.masks.shape == (6, size, size)
    frac = s.masks.float().mean(dim=(1, 2))
    assert bool((frac >= 0.05).all()) and bool((frac <= 0.35).all())


def test_deterministic(scenes: Scenes) -> None:
    again = make_scenes(n=200, seed=0)
    assert torch.equal(scenes.images, again.images)
    assert torch.equal(scenes.labels, again.labels)
    assert torch.equal(scenes.masks, again.masks)
    assert torch.equal(scenes.boxes, again.boxes)
    other = make_scenes(n=20, seed=1)
    assert not torch.equal(scenes.images[:20], other.images)


def test_start_gives_the_same_slice() -> None:
    full = make_scenes(n=8, seed=5)
    part = make_scenes(n=5, seed=5, start=3)
    assert torch.equal(full.images[3:], part.images)
    assert torch.equal(full.labels[3:], part.labels)
    assert torch.equal(full.masks[3:], part.masks)
    assert torch.equal(full.boxes[3:], part.boxes)
    assert torch.equal(part.indices, torch.arange(3, 8))


def test_masks_nonempty_and_boxes_tight(scenes: Scenes) -> None:
    for m, b in zip(scenes.masks, scenes.boxes):
        assert m.any()
        x0, y0, x1, y1 = b.tolist()
        assert 0 <= x0 < x1 <= 64 and 0 <= y0 < y1 <= 64
        assert int(m.sum()) == int(m[y0:y1, x0:x1].sum())  # mask inside the box (x1, y1 exclusive)
        rows = torch.nonzero(m.any(dim=1)).flatten()
        cols = torch.nonzero(m.any(dim=0)).flatten()
        assert (x0, y0, x1, y1) == (int(cols[0]), int(rows[0]), int(cols[-1]) + 1, int(rows[-1]) + 1)


def test_area_fraction_in_range(scenes: Scenes) -> None:
    frac = scenes.masks.float().mean(dim=(1, 2))
    assert float(frac.min()) >= 0.05
    assert float(frac.max()) <= 0.35
    # always several 8-px tokens' worth of pixels
    assert int(scenes.masks.sum(dim=(1, 2)).min()) >= 3 * 64


def test_labels_balanced(scenes: Scenes) -> None:
    counts = torch.bincount(scenes.labels, minlength=len(CLASS_NAMES))
    assert counts.sum() == 200
    assert int(counts.min()) >= 15 and int(counts.max()) <= 55  # expected 33 each


def test_object_pixels_differ_from_surroundings(scenes: Scenes) -> None:
    """The object is drawn on top (its colour contrasts with the background around it)."""
    img, m = scenes.images[0], scenes.masks[0]
    inside = img[:, m].mean(dim=1)
    ring = torch.nn.functional.max_pool2d(m[None, None].float(), 5, 1, 2)[0, 0].bool() & ~m
    outside = img[:, ring].mean(dim=1)
    assert float((inside - outside).norm()) > 0.1


def test_colour_and_area_carry_no_class_information() -> None:
    s = make_scenes(n=600, seed=7)
    frac = s.masks.float().mean(dim=(1, 2))
    mean_colour = torch.stack([s.images[i][:, s.masks[i]].mean(dim=1) for i in range(len(s))])
    for c in range(len(CLASS_NAMES)):
        sel = s.labels == c
        assert abs(float(frac[sel].mean()) - float(frac.mean())) < 0.03
        assert float((mean_colour[sel].mean(0) - mean_colour.mean(0)).abs().max()) < 0.1


def test_subset(scenes: Scenes) -> None:
    sub = scenes.subset([4, 1, 7])
    assert len(sub) == 3
    assert torch.equal(sub.images[1], scenes.images[1])
    assert torch.equal(sub.labels, scenes.labels[[4, 1, 7]])
    assert torch.equal(sub.indices, torch.tensor([4, 1, 7]))
    assert len(scenes.subset(slice(10, 20))) == 10
    assert len(scenes.subset(5)) == 1
    assert len(scenes.subset(scenes.labels == 0)) == int((scenes.labels == 0).sum())
    assert torch.equal(scenes.subset(np.arange(3)).masks, scenes.masks[:3])


@pytest.mark.parametrize(
    "kwargs",
    [
        {"n": 0},
        {"n": -3},
        {"n": 2.5},
        {"size": 31},
        {"size": 225},
        {"size": 64.0},
        {"seed": -1},
        {"start": -1},
        {"n": True},
    ],
)
def test_bad_arguments_raise(kwargs: dict) -> None:
    with pytest.raises(ValueError) as info:
        make_scenes(**kwargs)
    assert isinstance(info.value, (InputError, VitlensError))
    assert str(info.value)
