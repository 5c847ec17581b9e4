"""Perturbation metrics (insertion/deletion, positive/negative perturbation, faithfulness violation) on hand-made
models and maps whose results are computed by hand below."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from vitlens.errors import InputError, TargetError, UnsupportedModelError, VitlensError
from vitlens.metrics import get_metric
from vitlens.metrics.perturbation import (
    FaithfulnessViolation,
    InsertionDeletion,
    PositiveNegativePerturbation,
    feature_ranks,
    feature_scores,
    gaussian_blur,
    make_baseline,
)
from vitlens.images import DataConfig


class RegionModel(nn.Module):
    """Logit 0 = mean of the input over ``region`` (all channels) + ``offset``; logit 1 = its negative.

    So ``softmax(logits)[0] = 1 / (1 + exp(-2 * logit0))``.
    """

    def __init__(self, region: torch.Tensor, offset: float = 0.0, mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0)):
        super().__init__()
        self.register_buffer("region", region.float())
        self.offset = offset
        h, w = region.shape
        self.vitlens_data_config = {"input_size": (3, h, w), "mean": mean, "std": std}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = (x * self.region).sum(dim=(1, 2, 3)) / (3 * self.region.sum()) + self.offset
        return torch.stack([v, -v], dim=1)


def p0(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-2.0 * v))


def trapezoid(ys: list[float], xs: list[float]) -> float:
    return sum((xs[i + 1] - xs[i]) * (ys[i] + ys[i + 1]) / 2 for i in range(len(ys) - 1))


def top_left_region() -> torch.Tensor:
    """4x4 image, region = the top-left 2x2 block (flat pixel indices 0, 1, 4, 5)."""
    r = torch.zeros(4, 4, dtype=torch.bool)
    r[:2, :2] = True
    return r


RASTER_MAP = (15.0 - torch.arange(16.0)).view(1, 4, 4)  # strictly decreasing in raster order
ONES = torch.ones(1, 3, 4, 4)
T0 = torch.tensor([0])

# Removing pixels in raster order: after k pixels, the region (indices 0, 1, 4, 5) has lost this many.
REGION_LOST = [0, 1, 2, 2, 2, 3, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4]
X16 = [k / 16 for k in range(17)]


# ------------------------------------------------------------------------------------------------------------------
# Insertion / deletion by hand
# ------------------------------------------------------------------------------------------------------------------


def test_insertion_deletion_logit_by_hand():
    model = RegionModel(top_left_region())
    metric = InsertionDeletion(steps=16, deletion_baseline="black", insertion_baseline="black", score="logit")
    r = metric(RASTER_MAP, model=model, x=ONES, targets=T0)
    # Image is 1 everywhere, black is 0 (mean 0, std 1): logit0 = share of the region still showing the image.
    deletion = [1 - lost / 4 for lost in REGION_LOST]  # 1, .75, .5, .5, .5, .25, 0, ...
    insertion = [lost / 4 for lost in REGION_LOST]  # 0, .25, .5, .5, .5, .75, 1, ...
    assert r.curves["deletion"][0].tolist() == pytest.approx(deletion)
    assert r.curves["insertion"][0].tolist() == pytest.approx(insertion)
    assert r.curve_x.tolist() == pytest.approx(X16)
    # trapezoids with dx = 1/16: (0.875 + 0.625 + 0.5 + 0.5 + 0.375 + 0.125) / 16 = 3/16, insertion 13/16
    assert float(r.values["deletion"][0]) == pytest.approx(3 / 16)
    assert float(r.values["insertion"][0]) == pytest.approx(13 / 16)
    assert float(r.values["ins_minus_del"][0]) == pytest.approx(10 / 16)
    assert r.higher_is_better == {"insertion": True, "deletion": False, "ins_minus_del": True}


def test_insertion_deletion_probability_by_hand():
    model = RegionModel(top_left_region())
    metric = InsertionDeletion(steps=16, deletion_baseline="black", insertion_baseline="black")
    r = metric(RASTER_MAP, model=model, x=ONES, targets=T0)
    deletion = [p0(1 - lost / 4) for lost in REGION_LOST]
    insertion = [p0(lost / 4) for lost in REGION_LOST]
    assert r.curves["deletion"][0].tolist() == pytest.approx(deletion, abs=1e-6)
    assert r.curves["insertion"][0].tolist() == pytest.approx(insertion, abs=1e-6)
    assert float(r.values["deletion"][0]) == pytest.approx(trapezoid(deletion, X16), abs=1e-6)
    assert float(r.values["insertion"][0]) == pytest.approx(trapezoid(insertion, X16), abs=1e-6)
    # class 1 is the negative logit: its probability is 1 - p0
    r1 = metric(RASTER_MAP, model=model, x=ONES, targets=torch.tensor([1]))
    assert r1.curves["deletion"][0].tolist() == pytest.approx([1 - p for p in deletion], abs=1e-6)


def test_patch_granularity_by_hand():
    model = RegionModel(top_left_region())
    maps = torch.tensor([[[2.0, 2.0, 9.0, 9.0], [2.0, 2.0, 9.0, 9.0], [1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]]])
    metric = InsertionDeletion(steps=4, granularity=2, deletion_baseline="black", insertion_baseline="black",
                               score="logit")
    r = metric(maps, model=model, x=ONES, targets=T0)
    # patch order: top-right (9), top-left = region (2), bottom-left (1), bottom-right (0)
    assert r.curves["deletion"][0].tolist() == pytest.approx([1, 1, 0, 0, 0])
    assert r.curves["insertion"][0].tolist() == pytest.approx([0, 0, 1, 1, 1])
    assert float(r.values["deletion"][0]) == pytest.approx((1 + 0.5) / 4)
    assert float(r.values["insertion"][0]) == pytest.approx((0.5 + 1 + 1) / 4)
    assert r.protocol["feature_size"] == [2, 2] and r.protocol["num_features"] == 4
    # patch score = mean over the patch: a single large pixel can outweigh a uniformly higher patch
    spiky = torch.zeros(1, 4, 4)
    spiky[0, 0, 0] = 10.0  # region patch mean 2.5
    spiky[0, 0:2, 2:4] = 2.0  # top-right mean 2.0
    r = metric(spiky, model=model, x=ONES, targets=T0)
    assert r.curves["deletion"][0].tolist() == pytest.approx([1, 0, 0, 0, 0])


def test_pixel_and_patch_granularity_agree_on_patch_constant_maps():
    """A map constant on 2x2 patches: pixel ranking breaks the ties inside a patch by raster index, so every 4
    consecutive pixel ranks are one patch and pixel-level with 4 steps equals patch-level."""
    torch.manual_seed(0)
    model = RegionModel(top_left_region())
    x = torch.randn(2, 3, 4, 4)
    maps = torch.rand(2, 2, 2).repeat_interleave(2, 1).repeat_interleave(2, 2)
    t = torch.tensor([0, 1])
    a = InsertionDeletion(steps=4, granularity="pixel", insertion_baseline="black")(maps, model=model, x=x, targets=t)
    b = InsertionDeletion(steps=4, granularity=2, insertion_baseline="black")(maps, model=model, x=x, targets=t)
    for k in ("insertion", "deletion"):
        torch.testing.assert_close(a.curves[k], b.curves[k])


def test_step_schedule_rounds_to_the_nearest_feature_count():
    model = RegionModel(top_left_region())
    r = InsertionDeletion(steps=3, insertion_baseline="black", score="logit")(RASTER_MAP, model=model, x=ONES,
                                                                            targets=T0)
    # k_i = round(16 i / 3) = 0, 5, 11, 16
    assert r.curve_x.tolist() == pytest.approx([0, 5 / 16, 11 / 16, 1])
    assert r.curves["deletion"][0].tolist() == pytest.approx([1, 0.25, 0, 0])


def test_partial_edge_patches():
    assert feature_scores(torch.arange(25.0).view(1, 5, 5), (2, 2)).shape == (1, 3, 3)
    s = feature_scores(torch.arange(25.0).view(1, 5, 5), (2, 2))
    assert float(s[0, 0, 2]) == pytest.approx((4 + 9) / 2)  # right edge: 2x1 pixels
    assert float(s[0, 2, 2]) == pytest.approx(24.0)


def test_feature_ranks_ties_by_index():
    scores = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0]])
    assert feature_ranks(scores).tolist() == [[3, 0, 1, 4, 2]]
    assert feature_ranks(scores, descending=False).tolist() == [[1, 2, 3, 0, 4]]


# ------------------------------------------------------------------------------------------------------------------
# Baselines
# ------------------------------------------------------------------------------------------------------------------


def test_baselines_in_pixel_space():
    cfg = DataConfig(input_size=(3, 4, 4), mean=(0.5, 0.25, 0.0), std=(0.5, 0.25, 1.0))
    x = torch.randn(2, 3, 4, 4)
    black = make_baseline("black", x, cfg)
    assert black[:, 0].unique().tolist() == [-1.0] and black[:, 1].unique().tolist() == [-1.0]
    assert black[:, 2].unique().tolist() == [0.0]
    assert make_baseline("mean", x, cfg).abs().max() == 0  # the config's mean colour is 0 after normalising
    grey = make_baseline("mean", x, cfg, mean_color=(1.0, 0.5, 0.25))
    assert grey[:, :, 0, 0].tolist() == [[1.0, 1.0, 0.25]] * 2
    n1, n2 = make_baseline("noise", x, cfg, noise_seed=3), make_baseline("noise", x, cfg, noise_seed=3)
    assert torch.equal(n1, n2) and not torch.equal(n1, make_baseline("noise", x, cfg, noise_seed=4))
    pixels = n1 * torch.tensor(cfg.std).view(1, 3, 1, 1) + torch.tensor(cfg.mean).view(1, 3, 1, 1)
    assert 0 <= pixels.min() and pixels.max() < 1 + 1e-6
    # blur in pixel space of a constant image is that image (replicated edges)
    flat = torch.full((1, 3, 4, 4), 0.3)
    torch.testing.assert_close(make_baseline("blur", flat, cfg), flat)


def test_gaussian_blur_by_hand():
    img = torch.zeros(1, 1, 7, 7)
    img[0, 0, 3, 3] = 1.0
    out = gaussian_blur(img, kernel=3, sigma=1.0)
    a = math.exp(-0.5)
    w = [a / (1 + 2 * a), 1 / (1 + 2 * a), a / (1 + 2 * a)]
    expected = torch.zeros(7, 7)
    for i in range(3):
        for j in range(3):
            expected[2 + i, 2 + j] = w[i] * w[j]
    torch.testing.assert_close(out[0, 0], expected)
    # edges are replicated: a ramp's first value is a weighted mean of (x0, x0, x1)
    ramp = torch.arange(5.0).view(1, 1, 1, 5).expand(1, 1, 5, 5).contiguous()
    assert float(gaussian_blur(ramp, 3, 1.0)[0, 0, 0, 0]) == pytest.approx(w[2] * 1.0)


@pytest.mark.parametrize("kind, value", [("black", -1.0), ("mean", 0.0), ("blur", 1.0), ("noise", None)])
def test_each_baseline_end_points(kind, value):
    """Deletion ends at the deletion baseline, insertion starts at the insertion baseline (mean/std 0.5: black is
    -1, the mean colour 0; the blur of a constant image is the image)."""
    model = RegionModel(top_left_region(), mean=(0.5,) * 3, std=(0.5,) * 3)
    metric = InsertionDeletion(steps=4, deletion_baseline=kind, insertion_baseline=kind, score="logit")
    r = metric(RASTER_MAP, model=model, x=ONES, targets=T0)
    if value is None:  # noise: the region mean of the seeded baseline
        base = make_baseline("noise", ONES, DataConfig(mean=(0.5,) * 3, std=(0.5,) * 3))
        value = float(base[0, :, :2, :2].mean())
    assert float(r.curves["deletion"][0, -1]) == pytest.approx(value, abs=1e-6)
    assert float(r.curves["insertion"][0, 0]) == pytest.approx(value, abs=1e-6)
    assert float(r.curves["deletion"][0, 0]) == pytest.approx(1.0)


def test_different_baselines_for_deletion_and_insertion():
    model = RegionModel(top_left_region(), mean=(0.5,) * 3, std=(0.5,) * 3)
    metric = InsertionDeletion(steps=16, deletion_baseline="black", insertion_baseline="mean", score="logit")
    r = metric(RASTER_MAP, model=model, x=ONES, targets=T0)
    assert r.curves["deletion"][0].tolist() == pytest.approx([1 - 2 * lost / 4 for lost in REGION_LOST])
    assert r.curves["insertion"][0].tolist() == pytest.approx([lost / 4 for lost in REGION_LOST])
    custom = InsertionDeletion(steps=4, insertion_baseline="mean", mean_color=(0.75,) * 3, score="logit")
    assert float(custom(RASTER_MAP, model=model, x=ONES, targets=T0).curves["insertion"][0, 0]) == pytest.approx(0.5)


# ------------------------------------------------------------------------------------------------------------------
# Batching, presets, protocol
# ------------------------------------------------------------------------------------------------------------------


def _vit_case():
    from conftest import tiny_vit

    torch.manual_seed(1)
    model = tiny_vit()
    model.vitlens_data_config = {"input_size": (3, 32, 32)}  # built directly, not by timm.create_model
    x = torch.randn(3, 3, 32, 32)
    maps = torch.randn(3, 32, 32)
    return model, x, maps, torch.tensor([0, 3, 4])


@pytest.mark.parametrize("make", [
    lambda bs: InsertionDeletion(steps=4, granularity="patch", batch_size=bs),
    lambda bs: InsertionDeletion(steps=4, deletion_baseline="noise", insertion_baseline="mean", batch_size=bs),
    lambda bs: PositiveNegativePerturbation(fractions=(0.25, 0.5, 0.75), score="probability", batch_size=bs),
    lambda bs: FaithfulnessViolation(k=3, batch_size=bs),
])
def test_batch_size_does_not_change_results(make):
    model, x, maps, t = _vit_case()
    results = [make(bs)(maps, model=model, x=x, targets=t) for bs in (1, 4, 1000)]
    for r in results[1:]:
        assert r.protocol == results[0].protocol  # batch_size is a cost knob, not part of the protocol
        for k in r.values:
            torch.testing.assert_close(r.values[k], results[0].values[k], atol=1e-5, rtol=1e-5, equal_nan=True)
        for k in r.curves:
            torch.testing.assert_close(r.curves[k], results[0].curves[k], atol=1e-5, rtol=1e-5)
    # a batch gives the per-image results
    one = make(64)(maps[1:2], model=model, x=x[1:2], targets=t[1:2])
    for k in one.values:
        torch.testing.assert_close(one.values[k], results[0].values[k][1:2], atol=1e-5, rtol=1e-5, equal_nan=True)


def test_presets_record_their_protocol():
    model, x, maps, t = _vit_case()
    rise = InsertionDeletion(preset="rise").protocol()
    assert (rise["preset"], rise["steps"], rise["granularity"], rise["deletion_baseline"], rise["insertion_baseline"],
            rise["blur_kernel"], rise["blur_sigma"], rise["score"]) == ("rise", 224, "pixel", "black", "blur", 11, 5.0,
                                                                        "probability")
    aha = InsertionDeletion(preset="aha").protocol()
    assert (aha["steps"], aha["granularity"], aha["deletion_baseline"], aha["insertion_baseline"]) == (
        20, "pixel", "mean", "mean")
    r = InsertionDeletion(preset="mutex")(maps, model=model, x=x, targets=t)
    assert r.protocol["preset"] == "mutex" and r.protocol["preset_overrides"] == []
    assert r.protocol["granularity"] == "patch" and r.protocol["feature_size"] == [8, 8]  # the model's patch size
    assert r.curve_x.tolist() == pytest.approx([0, 2 / 16, 3 / 16, 5 / 16, 6 / 16, 8 / 16, 10 / 16, 11 / 16, 13 / 16,
                                                14 / 16, 1])  # round(16 i / 10) of the 4x4 patches
    assert r.protocol["data_mean"] == [0.485, 0.456, 0.406]
    changed = InsertionDeletion(preset="aha", steps=10, batch_size=3).protocol()
    assert changed["preset_overrides"] == ["steps"] and changed["steps"] == 10 and "batch_size" not in changed
    assert set(InsertionDeletion.presets()) == {"rise", "aha", "aha_authors", "mutex"}


def test_registered_and_self_describing():
    for name, cls in [("insertion_deletion", InsertionDeletion), ("pos_neg_perturbation", PositiveNegativePerturbation),
                      ("faithfulness_violation", FaithfulnessViolation)]:
        m = get_metric(name)
        assert isinstance(m, cls) and m.needs == frozenset({"model", "x", "targets"})
    assert PositiveNegativePerturbation.outputs == {"pos_auc": False, "neg_auc": True, "neg_minus_pos": True}
    assert FaithfulnessViolation.outputs == {"violation": False}


def test_model_state_restored_and_no_grad():
    model, x, maps, t = _vit_case()
    model.train()
    r = InsertionDeletion(steps=4)(maps, model=model, x=x, targets=t)
    assert model.training and all(m.training for m in model.modules())
    assert all(p.requires_grad for p in model.parameters())
    assert not r.values["insertion"].requires_grad and not r.curves["deletion"].requires_grad


# ------------------------------------------------------------------------------------------------------------------
# Positive / negative perturbation by hand
# ------------------------------------------------------------------------------------------------------------------


def test_positive_negative_by_hand():
    # logit0 = share of the region showing the image - 0.3: the target (class 0) is predicted while more than 30 %
    # of the region is left. Map: 1 on the region, 0 elsewhere.
    model = RegionModel(top_left_region(), offset=-0.3)
    maps = top_left_region().float()[None]
    r = PositiveNegativePerturbation()(maps, model=model, x=ONES, targets=T0)
    ks = [0, 1, 3, 4, 6, 8, 9, 11, 12, 14]  # floor(f * 16) for f = 0, 0.1, ..., 0.9
    xs = [k / 16 for k in ks]
    assert r.curve_x.tolist() == pytest.approx(xs)
    # positive: the region goes first: 4, 3, 1, 0, ... region pixels left
    assert r.curves["positive"][0].tolist() == [1, 1, 0, 0, 0, 0, 0, 0, 0, 0]
    # negative: the 12 other pixels go first; at k = 14 two region pixels are gone (share 0.5 > 0.3)
    assert r.curves["negative"][0].tolist() == [1] * 10
    assert float(r.values["pos_auc"][0]) == pytest.approx(1 / 16 + (2 / 16) * 0.5)
    assert float(r.values["neg_auc"][0]) == pytest.approx(14 / 16)
    assert float(r.values["neg_minus_pos"][0]) == pytest.approx(14 / 16 - 2 / 16)
    prob = PositiveNegativePerturbation(score="probability")(maps, model=model, x=ONES, targets=T0)
    left = [4, 3, 1, 0, 0, 0, 0, 0, 0, 0]
    pos = [p0(n / 4 - 0.3) for n in left]
    assert prob.curves["positive"][0].tolist() == pytest.approx(pos, abs=1e-6)
    assert float(prob.values["pos_auc"][0]) == pytest.approx(trapezoid(pos, xs), abs=1e-6)
    neg = [p0(1 - 0.3)] * 9 + [p0(0.5 - 0.3)]
    assert prob.curves["negative"][0].tolist() == pytest.approx(neg, abs=1e-6)


# ------------------------------------------------------------------------------------------------------------------
# Faithfulness violation by hand
# ------------------------------------------------------------------------------------------------------------------


def _fv_maps(values: list[float]) -> torch.Tensor:
    """4x4 map constant on each 2x2 patch, patches in raster order (top-left = the region)."""
    return torch.tensor(values).view(1, 2, 2).repeat_interleave(2, 1).repeat_interleave(2, 2)


def test_faithfulness_violation_by_hand():
    model = RegionModel(top_left_region())
    fv = FaithfulnessViolation(patch_size=2)
    # removing the region patch drops p0 from p0(1) to p0(0): Δ > 0
    assert fv(_fv_maps([3.0, 1.0, 0.0, 0.0]), model=model, x=ONES, targets=T0).values["violation"].tolist() == [0.0]
    r = fv(_fv_maps([-3.0, 1.0, 0.0, 0.0]), model=model, x=ONES, targets=T0)  # |−3| is the strongest, sign wrong
    assert r.values["violation"].tolist() == [1.0]
    assert float(r.curves["delta"][0, 0]) == pytest.approx(p0(1.0) - p0(0.0), abs=1e-6)
    assert float(r.curves["weight"][0, 0]) == -3.0
    # the image is -1 on the region: removing it raises p0 (Δ < 0), so a positive weight violates
    assert fv(_fv_maps([3.0, 1.0, 0.0, 0.0]), model=model, x=-ONES, targets=T0).values["violation"].tolist() == [1.0]
    # another patch strongest: removing it changes nothing (Δ = 0) → w·Δ = 0 is not a violation
    assert fv(_fv_maps([1.0, -5.0, 0.0, 0.0]), model=model, x=ONES, targets=T0).values["violation"].tolist() == [0.0]
    # logit scoring: Δ = 1 - 0
    r = FaithfulnessViolation(patch_size=2, score="logit")(_fv_maps([3.0, 0, 0, 0]), model=model, x=ONES, targets=T0)
    assert float(r.curves["delta"][0, 0]) == pytest.approx(1.0)


def test_faithfulness_violation_top_k_by_hand():
    model = RegionModel(top_left_region())
    # order by |w|: patch 1 (-4), patch 0 (-3), patch 2 (2), patch 3 (0, not counted)
    maps = _fv_maps([-3.0, -4.0, 2.0, 0.0])
    r = FaithfulnessViolation(k=4, patch_size=2)(maps, model=model, x=ONES, targets=T0)
    assert r.curves["weight"][0].tolist() == [-4.0, -3.0, 2.0, 0.0]
    # only patch 0 (the region) matters and its weight is negative: 1 violation out of 3 counted features
    assert float(r.values["violation"][0]) == pytest.approx(1 / 3)
    assert r.protocol["k_used"] == 4
    big = FaithfulnessViolation(k=10, patch_size=2)(maps, model=model, x=ONES, targets=T0)
    assert big.protocol["k_used"] == 4 and big.curves["delta"].shape == (1, 4)


# ------------------------------------------------------------------------------------------------------------------
# Constant maps
# ------------------------------------------------------------------------------------------------------------------


def test_constant_maps_are_deterministic_raster_order():
    torch.manual_seed(0)
    model = RegionModel(top_left_region())
    x = torch.randn(1, 3, 4, 4)
    const = torch.full((1, 4, 4), 0.7)
    metric = InsertionDeletion(steps=16, insertion_baseline="black")
    a, b = metric(const, model=model, x=x, targets=T0), metric(RASTER_MAP, model=model, x=x, targets=T0)
    for k in ("insertion", "deletion"):
        assert torch.equal(a.curves[k], b.curves[k])  # ties → raster order, top-left first
    pn = PositiveNegativePerturbation()(const, model=model, x=x, targets=T0)
    assert torch.equal(pn.curves["positive"], pn.curves["negative"]) and float(pn.values["neg_minus_pos"]) == 0
    fv = FaithfulnessViolation(k=2, patch_size=2)
    r = fv(_fv_maps([-1.0] * 4), model=model, x=ONES, targets=T0)  # ties → patch 0 (the region) first
    assert r.values["violation"].tolist() == [0.5]
    zero = fv(torch.zeros(1, 4, 4), model=model, x=ONES, targets=T0)
    assert math.isnan(float(zero.values["violation"][0]))  # no sign anywhere: skipped
    assert math.isnan(zero.mean()["violation"])


# ------------------------------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("metric", [InsertionDeletion(steps=4), PositiveNegativePerturbation(),
                                    FaithfulnessViolation(patch_size=2)])
def test_input_errors(metric):
    model = RegionModel(top_left_region())
    x, maps, t = torch.ones(2, 3, 4, 4), torch.rand(2, 4, 4), torch.tensor([0, 1])
    with pytest.raises(InputError, match="maps must have shape"):
        metric(maps[0], model=model, x=x, targets=t)
    with pytest.raises(InputError, match="maps are \\(5, 5\\), images are \\(4, 4\\)"):
        metric(torch.rand(2, 5, 5), model=model, x=x, targets=t)
    with pytest.raises(InputError, match="3 maps given for a batch of 2"):
        metric(torch.rand(3, 4, 4), model=model, x=x, targets=t)
    bad = maps.clone()
    bad[1, 2, 2] = float("nan")
    with pytest.raises(InputError, match="NaN"):
        metric(bad, model=model, x=x, targets=t)
    with pytest.raises(InputError, match="class 2 is out of range for a model with 2 classes"):
        metric(maps, model=model, x=x, targets=torch.tensor([0, 2]))
    with pytest.raises(TargetError, match="negative"):
        metric(maps, model=model, x=x, targets=torch.tensor([-1, 0]))
    with pytest.raises(InputError, match="3 targets given for a batch of 2"):
        metric(maps, model=model, x=x, targets=torch.tensor([0, 1, 1]))
    with pytest.raises(InputError, match="integer class indices"):
        metric(maps, model=model, x=x, targets=torch.tensor([0.0, 1.0]))
    with pytest.raises(InputError, match="needs model"):
        metric(maps, x=x, targets=t)
    with pytest.raises(InputError, match="x must be the normalised model input"):
        metric(maps, model=model, x=x[:, :1], targets=t)
    with pytest.raises(VitlensError, match="pixel mean/std"):
        metric(maps, model=nn.Identity(), x=x, targets=t)


def test_settings_errors():
    with pytest.raises(InputError, match="unknown preset 'riseee'"):
        InsertionDeletion(preset="riseee")
    with pytest.raises(InputError, match="deletion_baseline must be one of"):
        InsertionDeletion(deletion_baseline="zeros")
    with pytest.raises(InputError, match="blur_kernel must be odd"):
        InsertionDeletion(blur_kernel=4)
    with pytest.raises(InputError, match="blur_sigma must be"):
        InsertionDeletion(blur_sigma=0)
    with pytest.raises(InputError, match="steps must be an integer >= 1"):
        InsertionDeletion(steps=0)
    with pytest.raises(InputError, match="granularity must be"):
        InsertionDeletion(granularity="token")
    with pytest.raises(InputError, match="score must be one of"):
        PositiveNegativePerturbation(score="logit")
    with pytest.raises(InputError, match="fractions must be increasing"):
        PositiveNegativePerturbation(fractions=(0.5, 0.2))
    with pytest.raises(InputError, match="batch_size"):
        FaithfulnessViolation(batch_size=0)
    with pytest.raises(InputError, match="mean_color"):
        InsertionDeletion(mean_color=(0.5, 0.5))
    model = RegionModel(top_left_region())
    with pytest.raises(InputError, match="needs the model's patch size"):
        FaithfulnessViolation()(torch.rand(1, 4, 4), model=model, x=ONES, targets=T0)


def test_explicit_data_config_for_a_plain_model():
    class Plain(nn.Module):
        def forward(self, x):
            v = x.mean(dim=(1, 2, 3))
            return torch.stack([v, -v], 1)

    metric = InsertionDeletion(steps=2, insertion_baseline="black", score="logit",
                               data_config={"input_size": (3, 4, 4), "mean": (0.5,) * 3, "std": (0.5,) * 3})
    r = metric(RASTER_MAP, model=Plain(), x=ONES, targets=T0)
    assert r.curves["deletion"][0].tolist() == pytest.approx([1.0, 0.0, -1.0])  # black = -1
    assert r.protocol["data_config"]["mean"] == (0.5, 0.5, 0.5)
    with pytest.raises(UnsupportedModelError):
        InsertionDeletion(data_config=nn.Identity())
