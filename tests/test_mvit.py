"""timm MViTv2 (``models/timm_mvit.py``): Grad-CAM and Finer-CAM on the last stage's tokens (checked against a
by-hand Grad-CAM, with and without a CLS token), input sizes refused exactly where the model's own tables stop,
GradSkip on its pooling attention (the propagation itself: ``tests/test_gradskip_mvit.py``), and every method that
needs one token sequence (rollout, GAE, the LRP family, attention Grad-CAM), AHA, ViT-CX and the token-dropping
methods refused with the reason instead of a raw error; GradSkip refused, with the reason, where the attention pools
before its q/k/v maps (``pool_first=True``)."""

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
from timm.models.mvitv2 import MultiScaleVit, MultiScaleVitCfg  # noqa: E402


def _mvit(cls_token: bool = False, abs_pos: bool = False, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = MultiScaleVitCfg(depths=(1, 2), embed_dim=16, num_heads=1, stride_q=((1, 1), (2, 2)),
                           use_cls_token=cls_token, use_abs_pos=abs_pos)
    return trained_like(MultiScaleVit(cfg, img_size=32, num_classes=5).eval())


def _x(n: int = 2, size: int = 32, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


def test_cams_refuse_a_class_token_readout_instead_of_an_all_zero_map():
    # the patch tokens at the final norm's input carry no gradient when the head reads CLS alone: a map there is 0
    model = _mvit(cls_token=True)
    assert model.global_pool == "token"
    for name in ("gradcam", "finercam"):
        with pytest.raises(vitlens.VitlensError, match="reads the class token alone"):
            vitlens.explain(model, _x(), method=name, target=2)


@pytest.mark.parametrize("cls_token", [False, True], ids=["avg", "cls-avg"])
def test_gradcam_is_the_grad_cam_of_the_last_stage_tokens(cls_token):
    model = _mvit(cls_token)
    model.global_pool = "avg"  # with a CLS token, the mean-pooled readout still has a CAM
    a = vitlens.get_adapter(model)
    assert a.family == "timm-mvitv2" and a.num_prefix_tokens == int(cls_token)
    assert a.grid((32, 32)) == (8, 8) and a.feature_grid((32, 32)) == (4, 4) and a.patch_size == (4, 4)
    x = _x()
    seen = {}

    def keep(module, args):
        args[0].retain_grad()
        seen["u"] = args[0]

    handle = model.norm.register_forward_pre_hook(keep)
    try:
        model(x)[:, 2].sum().backward()
    finally:
        handle.remove()
    p = int(cls_token)
    u, g = seen["u"][:, p:], seen["u"].grad[:, p:]  # (B, 16, C): the last stage's tokens, CLS left out
    expected = (u * g.mean(1, keepdim=True)).sum(-1).clamp_min(0).reshape(2, 4, 4)
    model.zero_grad(set_to_none=True)
    exp = vitlens.explain(model, x, method="gradcam", target=2)
    assert float(expected.detach().abs().sum()) > 0  # a real map, not two zeros
    torch.testing.assert_close(exp.token_maps, expected.detach(), rtol=1e-4, atol=1e-8)
    fin = vitlens.explain(model, x, method="finercam", target=2)
    assert fin.token_maps.shape == (2, 4, 4) and torch.isfinite(fin.maps).all()


SEQUENCE_METHODS = ["rollout", "gae", "transformer_attribution", "attnlrp", "cplrp", "attn_gradcam"]


@pytest.mark.parametrize("cls_token", [False, True], ids=["avg", "cls"])
def test_gradskip_runs_and_sequence_aha_and_token_methods_refuse_with_the_reason(cls_token):
    model = _mvit(cls_token)
    working = working_methods(model)
    cams = set() if cls_token else {"gradcam", "finercam"}  # a CLS readout refuses them (test above)
    assert {"gradskip", "gradient", "rise"} | cams <= set(working)
    assert not cls_token or not {"gradcam", "finercam"} & set(working)
    exp = vitlens.explain(model, _x(2), method="gradskip")
    assert exp.token_maps.shape == (2, 8, 8)
    torch.testing.assert_close(exp.token_maps.sum((1, 2)) + exp.remainder, exp.scores, rtol=1e-5, atol=1e-6)
    for name in [*SEQUENCE_METHODS, "vitcx", "aha", "tis", "mutex"]:
        opts = {"explainer": "untrained", "refine_steps": 0} if name == "aha" else {}
        with pytest.raises(UnsupportedModelError) as err:
            get_method(name, **opts).explain(model, _x(1))
        msg = str(err.value)
        assert msg.startswith(f"method '{name}' needs ") and "MultiScaleVit (timm-mvitv2)" in msg and "\n" not in msg
        why = "tokens cannot be dropped" if name in ("tis", "mutex") else "successive blocks do not share their tokens"
        assert why in msg, msg
        assert msg.split("methods that work on this model: ")[1].split(", ") == working, name
    with pytest.raises(UnsupportedModelError, match="'feature_maps'.*feature_info"):
        get_method("aha", explainer="untrained", refine_steps=0).explain(model, _x(1))


def test_attention_that_pools_before_its_qkv_maps_refuses_gradskip_with_the_reason():
    torch.manual_seed(0)
    cfg = MultiScaleVitCfg(depths=(1, 2), embed_dim=16, num_heads=1, stride_q=((1, 1), (2, 2)), pool_first=True)
    model = MultiScaleVit(cfg, img_size=32, num_classes=5).eval()
    assert "gradskip" not in working_methods(model) and "gradcam" in working_methods(model)
    with pytest.raises(UnsupportedModelError, match="needs 'attention'.*pool_first=True.*methods that work on this"):
        vitlens.explain(model, _x(1), method="gradskip")  # refused before the forward (which the installed timm's
        # MultiScaleAttentionPoolFirst cannot run on this config anyway)


def test_sizes_are_refused_exactly_where_the_models_tables_stop():
    model = _mvit()
    assert vitlens.explain(model, _x(1, 24), method="gradcam").token_maps.shape == (1, 3, 3)  # smaller: it runs
    with pytest.raises(IndexError):  # larger: the model itself indexes past its relative position tables
        model(_x(1, 48))
    with pytest.raises(vitlens.InputError, match="expects 32x32 inputs or smaller; got 48x48 .*8x8 token grid"):
        vitlens.explain(model, _x(1, 48), method="gradcam")
    fixed = _mvit(abs_pos=True)
    assert vitlens.explain(fixed, _x(1), method="gradcam").token_maps.shape == (1, 4, 4)
    with pytest.raises(vitlens.InputError, match="expects 32x32 inputs; got 24x24 .*absolute position embedding"):
        vitlens.explain(fixed, _x(1, 24), method="gradcam")
    with pytest.raises(vitlens.InputError, match="3 input channels"):
        vitlens.explain(model, torch.randn(1, 1, 32, 32), method="gradcam")


def test_model_restored_after_success_and_exception():
    model = _mvit().train()
    assert_restored(model, lambda m: vitlens.explain(m, _x(1), method="gradcam"), model.stages[1])
    assert model.training
