"""`--recipe authors` and the `aha_authors` evaluation preset against the AHA authors' code (GitHub dschinagl/AHA).

The expected numbers were obtained by running the authors' code (their ``src/aha/pipeline`` and ``src/aha/sorter``
modules, unchanged, in a scratch folder outside the project; their code is not part of vitlens) on the fixed inputs
built below: a tiny convolutional classifier, two 24×24 images, two maps without ties, all given by formulas (no
random numbers), and Gumbel noise from a formula passed to both sides. Their classifier wrapper takes pixels in
[0, 1], normalises them and returns the softmax; vitlens works on normalised images, so the two agree up to float
rounding. A 5×5 grid on 24 px makes the adaptive pooling windows overlap.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vitlens.aha.config import AUTHORS_OPTIONS, AHATrainConfig
from vitlens.aha.plan import choose_classes, schedule_factor, temperature
from vitlens.aha.soft_metrics import (RegionGrid, blend, curve_fractions, map_loss, peak_penalty, reference,
                                      soft_curves, soft_membership)
from vitlens.aha.sorter import soft_sort
from vitlens.errors import InputError
from vitlens.metrics.perturbation import InsertionDeletion

H = W = 24
B, K, G, TAU = 2, 5, 5, 0.3
MEAN, STD = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)

# ---- the authors' code's outputs on these inputs (their functions run in a scratch folder) -----------------------
AUTHORS = {
    "classes": ([0, 2], [2, 4]),  # resolve_target_classes(..., "prediction_and_ground_truth"), labels (0, 4)
    "pooled": 23.04550969111618,  # pool_heatmap_to_grid (adaptive_avg_pool2d), checksum
    "pooled_first": [0.033195383846759796, 0.22817140817642212, 0.7954974174499512],
    "p_desc": 48.85474427418825,  # GumbelSinkhorn(30, 0.3, gumbel on) of the raw pooled scores, noise salt 1
    "p_asc": 49.380048391778296,  # ... of their negation, noise salt 2
    "p_desc_nonoise": 50.18134638567598,
    "ref_blur": 1730.7708580340445,  # build_reference_image(x, "blur"): 37 taps, σ 37, reflect
    "ref_blur_px": [0.5003358721733093, 0.5002123117446899, 0.500033974647522],
    "interventions_desc_blur": 27701.101230295393,  # build_intervention_images(P_desc, 5, x, blur, 16 points, σ 1)
    # AUCLoss.compute (batch means): (desc, prediction), (desc, second class), (asc, prediction), (asc, second)
    "auc_black": (0.12465905398130417, 0.4197143614292145, 0.2606547176837921, 0.5264756083488464),
    "auc_mean": (0.27397945523262024, 0.6221177577972412, 0.40687045454978943, 0.36859601736068726),
    "auc_blur": (0.2940281927585602, 0.6043777465820312, 0.4089805483818054, 0.34521687030792236),
    # the loss of scripts/train.py: mean desc AUC + (1 − mean asc AUC) + 0.0025 · peak_suppression_penalty
    "loss_black": 0.8789160251617432,
    "loss_mean": 1.0606099367141724,
    "loss_blur": 1.0723987817764282,
    "peak_per_image": [0.07805517315864563, 0.1575503945350647],
    # LinearWarmupCosineDecayLR(total 200, max_lr 3e-4, pct 0.06, div 25, final div 1e4): lr at optimiser step s
    "lr": {0: 1.1999999999999999e-05, 1: 3.612060301507537e-05, 5: 0.00013260301507537686,
           11: 0.00027732663316582917, 12: 0.00029999992384474513, 13: 0.00029997623172452214,
           50: 0.0002703859806060738, 100: 0.00016376111707147896, 150: 4.799004774769156e-05,
           198: 2.2353742016513556e-08, 199: 1.1999999999999998e-09},
    "tau": [1.0, 0.6482412060301508, 0.3],  # linear_anneal at steps 0, 100, 199 of 200
    # PixelAUCMetric (21 points, no smoothing), per image: (auc_desc, auc_asc) for the predicted class
    "pixel_auc_mean": [(0.2788350284099579, 0.39742332696914673), (0.45280230045318604, 0.2980504035949707)],
    "pixel_auc_black": [(0.12153403460979462, 0.13888581097126007), (0.3164606988430023, 0.07212546467781067)],
    "pixel_auc_blur": [(0.34976837038993835, 0.4341123104095459), (0.4505730867385864, 0.30895912647247314)],
}


# ---- the fixed inputs (formulas; the scratch run built the same) -------------------------------------------------
def images() -> torch.Tensor:
    i = torch.arange(B * 3 * H * W, dtype=torch.float64)
    return (0.5 + 0.45 * torch.sin(i * 0.37 + 0.1 * torch.cos(i * 0.011))).reshape(B, 3, H, W).float()


def heatmap() -> torch.Tensor:
    y = torch.arange(H, dtype=torch.float64)[:, None]
    x = torch.arange(W, dtype=torch.float64)[None, :]
    maps = []
    for b in range(B):
        m = torch.exp(-((y - 7 - 9 * b) ** 2 + (x - 15 + 6 * b) ** 2) / 40.0) * (2.0 + b)
        maps.append(m + 0.3 * torch.sin(0.7 * y + 1.3 * x + b) + 0.01 * torch.cos(3.1 * x * y + b))
    return torch.stack(maps).float()


def gumbel(shape: tuple[int, ...], salt: int) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    i = torch.arange(n, dtype=torch.float64)
    u = torch.frac(torch.sin(i * 12.9898 + salt * 78.233) * 43758.5453).abs().clamp(1e-6, 1 - 1e-6)
    return (-torch.log(-torch.log(u))).reshape(shape).float()


class Tiny(nn.Module):
    """conv 3→4 (3×3, stride 2) + ReLU + linear to 5 classes, weights from formulas; takes normalised images."""

    def __init__(self) -> None:
        super().__init__()
        f = lambda n: torch.arange(n, dtype=torch.float64)  # noqa: E731
        self.w1 = nn.Parameter((0.3 * torch.sin(f(108) * 0.7)).reshape(4, 3, 3, 3).float())
        self.b1 = nn.Parameter((0.1 * torch.cos(f(4))).float())
        self.w2 = nn.Parameter((0.05 * torch.cos(f(K * 576) * 0.31)).reshape(K, 576).float())
        self.b2 = nn.Parameter((0.2 * torch.sin(f(K))).float())
        self.vitlens_data_config = {"input_size": (3, H, W), "mean": MEAN, "std": STD}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(F.conv2d(x, self.w1, self.b1, stride=2, padding=1))
        return h.flatten(1) @ self.w2.t() * 4.0 + self.b2


def normalise(x: torch.Tensor) -> torch.Tensor:
    return (x - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)


def pixels(x: torch.Tensor) -> torch.Tensor:
    return x * torch.tensor(STD).view(1, 3, 1, 1) + torch.tensor(MEAN).view(1, 3, 1, 1)


def check(t: torch.Tensor) -> float:
    """The checksum the scratch run printed: the sum weighted by a fixed ramp (sensitive to position)."""
    t = t.detach().double().reshape(-1)
    return float((t * (1.0 + 0.5 * torch.sin(torch.arange(t.numel(), dtype=torch.float64) * 0.1))).sum())


def probs(model: nn.Module):
    def fn(im: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        p = model(im).softmax(-1)
        return p.gather(1, c if c.ndim == 2 else c[:, None]) if c.ndim == 2 else p.gather(1, c[:, None])[:, 0]
    return fn


# ---- the tests ----------------------------------------------------------------------------------------------------
def test_authors_recipe_has_every_item_of_their_code():
    cfg = AHATrainConfig.preset("authors")
    for key, value in AUTHORS_OPTIONS.items():
        assert getattr(cfg, key) == value, key
    assert (cfg.lr, cfg.tau_start, cfg.tau_end, cfg.noise_scale, cfg.m, cfg.step_sampling, cfg.n_iters,
            cfg.classes_per_image, cfg.w_peak, cfg.peak_kernel, cfg.mask_sigma, cfg.warmup_frac, cfg.clip,
            cfg.weight_decay) == (3e-4, 1.0, 0.3, 1.0, 16, "fixed", 30, 2, 0.0025, 15, 1.0, 0.06, 1.0, 1e-3)
    assert set(cfg.references) == {"black", "mean", "blur"}
    tracked = AHATrainConfig.preset("tracked", sorter_input="raw")  # any item alone on the tracked recipe
    assert tracked.sorter_input == "raw" and tracked.pooling == "partition"
    with pytest.raises(InputError, match="needs grid_offset off"):
        AHATrainConfig.preset("tracked", pooling="adaptive").check()
    with pytest.raises(InputError, match="classes_per_image = 2"):
        AHATrainConfig.preset("tracked", classes="authors").check()
    with pytest.raises(InputError, match="sorter_input must be one of"):
        AHATrainConfig.preset("tracked", sorter_input="scaled").check()


def test_classes_pooling_and_soft_sort_equal_the_authors():
    model = Tiny()
    x = normalise(images())
    with torch.no_grad():
        classes = choose_classes(model(x), torch.tensor([0, 4]), 2)
    assert (classes[:, 0].tolist(), classes[:, 1].tolist()) == AUTHORS["classes"]
    grid = RegionGrid((H, W), G, pooling="adaptive")
    pooled = grid.pool(heatmap())
    assert check(pooled) == pytest.approx(AUTHORS["pooled"], abs=1e-5)
    assert pooled[0, :3].tolist() == pytest.approx(AUTHORS["pooled_first"], abs=1e-6)
    partition = RegionGrid((H, W), G).pool(heatmap())  # vitlens's own pooling differs where windows overlap
    assert (partition - pooled).abs().max() > 1e-3
    noise = torch.stack([gumbel((B, G * G, G * G), 1), gumbel((B, G * G, G * G), 2)], dim=1)
    p_desc = soft_sort(pooled, TAU, 30, noise=noise[:, 0], scale=False)
    p_asc = soft_sort(pooled, TAU, 30, noise=noise[:, 1], descending=False, scale=False)
    assert check(p_desc) == pytest.approx(AUTHORS["p_desc"], abs=2e-4)
    assert check(p_asc) == pytest.approx(AUTHORS["p_asc"], abs=2e-4)
    assert check(soft_sort(pooled, TAU, 30, scale=False)) == pytest.approx(AUTHORS["p_desc_nonoise"], abs=2e-4)


def test_references_and_masks_equal_the_authors():
    x = normalise(images())
    blur = pixels(reference(x, "blur", MEAN, STD, style="authors"))
    assert check(blur) == pytest.approx(AUTHORS["ref_blur"], rel=1e-6)
    assert blur[1, :, 3, 20].tolist() == pytest.approx(AUTHORS["ref_blur_px"], abs=1e-6)
    mean = pixels(reference(x, "mean", MEAN, STD, style="authors"))
    assert mean[0, :, 5, 7].tolist() == pytest.approx([0.485, 0.456, 0.406], abs=1e-6)
    assert pixels(reference(x, "black", MEAN, STD, style="authors")).abs().max() < 1e-6
    grid = RegionGrid((H, W), G, pooling="adaptive")
    noise = gumbel((B, G * G, G * G), 1)
    p_desc = soft_sort(grid.pool(heatmap()), TAU, 30, noise=noise, scale=False)
    masks = grid.to_pixels(soft_membership(p_desc, curve_fractions(16)), 1.0, clamp_before=True)
    got = blend(images(), masks, blur)  # (B, 16, 3, H, W): image-major as their repeat_interleave
    assert check(got) == pytest.approx(AUTHORS["interventions_desc_blur"], abs=2e-3)
    memb = soft_membership(p_desc, curve_fractions(16))
    assert float(memb.max()) > 1.005  # the noisy sorter's column sums overshoot: clamping first matters
    after_only = check(blend(images(), grid.to_pixels(memb, 1.0), blur))  # vitlens's clamp (after the blur only)
    assert abs(after_only - AUTHORS["interventions_desc_blur"]) > 1e-2


@pytest.mark.parametrize("ref", ["black", "mean", "blur"])
def test_soft_aucs_and_loss_equal_the_authors(ref):
    model = Tiny()
    x = normalise(images())
    cfg = AHATrainConfig.preset("authors")
    grid = RegionGrid((H, W), G, pooling=cfg.pooling)
    classes = torch.tensor(AUTHORS["classes"]).t()  # (B, 2): prediction, second class
    r = reference(x, ref, MEAN, STD, style=cfg.reference_style)
    noise = torch.stack([gumbel((B, G * G, G * G), 1), gumbel((B, G * G, G * G), 2)], dim=1)
    fr = curve_fractions(cfg.m, cfg.step_sampling)
    kw = dict(scale=False, clamp_before=True, mask_sigma=cfg.mask_sigma)
    with torch.no_grad():
        one = [soft_curves(probs(model), x, r, heatmap(), classes[:, j], grid, fr, TAU, 30, noise=noise, **kw)
               for j in (0, 1)]
        loss, parts = map_loss(probs(model), x, r, heatmap(), classes, grid, fr, TAU, cfg, noise)
    want = AUTHORS[f"auc_{ref}"]
    got = (float(one[0].del_auc.mean()), float(one[1].del_auc.mean()), float(one[0].ins_auc.mean()),
           float(one[1].ins_auc.mean()))
    assert got == pytest.approx(want, abs=2e-6)
    assert float(parts["del_auc"].mean()) == pytest.approx((want[0] + want[1]) / 2, abs=2e-6)
    assert parts["peak"].tolist() == pytest.approx(AUTHORS["peak_per_image"], rel=1e-5)
    assert float(loss.mean()) == pytest.approx(AUTHORS[f"loss_{ref}"], abs=3e-6)
    tracked = AHATrainConfig.preset("tracked")  # vitlens's own choices give another loss on the same inputs
    with torch.no_grad():
        other, _ = map_loss(probs(model), x, r, heatmap(), classes[:, 0], RegionGrid((H, W), G), fr, TAU, tracked,
                            noise)
    assert abs(float(other.mean()) - AUTHORS[f"loss_{ref}"]) > 1e-3


def test_peak_penalty_on_the_raw_map_equals_the_authors():
    got = peak_penalty(heatmap(), 15, on="raw")
    assert got.tolist() == pytest.approx(AUTHORS["peak_per_image"], rel=1e-5)
    assert float(peak_penalty(3.0 * heatmap(), 15, on="raw")[0]) == pytest.approx(9 * AUTHORS["peak_per_image"][0],
                                                                                  rel=1e-5)


def test_learning_rate_schedule_and_temperature_equal_the_authors():
    cfg = AHATrainConfig.preset("authors", steps=200)
    for step, lr in AUTHORS["lr"].items():
        assert cfg.lr * schedule_factor(step, cfg) == pytest.approx(lr, rel=1e-9, abs=1e-15)
    opt = torch.optim.AdamW([nn.Parameter(torch.zeros(1))], lr=cfg.lr)  # as the training builds it
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: schedule_factor(s, cfg))
    seen = []
    for _ in range(200):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert [seen[s] for s in AUTHORS["lr"]] == pytest.approx(list(AUTHORS["lr"].values()), rel=1e-9, abs=1e-15)
    assert [temperature(s, cfg) for s in (0, 100, 199)] == pytest.approx(AUTHORS["tau"], abs=1e-12)


@pytest.mark.parametrize("ref", ["mean", "black", "blur"])
def test_aha_authors_preset_equals_their_pixel_auc_metric(ref):
    model = Tiny()
    x = normalise(images())
    with torch.no_grad():
        pred = model(x).argmax(-1)
    r = InsertionDeletion(preset="aha_authors", deletion_baseline=ref)(heatmap(), model=model, x=x, targets=pred)
    want = AUTHORS[f"pixel_auc_{ref}"]
    assert r.values["deletion"].tolist() == pytest.approx([w[0] for w in want], abs=1e-6)
    assert r.values["insertion"].tolist() == pytest.approx([w[1] for w in want], abs=1e-6)
    assert r.curves["least_first"].shape == (B, 21)
    assert r.protocol["insertion"] == "least_first" and r.protocol["blur_padding"] == "reflect"
    assert r.protocol["preset_overrides"] == ([] if ref == "mean" else ["deletion_baseline"])
    if ref == "mean":  # without ties in the map, least-first deletion is insertion read backwards
        restore = InsertionDeletion(preset="aha_authors", insertion="restore")(heatmap(), model=model, x=x,
                                                                                targets=pred)
        assert restore.values["insertion"].tolist() == pytest.approx(r.values["insertion"].tolist(), abs=1e-6)
        assert "insertion" not in InsertionDeletion(preset="aha").protocol()  # earlier protocols are unchanged


def test_cli_recipe_authors_and_single_options(monkeypatch, tmp_path):
    import argparse
    import types

    import vitlens.aha.cli as cli_mod
    from vitlens.aha.train import add_train_aha_parser

    seen = {}
    monkeypatch.setattr(cli_mod, "train_aha", lambda model, data, out, config, **kw: (
        seen.__setitem__("cfg", config), types.SimpleNamespace(finished=False))[1])
    p = argparse.ArgumentParser()
    add_train_aha_parser(p.add_subparsers(dest="command"))
    base = ["train-aha", "--model", "shapes-vit", "--out", str(tmp_path / "o"), "--steps", "3"]
    for argv, want in [(("--recipe", "authors"), AHATrainConfig.preset("authors", steps=3)),
                       (("--recipe-option", "sorter_input=raw", "--recipe-option", "pooling=adaptive",
                         "--no-grid-offset"),
                        AHATrainConfig.preset("tracked", steps=3, sorter_input="raw", pooling="adaptive",
                                              grid_offset=False))]:
        args = p.parse_args([*base, *argv])
        args.func(args)
        for key in (*AUTHORS_OPTIONS, "lr", "noise_scale", "classes_per_image", "references"):
            assert getattr(seen["cfg"], key) == getattr(want, key), (argv, key)
    args = p.parse_args([*base, "--backbone", "vit_large_patch16_dinov3", "--depths", "4,11,17,23"])
    args.func(args)
    assert (seen["cfg"].backbone, seen["cfg"].depths) == ("vit_large_patch16_dinov3", (4, 11, 17, 23))
    with pytest.raises(InputError, match="--depths must be"):
        args = p.parse_args([*base, "--depths", "4,x"])
        args.func(args)
    with pytest.raises(InputError, match="--recipe-option 'pooling=bilinear'"):
        args = p.parse_args([*base, "--recipe-option", "pooling=bilinear"])
        args.func(args)


def _dinov3(depth: int = 24):
    import timm

    # the authors' backbone architecture (timm's DINOv3 ViT-L/16: RoPE, 4 registers, layer scale), tiny widths
    return timm.create_model("vit_large_patch16_dinov3", pretrained=False, depth=depth, embed_dim=32, num_heads=2)


def test_dinov3_vit_l16_backbone_at_the_authors_layers():
    """The authors' configuration through ``backbone=``: timm's ``vit_large_patch16_dinov3`` (random weights, tiny
    widths, the full 24 blocks) read at blocks 4, 11, 17, 23; the features are those blocks' patch tokens."""
    import vitlens
    from vitlens.aha.network import AHANet

    target = vitlens.load_model("shapes-vit")
    backbone = _dinov3().eval()
    net = AHANet(target, backbone=backbone, depths=(4, 11, 17, 23), seed=0)
    assert net.arch["depths"] == [4, 11, 17, 23] and net.arch["channels"] == [32] * 4
    x = torch.randn(2, 3, 64, 64)
    feats, logits = net.features(x)
    assert [tuple(f.shape) for f in feats] == [(2, 32, 4, 4)] * 4  # any input size: 64 px → 4×4 tokens, no resize
    seen = {}
    hooks = [backbone.blocks[d].register_forward_hook(lambda m, a, o, d=d: seen.__setitem__(d, o)) for d in (4, 23)]
    with torch.no_grad():
        backbone(net._backbone_input(x))
    for h in hooks:
        h.remove()
    p = backbone.num_prefix_tokens  # CLS + 4 registers dropped
    for k, d in ((0, 4), (3, 23)):
        torch.testing.assert_close(feats[k], seen[d][:, p:].reshape(2, 4, 4, 32).permute(0, 3, 1, 2))
    maps = net(x, logits.argmax(-1))
    assert maps.shape == (2, 64, 64) and torch.isfinite(maps).all()


def test_dinov3_backbone_by_name_for_training(monkeypatch, tmp_path):
    """``train-aha --backbone vit_large_patch16_dinov3 --depths 4,11,17,23``: the name reaches vitlens.load_model
    (here made offline-tiny: random weights, 24 blocks of width 32) and the run trains and writes its explainer."""
    import vitlens
    import vitlens.models as models
    from vitlens.aha.train import train_aha

    asked = []

    def tiny(name, pretrained=True, **kw):
        asked.append((name, pretrained))
        return _dinov3()

    monkeypatch.setattr(models, "load_model", tiny)
    res = train_aha(vitlens.load_model("shapes-vit"), "scenes", tmp_path, steps=1, batch_size=2, n_train=2, n_val=2,
                    m=3, width=8, backbone="vit_large_patch16_dinov3", depths=(4, 11, 17, 23), progress=False)
    assert asked == [("timm:vit_large_patch16_dinov3", True)]
    assert res.finished and res.net.arch["backbone"] == "vit_large_patch16_dinov3"
    assert res.net.arch["depths"] == [4, 11, 17, 23]
