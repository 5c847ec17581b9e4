"""Cascading model-parameter randomisation (Adebayo et al. 2018) on a tiny timm ViT, and the similarity measures."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import model_fingerprint, tiny_vit
from vitlens import explain
from vitlens.errors import InputError
from vitlens.metrics.sanity import randomisation_check, reinitialise, spearman, ssim

pytestmark = pytest.mark.usefixtures("one_thread_per_module")


@pytest.fixture(scope="module")
def batch():
    return torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def gradskip_check(batch):
    model = tiny_vit()
    before = model_fingerprint(model)
    rng = torch.get_rng_state()
    result = randomisation_check(model, batch, method="gradskip")
    return model, before, rng, result


def test_stages_and_shapes(gradskip_check, batch):
    model, _, _, r = gradskip_check
    assert r["stages"] == ["head", "blocks.2", "blocks.1", "blocks.0"]
    assert r["ssim"].shape == r["spearman"].shape == (4, 3)
    assert r["ssim_mean"].shape == r["spearman_mean"].shape == (4,)
    assert r["maps"].shape == (4, 3, 32, 32) and r["original_maps"].shape == (3, 32, 32)
    with torch.no_grad():
        predicted = model(batch).argmax(1)
    assert torch.equal(r["targets"], predicted)
    # the copy explains exactly like the user's model
    assert torch.allclose(r["original_maps"], explain(model, batch, "gradskip").maps)
    assert r["protocol"]["method"] == "gradskip" and r["protocol"]["spearman"]["absolute"] is True


def test_user_model_and_rng_untouched(gradskip_check):
    model, before, rng, _ = gradskip_check
    assert model_fingerprint(model) == before
    assert torch.equal(torch.get_rng_state(), rng)


def test_gradskip_similarity_drops(gradskip_check):
    r = gradskip_check[3]
    assert r["ssim_mean"][-1] < 0.6 and r["spearman_mean"][-1] < 0.6
    assert bool((r["ssim"] < 0.9).all())


def test_self_similarity_is_one(gradskip_check):
    m = gradskip_check[3]["original_maps"]
    assert torch.allclose(ssim(m, m), torch.ones(3, dtype=torch.float64))
    assert torch.allclose(spearman(m, m), torch.ones(3, dtype=torch.float64))
    # invariances: SSIM of min-max normalised maps ignores affine rescaling; Spearman ignores monotone maps
    assert torch.allclose(ssim(m, 5 * m.double() + 2), torch.ones(3, dtype=torch.float64))
    assert torch.allclose(spearman(m, m.abs() ** 3), torch.ones(3, dtype=torch.float64))


def test_targets_fixed_and_seeded(batch):
    model = tiny_vit()
    r = randomisation_check(model, batch[:2], method="inputxgradient", targets=2, seed=3)
    assert r["targets"].tolist() == [2, 2] and r["protocol"]["seed"] == 3
    blocks = [tiny_vit().blocks[0] for _ in range(3)]
    for blk, seed in zip(blocks, (3, 3, 4)):
        reinitialise([blk], seed)
    weights = [blk.attn.qkv.weight for blk in blocks]
    assert torch.equal(weights[0], weights[1]) and not torch.equal(weights[0], weights[2])


def test_reinitialise_changes_every_parameter():
    model = tiny_vit()
    blk = model.blocks[1]
    old = {n: p.clone() for n, p in blk.named_parameters()}
    reinitialise([blk], seed=0)
    for n, p in blk.named_parameters():
        if n.endswith(("norm1.weight", "norm2.weight")):
            assert bool((p == 1).all())  # LayerNorm's own initialisation
        elif n.endswith(("norm1.bias", "norm2.bias")) or n.endswith("bias") and bool((old[n] == 0).all()):
            continue
        else:
            assert not torch.equal(p, old[n]), n


def test_ssim_matches_skimage():
    metrics = pytest.importorskip("skimage.metrics")
    g = torch.Generator().manual_seed(2)
    a = torch.rand(3, 24, 30, generator=g, dtype=torch.float64)
    b = 0.6 * a + 0.4 * torch.rand(3, 24, 30, generator=g, dtype=torch.float64)
    b[2] = torch.rand(24, 30, generator=g, dtype=torch.float64) ** 4
    ours = ssim(a, b)
    na, nb = ((t - t.amin((1, 2), keepdim=True)) / (t.amax((1, 2), keepdim=True) - t.amin((1, 2), keepdim=True))
              for t in (a, b))
    ref = [metrics.structural_similarity(na[i].numpy(), nb[i].numpy(), data_range=1.0, gaussian_weights=True,
                                         sigma=1.5, use_sample_covariance=False) for i in range(3)]
    assert (ours - torch.tensor(ref, dtype=torch.float64)).abs().max().item() < 1e-10


def test_spearman_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    g = torch.Generator().manual_seed(3)
    a = torch.randn(4, 9, 9, generator=g)
    b = a + torch.randn(4, 9, 9, generator=g)
    a[1] = torch.round(a[1] * 2) / 2  # ties
    b[3] = -b[3]  # sign flips do not matter with absolute values
    ours = spearman(a, b)
    ref = [stats.spearmanr(a[i].abs().flatten().numpy(), b[i].abs().flatten().numpy()).statistic for i in range(4)]
    assert (ours - torch.tensor(ref, dtype=torch.float64)).abs().max().item() < 1e-12
    assert math.isnan(spearman(a[:1], torch.zeros(1, 9, 9)).item())  # constant map: undefined


def test_errors(batch):
    with pytest.raises(InputError, match="equal shape"):
        ssim(torch.zeros(1, 16, 16), torch.zeros(1, 16, 15))
    with pytest.raises(InputError, match="SSIM window"):
        ssim(torch.zeros(1, 8, 8), torch.zeros(1, 8, 8))
    with pytest.raises(InputError, match="SSIM window"):
        randomisation_check(tiny_vit(img_size=8, patch_size=4), torch.zeros(1, 3, 8, 8))
    with pytest.raises(InputError, match="NaN"):
        spearman(torch.full((1, 4, 4), float("nan")), torch.zeros(1, 4, 4))


def test_hf_vit(batch):
    pytest.importorskip("transformers")
    from conftest import timm_to_hf_vit

    hf = timm_to_hf_vit(tiny_vit())
    r = randomisation_check(hf, batch[:1], method="gradskip")
    assert r["stages"] == ["head", "blocks.2", "blocks.1", "blocks.0"] and r["ssim"].shape == (4, 1)
    assert r["ssim_mean"][-1] < 0.9


# --------------------------------------------------------------------------------------------------------------------
# CNNs: walked through their stage container, in execution order
# --------------------------------------------------------------------------------------------------------------------


class TinyCNN(torch.nn.Module):
    """EfficientNet's layout in miniature: stem, a ``blocks`` container, a conv head above it, pool, classifier.

    ``norm_between`` runs a parameterised layer between two stages (no top-down order); ``module_list`` holds the
    stages in a ModuleList the forward iterates (never called as a whole)."""

    def __init__(self, norm_between: bool = False, module_list: bool = False) -> None:
        super().__init__()
        nn = torch.nn
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.classifier = nn.Linear(12, 4)  # defined first on purpose: the order comes from the forward pass
            self.conv_stem, self.bn1 = nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6)
            stages = [nn.Sequential(nn.Conv2d(6, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU()) for _ in range(3)]
            self.blocks = nn.ModuleList(stages) if module_list else nn.Sequential(*stages)
            self.mid = nn.GroupNorm(1, 6) if norm_between else None
            self.conv_head, self.bn2 = nn.Conv2d(6, 12, 1), nn.BatchNorm2d(12)
            self.unused = nn.Linear(3, 3)  # never runs: not a stage

    def get_classifier(self) -> torch.nn.Module:
        return self.classifier

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.bn1(self.conv_stem(x)).relu()
        for i, stage in enumerate(self.blocks):
            x = stage(x)
            if i == 0 and self.mid is not None:
                x = self.mid(x)
        x = self.bn2(self.conv_head(x)).relu()
        return self.classifier(x.mean((2, 3)))


def test_cnn_cascade_follows_the_forward_pass(batch):
    for module_list in (False, True):
        model = TinyCNN(module_list=module_list)
        before = model_fingerprint(model)
        r = randomisation_check(model, batch, method="inputxgradient")
        assert r["stages"] == ["head", "conv_head+bn2", "blocks.2", "blocks.1", "blocks.0", "conv_stem+bn1"]
        assert r["ssim"].shape == (6, 3) and torch.isfinite(r["ssim"]).all()
        assert model_fingerprint(model) == before


def test_cnn_cascade_reinitialises_the_layers_above_the_stages(batch):
    """Stage 1 re-initialises conv_head + bn2 (seed + 1) on top of the random head: the same as doing it by hand."""
    model = TinyCNN()
    r = randomisation_check(model, batch, method="inputxgradient", seed=5)
    work = TinyCNN()
    reinitialise([work.classifier], 5)
    reinitialise([work.conv_head, work.bn2], 6)
    assert torch.allclose(r["maps"][1], explain(work, batch, "inputxgradient", target=r["targets"]).maps)
    assert not torch.allclose(r["maps"][1], r["maps"][0])


def test_cnn_cascade_refuses_layers_between_stages(batch):
    from vitlens.errors import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="mid run"):
        randomisation_check(TinyCNN(norm_between=True), batch, method="inputxgradient")


def test_timm_cnn_stage_names():
    """timm's own CNN layouts: ConvNeXt keeps a norm next to its classifier in ``head``; MobileNetV3 runs its
    ``conv_head`` after the global pool."""
    timm = pytest.importorskip("timm")
    x = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    expected = {
        "convnext_atto": ["head", "head.norm", "stages.3", "stages.2", "stages.1", "stages.0", "stem"],
        "mobilenetv3_small_050": ["head", "conv_head"] + [f"blocks.{i}" for i in reversed(range(6))]
        + ["conv_stem+bn1"],
    }
    for arch, stages in expected.items():
        model = timm.create_model(arch, num_classes=3).eval()
        assert randomisation_check(model, x, method="gradient")["stages"] == stages, arch
