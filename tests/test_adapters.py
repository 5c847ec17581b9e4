"""Adapters leave the model exactly as they found it, after success and after an exception."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import vitlens
from vitlens.targets import ClassLogit

from conftest import model_fingerprint, tiny_vit, timm_to_hf_vit


class Boom(RuntimeError):
    pass


class ExplodingTarget(ClassLogit):
    """A target whose score raises after the forward pass, i.e. mid-explanation with every hook installed."""

    def score(self, logits):
        raise Boom("mid-explanation failure")


def models():
    tm = tiny_vit()
    out = [("timm", tm)]
    try:
        out.append(("hf", timm_to_hf_vit(tiny_vit())))
    except ImportError:  # pragma: no cover
        pass
    return out


@pytest.mark.parametrize("name,model", models(), ids=lambda v: v if isinstance(v, str) else "")
@pytest.mark.parametrize("train_mode", [False, True])
def test_model_restored_after_success_and_exception(name, model, train_mode):
    model.train(train_mode)
    if name == "timm":
        model.blocks[1].attn.fused_attn = True  # the fused path must come back on
    for p in list(model.parameters())[:3]:
        p.requires_grad_(False)  # a partly frozen model stays partly frozen
    before = model_fingerprint(model)
    x = torch.randn(2, 3, 32, 32)
    for method in ["gradskip", "inputxgradient", "random"]:
        vitlens.explain(model, x, method=method)
        assert model_fingerprint(model) == before, method
        with pytest.raises(Boom):
            vitlens.explain(model, x, method=method, target=ExplodingTarget(1))
        assert model_fingerprint(model) == before, method


def test_exception_inside_a_block_restores_the_model():
    model = tiny_vit()
    before = model_fingerprint(model)

    def bad(module, args, out):
        raise Boom("block failure")

    h = model.blocks[1].mlp.register_forward_hook(bad)
    before = model_fingerprint(model)
    with pytest.raises(Boom):
        vitlens.explain(model, torch.randn(1, 3, 32, 32))
    assert model_fingerprint(model) == before
    h.remove()


def test_unsupported_model_error_names_the_supported_families():
    cnn = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))
    with pytest.raises(vitlens.UnsupportedModelError) as err:
        vitlens.explain(cnn, torch.randn(1, 3, 16, 16), method="gradskip")
    msg = str(err.value)
    assert "timm-vit" in msg and "hf-vit" in msg and "Adapter" in msg and "\n" not in msg
    # model-agnostic methods still work on it
    exp = vitlens.explain(cnn, torch.randn(2, 3, 16, 16), method="inputxgradient")
    assert exp.maps.shape == (2, 16, 16) and exp.token_maps is None


def test_unsupported_timm_block_family():
    from timm.models.vision_transformer import ResPostBlock, VisionTransformer

    m = VisionTransformer(img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=4, num_classes=3,
                          block_fn=ResPostBlock).eval()
    with pytest.raises(vitlens.UnsupportedModelError, match="pre-norm"):
        vitlens.explain(m, torch.randn(1, 3, 32, 32))


def test_adapter_layout():
    a = vitlens.get_adapter(tiny_vit(dynamic_img_size=True))
    assert a.family == "timm-vit" and a.num_classes == 5 and a.readout_tokens == (0,)
    assert a.grid((32, 32)) == (4, 4) and a.grid((48, 24)) == (6, 3)


@pytest.mark.parametrize("kind", ["timm", "timm-gap-reg", "hf"])
def test_keep_tokens_runs_on_a_subset_with_own_position_embeddings(kind):
    if kind == "hf":
        model = timm_to_hf_vit(tiny_vit())
    elif kind == "timm":
        model = tiny_vit()
    else:
        model = tiny_vit(reg_tokens=2, global_pool="avg", class_token=False)
    adapter = vitlens.get_adapter(model)
    x = torch.randn(2, 3, 32, 32)
    seen = []
    blk = adapter.blocks()[0]
    h = blk.register_forward_pre_hook(lambda m, a: seen.append(a[0].shape[1]))
    all_tokens = torch.arange(16).expand(2, 16).clone()
    with torch.no_grad():
        full = adapter.forward(x)
        with adapter.keep_tokens(all_tokens):
            same = adapter.forward(x)
        with adapter.keep_tokens(torch.tensor([[0, 5, 10], [15, 3, 1]])):
            sub = adapter.forward(x)
    h.remove()
    torch.testing.assert_close(full, same)
    assert seen[-1] == adapter.num_prefix_tokens + 3
    assert sub.shape == full.shape and not torch.allclose(sub, full)
    assert all(len(m._forward_hooks) == 0 for m in model.modules())
