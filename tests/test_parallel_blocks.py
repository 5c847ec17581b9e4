"""timm ``VisionTransformer``s with other block classes (issue #25, item 3), real timm classes with tiny configs.

``ParallelScalingBlock`` (attention and MLP read the same normed input, ``x = u + a + m``): the recorded attention is
the block's own ``softmax(q̂·k̂ᵀ·scale)``, GradSkip is complete and conserved per layer on trained-like parameters,
its skip gate splits by the three actual contributions, and the fused and explicit attention paths agree.
``DiffAttention`` and ``ParallelThingsBlock``: the feature methods run, the attention methods are refused naming why.
"""

from __future__ import annotations

import pytest
import torch

import vitlens
from vitlens.errors import UnsupportedModelError
from vitlens.explainers.support import working_methods
from vitlens.models.families import trained_like

timm = pytest.importorskip("timm")

_T = dict(img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=4, num_classes=5)
PARALLEL = {"pwee": ("vit_pwee_patch16_reg1_gap_256", dict(init_values=0.5)),  # register token, mean readout, LS
            "xp": ("vit_base_patch16_xp_224", {})}  # RmsNorm, qk_norm, CLS readout


def parallel_vit(name: str) -> torch.nn.Module:
    arch, kw = PARALLEL[name]
    torch.manual_seed(0)
    model = timm.create_model(arch, pretrained=False, **{**_T, **kw}).eval()
    with torch.no_grad():  # peaked attention: scale the query/key rows of the fused input projection
        for blk in model.blocks:
            d = blk.num_heads * blk.head_dim
            blk.in_proj.weight[blk.in_split[0]:blk.in_split[0] + 2 * d].mul_(3.0)
    return trained_like(model)


def batch(n: int = 2) -> torch.Tensor:
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", sorted(PARALLEL))
def test_gradskip_is_complete_and_conserved_per_layer(name):
    model = parallel_vit(name)
    assert vitlens.get_adapter(model).family == "timm-vit-parallel"
    exp = vitlens.explain(model, batch(), method="gradskip")
    y = exp.scores.double()
    total = exp.token_maps.sum((1, 2)).double() + exp.remainder.double()
    torch.testing.assert_close(total, y, rtol=1e-5, atol=1e-6)
    totals = exp.extras["layer_totals"].double()
    torch.testing.assert_close(totals, y[:, None].expand_as(totals), rtol=1e-5, atol=1e-6)
    assert (exp.token_maps >= -1e-7).all() or (y < 0).any()


@pytest.mark.parametrize("name", sorted(PARALLEL))
def test_recorded_attention_is_the_blocks_own_softmax(name):
    model = parallel_vit(name)
    adapter = vitlens.get_adapter(model)
    seen = {}

    def grab(i):
        def hook(module, args, out):
            seen[i] = out.detach()
        return hook

    handles = [blk.in_proj.register_forward_hook(grab(i)) for i, blk in enumerate(model.blocks)]
    try:
        with adapter.session(capture=True) as rec:  # explicit attention: the probabilities themselves
            adapter.forward(batch())
    finally:
        for h in handles:
            h.remove()
    for i, blk in enumerate(model.blocks):
        b, n, _ = seen[i].shape
        _, q, k, _ = seen[i].split(blk.in_split, dim=-1)
        q = blk.q_norm(q.view(b, n, blk.num_heads, blk.head_dim)).transpose(1, 2)
        k = blk.k_norm(k.view(b, n, blk.num_heads, blk.head_dim)).transpose(1, 2)
        ref = ((q * blk.scale) @ k.transpose(-2, -1)).softmax(-1)
        torch.testing.assert_close(rec.blocks[i].attn.detach(), ref, rtol=1e-5, atol=1e-6)
    assert all(blk.fused_attn for blk in model.blocks)  # restored


@pytest.mark.parametrize("name", sorted(PARALLEL))
def test_skip_gate_splits_by_the_three_contributions(name):
    """β_main = |⟨a, ∇x⟩| / (|⟨a, ∇x⟩| + |⟨u, ∇x⟩| + |⟨m, ∇x⟩|) at each block output x = u + a + m, computed here
    from the model's own modules with plain gradients (``conservative=False``)."""
    model = parallel_vit(name)
    x = batch()
    exp = vitlens.explain(model, x, method="gradskip", conservative=False)
    outs, ins, mlps = {}, {}, {}
    handles = []
    for i, blk in enumerate(model.blocks):
        handles.append(blk.register_forward_pre_hook(lambda m, a, i=i: ins.__setitem__(i, a[0])))
        handles.append(blk.register_forward_hook(lambda m, a, o, i=i: outs.__setitem__(i, o)))
        handles.append(blk.mlp_out_proj.register_forward_hook(
            lambda m, a, o, i=i, blk=blk: mlps.__setitem__(i, blk.ls(o))))
    try:
        logits = model(x)
    finally:
        for h in handles:
            h.remove()
    y = logits.gather(1, exp.targets[:, None]).sum()
    grads = torch.autograd.grad(y, [outs[i] for i in range(len(model.blocks))])
    for i, g in enumerate(grads):
        u, out, m = ins[i].detach(), outs[i].detach(), mlps[i].detach()
        a = out - u - m
        c_a, c_u, c_m = ((t * g).sum(-1).abs() for t in (a, u, m))
        beta = c_a / (c_a + c_u + c_m + 1e-12)
        torch.testing.assert_close(exp.extras["beta_main"][:, i], beta, rtol=1e-4, atol=1e-6)
        two_term = c_a / (c_a + (u * g).sum(-1).add((m * g).sum(-1)).abs() + 1e-12)
        assert float((two_term - beta).abs().max()) > 1e-4  # the MLP branch is its own term, not folded into u


@pytest.mark.parametrize("method", ["gradskip", "rollout", "gae", "attn_gradcam"])
def test_fused_and_explicit_attention_give_the_same_maps(method):
    model = parallel_vit("xp")
    fused = vitlens.explain(model, batch(), method=method)
    for blk in model.blocks:
        blk.fused_attn = False
    explicit = vitlens.explain(model, batch(), method=method)
    torch.testing.assert_close(fused.maps, explicit.maps, rtol=1e-4, atol=1e-6 * float(explicit.maps.abs().max()))


def test_a_fused_output_projection_is_refused_with_its_reason():
    torch.manual_seed(0)
    from timm.models.vision_transformer import ParallelScalingBlock, VisionTransformer

    model = VisionTransformer(**_T, block_fn=lambda **kw: ParallelScalingBlock(**kw, fuse_out_proj=True)).eval()
    assert "rise" in working_methods(model)
    with pytest.raises(UnsupportedModelError, match="fuse_out_proj=True"):
        vitlens.explain(model, batch(1), method="gradskip")


@pytest.mark.parametrize("arch,why", [("vit_dwee_patch16_reg1_gap_256", "DiffAttention subtracts two softmax maps"),
                                      ("vit_dpwee_patch16_reg1_gap_256", "DiffAttention subtracts two softmax maps"),
                                      ("vit_small_patch16_18x2_224", "ParallelThingsBlock runs several attention")])
def test_blocks_without_a_probability_map_get_features_and_refuse_attention_methods(arch, why):
    torch.manual_seed(0)
    model = trained_like(timm.create_model(arch, pretrained=False, **_T).eval())
    working = working_methods(model)
    assert {"gradcam", "finercam", "rise"} <= set(working)
    assert not {"gradskip", "rollout", "gae", "attnlrp", "attn_gradcam"} & set(working)
    exp = vitlens.explain(model, batch(), method="gradcam")
    assert exp.maps.shape == (2, 32, 32) and torch.isfinite(exp.maps).all() and exp.maps.abs().sum() > 0
    for method in ("gradskip", "rollout", "attnlrp"):
        with pytest.raises(UnsupportedModelError, match=why):
            vitlens.explain(model, batch(1), method=method)
