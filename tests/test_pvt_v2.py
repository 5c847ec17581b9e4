"""PVTv2 (``models/pvt_v2.py``): timm ``PyramidVisionTransformerV2`` and transformers ``PvtV2ForImageClassification``.
The capture records the probabilities over the spatially reduced keys that the blocks compute, GradSkip through
key reduction and patch embeddings is complete and conserved block by block (as initialised and with trained-like
parameters), the two libraries' models with the same weights get the same maps, Grad-CAM is the last stage's
Grad-CAM, and every method that needs one token sequence (or AHA's feature maps, on HF) is refused clearly."""

from __future__ import annotations

import pytest
import torch

import vitlens
from vitlens.errors import UnsupportedModelError
from vitlens.explainers import get_method
from vitlens.models.families import trained_like

from conftest import assert_restored

timm = pytest.importorskip("timm")
transformers = pytest.importorskip("transformers")

#: a 4-stage pvt_v2_b0 layout, narrower: depths, widths, heads, key reductions
DEPTHS, DIMS, HEADS, SRS = (2, 1, 1, 1), (16, 24, 32, 48), (1, 2, 2, 4), (4, 2, 1, 1)


def _timm_pvt(trained: bool = False, seed: int = 0, **kw) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = timm.create_model("pvt_v2_b0", pretrained=False, depths=DEPTHS, embed_dims=DIMS, num_heads=HEADS,
                              sr_ratios=SRS, mlp_ratios=(2, 2, 2, 2), num_classes=5, **kw).eval()
    with torch.no_grad():  # peaked attention: heads differ (random init is near-uniform)
        for name, p in model.named_parameters():
            if name.endswith("attn.kv.weight"):
                p[: p.shape[0] // 2].mul_(6.0)
    return trained_like(model) if trained else model


def _hf_config(**kw):
    return transformers.PvtV2Config(depths=list(DEPTHS), hidden_sizes=list(DIMS), num_attention_heads=list(HEADS),
                                    sr_ratios=list(SRS), mlp_ratios=[2, 2, 2, 2], num_labels=5, **kw)


def _hf_from_timm(src: torch.nn.Module) -> torch.nn.Module:
    """A transformers PvtV2ForImageClassification holding ``src``'s weights (the same network, parameter by
    parameter; timm's fused key/value map split into key and value)."""
    hf = transformers.PvtV2ForImageClassification(_hf_config()).eval()
    sd = src.state_dict()
    out = {"classifier.weight": sd["head.weight"], "classifier.bias": sd["head.bias"]}
    for s in range(len(DEPTHS)):
        pre, emb = f"pvt_v2.encoder.layers.{s}.", "patch_embed." if s == 0 else f"stages.{s}.downsample."
        for a, b in (("proj", "patch_embedding.proj"), ("norm", "patch_embedding.layer_norm")):
            for leaf in ("weight", "bias"):
                out[f"{pre}{b}.{leaf}"] = sd[f"{emb}{a}.{leaf}"]
        for leaf in ("weight", "bias"):
            out[f"{pre}layer_norm.{leaf}"] = sd[f"stages.{s}.norm.{leaf}"]
        for j in range(DEPTHS[s]):
            t, h = f"stages.{s}.blocks.{j}.", f"{pre}blocks.{j}."
            names = {"norm1": "layer_norm_1", "norm2": "layer_norm_2", "attn.q": "attention.query",
                     "attn.proj": "attention.proj", "attn.sr": "attention.spatial_reduction",
                     "attn.norm": "attention.layer_norm", "mlp.fc1": "mlp.dense1", "mlp.dwconv": "mlp.dwconv.dwconv",
                     "mlp.fc2": "mlp.dense2"}
            for a, b in names.items():
                for leaf in ("weight", "bias"):
                    if f"{t}{a}.{leaf}" in sd:
                        out[f"{h}{b}.{leaf}"] = sd[f"{t}{a}.{leaf}"]
            for leaf in ("weight", "bias"):
                k, v = sd[f"{t}attn.kv.{leaf}"].chunk(2, dim=0)
                out[f"{h}attention.key.{leaf}"], out[f"{h}attention.value.{leaf}"] = k, v
    missing, unexpected = hf.load_state_dict(out, strict=True)
    assert not missing and not unexpected
    return hf


def _x(n: int = 2, size: tuple[int, int] = (64, 48), seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 3, *size, generator=torch.Generator().manual_seed(seed))


def _both(trained: bool):
    timm_model = _timm_pvt(trained)
    return {"timm": timm_model, "hf": _hf_from_timm(timm_model)}


def test_adapters_read_the_layout_from_the_model():
    for lib, model in _both(False).items():
        a = vitlens.get_adapter(model)
        assert a.family == f"{lib}-pvt-v2" and a.num_classes == 5 and a.num_prefix_tokens == 0
        assert a.readout_tokens is None and a.patch_size == (4, 4) and a.any_size
        assert a.stage_grids((64, 48)) == [(16, 12), (8, 6), (4, 3), (2, 2)]
        assert a.stage_grids((66, 50)) == [(17, 13), (9, 7), (5, 4), (3, 2)]
        assert a.grid((66, 50)) == (17, 13) and a.feature_grid((66, 50)) == (3, 2)
        assert len(a.blocks()) == sum(DEPTHS)
        with pytest.raises(vitlens.InputError, match="no 4x4 key-reduction window"):
            vitlens.explain(model, torch.randn(1, 3, 8, 8), method="gradskip")
        with pytest.raises(vitlens.InputError, match="3 input channels"):
            vitlens.explain(model, torch.randn(1, 1, 64, 48), method="gradskip")


def _reference_probs(block, u: torch.Tensor, hw: tuple[int, int]) -> torch.Tensor:
    """timm's spatial-reduction attention probabilities written out from the block's parameters."""
    att = block.attn
    b, n, c = u.shape
    z = block.norm1(u)
    q = att.q(z).reshape(b, n, att.num_heads, -1).transpose(1, 2)
    kv_in = z
    if att.sr is not None:
        kv_in = att.norm(att.sr(z.transpose(1, 2).reshape(b, c, *hw)).flatten(2).transpose(1, 2))
    k = att.kv(kv_in).reshape(b, kv_in.shape[1], 2, att.num_heads, -1).permute(2, 0, 3, 1, 4)[0]
    return (q @ k.transpose(-2, -1) * att.scale).softmax(-1)


@pytest.mark.parametrize("lib", ["timm", "hf"])
def test_capture_records_the_probabilities_over_the_reduced_keys(lib):
    model = _both(True)[lib]
    a = vitlens.get_adapter(model)
    x = _x(2, (66, 50))
    with torch.no_grad():
        ref = a.forward(x)
    with a.session(capture=True) as rec:
        logits = a.forward(x)
    torch.testing.assert_close(logits.detach(), ref, rtol=1e-5, atol=1e-6)
    with pytest.raises(UnsupportedModelError, match="PVTv2 has hierarchical stages"):
        rec.blocks
    assert [st.grid for st in rec.stages] == a.stage_grids((66, 50))
    assert [st.readout is not None for st in rec.stages] == [False, False, False, True]
    assert rec.features[0] is rec.stages[-1].readout and rec.features[0].shape == (2, 6, DIMS[-1])
    assert rec.stages[0].merge is None and all(st.merge is not None for st in rec.stages[1:])
    for s, st in enumerate(rec.stages):
        gh, gw = st.grid
        keys = (gh // SRS[s]) * (gw // SRS[s])
        for j, blk in enumerate(st.blocks):
            assert blk.attn.shape == (2, HEADS[s], gh * gw, keys) and blk.value.shape[:3] == (2, HEADS[s], keys)
            torch.testing.assert_close(blk.attn.detach().sum(-1), torch.ones(blk.attn.shape[:-1]))
            assert (blk.reduction is not None) == (SRS[s] > 1)
            if lib == "timm":
                with torch.no_grad():
                    probs = _reference_probs(model.stages[s].blocks[j], blk.u.detach(), st.grid)
                torch.testing.assert_close(blk.attn.detach(), probs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("size", [(64, 48), (66, 50)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("trained", [False, True], ids=["init", "trained-like"])
@pytest.mark.parametrize("lib", ["timm", "hf"])
def test_gradskip_is_complete_and_conserved_block_by_block(lib, trained, size):
    model = _both(trained)[lib]
    exp = vitlens.explain(model, _x(3, size), method="gradskip")
    y = exp.scores.double()
    assert exp.token_maps.shape == (3, *vitlens.get_adapter(model).grid(size)) and exp.maps.shape == (3, *size)
    assert torch.all(exp.remainder == 0)
    torch.testing.assert_close(exp.token_maps.sum((1, 2)).double(), y, rtol=1e-5, atol=1e-6)
    shares = exp.extras["readout_shares"].double()  # the classifier reads the last stage only
    torch.testing.assert_close(shares[:, -1], y, rtol=1e-5, atol=1e-6)
    assert torch.all(shares[:, :-1] == 0)
    for key in ("stage_totals", "layer_totals"):  # every stage output and every block keeps all of y
        totals = exp.extras[key].double()
        torch.testing.assert_close(totals, y[:, None].expand_as(totals), rtol=1e-5, atol=1e-6)
    assert exp.extras["layer_totals"].shape == (3, sum(DEPTHS))
    assert exp.extras["beta_main_stage1"].shape == (3, DEPTHS[0], exp.token_maps[0].numel())
    for i in range(3):  # all factors are non-negative: the map has the sign of y
        assert float((exp.token_maps[i] * torch.sign(exp.scores[i])).min()) >= 0


@pytest.mark.parametrize("trained", [False, True], ids=["init", "trained-like"])
def test_timm_and_hf_with_the_same_weights_get_the_same_maps(trained):
    models = _both(trained)
    x = _x(2)
    with torch.no_grad():
        torch.testing.assert_close(models["hf"](pixel_values=x).logits, models["timm"](x), rtol=1e-5, atol=1e-5)
    for name in ("gradskip", "gradcam"):
        a, b = (vitlens.explain(models[k], x, method=name, target=2) for k in ("timm", "hf"))
        torch.testing.assert_close(a.token_maps, b.token_maps, rtol=1e-4, atol=1e-6, msg=name)


def test_gradcam_is_the_grad_cam_of_the_last_stage_output():
    model = _timm_pvt(trained=True)
    x = _x(2)
    feats = {}

    def keep(module, args, out):
        out.retain_grad()
        feats["map"] = out

    handle = model.stages[-1].register_forward_hook(keep)
    try:
        model(x)[:, 3].sum().backward()
    finally:
        handle.remove()
    fmap, grad = feats["map"], feats["map"].grad  # (B, C, 2, 2)
    expected = (fmap * grad.mean((2, 3), keepdim=True)).sum(1).clamp_min(0)
    model.zero_grad(set_to_none=True)
    exp = vitlens.explain(model, x, method="gradcam", target=3)
    assert exp.token_maps.shape == (2, 2, 2)
    torch.testing.assert_close(exp.token_maps, expected.detach(), rtol=1e-4, atol=1e-7)


SEQUENCE_METHODS = ["rollout", "gae", "transformer_attribution", "attnlrp", "cplrp", "attn_gradcam", "tis", "mutex",
                    "vitcx"]


@pytest.mark.parametrize("lib", ["timm", "hf"])
def test_methods_that_need_one_token_sequence_refuse_clearly(lib):
    model = _both(False)[lib]
    for name in SEQUENCE_METHODS:
        with pytest.raises(UnsupportedModelError) as err:
            get_method(name).explain(model, _x(1))
        msg = str(err.value)
        assert msg.startswith(f"method '{name}' needs ") and "\n" not in msg, msg
        assert "spatially reduced grid" in msg or "tokens cannot be dropped" in msg, msg
        listed = msg.split("methods that work on this model: ")[1].split(", ")
        assert {"gradskip", "gradcam", "gradient", "rise"} <= set(listed), name


def test_aha_reads_timm_feature_maps_and_refuses_hf_clearly():
    aha = get_method("aha", explainer="untrained", refine_steps=0)
    exp = aha.explain(_timm_pvt(), _x(2, (64, 64)))
    assert exp.maps.shape == (2, 64, 64) and torch.isfinite(exp.maps).all()
    with pytest.raises(UnsupportedModelError, match="method 'aha' needs one of 'token_sequence', 'feature_maps'.*"
                                                    "no timm feature_info.*methods that work on this model: "):
        aha.explain(_both(False)["hf"], _x(1))


def test_linear_attention_variants_fall_back_with_the_reason():
    torch.manual_seed(0)
    li = timm.create_model("pvt_v2_b0", pretrained=False, depths=(1, 1), embed_dims=(16, 32), num_heads=(1, 2),
                           sr_ratios=(2, 1), num_classes=3, linear=True).eval()
    hf_li = transformers.PvtV2ForImageClassification(
        transformers.PvtV2Config(num_encoder_blocks=2, depths=[1, 1], hidden_sizes=[16, 32], num_attention_heads=[1, 2],
                                 sr_ratios=[2, 1], mlp_ratios=[2, 2], patch_sizes=[7, 3], strides=[4, 2],
                                 linear_attention=True, num_labels=3)).eval()
    for model in (li, hf_li):
        a = vitlens.get_adapter(model)
        assert a.family == "generic" and "adaptive 7×7 average pooling" in a.fallback_reason
        with pytest.raises(UnsupportedModelError, match="adaptive 7×7 average pooling.*methods that work on this "
                                                        "model: .*gradient"):
            vitlens.explain(model, _x(1), method="gradskip")
        exp = vitlens.explain(model, _x(1), method="gradient")
        assert exp.maps.shape == (1, 64, 48) and torch.isfinite(exp.maps).all()


def test_fused_attention_and_model_state_restored_after_success_and_exception():
    model = _timm_pvt().train()
    for m in model.modules():
        if hasattr(m, "fused_attn"):
            m.fused_attn = True
    assert_restored(model, lambda m: vitlens.explain(m, _x(1), method="gradskip"), model.stages[2])
    assert all(m.fused_attn for m in model.modules() if hasattr(m, "fused_attn")) and model.training
