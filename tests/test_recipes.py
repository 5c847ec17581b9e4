"""The two recipes of docs/architecture.md, followed in this file only (no edit anywhere else): a new method
(declares what it needs, registered with one decorator) and a new model family (an adapter for a toy transformer,
registered with one call). Both are swept like the built-in ones: what the support query lists runs, the rest is
refused by the one refusal path."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

import vitlens
from vitlens.errors import UnsupportedModelError
from vitlens.explainers import Explainer, get_method
from vitlens.explainers.base import Attribution
from vitlens.explainers.registry import method_classes, register, unregister
from vitlens.explainers.support import why_not, working_methods
from vitlens.models import Adapter, register_adapter, unregister_adapter
from vitlens.models._sequence import BlockParts, SequenceAdapter, value_weights
from vitlens.models.base import LRPLinears, linears_at
from vitlens.models.capabilities import ATTENTION, LINEAR_HEAD, LRP_LINEARS, TOKEN_SEQUENCE, TOKENS
from vitlens.models.families import build
from vitlens.targets import Target


# -- recipe 1: a new method ---------------------------------------------------------------------------------------
class RawAttention(Explainer):
    """The readout row of the last block's head-mean attention (a baseline)."""

    name = "raw_attention_recipe"
    description = "the last block's head-mean attention, readout row"
    needs = (ATTENTION, TOKEN_SEQUENCE)
    level = "token"
    defaults: dict[str, Any] = {}

    def attribute(self, adapter: Adapter, x: Tensor, target: Target) -> tuple[Attribution, Tensor, Target]:
        with adapter.session(capture=True) as rec, torch.no_grad():
            logits = adapter.forward(x)
            tgt = self.resolve_target(target, logits)
            attn = rec.blocks[-1].attn.mean(1)  # (B, T, T)
        p = adapter.num_prefix_tokens
        rows = attn[:, list(adapter.readout_tokens or [0])].mean(1) if adapter.readout_tokens else attn.mean(1)
        return Attribution(values=self.on_grid(adapter, rows[:, p:], tuple(x.shape[-2:]))), logits.detach(), tgt


@pytest.fixture
def new_method():
    register(RawAttention)
    try:
        yield RawAttention.name
    finally:
        unregister(RawAttention.name)


def test_a_new_method_is_one_class_and_one_registration(new_method):
    vit, swin = build("timm ViT"), build("timm Swin")
    assert new_method in working_methods(vit) and new_method not in working_methods(swin)
    exp = vitlens.explain(vit, torch.randn(2, 3, 32, 32), method=new_method)
    assert exp.token_maps.shape == (2, 4, 4) and torch.isfinite(exp.maps).all()
    with pytest.raises(UnsupportedModelError, match=f"method '{new_method}' needs 'token_sequence'.*windowed"):
        vitlens.explain(swin, torch.randn(1, 3, 32, 32), method=new_method)
    info = {i.name: i.description for i in vitlens.describe_methods()}
    assert info[new_method] == RawAttention.description


# -- recipe 2: a new model family ---------------------------------------------------------------------------------
class ToyAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.num_heads = heads
        self.qkv, self.proj, self.softmax = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim), nn.Softmax(dim=-1)

    def forward(self, x: Tensor) -> Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, d // self.num_heads).permute(2, 0, 3, 1, 4)
        attn = self.softmax(q @ k.transpose(-2, -1) * (d // self.num_heads) ** -0.5)
        return self.proj((attn @ v).transpose(1, 2).reshape(b, n, d))


class ToyBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.attn, self.norm2 = nn.LayerNorm(dim), ToyAttention(dim, heads), nn.LayerNorm(dim)
        self.mlp = nn.Sequential()
        self.mlp.fc1, self.mlp.act, self.mlp.fc2 = nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ToyViT(nn.Module):
    """A CLS-token ViT written from scratch: 32×32 inputs, 8×8 patches, two blocks."""

    def __init__(self, dim: int = 32, heads: int = 4, classes: int = 5) -> None:
        super().__init__()
        self.embed_dim = dim  # the token width (AHA reads it)
        self.embed = nn.Conv2d(3, dim, 8, 8)
        self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.1)
        self.pos = nn.Parameter(torch.randn(1, 17, dim) * 0.1)
        self.pos_drop = nn.Identity()  # where the tokens are complete (tokens may be dropped after it)
        self.blocks = nn.ModuleList([ToyBlock(dim, heads) for _ in range(2)])
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, classes)
        for m in self.modules():  # zero biases, as timm initialises its linears (LRP's bias terms vanish)
            if isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)

    def forward(self, x: Tensor) -> Tensor:
        t = self.embed(x).flatten(2).transpose(1, 2)
        t = self.pos_drop(torch.cat([self.cls.expand(t.shape[0], -1, -1), t], 1) + self.pos)
        for blk in self.blocks:
            t = blk(t)
        return self.head(self.norm(t)[:, 0])


class ToyAdapter(SequenceAdapter):
    """The toy family: describe the layout and the blocks; the capture is SequenceAdapter's."""

    family = "toy-vit"
    capabilities = SequenceAdapter.capabilities | {LRP_LINEARS, LINEAR_HEAD, TOKENS}

    @staticmethod
    def matches(model: nn.Module) -> bool:
        return isinstance(model, ToyViT)

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.num_prefix_tokens, self.readout_tokens, self.num_classes = 1, (0,), int(self.model.head.out_features)
        self.patch_size, self.in_chans, self.default_size, self.any_size = (8, 8), 3, (32, 32), False

    def parts(self) -> list[BlockParts]:
        return [BlockParts(block=b, attention=b.attn, probs_at=b.attn.softmax, probs_index=None, norm2=b.norm2,
                           value=value_weights(b.attn), heads=b.attn.num_heads) for b in self.model.blocks]

    def lrp_linears(self) -> list[LRPLinears]:
        return [linears_at(b, i, qkv=[("attn.qkv",)], proj=("attn.proj",), fc1=("mlp.fc1",), fc2=("mlp.fc2",))
                for i, b in enumerate(self.model.blocks)]

    def classifier_modules(self) -> list[nn.Module]:
        return [self.model.head]

    def _embedding_module(self) -> nn.Module:
        return self.model.pos_drop


@pytest.fixture
def toy():
    register_adapter(ToyAdapter)
    try:
        torch.manual_seed(0)
        yield ToyViT().eval()
    finally:
        unregister_adapter(ToyAdapter)


def test_a_new_family_is_one_adapter_and_one_registration(toy):
    assert vitlens.get_adapter(toy).family == "toy-vit"
    working = working_methods(toy)
    # a plain ViT block: every method applies but the two whose needs go past the blocks' parts (LeGrad reads the
    # head from any block's stream; ViT-Shapley masks attention), which the toy adapter does not claim
    assert set(method_classes()) - set(working) == {"legrad", "vit_shapley"}
    assert "stream_head" in why_not(toy, "legrad") and "attention_mask" in why_not(toy, "vit_shapley")
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    exp = vitlens.explain(toy, x, method="gradskip")
    total = exp.token_maps.sum((1, 2)).double() + exp.remainder.double()
    torch.testing.assert_close(total, exp.scores.double(), rtol=1e-5, atol=1e-6)
    for name in working:
        opts = {"explainer": "untrained", "refine_steps": 0} if name == "aha" else \
            dict(type(get_method(name)).fast_options)
        out = get_method(name, **opts).explain(toy, x[:1])
        assert out.maps.shape == (1, 32, 32) and torch.isfinite(out.maps).all(), name
    exp = vitlens.explain(toy, x, method="cplrp")  # the declared linears: CP-LRP is complete
    total = exp.token_maps.sum((1, 2)).double() + exp.remainder.double()
    torch.testing.assert_close(total, exp.scores.double(), rtol=1e-4, atol=1e-5)
