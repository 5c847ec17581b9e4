"""GradSkip on HF SegFormer and the segmentation target: shapes on the stage-1 grid, conservation through key
reduction and patch merging, completeness, cost, equivariance, restoration, ablations, target errors, baselines."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import vitlens
from vitlens.explainers.gradskip_segformer import window_contributions, window_handback
from vitlens.targets import ClassLogit, SegmentationTarget

from conftest import GRADSKIP_ABLATIONS, load_benchmark, model_fingerprint, options_id, sharpen

transformers = pytest.importorskip("transformers")

#: name → (stages, depths, sr_ratios, hidden sizes, heads)
CONFIGS = {
    "2stage-sr2": (2, [2, 1], [2, 1], [16, 32], [2, 2]),
    "4stage-sr4": (4, [2, 1, 1, 1], [4, 2, 1, 1], [16, 24, 32, 48], [2, 2, 4, 4]),
    "4stage-sr1": (4, [1, 1, 1, 1], [1, 1, 1, 1], [16, 24, 32, 48], [1, 2, 2, 4]),
}


def tiny_segformer(kind: str = "4stage-sr4", seed: int = 0, num_labels: int = 5) -> nn.Module:
    """A random SegFormer with ``kind``'s layout; q/k sharpened so heads differ, decode head scaled so classes do."""
    n, depths, srs, hidden, heads = CONFIGS[kind]
    cfg = transformers.SegformerConfig(
        num_channels=3, num_encoder_blocks=n, depths=depths, sr_ratios=srs, hidden_sizes=hidden,
        num_attention_heads=heads, patch_sizes=[7] + [3] * (n - 1), strides=[4] + [2] * (n - 1),
        mlp_ratios=[2] * n, decoder_hidden_size=32, num_labels=num_labels,
    )
    torch.manual_seed(seed)
    model = transformers.SegformerForSemanticSegmentation(cfg).eval()
    with torch.no_grad():
        model.decode_head.classifier.weight.mul_(8.0)
    return sharpen(model)


def images(n: int = 3, size: tuple[int, int] = (64, 48), seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 3, *size, generator=torch.Generator().manual_seed(seed))


def majority_classes(model: nn.Module, x: torch.Tensor) -> list[int]:
    """The class predicted on the most logit pixels of each image (so the default region is not empty)."""
    with torch.no_grad():
        pred = model(pixel_values=x).logits.argmax(1).flatten(1)
    return [int(p.bincount().argmax()) for p in pred]


def explain(model, x, **kw):
    target = kw.pop("target", None) or SegmentationTarget(majority_classes(model, x))
    return vitlens.explain(model, x, method="gradskip", target=target, **kw)


def close_to(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-4) -> None:
    torch.testing.assert_close(a, b, rtol=rtol, atol=1e-6 * float(b.abs().max()))


# -- adapter ----------------------------------------------------------------------------------------------------------

def test_adapter_layout_is_derived_from_the_model():
    model = tiny_segformer("4stage-sr4")
    a = vitlens.get_adapter(model)
    assert a.family == "hf-segformer" and a.num_classes == 5 and a.num_prefix_tokens == 0
    assert a.stage_grids((64, 48)) == [(16, 12), (8, 6), (4, 3), (2, 2)]
    assert a.stage_grids((66, 50)) == [(17, 13), (9, 7), (5, 4), (3, 2)]
    assert a.grid((66, 50)) == (17, 13)
    assert len(a.blocks()) == 5
    with pytest.raises(vitlens.InputError, match="no 4x4 key-reduction window"):
        vitlens.explain(model, torch.randn(1, 3, 8, 8), target=SegmentationTarget(0))
    with pytest.raises(vitlens.InputError, match="3 input channels"):
        vitlens.explain(model, torch.randn(1, 1, 64, 48), target=SegmentationTarget(0))


# -- completeness and conservation ----------------------------------------------------------------------------------

@pytest.mark.parametrize("size", [(64, 48), (66, 50)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_shapes_and_completeness(kind, size):
    model = tiny_segformer(kind)
    x = images(2, size)
    exp = explain(model, x)
    grid = vitlens.get_adapter(model).grid(size)
    assert exp.token_maps.shape == (2, *grid) and exp.maps.shape == (2, *size)
    assert torch.all(exp.remainder == 0)
    close_to(exp.token_maps.sum((1, 2)) + exp.remainder, exp.scores)
    if size == (64, 48):  # integer upsampling factor: the pixel map keeps the total too
        close_to(exp.maps.sum((1, 2)), exp.scores)
    assert exp.extras["layer_totals"].shape == (2, len(vitlens.get_adapter(model).blocks()))


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_conservation_per_block_through_reduction_and_between_stages(kind):
    model = tiny_segformer(kind)
    depths = CONFIGS[kind][1]
    x = images(3, (66, 50))
    exp = explain(model, x)
    y = exp.scores
    shares, stage_tot, layer_tot = (exp.extras[k] for k in ("readout_shares", "stage_totals", "layer_totals"))
    close_to(shares.sum(1), y)  # the start relevance is complete
    first = [sum(depths[:s]) for s in range(len(depths))]
    for s, d in enumerate(depths):
        for j in range(d):  # every block (attention + key hand-back + skip) keeps the stage total
            close_to(layer_tot[:, first[s] + j], stage_tot[:, s])
        if s + 1 < len(depths):  # stage output = its readout share + what patch merging handed down
            close_to(stage_tot[:, s], shares[:, s] + layer_tot[:, first[s + 1]])
    close_to(exp.token_maps.sum((1, 2)), layer_tot[:, 0])


def test_maps_are_nonnegative_for_positive_scores_and_scale_with_y():
    model = tiny_segformer()
    x = images(3)
    exp = explain(model, x)
    for i in range(3):
        if exp.scores[i] > 0:
            assert float(exp.token_maps[i].min()) >= 0
        else:
            assert float(exp.token_maps[i].max()) <= 0


CONVS = [
    nn.Conv2d(4, 6, 7, stride=4, padding=3),  # stage-1 style overlapping embedding
    nn.Conv2d(4, 6, 3, stride=2, padding=1),  # patch merging
    nn.Conv2d(4, 4, 4, stride=4),  # key reduction, r = 4 (leaves uncovered edge positions on 10x9)
]


@pytest.mark.parametrize("conv", CONVS, ids=["k7s4", "k3s2", "r4"])
def test_window_handback_is_exact_and_conservative(conv):
    torch.manual_seed(0)
    x = torch.randn(2, 4, 10, 9)
    out = conv(x)
    g = torch.randn_like(out)
    c = window_contributions(x, g, conv)
    # per window the contributions sum to <gradient, output - bias>
    expected = (g * (out - conv.bias[None, :, None, None])).sum(1).flatten(1)
    torch.testing.assert_close(c.sum(-1), expected.detach(), rtol=1e-4, atol=1e-5)
    r = torch.rand(2, out.shape[-2] * out.shape[-1])
    back = window_handback(r, x, g, conv)
    assert back.shape == (2, 90)
    torch.testing.assert_close(back.sum(-1), r.sum(-1), rtol=1e-5, atol=1e-6)
    assert float(back.min()) >= 0


def test_window_handback_uniform_fallback_over_in_image_positions():
    conv = nn.Conv2d(1, 1, 3, stride=2, padding=1)
    x = torch.zeros(1, 1, 6, 6)  # no activation: every window falls back to uniform
    g = torch.ones(1, 1, 3, 3)
    r = torch.zeros(1, 9)
    r[0, 0] = 1.0  # the corner window covers rows/cols {-1, 0, 1}: 4 in-image positions
    back = window_handback(r, x, g, conv).reshape(6, 6)
    assert torch.allclose(back[:2, :2], torch.full((2, 2), 0.25)) and float(back.sum()) == pytest.approx(1.0)
    r = torch.zeros(1, 9)
    r[0, 4] = 1.0  # the centre window covers 9 in-image positions
    back = window_handback(r, x, g, conv).reshape(6, 6)
    assert torch.allclose(back[1:4, 1:4], torch.full((3, 3), 1 / 9))


# -- cost, equivariance, determinism ----------------------------------------------------------------------------------

def test_exactly_one_forward_and_one_backward_per_batch():
    model = tiny_segformer()
    x = images(4)
    target = SegmentationTarget(majority_classes(model, x))
    calls = {"fwd": 0, "bwd": 0}

    def fwd(module, args, out):
        calls["fwd"] += 1
        out.logits.register_hook(lambda g: calls.__setitem__("bwd", calls["bwd"] + 1))

    seen = []
    hooks = [model.register_forward_hook(fwd),
             model.segformer.stages[0].patch_embeddings.proj.register_full_backward_hook(lambda *a: seen.append(1))]
    try:
        exp = vitlens.explain(model, x, target=target)
    finally:
        for h in hooks:
            h.remove()
    assert calls == {"fwd": 1, "bwd": 1}
    assert seen == []  # the backward stops at the first block of stage 1
    assert exp.cost.model_calls == 1 and exp.cost.backward_calls == 1
    assert exp.cost.forward_passes == 1.0 and exp.cost.backward_passes == 1.0


def test_batch_equals_one_by_one_and_chunks():
    model = tiny_segformer()
    x = images(3, (66, 50))
    classes = majority_classes(model, x)
    full = explain(model, x, target=SegmentationTarget(classes))
    for i in range(3):
        one = explain(model, x[i:i + 1], target=SegmentationTarget(classes[i]))
        scale = float(full.token_maps[i].abs().max())
        torch.testing.assert_close(one.token_maps[0], full.token_maps[i], rtol=1e-4, atol=1e-5 * scale)
    chunked = explain(model, x, target=SegmentationTarget(classes), batch_size=2)
    assert chunked.cost.model_calls == 2 and chunked.targets.tolist() == classes
    torch.testing.assert_close(chunked.token_maps, full.token_maps, rtol=1e-4, atol=1e-5 * float(full.maps.abs().max()))


def test_deterministic():
    model = tiny_segformer()
    x = images(2)
    assert torch.equal(explain(model, x).maps, explain(model, x).maps)


# -- model restored ---------------------------------------------------------------------------------------------------

class Boom(RuntimeError):
    pass


class ExplodingTarget(SegmentationTarget):
    def score(self, logits):
        raise Boom("fails after the forward pass, with every hook installed")


def restoration_setup(train_mode: bool):
    """A tiny SegFormer in the given mode with a few frozen parameters, a batch, and its fingerprint."""
    model = tiny_segformer("2stage-sr2")
    x = images(2)
    with torch.no_grad():
        model(pixel_values=x)  # transformers installs its own output-capturing hooks on the first call
    model.train(train_mode)
    for p in list(model.parameters())[:3]:
        p.requires_grad_(False)
    return model, x, model_fingerprint(model)


@pytest.mark.parametrize("train_mode", [False, True])
def test_model_restored_after_success_and_exception(train_mode):
    model, x, before = restoration_setup(train_mode)
    assert before["attn_impl"] != "eager"
    for method in ["gradskip", "inputxgradient", "random"]:
        vitlens.explain(model, x, method=method, target=SegmentationTarget(1))
        assert model_fingerprint(model) == before, method
        with pytest.raises(Boom):
            vitlens.explain(model, x, method=method, target=ExplodingTarget(1))
        assert model_fingerprint(model) == before, method
    # an exception inside a block
    handle = model.segformer.stages[1].blocks[0].mlp.register_forward_hook(lambda *a: (_ for _ in ()).throw(Boom()))
    before = model_fingerprint(model)
    with pytest.raises(Boom):
        vitlens.explain(model, x, target=SegmentationTarget(1))
    assert model_fingerprint(model) == before
    handle.remove()


# -- ablations --------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ablation_setup():
    model = tiny_segformer("4stage-sr4", seed=3)
    x = images(2, (64, 48), seed=5)
    target = SegmentationTarget(majority_classes(model, x))
    return model, x, target, vitlens.explain(model, x, target=target)


@pytest.mark.parametrize("opts", GRADSKIP_ABLATIONS, ids=options_id)
def test_each_ablation_switch_changes_the_map(opts, ablation_setup):
    model, x, target, base = ablation_setup
    other = vitlens.explain(model, x, target=target, **opts)
    assert not torch.allclose(base.token_maps, other.token_maps, rtol=1e-3, atol=1e-6), opts
    close_to(other.token_maps.sum((1, 2)) + other.remainder, other.scores)


def test_alpha_extremes_equal_the_single_score_modes(ablation_setup):
    model, x, target, _ = ablation_setup
    for alpha, mode in [(0.0, "sparsity"), (1.0, "gradient")]:
        a = vitlens.explain(model, x, target=target, alpha=alpha)
        b = vitlens.explain(model, x, target=target, head_weighting=mode)
        torch.testing.assert_close(a.maps, b.maps, rtol=0, atol=0)


# -- the segmentation target ------------------------------------------------------------------------------------------

SEG = torch.tensor([[[[1.0, 0.0], [0.0, 3.0]], [[0.0, 2.0], [1.0, 0.0]], [[-1.0, -1.0], [-1.0, -1.0]]]])  # (1, 3, 2, 2)


def test_segmentation_target_default_region_and_fallback():
    t = SegmentationTarget(0).resolve(SEG)  # class 0 wins at (0, 0) and (1, 1)
    assert t.mask[0].tolist() == [[True, False], [False, True]] and t.fallback.tolist() == [False]
    assert t(SEG).tolist() == [4.0]
    t = SegmentationTarget(2).resolve(SEG)  # class 2 wins nowhere: all pixels
    assert t.fallback.tolist() == [True] and t(SEG).tolist() == [-4.0]
    # the region is fixed at resolution: perturbed logits are scored over the same pixels
    assert t(SEG * 0 + 1).tolist() == [4.0]
    two = torch.cat([SEG, SEG.flip(-1)])
    assert SegmentationTarget([0, 1]).resolve(two)(two).tolist() == [4.0, 3.0]
    sel = SegmentationTarget([0, 1]).resolve(two).select(torch.tensor([1, 1, 0]))
    assert sel(torch.cat([two[1:], two[1:], two[:1]])).tolist() == [3.0, 3.0, 4.0]


def test_segmentation_target_explicit_regions():
    region = torch.tensor([[True, True], [False, False]])
    assert SegmentationTarget(1, region).resolve(SEG)(SEG).tolist() == [2.0]
    # at input resolution (4x the logit grid): logits upsampled bilinearly, then summed over the mask
    big = torch.ones(8, 8, dtype=torch.bool)
    t = SegmentationTarget(1, big).resolve(SEG)
    assert t.upsample_to == (8, 8)
    assert t(SEG).item() == pytest.approx(3.0 * 16)  # bilinear keeps the mean of this 2x2 map: 0.75 * 64
    odd = torch.ones(1, 7, 5, dtype=torch.bool)  # ceil(7/4) = 2, ceil(5/4) = 2
    assert SegmentationTarget(1, odd).resolve(SEG).upsample_to == (7, 5)


@pytest.mark.parametrize("args,logits,msg", [
    ((0,), torch.randn(2, 3), "needs per-pixel logits"),
    ((3,), SEG, "class 3 is out of range for a model with 3 classes"),
    (([0, 1, 2],), SEG, "3 class indices given for a batch of 1"),
    ((0, torch.ones(3, 9, dtype=torch.bool)), SEG, "3x9 matches neither the logits' 2x2 grid"),
    ((0, torch.ones(2, 2, 2, dtype=torch.bool)), SEG, "2 masks for a batch of 1"),
])
def test_segmentation_target_errors(args, logits, msg):
    with pytest.raises(vitlens.TargetError, match=msg):
        SegmentationTarget(*args).resolve(logits)


def test_segmentation_target_construction_errors():
    with pytest.raises(vitlens.TargetError, match="needs a class index"):
        SegmentationTarget(None)
    with pytest.raises(vitlens.TargetError, match="bool tensor"):
        SegmentationTarget(0, torch.ones(2, 2))
    with pytest.raises(vitlens.TargetError, match=r"shape \(h, w\) or \(B, h, w\)"):
        SegmentationTarget(0, torch.ones(2, dtype=torch.bool))
    with pytest.raises(vitlens.TargetError, match="use vitlens.targets.SegmentationTarget"):
        ClassLogit(None).resolve(SEG)


def test_classification_targets_on_segformer_are_a_clear_error():
    model = tiny_segformer("2stage-sr2")
    with pytest.raises(vitlens.TargetError, match="SegmentationTarget"):
        vitlens.explain(model, images(1))
    with pytest.raises(vitlens.TargetError, match=r"logits of shape \(B, K\)"):
        vitlens.explain(model, images(1), target=2)
    # per-image regions are not split by batch_size chunking: a clear error, not a silent mismatch
    region = torch.ones(2, 16, 12, dtype=torch.bool)
    with pytest.raises(vitlens.TargetError, match="2 masks for a batch of 1"):
        vitlens.explain(model, images(2), target=SegmentationTarget(1, region), batch_size=1)


def test_explicit_region_at_input_resolution_through_explain():
    model = tiny_segformer("2stage-sr2")
    x = images(2)
    region = torch.zeros(2, 64, 48, dtype=torch.bool)
    region[:, 8:40, 4:30] = True
    exp = explain(model, x, target=SegmentationTarget(2, region))
    with torch.no_grad():
        up = nn.functional.interpolate(model(pixel_values=x).logits, size=(64, 48), mode="bilinear")
    close_to(exp.scores, (up[:, 2] * region).sum((1, 2)))
    close_to(exp.token_maps.sum((1, 2)), exp.scores)


# -- other methods on SegFormer ---------------------------------------------------------------------------------------

BASELINES = {
    "inputxgradient": {},
    "gradient": {},
    "smoothgrad": {"n": 3},
    "integrated_gradients": {"n_steps": 4},
    "random": {},
    "rise": {"n_masks": 16, "grid_size": 3, "score": "target"},
}


@pytest.mark.parametrize("name", sorted(BASELINES))
def test_model_agnostic_baselines_run_with_a_segmentation_target(name):
    model = tiny_segformer("2stage-sr2")
    x = images(2)
    exp = vitlens.explain(model, x, method=name, target=SegmentationTarget(1), **BASELINES[name])
    assert exp.maps.shape == (2, 64, 48) and torch.isfinite(exp.maps).all()
    assert exp.targets.tolist() == [1, 1]


@pytest.mark.parametrize("name", ["rollout", "gae", "transformer_attribution", "attnlrp", "attn_gradcam", "tis"])
def test_single_sequence_methods_refuse_segformer_clearly(name):
    with pytest.raises(vitlens.UnsupportedModelError):
        vitlens.explain(tiny_segformer("2stage-sr2"), images(1), method=name, target=SegmentationTarget(1))


def test_rise_probability_score_needs_a_classifier():
    # refused by the support path: score='probability' (the default) needs class logits, SegFormer has per-pixel ones
    with pytest.raises(vitlens.UnsupportedModelError, match="needs 'class_logits'.*score='target'"):
        vitlens.explain(tiny_segformer("2stage-sr2"), images(1), method="rise", target=SegmentationTarget(1),
                        n_masks=4, grid_size=3)
    exp = vitlens.explain(tiny_segformer("2stage-sr2"), images(1), method="rise", target=SegmentationTarget(1),
                          n_masks=4, grid_size=3, score="target")
    assert torch.isfinite(exp.maps).all()


# -- the benchmark script runs end to end (untrained model: numbers not checked) ------------------------------------

def test_segmentation_benchmark_runs(tmp_path):
    bench = load_benchmark("segformer_segmentation")
    model = tiny_segformer("4stage-sr4", num_labels=7)  # background + the 6 scene classes
    model.config.image_size = 64
    model.config.vitlens_data_config = {"input_size": (3, 64, 64), "mean": (0.5,) * 3, "std": (0.25,) * 3,
                                        "interpolation": "bilinear", "crop_pct": 1.0, "crop_mode": "squash"}
    rows = [("GradSkip (default)", "gradskip", {}), ("  start: last stage only", "gradskip-last", {}),
            ("random", "random", {})]
    table, info = bench.run(model, n=1, seed=0, batch=8, rows=rows)
    assert table.count("\n| ") == 1 + 1 + len(rows)  # column names + the reference row + one row per method
    assert set(info["rows"]) == {"reference: the model's prediction mask", "GradSkip (default)",
                                 "start: last stage only", "random"}
    for scores in info["rows"].values():
        assert 0.0 <= scores["pa_mean"][0] <= 1.0 and 0.0 <= scores["miou_otsu"][0] <= 1.0
