"""Hiera (``models/hiera.py``: timm ``Hiera``, transformers ``HieraForImageClassification``): Grad-CAM and Finer-CAM
on the last block's output in raster order (checked against a by-hand Grad-CAM on the model's own re-roll, with all
unrolls consumed by pooling and with one left), timm = HF with the same weights, input sizes refused with the model's
own reason, and every method that needs products of attention matrices or LRP rules (rollout, GAE, the LRP family,
attention Grad-CAM), AHA, ViT-CX and the token-dropping methods refused with the mask-unit / query-pooling reason
instead of a raw error (GradSkip runs: tests/test_gradskip_hiera.py); model state restored after success and after
an exception."""

from __future__ import annotations

import pytest
import torch

import vitlens
from vitlens.errors import UnsupportedModelError
from vitlens.explainers import get_method
from vitlens.explainers.support import working_methods
from vitlens.models.families import trained_like

from conftest import assert_restored

pytest.importorskip("timm")
transformers = pytest.importorskip("transformers")
from timm.models.hiera import Hiera  # noqa: E402


def _hiera(q_pool: int = 2, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = Hiera(img_size=(32, 32), embed_dim=16, num_heads=1, stages=(1, 1, 1), q_pool=q_pool, mask_unit_size=(4, 4),
              mask_unit_attn=(True, False, False), num_classes=5)
    return trained_like(m.eval())


def _hf_hiera(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.HieraConfig(embed_dim=16, image_size=[32, 32], depths=[1, 1, 1], num_heads=[1, 2, 4],
                                   num_query_pool=2, masked_unit_size=[4, 4],
                                   masked_unit_attention=[True, False, False], num_labels=5)
    return trained_like(transformers.HieraForImageClassification(cfg).eval())


def _x(n: int = 2, size: int = 32, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("q_pool,grid", [(2, (2, 2)), (1, (4, 4))], ids=["all-unrolls-pooled", "one-unroll-left"])
def test_gradcam_is_the_grad_cam_of_the_last_blocks_tokens_on_the_grid(q_pool, grid):
    model = _hiera(q_pool)
    a = vitlens.get_adapter(model)
    assert a.family == "timm-hiera" and a.grid((32, 32)) == (8, 8) and a.feature_grid((32, 32)) == grid
    x = _x()
    seen = {}

    def keep(module, args):
        args[0].retain_grad()
        seen["u"] = args[0]

    handle = model.head.register_forward_pre_hook(keep)
    try:
        model(x)[:, 2].sum().backward()
    finally:
        handle.remove()
    last = len(model.blocks) - 1
    # the model's own re-roll puts the unrolled tokens on the grid: (B, h, w, C)
    u, g = model.reroll(seen["u"], last).flatten(1, 2), model.reroll(seen["u"].grad, last).flatten(1, 2)
    expected = (u * g.mean(1, keepdim=True)).sum(-1).clamp_min(0).reshape(2, *grid)
    model.zero_grad(set_to_none=True)
    exp = vitlens.explain(model, x, method="gradcam", target=2)
    torch.testing.assert_close(exp.token_maps, expected.detach(), rtol=1e-4, atol=1e-8)
    with torch.no_grad():  # the capture feeds the head the same values in the model's order: logits unchanged
        torch.testing.assert_close(exp.scores, model(x)[:, 2], rtol=0, atol=0)
    fin = vitlens.explain(model, x, method="finercam", target=2)
    assert fin.token_maps.shape == (2, *grid) and torch.isfinite(fin.maps).all()


def test_timm_and_hf_hiera_give_the_same_gradcam_with_the_same_weights():
    timm_model, hf = _hiera(), _hf_hiera()
    sd = timm_model.state_dict()
    mapped = {"hiera.embeddings.position_embeddings": sd["pos_embed"],
              "hiera.embeddings.patch_embeddings.projection.weight": sd["patch_embed.proj.weight"],
              "hiera.embeddings.patch_embeddings.projection.bias": sd["patch_embed.proj.bias"],
              "hiera.pooler.layernorm.weight": sd["head.norm.weight"],
              "hiera.pooler.layernorm.bias": sd["head.norm.bias"],
              "classifier.weight": sd["head.fc.weight"], "classifier.bias": sd["head.fc.bias"]}
    names = {"norm1": "layernorm_before", "norm2": "layernorm_after", "attn.qkv": "attn.qkv", "attn.proj": "attn.proj",
             "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2", "proj": "proj"}
    for i in range(3):  # one block per stage
        for t, h in names.items():
            for p in ("weight", "bias"):
                if f"blocks.{i}.{t}.{p}" in sd:
                    mapped[f"hiera.encoder.stages.{i}.layers.0.{h}.{p}"] = sd[f"blocks.{i}.{t}.{p}"]
    missing = set(hf.state_dict()) - set(mapped)
    assert not missing, missing
    hf.load_state_dict(mapped)
    x = _x()
    with torch.no_grad():
        torch.testing.assert_close(hf(pixel_values=x).logits, timm_model(x), rtol=1e-5, atol=1e-6)
    a = vitlens.get_adapter(hf)
    assert a.family == "hf-hiera" and a.feature_grid((32, 32)) == (2, 2)
    ours = vitlens.explain(hf, x, method="gradcam", target=1).token_maps
    torch.testing.assert_close(ours, vitlens.explain(timm_model, x, method="gradcam", target=1).token_maps,
                               rtol=1e-4, atol=1e-7)


ATTENTION_METHODS = ["rollout", "gae", "transformer_attribution", "attnlrp", "cplrp", "attn_gradcam"]


@pytest.mark.parametrize("make,name", [(_hiera, "Hiera (timm-hiera)"),
                                       (_hf_hiera, "HieraForImageClassification (hf-hiera)")], ids=["timm", "hf"])
def test_attention_methods_aha_and_token_methods_refuse_with_the_reason(make, name):
    model = make()
    working = working_methods(model)
    assert {"gradcam", "finercam", "gradient", "rise", "gradskip"} <= set(working) and "aha" not in working
    for method in [*ATTENTION_METHODS, "vitcx", "aha", "tis", "mutex"]:
        opts = {"explainer": "untrained", "refine_steps": 0} if method == "aha" else {}
        with pytest.raises(UnsupportedModelError) as err:
            get_method(method, **opts).explain(model, _x(1))
        msg = str(err.value)
        assert msg.startswith(f"method '{method}' needs ") and name in msg and "\n" not in msg
        why = ("tokens cannot be dropped" if method in ("tis", "mutex")
               else "max-pools its queries over the query stride")
        assert why in msg, msg
        assert msg.split("methods that work on this model: ")[1].split(", ") == working, method
    with pytest.raises(UnsupportedModelError, match="feature_info.*unrolled mask-unit order"):
        get_method("aha", explainer="untrained", refine_steps=0).explain(model, _x(1))


@pytest.mark.parametrize("make", [_hiera, _hf_hiera], ids=["timm", "hf"])
def test_other_sizes_are_refused_with_the_models_own_reason(make):
    model = make()
    with pytest.raises(RuntimeError, match="must match"):  # the model itself cannot add its position embedding
        model(_x(1, 48))
    for size in (48, 16):
        with pytest.raises(vitlens.InputError, match=f"expects 32x32 inputs; got {size}x{size} .*8x8 token grid.*"
                                                     "the model refuses it: The size of tensor a"):
            vitlens.explain(model, _x(1, size), method="gradcam")
    with pytest.raises(vitlens.InputError, match="3 input channels"):
        vitlens.explain(model, torch.randn(1, 1, 32, 32), method="gradcam")


@pytest.mark.parametrize("make", [_hiera, _hf_hiera], ids=["timm", "hf"])
def test_model_restored_after_success_and_exception(make):
    model = make().train()
    blocks = model.blocks if hasattr(model, "blocks") else model.hiera.encoder.stages
    assert_restored(model, lambda m: vitlens.explain(m, _x(1), method="gradcam"), blocks[1])
    assert model.training
