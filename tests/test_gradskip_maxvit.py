"""GradSkip on timm MaxViT (``explainers/gradskip_maxvit.py``, recording in ``models/_partitions.py``): the partition
layout against timm's own partition functions, the exact window hand-back through depthwise convolutions and average
pools (symmetric and "same" padding), the recorded value norms against timm's q/k/v split, completeness and
conservation per block on trained-like models (non-zero biases, non-trivial batch-norm statistics) in both attention
layouts and in half precision, conservative LayerNorm2d, one forward and one backward, batch equivariance, determinism, model state
restored after success and after an exception, ablations, and the refusals that remain (rollout, GAE, CoAtNet,
ConvNeXt-block MaxxViT)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import vitlens
from vitlens.errors import UnsupportedModelError
from vitlens.explainers import get_method
from vitlens.explainers.gradskip_maxvit import window_op_contributions, window_op_handback
from vitlens.models._partitions import from_partitions, to_partitions
from vitlens.models.families import trained_like

from conftest import GRADSKIP_ABLATIONS, assert_restored, model_fingerprint, options_id

timm = pytest.importorskip("timm")
maxxvit = pytest.importorskip("timm.models.maxxvit")

_TINY = dict(img_size=32, num_classes=5, embed_dim=(16, 32), depths=(1, 1), stem_width=(8, 16),
             transformer_dim_head=8, transformer_window_size=(2, 2), transformer_grid_size=(2, 2))
#: name → (timm architecture, extra kwargs): the TF layout ("same" padding, interleaved heads, NormMlp head), the
#: timm layouts (explicit padding; an MLP relative position bias), and the channels-first attention layers
ARCHS = {
    "tf": ("maxvit_tiny_tf_224", dict(head_hidden_size=32)),
    "rw": ("maxvit_nano_rw_256", {}),
    "rmlp": ("maxvit_rmlp_pico_rw_256", {}),
    "nchw": ("maxvit_nano_rw_256", dict(transformer_use_nchw_attn=True)),
}


def maxvit(kind: str = "tf", seed: int = 0, depths: tuple[int, int] = (1, 1)) -> nn.Module:
    """A tiny MaxViT with trained-like parameters and batch-norm statistics that are not the initial 0 / 1."""
    arch, extra = ARCHS[kind]
    torch.manual_seed(seed)
    model = timm.create_model(arch, pretrained=False, **{**_TINY, "depths": depths}, **extra)
    trained_like(model.eval())
    gen = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.copy_(0.2 * torch.randn(m.running_mean.shape, generator=gen))
                m.running_var.copy_(0.5 + torch.rand(m.running_var.shape, generator=gen))
    return model


def images(n: int = 2, size: int = 32, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


def assert_complete(exp, rtol: float = 1e-5) -> None:
    y = exp.scores.double()
    total = exp.token_maps.sum((1, 2)).double() + exp.remainder.double()
    torch.testing.assert_close(total, y, rtol=rtol, atol=rtol * float(y.abs().max()))
    totals = exp.extras["layer_totals"].double()
    torch.testing.assert_close(totals, y[:, None].expand_as(totals), rtol=rtol, atol=rtol * float(y.abs().max()))
    assert torch.equal(exp.remainder, torch.zeros_like(exp.remainder))


# -- layout and hand-back ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["block", "grid"])
@pytest.mark.parametrize("hw,size", [((8, 12), (2, 3)), ((6, 6), (3, 3)), ((4, 8), (4, 2))])
def test_partition_layout_is_timms(kind, hw, size):
    r = torch.randn(2, *hw)
    cl = (maxxvit.window_partition if kind == "block" else maxxvit.grid_partition)(r[..., None], list(size))
    cf = (maxxvit.window_partition_nchw if kind == "block" else maxxvit.grid_partition_nchw)(r[:, None], list(size))
    parts = to_partitions(r, kind, size)
    assert torch.equal(parts, cl.reshape(cl.shape[0], -1)) and torch.equal(parts, cf.reshape(cf.shape[0], -1))
    assert torch.equal(from_partitions(parts, 2, hw, kind, size), r)


def _ops():
    torch.manual_seed(0)
    dw = nn.Conv2d(6, 6, 3, stride=2, padding=1, groups=6)
    same = timm.layers.create_conv2d(6, 6, 3, stride=2, padding="same", depthwise=True)
    dw1 = nn.Conv2d(6, 6, 3, stride=1, padding=1, groups=6)
    pool = nn.AvgPool2d(2)
    pool_same = timm.layers.create_pool2d("avg", 2, padding="same")
    return {"dw-s2": dw, "dw-same-s2": same, "dw-s1": dw1, "avg2": pool, "avg2-same": pool_same}


@pytest.mark.parametrize("name", list(_ops()))
@pytest.mark.parametrize("hw", [(8, 8), (7, 9)])
def test_window_hand_back_is_exact_and_conservative(name, hw):
    op = _ops()[name]
    if name == "avg2" and hw == (7, 9):
        hw = (8, 10)  # an explicit 2x2 pool drops an odd row; the models' "same" pool pads it instead
    x = torch.randn(2, 6, *hw, requires_grad=True)
    out = op(x)
    g = torch.randn_like(out)
    contrib, inside, _ = window_op_contributions(x.detach(), g, op)
    bias = op.bias[None, :, None, None] if getattr(op, "bias", None) is not None else 0.0
    if isinstance(op, nn.Conv2d):  # Σ over each window's offsets = ⟨∂y/∂out_k, out_k − bias⟩
        expected = (g * (out - bias)).sum(1).flatten(1)
        torch.testing.assert_close(contrib.sum(-1), expected.detach(), rtol=1e-5, atol=1e-5)
    else:  # the pool's one weight per window (1/count): Σ_o c / count = ⟨∂y/∂out_k, out_k⟩
        count = inside.shape[-1] if op.count_include_pad else inside.sum(-1)
        expected = (g * out).sum(1).flatten(1)
        torch.testing.assert_close(contrib.sum(-1) / count, expected.detach(), rtol=1e-5, atol=1e-5)
    r = torch.rand(2, out.shape[-2] * out.shape[-1])
    back = window_op_handback(r, x.detach(), g, op)
    assert back.shape == (2, hw[0] * hw[1]) and (back >= 0).all()
    torch.testing.assert_close(back.sum(-1), r.sum(-1), rtol=1e-6, atol=1e-6)
    zero = window_op_handback(r, torch.zeros_like(x.detach()), g, op)  # no contribution anywhere: uniform
    torch.testing.assert_close(zero.sum(-1), r.sum(-1), rtol=1e-6, atol=1e-6)


# -- recording --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", list(ARCHS))
def test_recording_matches_the_model(kind):
    model = maxvit(kind)
    adapter = vitlens.get_adapter(model)
    x = images(2)
    seen: dict[int, torch.Tensor] = {}
    attn_layers = [layer for st in model.stages for b in st.blocks for layer in (b.attn_block, b.attn_grid)]

    def grab(module, args, out, i):
        seen[i] = out.detach()

    handles = [layer.attn.qkv.register_forward_hook(lambda m, a, o, i=i: grab(m, a, o, i))
               for i, layer in enumerate(attn_layers)]
    try:
        with adapter.session(capture=True, conservative=True, partitions=True) as rec:
            logits = adapter.forward(x)
    finally:
        for h in handles:
            h.remove()
    torch.testing.assert_close(logits, model(x), rtol=1e-4, atol=1e-5)  # conservative LayerNorms: same forward
    assert rec.start == (16, 16) and rec.final is not None and rec.final.shape[-2:] == (4, 4)
    parts = [a for b in rec.blocks for a in b.attns]
    assert [a.kind for a in parts] == ["block", "grid"] * 2 and [a.grid for a in parts] == [(8, 8)] * 2 + [(4, 4)] * 2
    for i, (a, layer) in enumerate(zip(parts, attn_layers)):
        att = layer.attn
        qkv, n = seen[i], seen[i].shape[0]
        if kind == "nchw":  # the split Attention2d.forward makes
            v = (qkv.view(n, att.num_heads, att.dim_head * 3, -1).chunk(3, dim=2)[2] if att.head_first else
                 qkv.reshape(n, 3, att.num_heads, att.dim_head, -1)[:, 2]).transpose(-1, -2)
        else:  # AttentionCl.forward's split
            v = (qkv.view(n, -1, att.num_heads, att.dim_head * 3).transpose(1, 2).chunk(3, dim=3)[2] if att.head_first
                 else qkv.reshape(n, -1, 3, att.num_heads, att.dim_head).transpose(1, 3).unbind(2)[2])
        torch.testing.assert_close(a.vnorm, v.norm(dim=-1))
        assert a.attn.shape == (n, att.num_heads, 4, 4) and torch.allclose(a.attn.sum(-1), torch.ones(()))
        assert a.u.shape == (2, a.grid[0] * a.grid[1], layer.norm1.normalized_shape[0])
    for b in rec.blocks:
        assert b.conv.pool is not None and b.conv.dw is not None  # every stage's first block strides


# -- the promise: completeness, conservation, positivity ------------------------------------------------------------

@pytest.mark.parametrize("kind", list(ARCHS))
def test_complete_and_conserved_per_block(kind):
    model = maxvit(kind, depths=(2, 1))
    exp = vitlens.explain(model, images(2), method="gradskip")
    assert exp.token_maps.shape == (2, 16, 16) and exp.maps.shape == (2, 32, 32)
    assert_complete(exp)
    assert exp.extras["layer_totals"].shape == (2, 4) and exp.extras["beta_conv"].shape == (2, 3, 64)
    assert exp.extras["head_weights"].shape[:2] == (2, 6) and exp.extras["beta_main"].shape == (2, 6, 64)
    torch.testing.assert_close(exp.extras["head_weights"].sum(-1), torch.ones(2, 6))
    beta = exp.extras["beta_conv"]
    assert (beta >= 0).all() and (beta <= 1).all() and beta[:, 0, :64].std() > 0  # a gate, not a constant


def test_same_padding_sizes_are_complete_and_maps_positive_for_a_positive_score():
    model = maxvit("tf")
    x = images(2, 30)  # 15x15 stem output: the "same" convolution and pool pad a row and a column
    with torch.no_grad():
        target = model(x).argmax(1).tolist()
    exp = vitlens.explain(model, x, method="gradskip", target=target)
    assert exp.token_maps.shape == (2, 15, 15)
    assert_complete(exp)
    if bool((exp.scores > 0).all()):
        assert (exp.token_maps >= 0).all()


@pytest.mark.parametrize("opts", GRADSKIP_ABLATIONS, ids=options_id)
def test_each_ablation_is_complete_and_changes_the_map(opts):
    model, x = maxvit("rw", seed=3), images(2, seed=5)
    base = vitlens.explain(model, x, method="gradskip", target=1)
    exp = get_method("gradskip", **opts).explain(model, x, target=1)
    assert_complete(exp)
    assert not torch.allclose(exp.token_maps, base.token_maps, rtol=1e-4, atol=1e-7), opts


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_precision_matches_float32_and_is_complete(dtype):
    model, x = maxvit("tf"), images(2)
    ref = vitlens.explain(model, x, method="gradskip", target=1)
    exp = vitlens.explain(copy.deepcopy(model).to(dtype), x, method="gradskip", target=1)
    a, b = exp.token_maps.flatten(1).double(), ref.token_maps.flatten(1).double()
    a, b = a - a.mean(1, keepdim=True), b - b.mean(1, keepdim=True)
    assert ((a * b).sum(1) / (a.norm(dim=1) * b.norm(dim=1))).min() >= 0.99  # measured: fp16 0.9999, bf16 0.998
    assert_complete(exp)


# -- cost, equivariance, determinism --------------------------------------------------------------------------------

def test_exactly_one_forward_and_one_backward_per_batch():
    model = maxvit("tf")
    calls = {"fwd": 0, "bwd": 0}

    def fwd(module, args, out):
        calls["fwd"] += 1
        out.register_hook(lambda g: calls.__setitem__("bwd", calls["bwd"] + 1))

    stem = []
    hooks = [model.register_forward_hook(fwd), model.stem.register_full_backward_hook(lambda *a: stem.append(1))]
    try:
        exp = vitlens.explain(model, images(3), method="gradskip")
    finally:
        for h in hooks:
            h.remove()
    assert calls == {"fwd": 1, "bwd": 1}
    assert stem == []  # the backward stops at the first block's input
    assert exp.cost.model_calls == 1 and exp.cost.backward_calls == 1
    assert exp.cost.forward_passes == 1.0 and exp.cost.backward_passes == 1.0


def test_batch_equals_one_by_one_and_chunks():
    model = maxvit("rw")
    x = images(3)
    full = vitlens.explain(model, x, method="gradskip", target=[0, 2, 4])
    for i, t in enumerate([0, 2, 4]):
        one = vitlens.explain(model, x[i:i + 1], method="gradskip", target=t)
        scale = float(full.token_maps[i].abs().max())
        torch.testing.assert_close(one.token_maps[0], full.token_maps[i], rtol=1e-4, atol=1e-5 * scale)
    chunked = vitlens.explain(model, x, method="gradskip", target=[0, 2, 4], batch_size=2)
    assert chunked.cost.model_calls == 2
    torch.testing.assert_close(chunked.token_maps, full.token_maps, rtol=1e-4,
                               atol=1e-5 * float(full.token_maps.abs().max()))


def test_deterministic():
    model, x = maxvit("tf"), images(2)
    first = vitlens.explain(model, x, method="gradskip")
    assert torch.equal(first.maps, vitlens.explain(model, x, method="gradskip").maps)


# -- state restored ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("train_mode", [False, True])
def test_model_restored_after_success_and_exception(train_mode):
    model = maxvit("tf").train(train_mode)
    for p in list(model.parameters())[:3]:
        p.requires_grad_(False)
    fused = [(n, m.fused_attn) for n, m in model.named_modules() if hasattr(m, "fused_attn")]
    assert fused and all(f for _, f in fused)  # the explanation switches them off for its duration only
    running = [b.clone() for n, b in model.named_buffers() if "running" in n]
    assert_restored(model, lambda m: vitlens.explain(m, images(2), method="gradskip"), model.stages[1].blocks[0].conv)
    assert_restored(model, lambda m: vitlens.explain(m, images(2), method="gradskip"), model.stages[0].blocks[0]
                    .attn_grid.attn.attn_drop)
    assert model.training == train_mode
    assert all(torch.equal(p, q) for p, q in zip(running, [b for n, b in model.named_buffers() if "running" in n]))
    assert [(n, m.fused_attn) for n, m in model.named_modules() if hasattr(m, "fused_attn")] == fused
    before = model_fingerprint(model)
    with pytest.raises(vitlens.InputError):  # a refused size leaves everything as it was
        vitlens.explain(model, images(1, 40), method="gradskip")
    assert model_fingerprint(model) == before


# -- what stays refused -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["rollout", "gae", "attnlrp", "attn_gradcam"])
def test_sequence_methods_refuse_with_the_reason(name):
    model = maxvit("tf")
    with pytest.raises(UnsupportedModelError) as err:
        get_method(name).explain(model, images(1))
    msg = str(err.value)
    assert "no token sequence whose attention matrices chain" in msg and "gradskip" in msg.split(
        "methods that work on this model: ")[1].split(", ")


def test_coatnet_and_convnext_maxxvit_still_refuse_gradskip_with_their_reason():
    torch.manual_seed(0)
    coat = timm.create_model("coatnet_nano_rw_224", pretrained=False, img_size=32, num_classes=5,
                             embed_dim=(8, 16, 16, 16), depths=(1, 1, 1, 1), stem_width=(8, 8),
                             transformer_dim_head=8).eval()
    convnext = timm.create_model("maxxvit_rmlp_nano_rw_256", pretrained=False, **_TINY).eval()
    for model, why in ((coat, "conv-only stages"), (convnext, "ConvNeXtBlock, not an MBConv block")):
        assert not vitlens.get_adapter(model).provides("partition_attention")
        with pytest.raises(UnsupportedModelError, match=why):
            get_method("gradskip").explain(model, images(1))
