"""Issue #25: no crash on any nn.Module for the model-agnostic methods (a family adapter that cannot read a model
falls back to the generic adapter with the reason recorded), hybrid-stem ViTs supported (the stem is part of the
embedding), AHA refusing clearly where it cannot read features."""

from __future__ import annotations

import pytest
import torch

import vitlens
from vitlens.errors import UnsupportedModelError
from vitlens.explainers.support import working_methods

timm = pytest.importorskip("timm")


def _model(arch, **kw):
    torch.manual_seed(0)
    m = timm.create_model(arch, pretrained=False, num_classes=5, **kw).eval()
    with torch.no_grad():  # trained-like: non-zero biases
        for n, p in m.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.05)
    return m


def _x(n=2, size=64):
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("arch", ["vit_tiny_r_s16_p8_224", "vitamin_small_224"])
def test_hybrid_stem_vits_are_read_with_the_stem_in_the_embedding(arch):
    model = _model(arch, img_size=64)
    adapter = vitlens.get_adapter(model)
    assert adapter.family == "timm-vit" and adapter.fallback_reason is None and adapter.in_chans == 3
    gh, gw = adapter.grid((64, 64))
    assert adapter.patch_size == (64 // gh, 64 // gw)  # pixels per token, the stem's stride included
    exp = vitlens.explain(model, _x(), method="gradskip")
    total = exp.token_maps.sum((1, 2)).double() + exp.remainder.double()
    torch.testing.assert_close(total, exp.scores.double(), rtol=1e-5, atol=1e-6)
    totals = exp.extras["layer_totals"].double()
    torch.testing.assert_close(totals, exp.scores.double()[:, None].expand_as(totals), rtol=1e-5, atol=1e-6)
    for name in ("rollout", "gae", "gradcam", "gradient"):
        assert torch.isfinite(vitlens.explain(model, _x(1), method=name).maps).all(), name


def test_vitamin_gated_mlp_gets_the_lrp_rules():
    # GeGluMlp (norm, act(w0(x))·w1(x), w2): the product rule of explainers/_lrp_variants.py (issue #25)
    model = _model("vitamin_small_224", img_size=64)
    assert {"attnlrp", "cplrp", "transformer_attribution"} <= set(working_methods(model))
    with torch.no_grad():  # CP-LRP is an exact decomposition without biases
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
    exp = vitlens.explain(model, _x(1), method="cplrp")
    torch.testing.assert_close(exp.token_maps.sum((1, 2)).double() + exp.remainder.double(), exp.scores.double(),
                               rtol=1e-5, atol=1e-6)
    totals = vitlens.explain(model, _x(1), method="transformer_attribution").extras["lrp_totals"]
    torch.testing.assert_close(totals, torch.ones_like(totals), rtol=1e-3, atol=1e-3)


def test_an_adapter_that_cannot_read_a_model_falls_back_with_the_reason():
    model = _model("vit_tiny_patch16_224", img_size=32, patch_size=8)
    model.patch_embed.proj = torch.nn.Identity()  # a layout the ViT adapter does not expect (no convolution)
    model.patch_embed.forward = lambda x: x.reshape(x.shape[0], 16, 192)  # instance attribute of this test's model
    adapter = vitlens.get_adapter(model)
    assert adapter.family == "generic" and "timm-vit adapter cannot read it" in adapter.fallback_reason
    assert vitlens.explain(model, _x(1, 32), method="gradient").maps.shape == (1, 32, 32)
    with pytest.raises(UnsupportedModelError, match="timm-vit adapter cannot read it"):
        vitlens.explain(model, _x(1, 32), method="gradskip")


@pytest.mark.parametrize("arch,kw", [("mvitv2_tiny", dict(img_size=64)), ("coat_lite_tiny", dict(img_size=64))])
def test_aha_refuses_where_it_cannot_read_features(arch, kw):
    model = _model(arch, **kw)
    assert "aha" not in working_methods(model) and "gradient" in working_methods(model)
    with pytest.raises(UnsupportedModelError, match="'feature_maps'.*feature_info"):
        vitlens.explain(model, _x(1), method="aha", explainer="untrained", refine_steps=0)


def test_hf_vit_at_another_size_is_refused_with_the_models_reason_unless_asked():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=48, num_hidden_layers=2,
                                 num_attention_heads=4, intermediate_size=96, num_labels=5)
    torch.manual_seed(0)
    model = transformers.ViTForImageClassification(cfg).eval()
    with pytest.raises(vitlens.InputError, match="ViTForImageClassification expects 32x32 inputs; got 48x48 "
                                                 r"\(the model refuses it: .*vitlens_interpolate_pos_encoding"):
        vitlens.explain(model, _x(1, 48), method="gradskip")
    assert vitlens.explain(model, _x(1, 32), method="gradskip").maps.shape == (1, 32, 32)
    model.vitlens_interpolate_pos_encoding = True  # the user asks for interpolated position embeddings
    exp = vitlens.explain(model, _x(1, 48), method="gradskip")
    assert exp.token_maps.shape == (1, 6, 6) and torch.isfinite(exp.maps).all()


@pytest.mark.parametrize("size", [40, 48])
def test_timm_swin_with_strict_img_size_false_runs_at_other_sizes(size):
    model = _model("swin_tiny_patch4_window7_224", img_size=32, patch_size=4, window_size=4, embed_dim=24,
                   depths=(2, 2), num_heads=(2, 4), strict_img_size=False)
    x = _x(2, size)
    exp = vitlens.explain(model, x, method="gradskip")
    assert exp.token_maps.shape == (2, size // 4, size // 4)
    torch.testing.assert_close(exp.scores, model(x).detach()[torch.arange(2), exp.targets], rtol=1e-5, atol=1e-6)
    total = exp.token_maps.sum((1, 2)).double() + exp.remainder.double()
    torch.testing.assert_close(total, exp.scores.double(), rtol=1e-5, atol=1e-6)
    totals = exp.extras["layer_totals"].double()
    torch.testing.assert_close(totals, exp.scores.double()[:, None].expand_as(totals), rtol=1e-5, atol=1e-6)
    for name in ("rollout", "gae", "gradcam"):
        assert torch.isfinite(vitlens.explain(model, x, method=name).maps).all(), name
    strict = _model("swin_tiny_patch4_window7_224", img_size=32, patch_size=4, window_size=4, embed_dim=24,
                    depths=(2, 2), num_heads=(2, 4))
    with pytest.raises(vitlens.InputError, match="strict_img_size=False"):
        vitlens.explain(strict, x, method="gradskip")
