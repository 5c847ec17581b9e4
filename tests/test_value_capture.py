"""GradSkip's value norms are read from the ``qkv`` output the attention computes (timm EVA: where ``q_norm`` receives
``q``; timm Swin v1: the ``qkv`` module's output) and equal the value projection of the attention's input; where no
such output exists (EVA with separate projections, SwinV2 with q/v biases) the projection is recomputed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import vitlens

timm = pytest.importorskip("timm")


def _eva(**kw):
    torch.manual_seed(0)
    return timm.create_model("eva02_tiny_patch14_224", pretrained=False, img_size=28, depth=2, num_classes=5,
                             **kw).eval()


def _projected_values(blk, x):
    """The value vectors ``(B, heads, T, d)`` by the block's own value weights, from the attention's input ``x``."""
    att = blk.attn
    if att.qkv is not None:
        c = att.qkv.out_features // 3
        v = F.linear(x, att.qkv.weight[2 * c:], att.v_bias)
    else:
        v = att.v_proj(x)
    b, n, _ = v.shape
    return v.reshape(b, n, att.num_heads, -1).permute(0, 2, 1, 3)


@pytest.mark.parametrize("fused_qkv", [True, False], ids=["qkv-output", "recomputed"])
def test_eva_values_are_the_attention_values(fused_qkv):
    model = _eva(qkv_fused=fused_qkv)
    adapter = vitlens.get_adapter(model)
    inputs = {}
    hooks = [blk.attn.register_forward_pre_hook(lambda m, a, kw, i=i: inputs.__setitem__(i, a[0].detach()),
                                                with_kwargs=True) for i, blk in enumerate(model.blocks)]
    try:
        with adapter.session(capture=True) as rec, torch.no_grad():
            adapter.forward(torch.randn(2, 3, 28, 28, generator=torch.Generator().manual_seed(1)))
    finally:
        for h in hooks:
            h.remove()
    for i, (blk, b) in enumerate(zip(model.blocks, rec.blocks)):
        assert b.value is not None, i
        torch.testing.assert_close(b.value, _projected_values(blk, inputs[i]), rtol=1e-5, atol=1e-6)
        base = b.value._base  # read from the qkv output (3·heads·d wide) or a projection of its own (heads·d)
        width = blk.attn.num_heads * blk.attn.head_dim
        assert base is not None and base.shape[-1] == (3 * width if fused_qkv else width), i


@pytest.mark.parametrize("name", ["swin_tiny_patch4_window7_224", "swinv2_tiny_window8_256"])
def test_swin_value_norms_are_the_attention_values(name):
    torch.manual_seed(0)
    size = 64
    model = timm.create_model(name, pretrained=False, img_size=size, embed_dim=24, depths=(1, 1), num_heads=(1, 2),
                              window_size=4, num_classes=5).eval()
    adapter = vitlens.get_adapter(model)
    blocks = [blk for stage in model.layers for blk in stage.blocks]
    inputs = {}
    hooks = [blk.attn.register_forward_pre_hook(lambda m, a, i=i: inputs.__setitem__(i, a[0].detach()))
             for i, blk in enumerate(blocks)]
    try:
        with adapter.session(capture=True) as rec, torch.no_grad():
            adapter.forward(torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(1)))
    finally:
        for h in hooks:
            h.remove()
    for i, (blk, b) in enumerate(zip(blocks, rec.blocks)):
        att = blk.attn
        c = att.qkv.out_features // 3
        v_bias = getattr(att, "v_bias", None)
        v = F.linear(inputs[i], att.qkv.weight[2 * c:], v_bias if v_bias is not None else att.qkv.bias[2 * c:])
        n, t, _ = v.shape
        want = v.reshape(n, t, att.num_heads, -1).norm(dim=-1).permute(0, 2, 1)
        torch.testing.assert_close(b.vnorm, want, rtol=1e-5, atol=1e-6)
