"""Attribution as segmentation: hand-computed PA/IoU, edge cases, and cross-checks against sklearn and skimage."""

from __future__ import annotations

import math

import pytest
import torch

from vitlens.errors import InputError
from vitlens.metrics.base import get_metric
from vitlens.metrics.segmentation import (Segmentation, average_precision, binarise, classes_in, minmax_normalise,
                                          otsu_threshold, pooled_scores, segmentation_counts, segmentation_per_class,
                                          segmentation_scores)


def _hand_case():
    """4x4: map = 1 on the top-left 2x2 block (0 elsewhere); mask = top-left 2x3 block."""
    maps = torch.zeros(1, 4, 4)
    maps[0, :2, :2] = 1.0
    masks = torch.zeros(1, 4, 4, dtype=torch.bool)
    masks[0, :2, :3] = True
    return maps, masks


def test_scores_by_hand():
    maps, masks = _hand_case()
    # normalised map = map; mean 4/16 → foreground = the 2x2 block: TP 4, FP 0, FN 2, TN 10
    s = segmentation_scores(maps * 3 - 1, masks)  # affine change: same normalised map
    assert s["pa"].item() == pytest.approx(14 / 16)
    assert s["iou_fg"].item() == pytest.approx(4 / 6)
    assert s["iou_bg"].item() == pytest.approx(10 / 12)
    assert s["miou"].item() == pytest.approx((4 / 6 + 10 / 12) / 2)
    # AP: value 1 → P = 4/4 at R = 4/6; value 0 → P = 6/16 at R = 1
    assert s["ap"].item() == pytest.approx(4 / 6 * 1 + 2 / 6 * 6 / 16)
    c = segmentation_counts(maps, masks)
    assert [c[k].item() for k in ("tp", "fp", "fn", "tn")] == [4, 0, 2, 10]


def test_thresholds_by_hand():
    maps = torch.tensor([[[0.0, 0.2, 0.4, 0.6, 0.8, 1.0]]])  # (1, 1, 6); mean 0.5
    masks = torch.tensor([[[False, False, False, True, True, True]]])
    assert binarise(maps).tolist() == [[[False, False, False, True, True, True]]]
    assert binarise(maps, 0.1).tolist() == [[[False, True, True, True, True, True]]]
    assert binarise(maps, 1.0).sum() == 0  # strictly above
    s = segmentation_scores(maps, masks, threshold=0.1)  # TP 3, FP 2, FN 0, TN 1
    assert s["pa"].item() == pytest.approx(4 / 6)
    assert s["iou_fg"].item() == pytest.approx(3 / 5)
    assert s["iou_bg"].item() == pytest.approx(1 / 3)
    bimodal = torch.tensor([[[0.0, 0.02, 0.04, 0.9, 0.95, 1.0, 1.0, 1.0]]])  # low values sit below their bin centres
    assert binarise(bimodal, "otsu").tolist() == [[[False] * 3 + [True] * 5]]


def test_constant_map_predicts_no_foreground():
    masks = torch.zeros(2, 4, 4, dtype=torch.bool)
    masks[:, :1, :] = True  # 4 of 16 pixels
    maps = torch.stack([torch.zeros(4, 4), torch.full((4, 4), 7.0)])
    assert not binarise(maps).any() and not binarise(maps, "otsu").any()
    assert torch.equal(minmax_normalise(maps), torch.zeros(2, 4, 4, dtype=torch.float64))
    s = segmentation_scores(maps, masks)
    assert s["pa"].tolist() == [12 / 16] * 2
    assert s["iou_fg"].tolist() == [0.0, 0.0]
    assert s["iou_bg"].tolist() == [12 / 16] * 2
    assert s["ap"].tolist() == [4 / 16] * 2  # one step at chance precision


def test_empty_and_full_masks():
    maps, _ = _hand_case()
    maps = maps.expand(2, 4, 4)
    masks = torch.stack([torch.zeros(4, 4, dtype=torch.bool), torch.ones(4, 4, dtype=torch.bool)])
    s = segmentation_scores(maps, masks)
    # empty mask: no object to localise → foreground scores undefined
    assert math.isnan(s["iou_fg"][0]) and math.isnan(s["miou"][0]) and math.isnan(s["ap"][0])
    assert s["pa"][0].item() == pytest.approx(12 / 16) and s["iou_bg"][0].item() == pytest.approx(12 / 16)
    # full mask: no background
    assert math.isnan(s["iou_bg"][1]) and math.isnan(s["miou"][1])
    assert s["iou_fg"][1].item() == pytest.approx(4 / 16) and s["ap"][1].item() == 1.0
    res = Segmentation()(maps, masks=masks)
    assert res.mean()["pa"] == pytest.approx(8 / 16)  # NaNs are skipped, defined values kept


def test_average_precision_matches_sklearn():
    metrics = pytest.importorskip("sklearn.metrics")
    g = torch.Generator().manual_seed(0)
    maps = torch.rand(6, 24, 24, generator=g)
    maps[3:] = torch.round(maps[3:] * 5) / 5  # heavy ties
    masks = torch.rand(6, 24, 24, generator=g) < torch.linspace(0.05, 0.6, 6)[:, None, None]
    masks[0, :8, :8] = True
    maps[0, :8, :8] += 0.5  # an informative map
    ours = average_precision(maps, masks)
    ref = torch.tensor([metrics.average_precision_score(masks[i].flatten().numpy(), maps[i].flatten().numpy())
                        for i in range(6)], dtype=torch.float64)
    assert (ours - ref).abs().max().item() < 1e-12
    # min-max normalisation leaves AP unchanged (order preserved)
    assert torch.allclose(average_precision(minmax_normalise(maps), masks), ours, atol=1e-12)


def test_otsu_matches_skimage():
    filters = pytest.importorskip("skimage.filters")
    g = torch.Generator().manual_seed(1)
    maps = [torch.rand(32, 32, generator=g), torch.randn(32, 32, generator=g) ** 2]
    two = torch.cat([torch.randn(300, generator=g) * 0.05 + 0.2, torch.randn(724, generator=g) * 0.1 + 0.7])
    maps += [two.reshape(32, 32), torch.round(torch.rand(32, 32, generator=g) * 7)]
    maps += [torch.rand(32, 32, generator=g) ** 6]
    norm = minmax_normalise(torch.stack(maps))
    for nbins in (256, 16):
        ours = otsu_threshold(norm, nbins)
        ref = torch.tensor([float(filters.threshold_otsu(m.numpy(), nbins=nbins)) for m in norm], dtype=torch.float64)
        assert (ours - ref).abs().max().item() < 1e-12
    assert otsu_threshold(torch.full((1, 3, 3), 0.25)).item() == 0.25


def test_per_class_average():
    seg = torch.zeros(2, 6, 6, dtype=torch.int64)
    seg[0, :3] = 4
    seg[0, 3:, :2] = 9
    seg[1, :, 3:] = 9
    classes = classes_in(seg)
    assert classes.tolist() == [[4, 9], [9, -1]]
    assert classes_in(seg, max_classes=1).tolist() == [[4], [9]]
    g = torch.Generator().manual_seed(0)
    maps = torch.rand(2, 2, 6, 6, generator=g)
    per = segmentation_per_class(maps, seg, classes)
    assert per["miou"].shape == (2, 2) and math.isnan(per["miou"][1, 1])
    direct = segmentation_scores(maps[0, 1][None], (seg[0] == 9)[None])
    assert per["iou_fg"][0, 1].item() == pytest.approx(direct["iou_fg"].item())
    res = Segmentation().compute_per_class(maps, seg, classes)
    assert res.values["miou"][0].item() == pytest.approx(per["miou"][0].mean().item())
    assert res.values["miou"][1].item() == pytest.approx(per["miou"][1, 0].item())  # padding skipped
    assert res.protocol["averaging"] == "per explained class, then image"
    with pytest.raises(InputError, match=r"\(B, K, H, W\)"):
        segmentation_per_class(maps[:, 0], seg, classes)


def test_pooled_scores():
    maps, masks = _hand_case()
    maps2 = torch.cat([maps, maps.flip(-1)])
    masks2 = torch.cat([masks, masks])
    c = segmentation_counts(maps2, masks2)  # image 2: TP 2, FP 2, FN 4, TN 8
    p = pooled_scores(c)
    assert p["iou_fg"] == pytest.approx(6 / (6 + 2 + 6))
    assert p["pa"] == pytest.approx((14 + 10) / 32)
    assert p["miou"] == pytest.approx((6 / 14 + 18 / 26) / 2)


def test_metric_object():
    maps, masks = _hand_case()
    metric = get_metric("segmentation", threshold="otsu")
    assert isinstance(metric, Segmentation)
    res = metric(maps, masks=masks)
    assert set(res.values) == {"pa", "iou_fg", "iou_bg", "miou", "ap"} and all(res.higher_is_better.values())
    assert res.protocol["threshold"] == "otsu" and res.protocol["metric"] == "segmentation"
    assert res.values["pa"].shape == (1,)
    with pytest.raises(InputError, match="needs masks"):
        metric(maps)
    with pytest.raises(InputError, match="masks must have the maps' shape"):
        metric(maps, masks=masks[:, :2])
    for bad in ("median", 1.5, True):
        with pytest.raises(InputError, match="threshold"):
            Segmentation(threshold=bad)
    with pytest.raises(InputError, match="NaN"):
        segmentation_scores(maps * float("nan"), masks)
