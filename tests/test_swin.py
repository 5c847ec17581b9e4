"""Swin (timm and HuggingFace): the window layout GradSkip, rollout and GAE use is the one the blocks use, and
relevance is conserved through shifted windows, padding and patch merging."""

from __future__ import annotations

import pytest
import torch

timm = pytest.importorskip("timm")

import vitlens  # noqa: E402
from vitlens.models import get_adapter  # noqa: E402
from vitlens.models.timm_swin import from_windows, to_windows  # noqa: E402


def _swin(img: int = 32, window: int = 4, depths=(2, 2), seed: int = 0):
    torch.manual_seed(seed)
    return timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, img_size=img, patch_size=4,
                             window_size=window, embed_dim=24, depths=depths, num_heads=(2, 4),
                             num_classes=5).eval()


@pytest.mark.parametrize("grid,window,shift", [((8, 8), (4, 4), (2, 2)), ((7, 7), (4, 4), (2, 2)),
                                               ((8, 8), (4, 4), (0, 0)), ((6, 9), (3, 3), (1, 1))])
def test_windows_match_timms_own_partition(grid, window, shift):
    from timm.models.swin_transformer import window_partition

    b = 2
    idx = torch.arange(b * grid[0] * grid[1], dtype=torch.float64).reshape(b, grid[0], grid[1]) + 1
    mine, padded = to_windows(idx, shift, window)
    # what a SwinTransformerBlock does to its (B, H, W, C) input before attention
    x = torch.roll(idx[..., None], shifts=(-shift[0], -shift[1]), dims=(1, 2))
    ph, pw = (-grid[0]) % window[0], (-grid[1]) % window[1]
    x = torch.nn.functional.pad(x, (0, 0, 0, pw, 0, ph))
    theirs = window_partition(x, window).reshape(-1, window[0] * window[1])
    assert torch.equal(mine, theirs) and padded == (grid[0] + ph, grid[1] + pw)
    back, lost = from_windows(mine, b, grid, padded, shift, window)
    assert torch.equal(back, idx) and torch.equal(lost, torch.zeros(b, dtype=torch.float64))


def test_gradcam_reads_the_last_stage_the_classifier_pools():
    model = _swin()
    x = torch.randn(2, 3, 32, 32)
    exp = vitlens.explain(model, x, method="gradcam", target=torch.tensor([1, 3]))
    feats = model.layers(model.patch_embed(x)).detach().requires_grad_(True)  # (B, 4, 4, C) before the final norm
    logits = model.forward_head(model.norm(feats))
    g, = torch.autograd.grad(logits[[0, 1], [1, 3]].sum(), feats)
    cam = (feats * g.mean((1, 2), keepdim=True)).sum(-1).clamp_min(0)
    torch.testing.assert_close(exp.token_maps, cam.detach(), rtol=1e-4, atol=1e-6)


# -- HuggingFace SwinForImageClassification -------------------------------------------------------------------------

def _hf_swin(img: int = 32, window: int = 4, depths=(2, 2), seed: int = 0):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    cfg = transformers.SwinConfig(image_size=img, patch_size=4, embed_dim=24, depths=list(depths), num_heads=[2, 4],
                                  window_size=window, num_labels=5)
    model = transformers.SwinForImageClassification(cfg).eval()
    with torch.no_grad():  # zeros at init: make the relative position bias matter
        for name, p in model.named_parameters():
            if name.endswith("relative_position_bias_table"):
                p.normal_(0.0, 1.0)
    return model


@pytest.mark.parametrize("grid,window,shift", [((8, 8), (4, 4), (2, 2)), ((7, 7), (4, 4), (2, 2)),
                                               ((8, 8), (4, 4), (0, 0)), ((6, 9), (3, 3), (1, 1))])
def test_windows_match_hfs_own_partition(grid, window, shift):
    """HF pads the grid first, then shifts the padded grid (timm: the other way round)."""
    pytest.importorskip("transformers")
    from transformers.models.swin.modeling_swin import window_partition

    b = 2
    idx = torch.arange(b * grid[0] * grid[1], dtype=torch.float64).reshape(b, grid[0], grid[1]) + 1
    mine, padded = to_windows(idx, shift, window, pad_first=True)
    # what a SwinLayer does to its (B, H, W, C) input before attention: maybe_pad, cyclic_shift, window_partition
    ph, pw = (-grid[0]) % window[0], (-grid[1]) % window[1]
    x = torch.nn.functional.pad(idx[..., None], (0, 0, 0, pw, 0, ph))
    x = torch.roll(x, shifts=(-shift[0], -shift[1]), dims=(1, 2))
    theirs = window_partition(x, window[0]).reshape(-1, window[0] * window[1])
    assert torch.equal(mine, theirs) and padded == (grid[0] + ph, grid[1] + pw)
    if any(shift) and (ph or pw):  # the order matters exactly when a shifted grid is padded
        assert not torch.equal(mine, to_windows(idx, shift, window)[0])
    back, lost = from_windows(mine, b, grid, padded, shift, window, pad_first=True)
    assert torch.equal(back, idx) and torch.equal(lost, torch.zeros(b, dtype=torch.float64))


def test_hf_recording_is_the_layout_each_layer_feeds_its_attention():
    """In a session, every layer's attention input equals the recorded partition of its normalised grid, with the
    shift and window the layer used at run time (28 px: a padded, shifted first stage; the second stage's grid is
    not larger than the window, so HF turns its shift off)."""
    model = _hf_swin(img=28)
    adapter = get_adapter(model)
    x = torch.randn(2, 3, 28, 28, generator=torch.Generator().manual_seed(2))
    seen = {}
    handles = []
    for i, blk in enumerate(adapter.blocks()):
        handles.append(blk.layernorm_before.register_forward_hook(lambda m, a, o, i=i: seen.__setitem__((i, 0), o)))
        handles.append(blk.attention.register_forward_pre_hook(lambda m, a, i=i: seen.__setitem__((i, 1), a[0])))
    try:
        with adapter.session(capture=True) as rec:
            adapter.forward(x)
    finally:
        for hnd in handles:
            hnd.remove()
    assert [(b.grid, b.shift, b.window) for b in rec.blocks] == [((7, 7), (0, 0), (4, 4)), ((7, 7), (2, 2), (4, 4)),
                                                                 ((4, 4), (0, 0), (4, 4)), ((4, 4), (0, 0), (4, 4))]
    for i, b in enumerate(rec.blocks):
        normed, windows = seen[(i, 0)].detach(), seen[(i, 1)].detach()
        grid = normed.reshape(2, *b.grid, -1).permute(3, 0, 1, 2)  # (C, B, H, W): one map per channel
        mine = torch.stack([to_windows(c, b.shift, b.window, b.pad_first)[0] for c in grid], dim=-1)
        assert b.pad_first and torch.equal(mine, windows), i
        assert b.attn.shape == (windows.shape[0], b.attn.shape[1], windows.shape[1], windows.shape[1])
    assert rec.merges[0] is None and rec.merges[1].shape == (2, 7, 7, 24) and rec.final.shape == (2, 16, 48)


def test_hf_gradcam_reads_the_last_stage_before_the_final_layernorm():
    model = _hf_swin()
    x = torch.randn(2, 3, 32, 32)
    exp = vitlens.explain(model, x, method="gradcam", target=torch.tensor([1, 3]))
    with torch.no_grad():
        emb, dims = model.swin.embeddings(x)
        out = model.swin.encoder(emb, dims).last_hidden_state  # (B, 16, C): the last stage, before the layernorm
    feats = out.detach().requires_grad_(True)
    pooled = model.swin.pooler(model.swin.layernorm(feats).transpose(1, 2)).flatten(1)
    logits = model.classifier(pooled)
    g, = torch.autograd.grad(logits[[0, 1], [1, 3]].sum(), feats)
    cam = (feats * g.mean(1, keepdim=True)).sum(-1).clamp_min(0).reshape(2, 4, 4)
    torch.testing.assert_close(exp.token_maps, cam.detach(), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(exp.scores, logits.detach()[[0, 1], [1, 3]], rtol=1e-5, atol=1e-6)


def test_hf_inputs_whose_grid_is_smaller_than_the_window_are_refused_before_the_model_runs():
    model = _hf_swin()
    windows = [(b.shift_size, b.window_size) for b in get_adapter(model).blocks()]
    with pytest.raises(vitlens.InputError, match="stage 1 a 2x2 token grid, smaller than its 4x4 window.*at least 28x28"):
        vitlens.explain(model, torch.randn(1, 3, 16, 16), method="gradskip")
    with pytest.raises(vitlens.InputError, match="not a multiple of the patch size 4x4"):
        vitlens.explain(model, torch.randn(1, 3, 34, 34), method="gradskip")
    assert [(b.shift_size, b.window_size) for b in get_adapter(model).blocks()] == windows  # HF's window not shrunk


# -- both families ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("img", [32, 28, 56])
@pytest.mark.parametrize("build", [_swin, _hf_swin], ids=["timm", "hf"])
def test_gradskip_conserves_through_windows_padding_and_merges(build, img):
    model = build(img=img)
    x = torch.randn(3, 3, img, img, generator=torch.Generator().manual_seed(1))
    exp = vitlens.explain(model, x, method="gradskip")
    y = exp.scores.double()
    torch.testing.assert_close(exp.token_maps.sum((1, 2)).double() + exp.remainder.double(), y, rtol=1e-5, atol=1e-6)
    totals = exp.extras["layer_totals"].double()
    torch.testing.assert_close(totals, y[:, None].expand_as(totals), rtol=1e-5, atol=1e-6)
    assert exp.token_maps.shape == (3, img // 4, img // 4)
    if img % 16:  # odd grids: padding tokens take part, their share is the remainder
        assert exp.remainder.abs().sum() > 0
    one = vitlens.explain(model, x[1:2], method="gradskip")
    torch.testing.assert_close(one.maps, exp.maps[1:2], rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("build,family", [(_swin, "timm-swin"), (_hf_swin, "hf-swin")], ids=["timm", "hf"])
def test_unsupported_methods_say_why_and_name_the_working_ones(build, family):
    model = build()
    with pytest.raises(vitlens.UnsupportedModelError, match="windowed.*methods that work on this model: .*gradskip"):
        vitlens.explain(model, torch.randn(1, 3, 32, 32), method="attnlrp")
    with pytest.raises(vitlens.UnsupportedModelError, match="tokens cannot be dropped"):
        vitlens.explain(model, torch.randn(1, 3, 32, 32), method="tis")
    adapter = get_adapter(model)
    assert adapter.family == family and adapter.feature_grid((32, 32)) == (4, 4)
