"""timm MaxxVit (``models/timm_maxxvit.py``: MaxViT, and CoAtNet built by the same class): Grad-CAM and Finer-CAM on
the final feature map (checked against a by-hand Grad-CAM), AHA on timm's feature_info maps, input sizes refused
exactly where the window/grid partitions stop dividing a stage's feature map (with the model's own words), GradSkip
listed (its MaxViT path: tests/test_gradskip_maxvit.py), every method that needs a token sequence (rollout, GAE, the
LRP family, attention Grad-CAM), ViT-CX and the token-dropping methods refused with the MBConv / block-grid-attention
reason instead of a raw error; model state (batch-norm statistics included) restored after success and after an
exception."""

from __future__ import annotations

import pytest
import torch

import vitlens
from vitlens.errors import UnsupportedModelError
from vitlens.explainers import get_method
from vitlens.explainers.support import working_methods
from vitlens.models.families import trained_like

from conftest import assert_restored

timm = pytest.importorskip("timm")

_TINY = dict(img_size=32, num_classes=5, embed_dim=(16, 32), depths=(1, 1), stem_width=(8, 16))


def _maxvit(seed: int = 0, arch: str = "maxvit_tiny_tf_224") -> torch.nn.Module:
    torch.manual_seed(seed)
    m = timm.create_model(arch, pretrained=False, **_TINY, head_hidden_size=32, transformer_dim_head=8,
                          transformer_window_size=(2, 2), transformer_grid_size=(2, 2))
    return trained_like(m.eval())


def _x(n: int = 2, size: int = 32, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ["maxvit_tiny_tf_224", "maxvit_nano_rw_256"])
def test_gradcam_is_the_grad_cam_of_the_final_feature_map(arch):
    model = _maxvit(arch=arch)
    a = vitlens.get_adapter(model)
    assert a.family == "timm-maxxvit" and a.stage_grids((32, 32)) == [(8, 8), (4, 4)] and a.grid((32, 32)) == (4, 4)
    assert [type(b).__name__ for st in model.stages for b in st.blocks] == ["MaxxVitBlock", "MaxxVitBlock"]
    x = _x()
    seen = {}

    def keep(module, args):
        args[0].retain_grad()
        seen["f"] = args[0]

    handle = model.head.global_pool.register_forward_pre_hook(keep)
    try:
        model(x)[:, 3].sum().backward()
    finally:
        handle.remove()
    f, g = seen["f"], seen["f"].grad  # (B, C, 4, 4): the last stage's output, the global pool's input
    expected = (f * g.mean((2, 3), keepdim=True)).sum(1).clamp_min(0)
    model.zero_grad(set_to_none=True)
    exp = vitlens.explain(model, x, method="gradcam", target=3)
    torch.testing.assert_close(exp.token_maps, expected.detach(), rtol=1e-4, atol=1e-8)
    fin = vitlens.explain(model, x, method="finercam", target=3)
    assert fin.token_maps.shape == (2, 4, 4) and torch.isfinite(fin.maps).all()
    aha = get_method("aha", explainer="untrained", refine_steps=0).explain(model, x)  # the feature_info maps
    assert aha.maps.shape == (2, 32, 32) and torch.isfinite(aha.maps).all()


ATTENTION_METHODS = ["rollout", "gae", "transformer_attribution", "attnlrp", "cplrp", "attn_gradcam"]


def test_sequence_and_token_methods_refuse_with_the_reason():
    model = _maxvit()
    working = working_methods(model)
    assert {"gradcam", "finercam", "aha", "gradient", "rise", "gradskip"} <= set(working)
    for name in [*ATTENTION_METHODS, "vitcx", "tis", "mutex"]:
        with pytest.raises(UnsupportedModelError) as err:
            get_method(name).explain(model, _x(1))
        msg = str(err.value)
        assert msg.startswith(f"method '{name}' needs ") and "MaxxVit (timm-maxxvit)" in msg and "\n" not in msg
        why = "tokens cannot be dropped" if name in ("tis", "mutex") else "MBConv convolution block"
        assert why in msg and "a CNN has no attention" not in msg, msg
        if name not in ("tis", "mutex"):
            assert "no token sequence whose attention matrices chain" in msg, msg
        assert msg.split("methods that work on this model: ")[1].split(", ") == working, name
    adapter = vitlens.get_adapter(model)
    assert adapter.provides("attention") and adapter.provides("partition_attention")
    assert "grid attention over a dilated grid" in adapter.lacking("token_sequence")
    exp = vitlens.explain(model, _x(), method="gradskip")  # tests/test_gradskip_maxvit.py checks it in full
    torch.testing.assert_close(exp.token_maps.sum((1, 2)), exp.scores, rtol=1e-5, atol=1e-6)


def test_sizes_are_refused_exactly_where_the_partitions_stop_dividing():
    model = _maxvit()
    for size, grid in ((48, (6, 6)), (64, (8, 8))):  # every stage divisible by the 2x2 partitions: it runs
        assert vitlens.explain(model, _x(1, size), method="gradcam").token_maps.shape == (1, *grid)
    with pytest.raises(AssertionError, match=r"height \(5\) must be divisible by window \(2\)"):
        model(_x(1, 40))  # the model's own check
    with pytest.raises(vitlens.InputError, match=r"cannot run a 40x40 input \(stage 2's 5x5 feature map is not "
                                                 r"divisible by its 2x2 block \(window\) attention partition; the "
                                                 r"model refuses it: height \(5\) must be divisible by window"):
        vitlens.explain(model, _x(1, 40), method="gradcam")
    with pytest.raises(vitlens.InputError, match="stage 1's 9x9 feature map"):
        vitlens.explain(model, _x(1, 36), method="gradcam")
    with pytest.raises(vitlens.InputError, match="3 input channels"):
        vitlens.explain(model, torch.randn(1, 1, 32, 32), method="gradcam")
    rw = _maxvit(arch="maxvit_nano_rw_256")  # explicit padding: its 2x2 average-pool shortcut rounds down
    with pytest.raises(RuntimeError, match="must match"):
        rw(_x(1, 30))
    assert vitlens.explain(_maxvit(), _x(1, 30), method="gradcam").token_maps.shape == (1, 4, 4)  # "same" padding
    with pytest.raises(vitlens.InputError, match=r"cannot run a 30x30 input \(the model refuses it: The size of"):
        vitlens.explain(rw, _x(1, 30), method="gradcam")


def test_coatnet_is_read_with_its_own_reason_and_only_at_its_size():
    torch.manual_seed(0)
    model = timm.create_model("coatnet_nano_rw_224", pretrained=False, img_size=32, num_classes=5,
                              embed_dim=(8, 16, 16, 16), depths=(1, 1, 1, 1), stem_width=(8, 8),
                              transformer_dim_head=8).eval()
    assert "TransformerBlock2d" in {type(b).__name__ for st in model.stages for b in st.blocks}
    a = vitlens.get_adapter(model)
    assert a.family == "timm-maxxvit" and "CoAtNet's stages are MBConv" in a.lacking("attention")
    assert vitlens.explain(model, _x(1), method="gradcam").token_maps.shape == (1, 1, 1)
    with pytest.raises(vitlens.InputError, match="relative position tables are built for the feature maps of a 32x32"):
        vitlens.explain(model, _x(1, 64), method="gradcam")


def test_model_restored_after_success_and_exception():
    model = _maxvit().train()
    assert_restored(model, lambda m: vitlens.explain(m, _x(1), method="gradcam"), model.stages[1])
    assert model.training
    before = [b.clone() for n, b in model.named_buffers() if "running" in n]
    with pytest.raises(vitlens.InputError):  # the refusal's probe forward leaves batch-norm statistics alone
        vitlens.explain(model, _x(1, 40), method="gradcam")
    after = [b for n, b in model.named_buffers() if "running" in n]
    assert before and all(torch.equal(p, q) for p, q in zip(before, after)) and model.training
