"""CaiT (timm ``Cait``): the capture of both phases (talking-heads self-attention on the patch tokens, class attention
on CLS), GradSkip's conservation through them, and the class-attention rollout / GAE (docs/methods/gradskip_cait.md).
Tiny random configs of the real timm class; the shared family properties run in tests/test_families.py."""

from __future__ import annotations

import pytest
import timm
import torch

import vitlens
from vitlens.errors import UnsupportedModelError
from vitlens.models import TimmCaitAdapter


def _cait(depth=3, depth_token_only=3, seed=0, **kw):
    torch.manual_seed(seed)
    m = timm.create_model("cait_xxs24_224", pretrained=False, img_size=32, patch_size=8, embed_dim=48, depth=depth,
                          depth_token_only=depth_token_only, num_heads=4, num_classes=5, init_values=0.5, **kw)
    with torch.no_grad():  # talking heads: near identity plus noise, so the mixing tensor is signed and not ≈ 0
        for blk in m.blocks:
            for lin in (blk.attn.proj_l, blk.attn.proj_w):
                lin.weight.add_(torch.eye(4) + 0.3 * torch.randn(4, 4))
                lin.bias.normal_(0.0, 0.05)
        for blk in m.blocks:  # peaked attention, as in the catalogue's tiny models
            blk.attn.qkv.weight[:96].mul_(3.0)
        for blk in m.blocks_token_only:
            blk.attn.q.weight.mul_(3.0)
            blk.attn.k.weight.mul_(3.0)
    return m.eval()


def _x(n=3, seed=0):
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("pool", ["token", "avg"])
@pytest.mark.parametrize("options", [{}, {"skip": "fixed"}, {"head_weighting": "uniform", "skip": "none"},
                                     {"head_subset": ("top", 0.5), "conservative": False}])
def test_gradskip_conserves_through_several_self_and_class_attention_blocks(pool, options):
    model = _cait(global_pool=pool)
    exp = vitlens.explain(model, _x(), method="gradskip", **options)
    y = exp.scores.double()
    total = exp.token_maps.sum((1, 2)).double() + exp.remainder.double()
    torch.testing.assert_close(total, y, rtol=1e-5, atol=1e-6)
    totals = exp.extras["layer_totals"].double()
    assert totals.shape == (3, 3 + 3 + 1)  # input of SA block 0 ... the readout
    torch.testing.assert_close(totals, y[:, None].expand_as(totals), rtol=1e-5, atol=1e-6)
    assert exp.extras["head_weights"].shape == (3, 6, 4) and exp.extras["beta_main"].shape == (3, 6, 17)
    beta = exp.extras["beta_main"]
    assert (beta[:, :3, 0] == 0).all() and (beta[:, 3:, 1:] == 0).all()  # SA: no CLS; CA: patches kept
    if pool == "avg":  # the patch mean: the head does not read CLS, so nothing reaches the remainder
        torch.testing.assert_close(exp.remainder.double(), torch.zeros_like(y), rtol=0, atol=1e-7)
    else:
        assert (exp.remainder.abs() > 0).all() and (exp.token_maps.abs().sum((1, 2)) > 0).all()


def test_captured_mixing_tensors_reproduce_the_attention_branches():
    model = _cait()
    adapter = vitlens.get_adapter(model)
    assert isinstance(adapter, TimmCaitAdapter) and adapter.class_attention
    x = _x(2)
    with torch.no_grad():
        ref = model(x)
    with adapter.session(capture=True) as rec, torch.no_grad():
        logits = adapter.forward(x)
    torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-6)
    blocks = adapter.blocks()
    assert rec.self_attention == 3 and len(rec.blocks) == len(blocks) == 6
    negative = False
    for i, (blk, r) in enumerate(zip(blocks, rec.blocks)):
        a, v = r.attn, r.value  # (B, H, T, T_k), (B, H, T_k, d)
        out = (a @ v).transpose(1, 2).reshape(2, a.shape[2], -1)  # the heads' outputs before proj
        torch.testing.assert_close(r.h, r.u + blk.gamma_1 * blk.attn.proj(out), rtol=1e-5, atol=1e-5)
        if i < 3:  # talking heads: proj_w(softmax(proj_l(q·kᵀ))), recomputed here from the block input
            q, k, _ = blk.attn.qkv(blk.norm1(r.u)).reshape(2, 16, 3, 4, 12).permute(2, 0, 3, 1, 4)
            s = blk.attn.proj_l((q * blk.attn.scale @ k.transpose(-2, -1)).permute(0, 2, 3, 1))
            mixed = blk.attn.proj_w(s.permute(0, 3, 1, 2).softmax(-1).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
            torch.testing.assert_close(a, mixed, rtol=1e-5, atol=1e-6)
            assert a.shape == (2, 4, 16, 16) and r.u.shape == (2, 16, 48)
            negative = negative or bool((a < 0).any())
        else:  # class attention: one row from CLS over [CLS, patches], probabilities
            assert a.shape == (2, 4, 1, 17) and r.u.shape == r.h.shape == (2, 1, 48)
            assert (a >= 0).all()
            torch.testing.assert_close(a.sum(-1), torch.ones(2, 4, 1))
    assert negative  # the talking-heads mixing tensor is not a probability (why Gini and fallbacks use |A'|)
    assert rec.final.shape == (2, 17, 48)


def test_session_switches_class_attention_to_the_explicit_path_and_restores_it():
    model = _cait()
    flags = [blk.attn.fused_attn for blk in model.blocks_token_only]
    for blk in model.blocks_token_only:
        blk.attn.fused_attn = True
    adapter = vitlens.get_adapter(model)
    with pytest.raises(RuntimeError, match="inside"):
        with adapter.session(capture=True):
            assert not any(blk.attn.fused_attn for blk in model.blocks_token_only)
            raise RuntimeError("inside")
    assert all(blk.attn.fused_attn for blk in model.blocks_token_only)
    for blk, f in zip(model.blocks_token_only, flags):
        blk.attn.fused_attn = f


@pytest.mark.parametrize("method", ["gradskip", "rollout", "gae", "gradcam", "finercam"])
def test_maps_are_finite_and_batch_equals_one_by_one(method):
    model = _cait()
    x = _x(3)
    full = vitlens.explain(model, x, method=method)
    assert full.token_maps.shape == (3, 4, 4) and torch.isfinite(full.token_maps).all()
    assert full.token_maps.abs().sum() > 0
    for i in range(3):
        one = vitlens.explain(model, x[i:i + 1], method=method)
        torch.testing.assert_close(one.token_maps, full.token_maps[i:i + 1], rtol=1e-4, atol=1e-7)


def _rollout_reference(rec):
    """Reference for the vector form: the (1+N)x(1+N) matrices of every block (CA: the CLS row, identity on the
    patches; SA: identity on CLS) multiplied out, readout row of CLS."""
    from vitlens.explainers.rollout import fuse_heads

    n = rec.final.shape[1] - 1
    j = torch.eye(n + 1).expand(rec.final.shape[0], -1, -1)
    for i, r in enumerate(rec.blocks):
        a = r.attn.detach()
        m = torch.eye(n + 1).repeat(a.shape[0], 1, 1)
        if i < rec.self_attention:
            mag = a.abs() / a.abs().sum(-1, keepdim=True)
            sa = 0.5 * fuse_heads(mag) + 0.5 * torch.eye(n)
            m[:, 1:, 1:] = sa / sa.sum(-1, keepdim=True)
        else:
            m[:, 0] = 0.5 * fuse_heads(a)[:, 0] + 0.5 * torch.eye(n + 1)[0]
        j = m.bmm(j)
    return j[:, 0]


def test_rollout_is_the_readout_row_of_the_multiplied_out_matrices():
    model = _cait()
    x = _x(2)
    exp = vitlens.explain(model, x, method="rollout")
    adapter = vitlens.get_adapter(model)
    with adapter.session(capture=True) as rec, torch.no_grad():
        adapter.forward(x)
    row = _rollout_reference(rec)
    torch.testing.assert_close(exp.token_maps.flatten(1), row[:, 1:], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(exp.remainder, row[:, 0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(exp.token_maps.sum((1, 2)) + exp.remainder, torch.ones(2))


def test_gae_adds_the_class_attention_rows_then_the_self_attention_maps():
    model = _cait()
    x = _x(2)
    exp = vitlens.explain(model, x, method="gae", target=2)
    adapter = vitlens.get_adapter(model)
    with adapter.session(capture=True) as rec:
        logits = adapter.forward(x)
        attns = [r.attn for r in rec.blocks]
        grads = torch.autograd.grad(logits[:, 2].sum(), attns)
    n = 16
    r = torch.zeros(2, n + 1)
    r[:, 0] = 1.0
    mats = []
    for i, (a, g) in enumerate(zip(attns, grads)):
        mbar = (g * a.detach()).clamp_min(0).mean(1)
        m = torch.zeros(2, n + 1, n + 1)
        if i < 3:
            m[:, 1:, 1:] = mbar
        else:
            m[:, 0] = mbar[:, 0]
        mats.append(m)
    for m in reversed(mats):  # R = Π (I + M_l), last block leftmost: the readout row is e_CLS · R
        r = r + r[:, None, :].bmm(m)[:, 0]
    torch.testing.assert_close(exp.token_maps.flatten(1), r[:, 1:], rtol=1e-5, atol=1e-7)


def test_methods_whose_rules_do_not_apply_refuse_and_name_the_working_ones():
    model = _cait(depth=1, depth_token_only=1)
    for name in ("attnlrp", "cplrp", "transformer_attribution", "attn_gradcam", "vitcx", "tis", "mutex"):
        with pytest.raises(UnsupportedModelError, match="methods that work on this model: .*gradskip") as err:
            vitlens.explain(model, _x(1), method=name)
        assert "Cait" in str(err.value)
    with pytest.raises(UnsupportedModelError, match="talking-heads"):
        vitlens.explain(model, _x(1), method="attnlrp")


def test_a_cait_with_other_blocks_falls_back_to_model_agnostic_methods():
    from timm.layers import Attention

    model = _cait(depth=1, depth_token_only=1)
    model.blocks[0].attn = Attention(48, num_heads=4)
    assert vitlens.get_adapter(model).family == "generic"
    with pytest.raises(UnsupportedModelError, match="TalkingHeadAttn.*methods that work on this model: .*gradient"):
        vitlens.explain(model, _x(1), method="gradskip")
    assert torch.isfinite(vitlens.explain(model, _x(1), method="gradient").maps).all()
    no_class_attention = _cait(depth=1, depth_token_only=0)  # the head would read the learned CLS token only
    with pytest.raises(UnsupportedModelError, match="no class-attention blocks: the head reads the learned CLS"):
        vitlens.explain(no_class_attention, _x(1), method="gradskip")
    pooled = _cait(depth=2, depth_token_only=0, global_pool="avg")  # fine: the SA stage alone, patch mean readout
    exp = vitlens.explain(pooled, _x(2), method="gradskip")
    torch.testing.assert_close(exp.token_maps.sum((1, 2)).double() + exp.remainder.double(), exp.scores.double(),
                               rtol=1e-5, atol=1e-7)


def test_other_input_sizes_are_refused_clearly():
    with pytest.raises(vitlens.InputError, match="Cait expects 32x32 inputs; got 48x48"):
        vitlens.explain(_cait(1, 1), torch.randn(1, 3, 48, 48), method="gradskip")


def test_head_statistics_refuse_cait_clearly():
    from vitlens.metrics.heads import head_statistics

    with pytest.raises(UnsupportedModelError, match="head_statistics reads one attention matrix .*Cait"):
        head_statistics(_cait(1, 1), _x(1))
