"""Tests of the multi-object scenes (vitlens.data.multiscenes): shapes, determinism, label-map ground truth, checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vitlens.data import CLASS_NAMES, MultiScenes, make_multi_scenes, make_scenes
from vitlens.data.multiscenes import MIN_VISIBLE_FRACTION, MULTI_AREA_RANGE
from vitlens.errors import InputError, VitlensError

K = len(CLASS_NAMES)


@pytest.fixture(scope="module")
def scenes() -> MultiScenes:
    return make_multi_scenes(120, seed=0)


def test_shapes_dtypes_ranges(scenes: MultiScenes) -> None:
    assert len(scenes) == 120 and scenes.size == 64 and scenes.num_labels == K + 1
    assert scenes.images.shape == (120, 3, 64, 64) and scenes.images.dtype == torch.float32
    assert scenes.label_maps.shape == (120, 64, 64) and scenes.label_maps.dtype == torch.int64
    assert scenes.present.shape == (120, K) and scenes.present.dtype == torch.bool
    assert scenes.objects.shape == (120, 4) and scenes.objects.dtype == torch.int64
    assert scenes.masks.shape == (120, K, 64, 64) and scenes.masks.dtype == torch.bool
    assert scenes.boxes.shape == (120, K, 4) and scenes.boxes.dtype == torch.int64
    assert float(scenes.images.min()) >= 0.0 and float(scenes.images.max()) <= 1.0
    assert int(scenes.label_maps.min()) >= 0 and int(scenes.label_maps.max()) <= K
    assert scenes.class_names == CLASS_NAMES
    assert torch.equal(scenes.indices, torch.arange(120)) and scenes.seed == 0


def test_deterministic_and_sliceable(scenes: MultiScenes) -> None:
    again = make_multi_scenes(120, seed=0)
    for name in ("images", "label_maps", "present", "objects"):
        assert torch.equal(getattr(scenes, name), getattr(again, name)), name
    part = make_multi_scenes(5, seed=0, start=7)
    assert torch.equal(part.images, scenes.images[7:12])
    assert torch.equal(part.label_maps, scenes.label_maps[7:12])
    assert torch.equal(part.indices, torch.arange(7, 12))
    other = make_multi_scenes(10, seed=1)
    assert not torch.equal(other.images, scenes.images[:10])


def test_independent_of_single_object_scenes() -> None:
    """Same seed and index as the single-object scenes, but a separate random stream (different backgrounds)."""
    single = make_scenes(n=4, seed=0)
    multi = make_multi_scenes(4, seed=0)
    assert not torch.equal(single.images, multi.images)


def test_two_to_four_distinct_classes(scenes: MultiScenes) -> None:
    counts = scenes.present.sum(dim=1)
    assert int(counts.min()) >= 2 and int(counts.max()) <= 4
    assert set(counts.tolist()) == {2, 3, 4}  # all counts occur in 120 scenes
    for objs, pres in zip(scenes.objects, scenes.present):
        drawn = objs[objs >= 0]
        assert len(set(drawn.tolist())) == len(drawn)  # different classes
        assert bool((objs[len(drawn):] == -1).all())  # padding at the end
        assert sorted(drawn.tolist()) == torch.nonzero(pres).flatten().tolist()
    # every class occurs, roughly equally often (expected 120 * 3 / 6 = 60 each)
    per_class = scenes.present.sum(dim=0)
    assert int(per_class.min()) >= 35 and int(per_class.max()) <= 85


def test_label_map_consistent_with_present(scenes: MultiScenes) -> None:
    for lm, pres in zip(scenes.label_maps, scenes.present):
        labels = set(torch.unique(lm).tolist())
        assert labels - {0} == {k + 1 for k in torch.nonzero(pres).flatten().tolist()}
        assert 0 in labels  # there is always background
    assert torch.equal(scenes.masks.any(dim=(2, 3)), scenes.present)
    assert torch.equal(scenes.masks.sum(dim=1) <= 1, torch.ones_like(scenes.label_maps, dtype=torch.bool))


def test_every_present_class_keeps_a_visible_area(scenes: MultiScenes) -> None:
    vis = scenes.masks.sum(dim=(2, 3)).float() / (64 * 64)
    # at least MIN_VISIBLE_FRACTION of the smallest drawn area (rasterisation adds ~1 percentage point of slack)
    floor = MIN_VISIBLE_FRACTION * MULTI_AREA_RANGE[0] - 0.01
    assert float(vis[scenes.present].min()) >= floor
    assert float(vis[scenes.present].min()) * 64 * 64 >= 2 * 64  # several 8-px tokens' worth of pixels
    # the topmost object is never occluded: its visible area is a whole shape of the drawn size
    last = scenes.objects.gather(1, ((scenes.objects >= 0).sum(1, keepdim=True) - 1))[:, 0]
    top = vis[torch.arange(len(scenes)), last]
    assert float(top.min()) >= MULTI_AREA_RANGE[0] - 0.015


def test_occlusion_happens_and_later_objects_are_on_top(scenes: MultiScenes) -> None:
    """Some scenes have overlapping objects; the boxes of visible parts stay inside the image."""
    boxes = scenes.boxes
    pres = scenes.present
    assert bool((boxes[pres] >= 0).all()) and bool((boxes[pres][:, 2:] <= 64).all())
    assert bool((boxes[~pres] == -1).all())
    m = scenes.masks
    for i in range(len(scenes)):
        for k in torch.nonzero(pres[i]).flatten().tolist():
            x0, y0, x1, y1 = boxes[i, k].tolist()
            assert int(m[i, k].sum()) == int(m[i, k, y0:y1, x0:x1].sum())


def test_objects_contrast_with_their_surroundings(scenes: MultiScenes) -> None:
    img, lm = scenes.images[0], scenes.label_maps[0]
    k = int(scenes.objects[0, (scenes.objects[0] >= 0).sum() - 1])  # topmost object
    m = lm == k + 1
    ring = torch.nn.functional.max_pool2d(m[None, None].float(), 5, 1, 2)[0, 0].bool() & ~m
    assert float((img[:, m].mean(dim=1) - img[:, ring].mean(dim=1)).norm()) > 0.1


@pytest.mark.parametrize("size", [32, 48, 100, 224])
def test_other_sizes(size: int) -> None:
    s = make_multi_scenes(3, seed=2, size=size)
    assert s.images.shape == (3, 3, size, size) and s.label_maps.shape == (3, size, size)
    counts = s.present.sum(dim=1)
    assert bool((counts >= 2).all() and (counts <= 4).all())
    assert torch.equal(s.masks.any(dim=(2, 3)), s.present)


def test_object_count_arguments() -> None:
    one = make_multi_scenes(6, seed=3, min_objects=1, max_objects=1)
    assert bool((one.present.sum(1) == 1).all()) and one.objects.shape == (6, 1)
    six = make_multi_scenes(3, seed=3, min_objects=6, max_objects=6)
    assert bool(six.present.all())


def test_subset(scenes: MultiScenes) -> None:
    sub = scenes.subset([4, 1, 7])
    assert len(sub) == 3 and torch.equal(sub.label_maps[1], scenes.label_maps[1])
    assert torch.equal(sub.indices, torch.tensor([4, 1, 7]))
    assert len(scenes.subset(slice(10, 20))) == 10 and len(scenes.subset(5)) == 1
    assert len(scenes.subset(scenes.present[:, 0])) == int(scenes.present[:, 0].sum())
    assert torch.equal(scenes.subset(np.arange(3)).present, scenes.present[:3])
    with pytest.raises(InputError):
        scenes.subset(torch.tensor([0.5]))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"n": 0},
        {"n": 2.5},
        {"n": True},
        {"seed": -1},
        {"size": 31},
        {"size": 225},
        {"size": 64.0},
        {"min_objects": 0},
        {"max_objects": 7},
        {"min_objects": 3, "max_objects": 2},
        {"start": -1},
    ],
)
def test_bad_arguments_raise(kwargs: dict) -> None:
    kwargs = {"n": 2, **kwargs}
    with pytest.raises(ValueError) as info:
        make_multi_scenes(**kwargs)
    assert isinstance(info.value, (InputError, VitlensError))
    msg = str(info.value)
    assert msg and "\n" not in msg
    assert any(name in msg for name in kwargs)


# -- twins with one object left out (shapes-clip's training pairs) -----------------------------------------------------
def test_twins_leave_out_exactly_one_object_and_change_nothing_else() -> None:
    from vitlens.data.multiscenes import make_multi_scene_pairs

    full, twins = make_multi_scene_pairs(40, seed=5, min_objects=1, max_objects=4, start=7)
    plain = make_multi_scenes(40, seed=5, min_objects=1, max_objects=4, start=7)
    assert torch.equal(full.images, plain.images) and torch.equal(full.label_maps, plain.label_maps)  # scenes unchanged
    m = full.present.sum(1)
    assert torch.equal(twins.present.sum(1), torch.where(m >= 2, m - 1, m))  # one object fewer, single ones kept
    assert not (twins.present & ~full.present).any()  # nothing new appears
    for i in range(40):
        gone = full.present[i] & ~twins.present[i]
        changed = (full.images[i] != twins.images[i]).any(0)
        relabelled = full.label_maps[i] != twins.label_maps[i]
        if m[i] == 1:
            assert not changed.any() and not relabelled.any()
            continue
        k = int(torch.nonzero(gone)[0])
        assert torch.equal(changed, relabelled)  # pixels differ exactly where the label map does
        assert (full.label_maps[i][relabelled] == k + 1).all()  # ... which is where the left-out object was visible
        kept = [int(c) for c in full.objects[i] if c >= 0 and c != k]
        assert twins.objects[i, : len(kept)].tolist() == kept and (twins.objects[i, len(kept):] == -1).all()
    again = make_multi_scene_pairs(40, seed=5, min_objects=1, max_objects=4, start=7)[1]
    assert torch.equal(again.images, twins.images)  # deterministic


def test_twins_uncover_what_the_left_out_object_hid() -> None:
    from vitlens.data.multiscenes import make_multi_scene_pairs

    full, twins = make_multi_scene_pairs(200, seed=1)
    grew = [(twins.label_maps[i] == c + 1).sum() > (full.label_maps[i] == c + 1).sum()
            for i in range(200) for c in range(K) if twins.present[i, c]]
    assert any(grew)  # an earlier object occluded by the left-out one is whole again in some twin


def test_twins_at_a_drawing_position_leave_out_that_object() -> None:
    from vitlens.data.multiscenes import make_multi_scene_pairs

    full, _ = make_multi_scene_pairs(30, seed=2)
    for j in range(4):
        _, twins = make_multi_scene_pairs(30, seed=2, position=j)
        for i in range(30):
            order = [int(c) for c in full.objects[i] if c >= 0]
            if j < len(order):
                assert not twins.present[i, order[j]] and int(twins.present[i].sum()) == len(order) - 1
            else:  # no object at that position: the scene is its own twin
                assert torch.equal(twins.images[i], full.images[i]) and torch.equal(twins.present[i], full.present[i])
    with pytest.raises(InputError, match="position"):
        make_multi_scene_pairs(2, seed=2, position=4)
