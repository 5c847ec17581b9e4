"""The None cases that strict-optional type checking spelled out (issue #23, item 9): an adapter whose capture
hooks leave a declared tensor unrecorded, and adapter layouts that lack a part, fail with one clear vitlens error
instead of an ``AttributeError``/``TypeError`` on ``None`` deep inside a method."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import vitlens
from vitlens.errors import UnsupportedModelError
from vitlens.models import TimmCNNAdapter
from vitlens.models.base import BlockRecord, Recording, recorded
from vitlens.models.timm_vit import TimmViTAdapter

from conftest import tiny_vit


class _ForgetfulAdapter(TimmViTAdapter):
    """Declares what the timm ViT adapter declares, but its capture records empty blocks (a half-written adapter)."""

    def _install_capture(self, rec: Recording, hooks: list) -> None:
        rec.blocks.extend(BlockRecord() for _ in self.blocks())


def test_recorded_returns_the_value_or_names_what_is_missing():
    t = torch.ones(2)
    assert recorded(t, "attention") is t
    with pytest.raises(UnsupportedModelError, match="the model's recording has no attention: its adapter declares"):
        recorded(None, "attention")


@pytest.mark.parametrize("method", ["gae", "rollout", "transformer_attribution", "attnlrp", "gradskip", "attn_gradcam"])
def test_a_method_on_an_adapter_that_records_nothing_names_the_missing_tensor(method):
    adapter = _ForgetfulAdapter(tiny_vit())
    with pytest.raises(UnsupportedModelError, match="the model's recording has no |the adapter captured no "):
        vitlens.explain(adapter, torch.rand(1, 3, 32, 32), method=method)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in adapter.model.modules())


def test_a_cnn_adapter_without_a_global_pool_is_refused_with_its_reason():
    class NoPool(nn.Module):
        feature_info = [{"reduction": 32}]
        global_pool = None

    with pytest.raises(UnsupportedModelError, match="no global-pool module"):
        TimmCNNAdapter(NoPool())
