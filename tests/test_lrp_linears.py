"""The linear maps the LRP methods act on are declared by the adapters (Adapter.lrp_linears), not guessed from the
order of calls: each family names its own, a linear map a block calls without its adapter declaring it is refused
with the reason, and the model comes back unchanged."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import vitlens
from vitlens.errors import UnsupportedModelError
from vitlens.models import families as catalogue, get_adapter
from vitlens.models.base import linears_at

from conftest import model_fingerprint

timm = pytest.importorskip("timm")


def _vit() -> nn.Module:
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
                             num_classes=4).eval()


@pytest.mark.parametrize("name", ["timm ViT", "HF ViT", "HF DINOv2", "HF CLIP", "HF SigLIP"])
def test_every_lrp_family_declares_one_set_of_maps_per_block(name):
    adapter = get_adapter(catalogue.build(name))
    declared = adapter.lrp_linears()
    assert len(declared) == len(adapter.blocks())
    for blk, maps in zip(adapter.blocks(), declared):
        inside = {id(m) for m in blk.modules()}
        mods = [*maps.qkv, maps.proj, maps.fc1, maps.fc2]
        assert all(isinstance(m, nn.Linear) and id(m) in inside for m in mods)
        assert len(maps.qkv) in (1, 3) and len({id(m) for m in mods}) == len(mods)
        assert maps.fc1.out_features == maps.fc2.in_features


def test_a_family_without_declared_maps_says_so():
    with pytest.raises(UnsupportedModelError, match="declares no linear maps for LRP rules"):
        get_adapter(catalogue.build("timm Swin")).lrp_linears()
    with pytest.raises(UnsupportedModelError, match=r"block 0 \(Block\): no nn.Linear MLP input map at mlp.gate"):
        linears_at(_vit().blocks[0], 0, qkv=[("attn.qkv",)], proj=("attn.proj",), fc1=("mlp.gate",), fc2=("mlp.fc2",))


@pytest.mark.parametrize("method", ["cplrp", "attnlrp", "transformer_attribution"])
def test_an_undeclared_linear_map_inside_a_block_is_refused_and_the_model_restored(method):
    model = _vit()
    mlp = model.blocks[1].mlp
    mlp.act = nn.Sequential(mlp.act, nn.Linear(mlp.fc1.out_features, mlp.fc1.out_features))  # not declared
    before = model_fingerprint(model)
    x = torch.randn(2, 3, 32, 32)
    with pytest.raises(UnsupportedModelError, match="block 1 calls a linear map .* not one of the q/k/v"):
        vitlens.explain(model, x, method=method)
    assert model_fingerprint(model) == before


def test_three_separate_projections_give_the_same_map_in_a_batch_and_one_by_one():
    """CP-LRP on timm ViT (one fused qkv) is pinned by the golden test; CLIP declares three projections (registered
    in the order k, v, q), which must resolve to the same map whether the images come in a batch or one by one."""
    model = catalogue.build("HF CLIP")
    x = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    whole = vitlens.explain(model, x, method="cplrp").maps
    single = torch.cat([vitlens.explain(model, x[i : i + 1], method="cplrp").maps for i in range(3)])
    torch.testing.assert_close(whole, single, rtol=1e-4, atol=1e-6)
    assert torch.isfinite(whole).all() and whole.abs().sum() > 0


def test_a_linear_map_after_the_blocks_that_is_not_the_declared_head_is_refused():
    model = _vit()
    model.fc_norm, model.head = nn.Linear(model.embed_dim, 4), nn.Identity()  # logits from a map that is no head
    before = model_fingerprint(model)
    with pytest.raises(UnsupportedModelError, match="classifier head"):
        vitlens.explain(model, torch.randn(1, 3, 32, 32), method="transformer_attribution")
    assert model_fingerprint(model) == before
