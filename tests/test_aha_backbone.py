"""AHA with a backbone other than the target: the target's input is re-normalised (and resized) for the backbone, and
a target whose preprocessing vitlens cannot tell gets a warning, never a silent pass-through."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vitlens.aha.network import AHANet
from vitlens.models import get_adapter

timm = pytest.importorskip("timm")


def _vit(img_size: int, **kw) -> nn.Module:
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=img_size, patch_size=8, depth=2,
                             num_classes=3, **kw).eval()


class Pixels(nn.Module):
    """A classifier of no known family (no data config)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.mean(dim=(2, 3)))


def test_the_backbone_gets_the_input_in_its_own_normalisation_and_size():
    target, backbone = _vit(32), _vit(48)
    backbone.vitlens_data_config = {"mean": (0.5, 0.5, 0.5), "std": (0.25, 0.25, 0.25)}
    net = AHANet(target, backbone=backbone, n_levels=2, seed=0)
    x = torch.randn(2, 3, 32, 32)
    y = net._backbone_input(x)
    assert tuple(y.shape) == (2, 3, 48, 48)  # the backbone has a fixed 48-px input
    src = get_adapter(target).data_config()
    pixels = x * torch.tensor(src.std).view(1, 3, 1, 1) + torch.tensor(src.mean).view(1, 3, 1, 1)
    expected = torch.nn.functional.interpolate((pixels - 0.5) / 0.25, size=(48, 48), mode="bilinear",
                                               align_corners=False)
    torch.testing.assert_close(y, expected)
    feats, logits = net.features(x)
    assert logits.shape == (2, 3) and all(torch.isfinite(f).all() for f in feats)


def test_a_dynamic_size_backbone_keeps_the_input_size():
    target, backbone = _vit(32), _vit(48, dynamic_img_size=True)
    net = AHANet(target, backbone=backbone, n_levels=2, seed=0)
    assert get_adapter(backbone).any_size
    assert tuple(net._backbone_input(torch.randn(1, 3, 32, 32)).shape) == (1, 3, 32, 32)


def test_a_target_of_unknown_preprocessing_warns_and_passes_the_input_as_it_is():
    net = AHANet(Pixels(), backbone=_vit(32), n_levels=2, num_classes=3, seed=0)
    x = torch.randn(2, 3, 32, 32)
    with pytest.warns(RuntimeWarning, match="not re-normalised.*Pixels"):
        y = net._backbone_input(x)
    assert torch.equal(y, x)


def test_the_architecture_name_is_timms_else_the_class_name():
    from vitlens.aha import shipped_explainer
    from vitlens.aha.card import model_name

    assert get_adapter(_vit(32)).architecture() == "vit_tiny_patch16_224" == model_name(_vit(32))
    assert get_adapter(Pixels()).architecture() == "Pixels"
    assert shipped_explainer(Pixels()) is None
