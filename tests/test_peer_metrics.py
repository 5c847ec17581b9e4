"""Cross-checks of vitlens metrics against peer libraries on identical inputs with matched protocols.

Peers (the ``peers`` extra): torchcam 0.5.0 (``torchcam.metrics.DeletionInsertionMetric``) and Quantus 0.6.0
(``PixelFlipping``, ``RegionPerturbation``, ``PointingGame``). Each test skips when its peer is not installed.

How the protocols were matched (read from the peers' source):

* **torchcam** ``DeletionInsertionMetric`` ranks pixels of the CAM by a *stable* descending sort (ties by flat
  index, as vitlens), perturbs ``counts = 0, s, 2s, …, N`` pixels with ``s = ceil(N / steps)``, uses one baseline
  tensor for both curves (given in the model's input space) and integrates with ``torch.trapezoid`` over
  ``count / N``. With ``N`` divisible by ``steps`` this is exactly vitlens' schedule, so the AUCs *and* both curves
  must agree (also on maps with ties). The CAM comes from a CAM extractor; a stand-in extractor that returns our
  maps is passed (torchcam's bilinear resize to the input size is the identity on maps already at that size).
  torchcam has no patch granularity; a map constant on patches ranks every patch's pixels consecutively (ties by
  index), so it reproduces vitlens' patch granularity with ``steps = number of patches``.
* **Quantus** ``PixelFlipping`` is deletion only. It broadcasts the map to every channel and ranks the ``3·H·W``
  channel values with a non-stable sort, so a step must remove whole pixels: ``features_in_step = 3·H·W / steps``,
  which Quantus also requires to divide ``H·W`` — hence a 24 px model (``H·W = 576``) with 12 steps of 48 pixels,
  and maps without ties. Its ``"black"`` means the minimum of the (normalised) image; vitlens' black is pixel 0, so
  a data config with mean = std = 0.5 is used (black = −1 in every channel) and Quantus gets
  ``perturb_baseline=-1.0``. Its curve omits the unperturbed point: it equals vitlens' deletion curve from the
  second point on. Its AUC (``return_auc_per_sample``) calls ``np.trapz``, removed in NumPy 2, so it fails on this
  stack; its definition (trapezoid with ``dx = 1`` over the Quantus curve) is related to ours by
  ``ours = (quantus + (c₀ + c₁) / 2) / steps`` and that relation is checked on the curves instead.
* **Quantus** ``RegionPerturbation`` (``order="morf"``) ranks patches by the *sum* of the map (same order as
  vitlens' mean for full patches) and returns ``p(x) − p(x_k)``; with ``regions_evaluation`` = number of patches
  it is ``deletion[0] − deletion[k]`` of vitlens' patch-level deletion curve.
* **Quantus** ``PointingGame``: hit if any maximum of the map is in the mask — vitlens' rule with tolerance 0.
  Differences by design: a constant map is a hit for Quantus (every pixel is a maximum) and a miss for vitlens
  (it points nowhere); an empty mask is meant to give NaN in Quantus but the NaN is written into a boolean array and
  becomes a hit, while vitlens gives a miss. Both are shown below.
"""

from __future__ import annotations

import functools
import warnings

import numpy as np
import pytest
import torch

from conftest import load_benchmark, tiny_vit
from vitlens.metrics.localisation import pointing_game
from vitlens.metrics.perturbation import InsertionDeletion

HALF = {"mean": (0.5, 0.5, 0.5), "std": (0.5, 0.5, 0.5)}  # black pixel = -1 in every channel
#: the stand-in torchcam CAM extractor that returns our maps, the one benchmarks/metric_throughput.py times
MapsAsCAM = load_benchmark("metric_throughput").MapsAsCAM


def _case(size: int, n: int = 3, seed: int = 0):
    torch.manual_seed(seed)
    model = tiny_vit(img_size=size)
    model.vitlens_data_config = {"input_size": (3, size, size), **HALF}
    x = torch.randn(n, 3, size, size)
    maps = torch.randn(n, size, size)
    targets = torch.tensor([0, 3, 4, 1, 2][:n])
    return model, x, maps, targets


def _torchcam_per_image(model, x, maps, targets, steps, probability):
    metrics = pytest.importorskip("torchcam.metrics")
    out = []
    for i in range(x.shape[0]):
        m = metrics.DeletionInsertionMetric(
            MapsAsCAM(model, maps[i : i + 1]), functools.partial(torch.softmax, dim=-1) if probability else None,
            steps=steps, baseline=torch.full((1, 3, 1, 1), -1.0), batch_size=64,
        )
        m.update(x[i : i + 1], class_idx=[int(targets[i])])
        s = m.summary()
        out.append((s["insertion_auc"], s["deletion_auc"]))
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("score", ["probability", "logit"])
@pytest.mark.parametrize("ties", [False, True])
def test_insertion_deletion_matches_torchcam(score, ties):
    pytest.importorskip("torchcam")
    model, x, maps, t = _case(32)
    if ties:
        maps = maps.round()  # a handful of values: many ties, broken by index in both libraries
    ours = InsertionDeletion(steps=16, deletion_baseline="black", insertion_baseline="black", score=score)(
        maps, model=model, x=x, targets=t)
    theirs = _torchcam_per_image(model, x, maps, t, steps=16, probability=score == "probability")
    mine = torch.stack([ours.values["insertion"], ours.values["deletion"]], 1).double()
    assert (mine - theirs).abs().max() < 1e-5


def test_patch_insertion_deletion_matches_torchcam_on_patch_constant_maps():
    pytest.importorskip("torchcam")
    model, x, maps, t = _case(32)
    ours = InsertionDeletion(steps=16, granularity="patch", insertion_baseline="black")(maps, model=model, x=x,
                                                                                        targets=t)
    assert ours.protocol["feature_size"] == [8, 8]
    patch_means = torch.nn.functional.avg_pool2d(maps[:, None], 8)[:, 0]
    upsampled = patch_means.repeat_interleave(8, 1).repeat_interleave(8, 2)
    theirs = _torchcam_per_image(model, x, upsampled, t, steps=16, probability=True)
    mine = torch.stack([ours.values["insertion"], ours.values["deletion"]], 1).double()
    assert (mine - theirs).abs().max() < 1e-5


def _quantus():
    quantus = pytest.importorskip("quantus")
    warnings.filterwarnings("ignore", module="quantus")
    return quantus


def test_deletion_matches_quantus_pixel_flipping():
    quantus = _quantus()
    model, x, maps, t = _case(24)
    steps = 12  # 48 pixels = 144 channel values per step
    ours = InsertionDeletion(steps=steps, deletion_baseline="black", insertion_baseline="black")(
        maps, model=model, x=x, targets=t)
    pf = quantus.PixelFlipping(features_in_step=3 * 24 * 24 // steps, perturb_baseline=-1.0, normalise=False,
                               abs=False, disable_warnings=True)
    curve = np.asarray(pf(model=model, x_batch=x.numpy(), y_batch=t.numpy(), a_batch=maps[:, None].numpy(),
                          channel_first=True, softmax=True, device="cpu"))
    deletion = ours.curves["deletion"].double().numpy()
    assert curve.shape == (3, steps)
    assert np.abs(curve - deletion[:, 1:]).max() < 1e-5
    quantus_auc = ((curve[:, :-1] + curve[:, 1:]) / 2).sum(1)  # np.trapz(curve, dx=1), as Quantus defines it
    ours_from_quantus = (quantus_auc + (deletion[:, 0] + deletion[:, 1]) / 2) / steps
    assert np.abs(ours_from_quantus - ours.values["deletion"].double().numpy()).max() < 1e-5


def test_patch_deletion_matches_quantus_region_perturbation():
    quantus = _quantus()
    model, x, maps, t = _case(24)
    ours = InsertionDeletion(steps=9, granularity=8, deletion_baseline="black", insertion_baseline="black")(
        maps, model=model, x=x, targets=t)
    rp = quantus.RegionPerturbation(patch_size=8, regions_evaluation=9, order="morf", perturb_baseline=-1.0,
                                    normalise=False, abs=False, disable_warnings=True)
    drops = np.asarray(rp(model=model, x_batch=x.numpy(), y_batch=t.numpy(), a_batch=maps[:, None].numpy(),
                          channel_first=True, softmax=True, device="cpu"))
    d = ours.curves["deletion"].double()
    assert drops.shape == (3, 9)
    assert np.abs(drops - (d[:, :1] - d[:, 1:]).numpy()).max() < 1e-5


def test_pointing_game_matches_quantus():
    quantus = _quantus()
    torch.manual_seed(0)
    n, size = 12, 16
    maps = torch.rand(n, size, size)
    masks = torch.rand(n, size, size) > 0.6
    for i in range(0, n, 2):  # make half of them hits
        ys, xs = torch.nonzero(masks[i], as_tuple=True)
        maps[i, ys[0], xs[0]] = 2.0
    maps[1, 0, 0] = maps[1, 15, 15] = 3.0  # two maxima
    masks[1] = False
    masks[1, 15, 15] = True  # one of them inside: a hit for both
    pg = quantus.PointingGame(normalise=False, abs=False, disable_warnings=True)

    def theirs(a, s):
        return np.asarray(pg(model=None, x_batch=np.zeros((a.shape[0], 3, size, size), np.float32),
                             y_batch=np.zeros(a.shape[0], int), a_batch=a[:, None].numpy(),
                             s_batch=s[:, None].numpy().astype(np.float32), channel_first=True), dtype=float)

    ours = pointing_game(maps, masks).numpy()
    assert ours.sum() >= n // 2 and np.array_equal(ours, theirs(maps, masks))
    # documented differences: a constant map (Quantus: hit; vitlens: miss), an empty mask (Quantus: hit, from a NaN
    # written into a boolean array; vitlens: miss)
    maps2, masks2 = maps[:2].clone(), masks[:2].clone()
    maps2[1] = 0.5
    masks2[0] = False
    assert theirs(maps2, masks2).tolist() == [1.0, 1.0]
    assert pointing_game(maps2, masks2).tolist() == [0.0, 0.0]
