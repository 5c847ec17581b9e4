"""timm Twins, CoaT, CrossViT, NesT, VOLO, TNT and EfficientViT-MSRA (``models/timm_twins.py`` ...
``timm_efficientvit.py``, on ``models/_feature_layer.py``): Grad-CAM and Finer-CAM on each family's documented feature layer (checked against
a by-hand Grad-CAM on that layer, with trained-like parameters), AHA on timm's feature_info maps where they can be
read, every attention method, ViT-CX, the token-dropping methods and (where the maps cannot be read) AHA refused with
the family's own reason, input sizes the model cannot run refused in the model's words, and model state restored
after success and after an exception."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

import vitlens
from vitlens.errors import UnsupportedModelError
from vitlens.explainers import get_method
from vitlens.explainers.support import working_methods
from vitlens.models.families import trained_like

from conftest import assert_restored

timm = pytest.importorskip("timm")
from timm.models.nest import Nest  # noqa: E402
from timm.models.volo import VOLO  # noqa: E402


def _twins_svt() -> torch.nn.Module:
    return timm.create_model("twins_svt_small", pretrained=False, img_size=32, embed_dims=(16, 32), num_heads=(1, 2),
                             mlp_ratios=(2, 2), depths=(2, 2), wss=(2, 2), sr_ratios=(2, 1), num_classes=5)


def _twins_pcpvt() -> torch.nn.Module:
    return timm.create_model("twins_pcpvt_small", pretrained=False, img_size=32, embed_dims=(16, 32),
                             num_heads=(1, 2), mlp_ratios=(2, 2), depths=(1, 1), sr_ratios=(2, 1), num_classes=5)


def _coat(lite: bool) -> Callable[[], torch.nn.Module]:
    def make() -> torch.nn.Module:
        extra: dict[str, Any] = {} if lite else dict(parallel_depth=1)  # lite: 64 px, a 2x2 grid at stage 4
        return timm.create_model("coat_lite_tiny" if lite else "coat_tiny", pretrained=False,
                                 img_size=64 if lite else 32,
                                 embed_dims=(16, 16, 24, 32) if lite else (16, 16, 16, 16),
                                 serial_depths=(1, 1, 1, 1), num_heads=2, crpe_window={3: 2},
                                 mlp_ratios=(2, 2, 2, 2), num_classes=5, **extra)
    return make


def _crossvit() -> torch.nn.Module:
    return timm.create_model("crossvit_tiny_240", pretrained=False, img_size=32, img_scale=(1.0, 0.75),
                             patch_size=[8, 12], embed_dim=[16, 32], depth=[[1, 1, 0], [1, 1, 0]], num_heads=[2, 2],
                             mlp_ratio=[2, 2, 1], num_classes=5)


def _nest() -> torch.nn.Module:
    return Nest(img_size=32, patch_size=4, num_levels=2, embed_dims=(16, 32), num_heads=(1, 2), depths=(1, 1),
                num_classes=5)


def _volo() -> torch.nn.Module:  # 64 px: a 4x4 grid after the patch merging
    return VOLO(img_size=64, layers=(1, 1), embed_dims=(16, 32), num_heads=(1, 2), outlook_attention=(True, False),
                downsamples=(True, False), stem_hidden_dim=8, mlp_ratio=2.0, num_classes=5)


def _tnt() -> torch.nn.Module:
    return timm.create_model("tnt_s_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=32,
                             inner_dim=8, depth=2, num_heads_inner=2, num_heads_outer=2, num_classes=5)


def _effvit() -> torch.nn.Module:  # 64 px: a 4x4 final map (the patch embedding has stride 16)
    return timm.create_model("efficientvit_m0", pretrained=False, img_size=64, embed_dim=(16, 16), depth=(1, 1),
                             num_heads=(2, 2), window_size=(2, 2), key_dim=(4, 4), down_ops=(("", 1), ("", 1)),
                             num_classes=5)


def _pre(module: Callable[[Any], torch.nn.Module], pick: Callable[[tuple], torch.Tensor]):
    """By hand: the feature is (part of) ``module(model)``'s positional input."""
    def install(model, seen):
        def hook(mod, args):
            t = pick(args)
            t.retain_grad()
            seen["f"] = t
        return module(model).register_forward_pre_hook(hook)
    return install


def _post(module: Callable[[Any], torch.nn.Module]):
    """By hand: the feature is ``module(model)``'s output."""
    def install(model, seen):
        def hook(mod, args, out):
            out.retain_grad()
            seen["f"] = out
        return module(model).register_forward_hook(hook)
    return install


def _first(args):
    return args[0]


#: family → (builder, input size, family name, where the by-hand hook reads the feature, its layout, prefix tokens,
#: the feature grid, a phrase of the attention refusal, whether AHA reads feature_info maps)
CASES = {
    "twins_svt": (_twins_svt, 32, "timm-twins", _pre(lambda m: m.norm, _first), "tokens", 0, (4, 4),
                  "locally-grouped self-attention", False),
    "twins_pcpvt": (_twins_pcpvt, 32, "timm-twins", _pre(lambda m: m.norm, _first), "tokens", 0, (4, 4),
                    "Twins-PCPVT's blocks use global sub-sampled attention", False),
    "coat_lite": (_coat(True), 64, "timm-coat", _pre(lambda m: m.serial_blocks4[-1], _first), "tokens", 1, (2, 2),
                  "factorized attention", False),
    "coat": (_coat(False), 32, "timm-coat", _post(lambda m: m.serial_blocks2[-1]), "tokens", 1, (4, 4),
             "parallel blocks run scales 2-4 side by side", False),
    "crossvit": (_crossvit, 32, "timm-crossvit", _pre(lambda m: m.blocks[-1], lambda a: a[0][0]), "tokens", 1, (4, 4),
                 "cross-attention of one branch's class token", False),
    "nest": (_nest, 32, "timm-nest", _pre(lambda m: m.global_pool, _first), "nchw", 0, (4, 4), "block aggregation",
             True),
    "volo": (_volo, 64, "timm-volo", _post(lambda m: m.network[-1]), "nhwc", 0, (4, 4), "outlook attention", True),
    "tnt": (_tnt, 32, "timm-tnt", _pre(lambda m: m.blocks[-1], lambda a: a[1]), "tokens", 1, (4, 4),
            "inner transformer on every patch's pixel tokens", False),
    "effvit": (_effvit, 64, "timm-efficientvit-msra", _pre(lambda m: m.global_pool, _first), "nchw", 0, (4, 4),
               "cascaded group attention", True),
}


def _model(case: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return trained_like(CASES[case][0]().eval())


def _x(n: int = 2, size: int = 32, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


def _by_hand(model, case: str, x: torch.Tensor, target: int) -> torch.Tensor:
    """Grad-CAM by hand on the family's feature layer: ReLU(Σ_c w_c f_c), w_c the gradient's mean over the patch
    tokens, on the feature grid."""
    _, _, _, install, layout, prefix, grid, _, _ = CASES[case]
    seen: dict[str, torch.Tensor] = {}
    handle = install(model, seen)
    try:
        model(x)[:, target].sum().backward()
    finally:
        handle.remove()
    model.zero_grad(set_to_none=True)
    f, g = seen["f"].detach(), seen["f"].grad
    if layout == "nchw":
        f, g = f.flatten(2).transpose(1, 2), g.flatten(2).transpose(1, 2)
    elif layout == "nhwc":
        f, g = f.flatten(1, 2), g.flatten(1, 2)
    f, g = f[:, prefix:], g[:, prefix:]
    return (f * g.mean(1, keepdim=True)).sum(-1).clamp_min(0).reshape(x.shape[0], *grid)


@pytest.mark.parametrize("case", list(CASES))
def test_gradcam_is_the_grad_cam_of_the_documented_layer(case):
    model = _model(case)
    size, family, grid = CASES[case][1], CASES[case][2], CASES[case][6]
    adapter = vitlens.get_adapter(model)
    assert adapter.family == family and adapter.feature_grid((size, size)) == grid
    x = _x(2, size)
    expected = _by_hand(model, case, x, target=3)
    assert expected.abs().sum() > 0  # a map with something in it: the comparison is not of two zeros
    exp = vitlens.explain(model, x, method="gradcam", target=3)
    torch.testing.assert_close(exp.token_maps, expected, rtol=1e-4, atol=1e-8)
    assert exp.maps.shape == (2, size, size)
    fin = vitlens.explain(model, x, method="finercam", target=3)
    assert fin.token_maps.shape == (2, *grid) and torch.isfinite(fin.maps).all()


ATTENTION_METHODS = ["gradskip", "rollout", "gae", "transformer_attribution", "attnlrp", "cplrp", "attn_gradcam"]


@pytest.mark.parametrize("case", list(CASES))
def test_attention_methods_refuse_with_the_familys_reason(case):
    model = _model(case)
    size, family, why, maps = CASES[case][1], CASES[case][2], CASES[case][7], CASES[case][8]
    working = working_methods(model)
    assert {"gradcam", "finercam", "gradient", "rise"} <= set(working)
    assert ("aha" in working) == maps
    refused = [*ATTENTION_METHODS, "vitcx", "tis", "mutex"] + ([] if maps else ["aha"])
    for name in refused:
        opts = {"explainer": "untrained", "refine_steps": 0} if name == "aha" else {}
        with pytest.raises(UnsupportedModelError) as err:
            get_method(name, **opts).explain(model, _x(1, size))
        msg = str(err.value)
        assert msg.startswith(f"method '{name}' needs ") and f"{type(model).__name__} ({family})" in msg, msg
        assert "\n" not in msg
        assert ("tokens cannot be dropped" if name in ("tis", "mutex") else why) in msg, msg
        assert msg.split("methods that work on this model: ")[1].split(", ") == working, name


@pytest.mark.parametrize("case", [c for c in CASES if CASES[c][8]])
def test_aha_reads_the_feature_info_maps(case):
    model, size = _model(case), CASES[case][1]
    exp = get_method("aha", explainer="untrained", refine_steps=0).explain(model, _x(2, size))
    assert exp.maps.shape == (2, size, size) and torch.isfinite(exp.maps).all()


@pytest.mark.parametrize("case, words", [
    ("twins_svt", "feature_info names 'block.k' where the stages are the containers 'blocks.k'"),
    ("coat", "feature_info module 'serial_blocks1' is never called in the forward (a container"),
    ("tnt", "feature_info module 'blocks.0' outputs (16, 4, 8), not a (B, C, h, w) map"),
    ("crossvit", "outputs (1, 17, 16), not a (B, C, h, w) map"),
])
def test_aha_refusal_says_why_the_maps_cannot_be_read(case, words):
    with pytest.raises(UnsupportedModelError, match="'feature_maps'") as err:
        get_method("aha", explainer="untrained", refine_steps=0).explain(_model(case), _x(1))
    assert words in str(err.value)


def test_sizes_the_model_cannot_run_are_refused_in_its_own_words():
    twins = _model("twins_svt")  # padded windows: any size whose stage grids are not empty
    assert vitlens.explain(twins, _x(1, 48), method="gradcam").token_maps.shape == (1, 6, 6)
    assert vitlens.explain(twins, _x(1, 40), method="gradcam").token_maps.shape == (1, 5, 5)
    cross = _model("crossvit")  # every input is resized to the two branch sizes: the same grid
    assert vitlens.explain(cross, _x(1, 48), method="gradcam").token_maps.shape == (1, 4, 4)
    effvit = _model("effvit")
    assert vitlens.explain(effvit, _x(1, 48), method="gradcam").token_maps.shape == (1, 3, 3)
    volo = _model("volo")  # 72 px rounds down to the same 4x4 grid after the merging; 96 px does not
    assert vitlens.explain(volo, _x(1, 72), method="gradcam").token_maps.shape == (1, 4, 4)
    with pytest.raises(RuntimeError, match="must match the size of tensor b"):
        volo(_x(1, 96))  # the model's own error
    with pytest.raises(vitlens.InputError, match=r"VOLO cannot run a 96x96 input \(the model refuses it: The size of "
                                                 r"tensor a \(6\) must match"):
        vitlens.explain(volo, _x(1, 96), method="gradcam")
    for case, words in (("coat", r"Input height \(48\) doesn't match model \(32\)"),
                        ("nest", r"Input height \(48\) doesn't match model \(32\)"),
                        ("tnt", r"Input image size \(48\*48\) doesn't match model \(32\*32\)")):
        model = _model(case)
        with pytest.raises(vitlens.InputError, match=rf"{type(model).__name__} cannot run a 48x48 input \(the "
                                                     rf"model refuses it: {words}"):
            vitlens.explain(model, _x(1, 48), method="gradcam")
    with pytest.raises(vitlens.InputError, match="3 input channels"):
        vitlens.explain(twins, torch.randn(1, 1, 32, 32), method="gradcam")
    assert [vitlens.get_adapter(_model(c)).any_size for c in ("twins_svt", "crossvit", "effvit")] == [True] * 3
    assert [vitlens.get_adapter(_model(c)).any_size for c in ("coat", "nest", "volo", "tnt")] == [False] * 4


#: the module a failing hook is put on, inside the forward after the feature layer
FAILING = {"twins_svt": lambda m: m.norm, "twins_pcpvt": lambda m: m.norm, "coat_lite": lambda m: m.norm4,
           "coat": lambda m: m.norm4, "crossvit": lambda m: m.norm[0], "nest": lambda m: m.head,
           "volo": lambda m: m.norm, "tnt": lambda m: m.norm, "effvit": lambda m: m.head}


@pytest.mark.parametrize("case", list(CASES))
def test_model_restored_after_success_and_exception(case):
    model, size = _model(case).train(), CASES[case][1]
    assert_restored(model, lambda m: vitlens.explain(m, _x(1, size), method="gradcam"), FAILING[case](model))
    assert model.training


def test_a_refused_size_leaves_batch_norm_statistics_alone():
    model = _model("volo").train()  # batch norms in its stem
    before = [b.clone() for n, b in model.named_buffers() if "running" in n]
    with pytest.raises(vitlens.InputError):  # the trial forward runs in eval mode without gradients
        vitlens.explain(model, _x(1, 96), method="gradcam")
    after = [b for n, b in model.named_buffers() if "running" in n]
    assert before and all(torch.equal(p, q) for p, q in zip(before, after)) and model.training


def test_crossvit_reads_its_finer_branch_and_both_heads_reach_it():
    model = _model("crossvit")
    adapter = vitlens.get_adapter(model)
    assert adapter.branch == 0 and adapter.feature_grid((32, 32)) == (4, 4)  # 8 px patches of 32 px; 12 of 24: 2x2
    seen: dict[str, torch.Tensor] = {}
    handle = CASES["crossvit"][3](model, seen)
    try:
        xs = model.forward_features(_x(1))
        heads = [model.head[i](xs[i][:, 0])[:, 3] for i in range(2)]
        grads = [torch.autograd.grad(h.sum(), seen["f"], retain_graph=True)[0][:, 1:] for h in heads]
    finally:
        handle.remove()
    # the finer branch's patch tokens reach both heads: their own through the branch's blocks, the other through the
    # fusion's cross-attention
    assert all(g.abs().sum() > 0 for g in grads)
