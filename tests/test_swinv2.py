"""timm Swin Transformer V2 (``models/timm_swinv2.py``): the probabilities recorded are the scaled-cosine softmax
with the log-spaced continuous position bias the blocks compute, ``h`` is read where the post-norm block has it, and
GradSkip / rollout / GAE / Grad-CAM go through windows, padding and patch merging conserving what they promise, as
initialised and with trained-like parameters (non-zero q/v biases and CPB-MLP biases, norm weights ≠ 1)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import vitlens
from vitlens.models import get_adapter
from vitlens.models.families import trained_like
from vitlens.models.timm_swin import to_windows

timm = pytest.importorskip("timm")


def _swinv2(img: int = 32, trained: bool = True, seed: int = 0, **kw):
    torch.manual_seed(seed)
    model = timm.create_model("swinv2_tiny_window8_256", pretrained=False, img_size=img, patch_size=4, window_size=4,
                              embed_dim=24, depths=(2, 2), num_heads=(2, 4), num_classes=5, **kw).eval()
    return trained_like(model) if trained else model


def _x(n=2, img=32, seed=1):
    return torch.randn(n, 3, img, img, generator=torch.Generator().manual_seed(seed))


def _cosine_softmax(attn_mod, xw, mask):
    """SwinV2's window attention probabilities written out from its parameters: softmax(τ·cos(q, k) + 16σ(CPB))."""
    heads = attn_mod.num_heads
    bias = torch.cat((attn_mod.q_bias, attn_mod.k_bias, attn_mod.v_bias))
    qkv = F.linear(xw, attn_mod.qkv.weight, bias).reshape(xw.shape[0], xw.shape[1], 3, heads, -1).permute(2, 0, 3, 1, 4)
    q, k = qkv[0], qkv[1]
    logits = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
    logits = logits * torch.clamp(attn_mod.logit_scale, max=math.log(100.0)).exp()
    table = attn_mod.cpb_mlp(attn_mod.relative_coords_table).view(-1, heads)
    n = xw.shape[1]
    rpb = table[attn_mod.relative_position_index.view(-1)].view(n, n, heads).permute(2, 0, 1)
    logits = logits + 16 * torch.sigmoid(rpb)[None]
    if mask is not None:
        nw = mask.shape[0]
        logits = (logits.view(-1, nw, heads, n, n) + mask[None, :, None]).view(-1, heads, n, n)
    return logits.softmax(-1)


def test_recorded_probabilities_are_the_scaled_cosine_softmax_with_the_continuous_bias():
    from timm.models.swin_transformer_v2 import window_partition

    model = _swinv2()
    adapter = get_adapter(model)
    assert adapter.family == "timm-swinv2" and adapter.fallback_reason is None
    x = _x()
    with torch.no_grad():
        ref = model(x)
    with adapter.session(capture=True) as rec:
        logits = adapter.forward(x)
    torch.testing.assert_close(logits.detach(), ref, rtol=1e-5, atol=1e-6)
    blocks = adapter.blocks()
    shifted = [b for b in rec.blocks if any(b.shift)]
    assert shifted, "the tiny config has shifted-window blocks"
    for blk, b in zip(blocks, rec.blocks):
        gh, gw = b.grid
        u = b.u.detach().reshape(x.shape[0], gh, gw, -1)
        with torch.no_grad():
            shifted_u = torch.roll(u, shifts=(-b.shift[0], -b.shift[1]), dims=(1, 2))
            xw = window_partition(shifted_u, b.window).reshape(-1, b.window[0] * b.window[1], u.shape[-1])
            probs = _cosine_softmax(blk.attn, xw, blk.attn_mask)
            h = u + blk.norm1(blk._attn(u))  # post-norm: the MLP reads u + norm1(attention(u))
            v = F.linear(xw, blk.attn.qkv.weight[2 * u.shape[-1]:], blk.attn.v_bias)
            vnorm = v.reshape(*v.shape[:2], blk.attn.num_heads, -1).norm(dim=-1).permute(0, 2, 1)
        torch.testing.assert_close(b.attn.detach(), probs, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(b.h.detach(), h.reshape(x.shape[0], gh * gw, -1), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(b.vnorm, vnorm, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("trained", [False, True], ids=["init", "trained-like"])
@pytest.mark.parametrize("img", [32, 28, 56])
def test_gradskip_conserves_through_windows_padding_and_merges(img, trained):
    model = _swinv2(img=img, trained=trained)
    x = _x(3, img)
    exp = vitlens.explain(model, x, method="gradskip")
    y = exp.scores.double()
    torch.testing.assert_close(exp.token_maps.sum((1, 2)).double() + exp.remainder.double(), y, rtol=1e-5, atol=1e-6)
    totals = exp.extras["layer_totals"].double()
    torch.testing.assert_close(totals, y[:, None].expand_as(totals), rtol=1e-5, atol=1e-6)
    assert exp.token_maps.shape == (3, img // 4, img // 4)
    # padding tokens are zeros: inside a window they carry relevance only through a non-zero value bias (v_bias,
    # zero as initialised); at a patch merge of an odd grid (28 px: 7x7) they take a share in any case
    if img % 16 and (trained or (img // 4) % 2):
        assert exp.remainder.abs().sum() > 0
    elif img % 8 == 0 and not trained:
        assert exp.remainder.abs().max() == 0
    one = vitlens.explain(model, x[1:2], method="gradskip")
    torch.testing.assert_close(one.maps, exp.maps[1:2], rtol=1e-4, atol=1e-7)


def test_rollout_row_keeps_its_unit_mass_and_gae_differs_from_it():
    model = _swinv2()
    roll = vitlens.explain(model, _x(2), method="rollout")
    torch.testing.assert_close(roll.token_maps.sum((1, 2)), torch.ones(2), rtol=1e-5, atol=1e-6)
    gae = vitlens.explain(model, _x(2), method="gae")
    assert gae.token_maps.shape == (2, 8, 8) and torch.isfinite(gae.token_maps).all()
    assert not torch.allclose(gae.token_maps / gae.token_maps.sum((1, 2), keepdim=True), roll.token_maps)


def test_gradcam_reads_the_last_stage_before_the_final_norm():
    model = _swinv2()
    x = _x(2)
    exp = vitlens.explain(model, x, method="gradcam", target=torch.tensor([1, 3]))
    feats = model.layers(model.patch_embed(x)).detach().requires_grad_(True)
    logits = model.forward_head(model.norm(feats))
    g, = torch.autograd.grad(logits[[0, 1], [1, 3]].sum(), feats)
    cam = (feats * g.mean((1, 2), keepdim=True)).sum(-1).clamp_min(0)
    torch.testing.assert_close(exp.token_maps, cam.detach(), rtol=1e-4, atol=1e-6)


def test_other_sizes_only_with_strict_img_size_false():
    with pytest.raises(vitlens.InputError, match="expects 32x32 inputs; got 40x40"):
        vitlens.explain(_swinv2(), _x(1, 40), method="gradskip")
    model = _swinv2(strict_img_size=False)
    exp = vitlens.explain(model, _x(2, 40), method="gradskip")
    total = exp.token_maps.sum((1, 2)).double() + exp.remainder.double()
    torch.testing.assert_close(total, exp.scores.double(), rtol=1e-5, atol=1e-6)


def test_lrp_and_token_dropping_are_refused_with_the_windowed_reason():
    model = _swinv2()
    with pytest.raises(vitlens.UnsupportedModelError, match="windowed.*methods that work on this model: .*gradskip"):
        vitlens.explain(model, _x(1), method="cplrp")
    with pytest.raises(vitlens.UnsupportedModelError, match="tokens cannot be dropped"):
        vitlens.explain(model, _x(1), method="mutex")


# -- HuggingFace Swinv2ForImageClassification ------------------------------------------------------------------------

def _hf_swinv2(img: int = 32, trained: bool = True, seed: int = 0):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    cfg = transformers.Swinv2Config(image_size=img, patch_size=4, embed_dim=24, depths=[2, 2], num_heads=[2, 4],
                                    window_size=4, num_labels=5)
    model = transformers.Swinv2ForImageClassification(cfg).eval()
    return trained_like(model) if trained else model


def test_hf_recording_is_what_each_post_norm_layer_computes():
    """28 px: a padded, shifted first stage (HF pads, then shifts). Every layer's attention input is the recorded
    partition of u itself (post-norm: no norm before the attention), the recorded probabilities are the
    scaled-cosine softmax with the continuous bias, and h = u + layernorm_before(attention output)."""
    model = _hf_swinv2(img=28)
    adapter = get_adapter(model)
    assert adapter.family == "hf-swinv2" and adapter.fallback_reason is None
    x = _x(2, 28, seed=2)
    seen: dict = {}
    handles = []
    for i, blk in enumerate(adapter.blocks()):
        handles.append(blk.attention.register_forward_pre_hook(lambda m, a, i=i: seen.__setitem__((i, 0), a)))
        handles.append(blk.layernorm_before.register_forward_hook(lambda m, a, o, i=i: seen.__setitem__((i, 1), o)))
    try:
        with torch.no_grad():
            ref = model(pixel_values=x).logits
        with adapter.session(capture=True) as rec:
            logits = adapter.forward(x)
    finally:
        for hnd in handles:
            hnd.remove()
    torch.testing.assert_close(logits.detach(), ref, rtol=1e-5, atol=1e-6)
    assert any(any(b.shift) for b in rec.blocks)
    for i, (blk, b) in enumerate(zip(adapter.blocks(), rec.blocks)):
        windows, mask = seen[(i, 0)][0].detach(), seen[(i, 0)][1]
        grid = b.u.detach().reshape(2, *b.grid, -1).permute(3, 0, 1, 2)
        mine = torch.stack([to_windows(c, b.shift, b.window, b.pad_first)[0] for c in grid], dim=-1)
        assert b.pad_first and torch.equal(mine, windows), i
        att = blk.attention.self
        heads, n = att.num_attention_heads, windows.shape[1]
        with torch.no_grad():
            q = att.query(windows).view(windows.shape[0], n, heads, -1).transpose(1, 2)
            k = att.key(windows).view(windows.shape[0], n, heads, -1).transpose(1, 2)
            logits_ = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
            logits_ = logits_ * torch.clamp(att.logit_scale, max=math.log(100.0)).exp()
            table = att.continuous_position_bias_mlp(att.relative_coords_table).view(-1, heads)
            rpb = table[att.relative_position_index.view(-1)].view(n, n, heads).permute(2, 0, 1)
            logits_ = logits_ + 16 * torch.sigmoid(rpb)[None]
            if mask is not None:  # transformers adds the shift mask twice; -100 or -200 both vanish in the softmax
                nw = mask.shape[0]
                logits_ = (logits_.view(-1, nw, heads, n, n) + 2 * mask[None, :, None]).view(-1, heads, n, n)
            probs = logits_.softmax(-1)
        torch.testing.assert_close(b.attn.detach(), probs, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(b.h.detach(), b.u.detach() + seen[(i, 1)].detach(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("trained", [False, True], ids=["init", "trained-like"])
@pytest.mark.parametrize("img", [32, 28, 56])
def test_hf_gradskip_conserves_at_any_multiple_of_the_patch(img, trained):
    model = _hf_swinv2(trained=trained)  # built for 32 px: other sizes pad to the windows fixed at build time
    x = _x(2, img)
    exp = vitlens.explain(model, x, method="gradskip")
    y = exp.scores.double()
    torch.testing.assert_close(exp.token_maps.sum((1, 2)).double() + exp.remainder.double(), y, rtol=1e-5, atol=1e-6)
    totals = exp.extras["layer_totals"].double()
    torch.testing.assert_close(totals, y[:, None].expand_as(totals), rtol=1e-5, atol=1e-6)
    assert exp.token_maps.shape == (2, img // 4, img // 4)
    with pytest.raises(vitlens.InputError, match="not a multiple of the patch size"):
        vitlens.explain(model, _x(1, 30), method="gradskip")


def test_hf_gradcam_reads_the_last_stage_before_the_final_layernorm():
    model = _hf_swinv2()
    x = _x(2)
    exp = vitlens.explain(model, x, method="gradcam", target=torch.tensor([1, 3]))
    with torch.no_grad():
        emb, dims = model.swinv2.embeddings(x)
        out = model.swinv2.encoder(emb, dims).last_hidden_state
    feats = out.detach().requires_grad_(True)
    pooled = model.swinv2.pooler(model.swinv2.layernorm(feats).transpose(1, 2)).flatten(1)
    logits = model.classifier(pooled)
    g, = torch.autograd.grad(logits[[0, 1], [1, 3]].sum(), feats)
    cam = (feats * g.mean(1, keepdim=True)).sum(-1).clamp_min(0).reshape(2, 4, 4)
    torch.testing.assert_close(exp.token_maps, cam.detach(), rtol=1e-4, atol=1e-6)
