"""Swin (timm): the window layout GradSkip, rollout and GAE use is the one the blocks use, and relevance is
conserved through shifted windows, padding and patch merging."""

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


@pytest.mark.parametrize("img,depths", [(32, (2, 2)), (28, (2, 2)), (56, (2, 2))])
def test_gradskip_conserves_through_windows_padding_and_merges(img, depths):
    model = _swin(img=img, depths=depths)
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


def test_gradcam_reads_the_last_stage_the_classifier_pools():
    model = _swin()
    x = torch.randn(2, 3, 32, 32)
    exp = vitlens.explain(model, x, method="gradcam", target=torch.tensor([1, 3]))
    feats = model.layers(model.patch_embed(x)).detach().requires_grad_(True)  # (B, 4, 4, C) before the final norm
    logits = model.forward_head(model.norm(feats))
    g, = torch.autograd.grad(logits[[0, 1], [1, 3]].sum(), feats)
    cam = (feats * g.mean((1, 2), keepdim=True)).sum(-1).clamp_min(0)
    torch.testing.assert_close(exp.token_maps, cam.detach(), rtol=1e-4, atol=1e-6)


def test_unsupported_methods_say_why_and_name_the_working_ones():
    model = _swin()
    with pytest.raises(vitlens.UnsupportedModelError, match="windowed.*methods that work on this model: .*gradskip"):
        vitlens.explain(model, torch.randn(1, 3, 32, 32), method="attnlrp")
    with pytest.raises(vitlens.UnsupportedModelError, match="tokens cannot be dropped"):
        vitlens.explain(model, torch.randn(1, 3, 32, 32), method="tis")
    assert get_adapter(model).feature_grid((32, 32)) == (4, 4)
