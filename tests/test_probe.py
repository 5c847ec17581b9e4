"""vitlens.models.LinearProbe: a HF backbone (DINOv3, DINOv2) with a linear head, as users build it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

import vitlens  # noqa: E402
from vitlens.errors import InputError, UnsupportedModelError  # noqa: E402
from vitlens.models import LinearProbe, get_adapter  # noqa: E402
from vitlens.models.families import _H  # noqa: E402


def _dinov3(registers: int = 4):
    import transformers

    torch.manual_seed(0)
    return transformers.DINOv3ViTModel(transformers.DINOv3ViTConfig(**_H, num_register_tokens=registers)).eval()


@pytest.mark.parametrize("readout", ["cls", "mean", "cls+mean"])
def test_forward_is_the_head_on_the_stated_readout(readout):
    bb = _dinov3()
    head = nn.Linear(48 * (2 if readout == "cls+mean" else 1), 3)
    m = LinearProbe(bb, head, readout=readout).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        seq = bb(pixel_values=x).last_hidden_state
        cls, patches = seq[:, 0], seq[:, 5:]  # CLS, 4 registers, then 16 patch tokens
        feat = {"cls": cls, "mean": patches.mean(1), "cls+mean": torch.cat([cls, patches.mean(1)], -1)}[readout]
        torch.testing.assert_close(m(x), head(feat))
    a = get_adapter(m)
    assert a.family == "hf-dinov3" and a.num_prefix_tokens == 5 and a.num_classes == 3
    assert a.readout_tokens == ((0,) if readout == "cls" else None)
    exp = vitlens.explain(m, x, method="gradskip")
    assert exp.maps.shape == (2, 32, 32) and torch.isfinite(exp.maps).all()


def test_bad_probes_are_refused_clearly():
    with pytest.raises(InputError, match="readout must be one of"):
        LinearProbe(_dinov3(), nn.Linear(48, 3), readout="pooled")
    with pytest.raises(InputError, match="transformers backbone"):
        LinearProbe(nn.Identity(), nn.Linear(48, 3))
    headless = LinearProbe(_dinov3(), nn.Identity()).eval()
    assert get_adapter(headless).family == "generic"  # model-agnostic methods still run; relevance methods say why
    with pytest.raises(UnsupportedModelError, match="no nn.Linear.*methods that work on this model: .*rise"):
        vitlens.explain(headless, torch.randn(1, 3, 32, 32), method="gradskip")
    with pytest.raises(UnsupportedModelError, match="RoPE"):
        vitlens.explain(LinearProbe(_dinov3(), nn.Linear(48, 3)).eval(), torch.randn(1, 3, 32, 32), method="attnlrp")
