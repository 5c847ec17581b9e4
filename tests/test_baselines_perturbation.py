"""Perturbation baselines: RISE, TIS, MUTEX, ViT-CX, MDA (small settings, tiny models; seconds on a CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import vitlens
from vitlens.errors import InputError, VitlensError
from vitlens.explainers import get_method
from vitlens.explainers.mda import convex_fit, gaussian_blur, search_window, slic_regions
from vitlens.explainers.mutex import STATISTICS, layer_statistics, multiplex_scores
from vitlens.explainers.rise import rise_masks
from vitlens.explainers.tis import coverage_average, kmeans
from vitlens.explainers.vitcx import cluster_masks

from conftest import load_benchmark, timm_to_hf_vit, tiny_vit

ROWS, COLS = slice(8, 16), slice(16, 24)  # the one region the toy model looks at (an 8×8 cell of a 32×32 image)


def region_mask(h=32, w=32):
    m = torch.zeros(h, w, dtype=torch.bool)
    m[ROWS, COLS] = True
    return m


class RegionModel(nn.Module):
    """Class 0's logit is ``gain`` × the mean of the input over one region (default the 8×8 cell ``ROWS, COLS``);
    class 1's is 0. Nothing else matters, so every faithful map must put its mass on that region."""

    def __init__(self, gain: float = 4.0, region: torch.Tensor | None = None) -> None:
        super().__init__()
        self.gain = gain
        self.region = region_mask() if region is None else region
        self.num_classes = 2

    def forward(self, x):
        v = x[:, :, self.region].mean(dim=(1, 2))
        return torch.stack([self.gain * v, torch.zeros_like(v)], dim=1)


def x_batch(n=2, size=32, seed=0):
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


class TokenCounter:
    """Forward pre-hook on the first block: the number of tokens of every forward call (and the images in it)."""

    def __init__(self, model):
        self.calls: list[tuple[int, int]] = []
        self.handle = model.blocks[0].register_forward_pre_hook(self)

    def __call__(self, module, args):
        self.calls.append((int(args[0].shape[0]), int(args[0].shape[1])))

    def remove(self):
        self.handle.remove()


# -- RISE ---------------------------------------------------------------------------------------------------------
def test_rise_masks_are_smooth_shifted_grids():
    g = torch.Generator().manual_seed(0)
    grids = (torch.rand(50, 4, 4, generator=g) < 0.5).float()
    grids[0] = 1.0
    shifts = torch.randint(0, 8, (50, 2), generator=g)
    m = rise_masks(grids, shifts, (32, 32))
    assert m.shape == (50, 32, 32)
    assert float(m.min()) >= 0.0 and float(m.max()) <= 1.0 + 1e-6
    torch.testing.assert_close(m[0], torch.ones(32, 32))
    assert 0.3 < float(m.mean()) < 0.7  # about p = 0.5 of the image kept on average


def test_rise_peaks_on_the_region_the_model_uses():
    x = torch.ones(1, 3, 32, 32)
    exp = get_method("rise", n_masks=1000, grid_size=4, batch_size=250).explain(RegionModel(), x, target=0)
    sal = exp.maps[0]
    inside = region_mask()
    assert float(sal[inside].mean()) > float(sal[~inside].mean()) + 0.03
    assert bool(inside.flatten()[sal.flatten().argmax()])
    assert exp.cost.forward_passes == 1001 and exp.cost.model_calls == 1 + 4


def test_rise_fill_is_the_value_of_masked_pixels():
    """With fill equal to the image value, masking changes nothing: the map is the constant score f(x)·E[M]/p."""
    x = torch.full((1, 3, 32, 32), 0.5)
    exp = vitlens.explain(RegionModel(), x, method="rise", n_masks=300, grid_size=4, fill=0.5, target=0)
    p = torch.softmax(torch.tensor([4 * 0.5, 0.0]), 0)[0]
    assert float(exp.maps[0].std()) < 0.15 * float(p)
    assert abs(float(exp.maps[0].mean()) - float(p)) < 0.1


# -- TIS ----------------------------------------------------------------------------------------------------------
def test_kmeans_recovers_separated_clusters_and_is_seeded():
    g = torch.Generator().manual_seed(1)
    centres = torch.tensor([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0]])
    pts = torch.cat([c + 0.1 * torch.randn(20, 2, generator=g) for c in centres])
    # Lloyd's algorithm from random points finds the clusters when the initial points hit every cluster
    seed = next(s for s in range(100)
                if len({int(i) // 20 for i in torch.randperm(60, generator=torch.Generator().manual_seed(s))[:3]}) == 3)
    c1, it = kmeans(pts, 3, torch.Generator().manual_seed(seed))
    c2, _ = kmeans(pts, 3, torch.Generator().manual_seed(seed))
    torch.testing.assert_close(c1, c2)
    assert 1 <= it < 100
    found = sorted(tuple(round(v) for v in row.tolist()) for row in c1)
    assert found == sorted(tuple(round(v) for v in row.tolist()) for row in centres)
    with pytest.raises(InputError):
        kmeans(pts, 61, torch.Generator().manual_seed(0))


def test_coverage_average_ignores_uncovered_tokens():
    masks = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    out = coverage_average(masks, torch.tensor([0.2, 0.6]))
    torch.testing.assert_close(out, torch.tensor([0.4, 0.2, 0.0]))


@pytest.mark.parametrize("method,options,kept", [
    ("tis", {"n_masks": 6, "token_ratio": 0.25}, lambda n: int(0.25 * n)),
    ("mutex", {"quantile": 0.5}, lambda n: n - int(0.5 * n)),
    ("mutex", {"quantile": 0.75, "statistics": ("mean", "max")}, lambda n: n - int(0.75 * n)),
])
@pytest.mark.parametrize("prefix", ["cls", "cls+4reg"])
def test_token_methods_run_the_model_on_subsets_of_the_declared_size(method, options, kept, prefix):
    model = tiny_vit(reg_tokens=4) if prefix == "cls+4reg" else tiny_vit()
    p = 5 if prefix == "cls+4reg" else 1
    n = 16
    explainer = get_method(method, batch_size=4, **options)
    counter = TokenCounter(model)
    try:
        exp = explainer.explain(model, x_batch(2))
    finally:
        counter.remove()
    declared = explainer.declared_cost()
    n_masks = declared["forward"] - 1
    full = [c for c in counter.calls if c[1] == p + n]
    sub = [c for c in counter.calls if c[1] != p + n]
    assert sum(b for b, _ in full) == 2  # one full forward per image (the activations / attention)
    assert {t for _, t in sub} == {p + kept(n)}  # every other call: prefix + the kept patch tokens
    assert sum(b for b, _ in sub) == 2 * n_masks
    assert max(b for b, _ in sub) <= 4  # batch_size caps the images per call
    assert exp.cost.forward_passes == pytest.approx(1 + n_masks)
    assert declared["token_fraction"] == pytest.approx(kept(n) / n, abs=0.1)
    assert exp.extras["mask_scores"].shape == (2, n_masks)
    assert (exp.extras["mask_scores"] >= 0).all() and (exp.extras["mask_scores"] <= 1).all()


def test_tis_needs_no_more_masks_than_channels():
    with pytest.raises(InputError, match="n_masks"):
        get_method("tis", n_masks=10_000).explain(tiny_vit(), x_batch(1))


# -- MUTEX --------------------------------------------------------------------------------------------------------
def test_layer_statistics_match_numpy_and_scipy():
    stats = pytest.importorskip("scipy.stats")
    v = torch.randn(7, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    out = layer_statistics(v).numpy()
    a = v.numpy()
    expected = [a.mean(0), np.median(a, 0), a.std(0), a.min(0), a.max(0), np.quantile(a, 0.25, 0),
                np.quantile(a, 0.75, 0), stats.skew(a, 0), stats.kurtosis(a, 0)]
    np.testing.assert_allclose(out, np.stack(expected), rtol=1e-10, atol=1e-12)
    flat = layer_statistics(torch.ones(3, 4))
    assert torch.isfinite(flat).all()


def test_multiplex_scores_layout_and_centralities():
    # one layer, one head, 1 prefix token + 3 patch tokens; patch token 2 receives all the attention
    a = torch.zeros(1, 1, 4, 4)
    a[0, 0, :, 3] = 0.9
    a[0, 0, :, 0] = 0.1
    s = multiplex_scores(a, num_prefix=1, edge_cut=None)
    assert s.shape == (3 * 2 * len(STATISTICS), 3)
    in_mean = s[0]  # aggregation min, in-degree, mean
    out_mean = s[len(STATISTICS)]  # aggregation min, out-degree, mean
    torch.testing.assert_close(in_mean.float(), torch.tensor([0.0, 0.0, 1.8]))  # token 2's self-loop dropped
    torch.testing.assert_close(out_mean.float(), torch.tensor([0.9, 0.9, 0.0]))


@pytest.mark.parametrize("method", ["rise", "tis", "mutex", "vitcx", "mda"])
def test_hf_model_gives_the_timm_maps(method):
    """The same weights as a HuggingFace ViT: same activations, attention and token dropping, so the same maps."""
    pytest.importorskip("transformers")
    from vitlens.explainers.registry import _METHODS

    tm, hm = tiny_vit(), timm_to_hf_vit(tiny_vit())
    x = x_batch(2)
    a = get_method(method, **_METHODS[method].fast_options).explain(tm, x)
    b = get_method(method, **_METHODS[method].fast_options).explain(hm, x)
    torch.testing.assert_close(a.maps, b.maps, rtol=1e-4, atol=1e-6 * float(a.maps.abs().max()))
    assert a.cost.forward_passes == b.cost.forward_passes


# -- ViT-CX -------------------------------------------------------------------------------------------------------
def _grouped_masks():
    """Two groups of three masks: near-identical inside a group (cosine distance < 0.01), disjoint across."""
    g = torch.Generator().manual_seed(0)
    left, right = torch.zeros(64), torch.zeros(64)
    left[:32], right[32:] = 1.0, 1.0
    rows = [left + 0.05 * torch.rand(64, generator=g) for _ in range(3)]
    rows += [right + 0.05 * torch.rand(64, generator=g) for _ in range(3)]
    return torch.stack(rows)


def test_vitcx_clustering_threshold():
    masks = _grouped_masks()
    labels, merged = cluster_masks(masks, 0.1)
    assert merged.shape == (2, 64)
    assert len(set(labels[:3].tolist())) == 1 and len(set(labels[3:].tolist())) == 1
    assert labels[0] != labels[3]
    assert float(merged.min()) == 0.0 and float(merged.max()) == 1.0
    labels, merged = cluster_masks(masks, 1e-6)  # nothing is that close: every channel is its own mask
    assert merged.shape[0] == 6
    labels, merged = cluster_masks(masks, 2.0)  # everything merges
    assert merged.shape[0] == 1


@pytest.mark.parametrize("correction,per_cluster", [(True, 2), (False, 1)])
def test_vitcx_cost_follows_the_cluster_count(correction, per_cluster):
    explainer = get_method("vitcx", noise_correction=correction)
    exp = explainer.explain(tiny_vit(), x_batch(2))
    n = exp.extras["n_clusters"].float()
    assert (n >= 1).all() and (n <= 48).all()
    assert exp.cost.forward_passes == pytest.approx(1 + per_cluster * float(n.mean()))
    assert explainer.declared_cost()["forward"] == pytest.approx(exp.cost.forward_passes)
    bigger = get_method("vitcx", distance_threshold=0.5, noise_correction=correction).explain(tiny_vit(), x_batch(2))
    assert (bigger.extras["n_clusters"] <= exp.extras["n_clusters"]).all()  # a looser threshold merges more


def test_vitcx_layer_option():
    exp = get_method("vitcx", layer=0).explain(tiny_vit(), x_batch(1))
    assert torch.isfinite(exp.maps).all()
    with pytest.raises(InputError, match="layer"):
        get_method("vitcx", layer=7).explain(tiny_vit(), x_batch(1))


# -- MDA ----------------------------------------------------------------------------------------------------------
def test_convex_fit_keeps_ends_and_is_convex():
    convex = np.array([1.0, 0.6, 0.35, 0.2, 0.1, 0.05, 0.0])
    np.testing.assert_allclose(convex_fit(convex), convex, atol=1e-9)
    rng = np.random.default_rng(0)
    curve = np.concatenate([[1.0], np.sort(rng.random(20))[::-1], [0.0]])
    y = convex_fit(curve)
    assert y[0] == pytest.approx(1.0) and y[-1] == pytest.approx(0.0)
    assert (np.diff(y, 2) >= -1e-9).all()
    line = np.linspace(1.0, 0.0, curve.size)  # a feasible convex curve: the fit is at least as close
    assert ((y - curve) ** 2).sum() <= ((line - curve) ** 2).sum() + 1e-12


def test_slic_regions_and_blur():
    labels = slic_regions(x_batch(1)[0], 16, 10000.0)
    assert labels.shape == (32, 32) and int(labels.min()) == 0
    assert int(labels.max()) + 1 == len(torch.unique(labels))
    assert 9 <= len(torch.unique(labels)) <= 25
    img = torch.ones(1, 3, 32, 32)
    blurred = gaussian_blur(img, 5, 2.0)
    assert blurred.shape == img.shape
    torch.testing.assert_close(blurred[..., 8:24, 8:24], img[..., 8:24, 8:24])  # normalised kernel
    assert float(blurred[0, 0, 0, 0]) < 1.0  # zero padding darkens the border
    assert search_window(196) == 28 and search_window(16) == 8


def test_mda_recovers_the_region_the_model_uses():
    x = 0.3 * x_batch(1, seed=3)
    labels = slic_regions(x[0], 16, 10000.0)  # compact SLIC: nearly a grid, whatever the colours
    inside = labels == int(labels[12, 20])
    x[:, :, inside] = 2.0
    assert torch.equal(slic_regions(x[0], 16, 10000.0), labels)
    explainer = get_method("mda", n_regions=16, blur_size=9, blur_sigma=4.0, blur_max_size=9)
    exp = explainer.explain(RegionModel(region=inside), x, target=0)
    sal = exp.maps[0]
    assert float(sal[inside].sum()) > 0.5 * float(sal.sum())
    assert bool(inside.flatten()[sal.flatten().argmax()])
    assert float(sal.min()) >= 0.0
    assert float(sal.sum()) == pytest.approx(1.0, abs=1e-4)  # marginal gains of a curve from 1 to 0
    declared = explainer.declared_cost()
    assert exp.cost.forward_passes == pytest.approx(declared["forward"])
    assert exp.cost.backward_passes == pytest.approx(1.0)  # the input×gradient reference ordering


def test_mda_without_reference_and_with_another_reference():
    x = x_batch(1)
    a = get_method("mda", n_regions=9, reference="none", blur_size=5, blur_max_size=5).explain(tiny_vit(), x)
    assert a.cost.backward_passes == 0 and torch.isfinite(a.maps).all()
    b = get_method("mda", n_regions=9, reference="random", blur_size=5, blur_max_size=5).explain(tiny_vit(), x)
    assert torch.isfinite(b.maps).all()


# -- options ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method,options", [
    ("rise", {"n_masks": 0}),
    ("rise", {"p_keep": 0.0}),
    ("rise", {"score": "logit"}),
    ("rise", {"batch_size": 2.5}),
    ("tis", {"token_ratio": 0.0}),
    ("tis", {"n_masks": -1}),
    ("mutex", {"statistics": ("mean", "mode")}),
    ("mutex", {"aggregations": "sum"}),
    ("mutex", {"quantile": 1.0}),
    ("mutex", {"edge_cut": "median"}),
    ("vitcx", {"distance_threshold": 0.0}),
    ("vitcx", {"noise_std": -1.0}),
    ("mda", {"reference": "mda"}),
    ("mda", {"reference": "no-such-method"}),
    ("mda", {"cutoff": 0.0}),
    ("mda", {"n_regions": 1}),
    ("mda", {"colour": "red"}),
])
def test_bad_options_raise_input_errors(method, options):
    with pytest.raises(InputError) as info:
        get_method(method, **options)
    assert isinstance(info.value, VitlensError)
    assert "\n" not in str(info.value)


def test_token_methods_need_a_token_model():
    with pytest.raises(VitlensError, match="tokens"):
        get_method("tis").explain(RegionModel(), torch.ones(1, 3, 32, 32))


# -- the FLOPs benchmark ------------------------------------------------------------------------------------------
def _load_flops_script():
    return load_benchmark("method_flops")


SMALL_VIT = "vit_tiny_patch16_224:img_size=32,patch_size=8,depth=2"


def test_flops_pieces_equal_full_runs():
    bench = _load_flops_script()
    res = bench.main(["--check", "--model", SMALL_VIT])
    assert [r[0] for r in res["check"]] == ["rise", "tis", "mutex", "vitcx", "mda"]
    for name, est, full in res["check"]:
        assert est == full > 0, name


def test_flops_table(tmp_path):
    bench = _load_flops_script()
    out = tmp_path / "flops.md"
    threads = torch.get_num_threads()
    res = bench.main(["--model", SMALL_VIT, "--methods", "gradskip,mutex,rise,tis", "--out", str(out)])
    assert torch.get_num_threads() == threads
    rows = {r.method: r for r in res["rows"]}
    assert rows["gradskip"].how == "full run" and rows["mutex"].how == "full run"
    assert rows["rise"].how == "pieces"
    assert rows["tis"].how == "failed" and "n_masks" in rows["tis"].note  # 2048 masks > 2·192 channels
    assert rows["mutex"].gflops > 10 * rows["gradskip"].gflops
    md = out.read_text()
    assert md == res["markdown"] and "MUTEX/GradSkip" in md and "seed: 14.45×" in md
    assert bench.mda_search_forwards(4, 2, prefix=1) == 1 + 1 + 1 + 2 + (2 + 2 + 1) + 0
