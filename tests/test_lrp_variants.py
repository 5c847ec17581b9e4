"""AttnLRP and CP-LRP through the timm ``Block`` variants (issue #25, item 3): q/k norms (``qk_norm=True``, LayerNorm
and RmsNorm), BEiT3's scale norms, gated MLPs (``SwiGLUPacked`` = ``GluMlp``, ``SwiGLU``) and the aimv2 layout
(RmsNorm + SwiGLU, no CLS token, mean readout), on real timm ``VisionTransformer``s with tiny configs.

Checked: (1) CP-LRP is conservative (relevance sums to the logit) with zero biases; (2) both methods equal a
hand-written reference — the model's forward written out from its parameters, with the rules as detach arithmetic
(norms: constant std, identity rule ``act(p)/p``, uniform rule halving both factors of ``q̂·k̂ᵀ``, ``A·v`` and the
gated product ``act(g)·x``; CP-LRP: constant attention and gate) — on trained-like parameters; (3) Transformer
Attribution, whose explicit sweep covers only the plain block, is refused naming the variant.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import vitlens
from vitlens.errors import UnsupportedModelError
from vitlens.explainers.support import working_methods
from vitlens.models.families import trained_like

from conftest import sharpen

timm = pytest.importorskip("timm")
from timm.layers import GluMlp, RmsNorm, SwiGLU, SwiGLUPacked  # noqa: E402

VARIANTS = {
    "qk_norm": dict(qk_norm=True),
    "qk_rmsnorm": dict(qk_norm=True, norm_layer=RmsNorm),
    "swiglu_packed": dict(mlp_layer=SwiGLUPacked, mlp_ratio=2.0),
    "swiglu": dict(mlp_layer=SwiGLU, mlp_ratio=2.0),
    "aimv2": dict(norm_layer=RmsNorm, mlp_layer=SwiGLU, qk_norm=True, class_token=False, global_pool="avg"),
    "beit3": dict(scale_attn_norm=True, scale_mlp_norm=True, global_pool="avg"),
}


def variant_vit(name: str, trained: bool = False) -> nn.Module:
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    args = dict(img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=4, num_classes=5, qkv_bias=True)
    model = sharpen(VisionTransformer(**{**args, **VARIANTS[name]})).eval()
    with torch.no_grad():  # GluMlp/SwiGLU initialise the gate's weights at 1e-6 (a constant gate): make it matter
        for m in model.modules():
            for gate in ([m.fc1_g] if isinstance(m, SwiGLU) else [m.fc1] if isinstance(m, GluMlp) else []):
                gate.weight.normal_(0.0, 0.2)
    if trained:
        return trained_like(model)
    with torch.no_grad():  # zero biases (GluMlp/SwiGLU initialise their gate bias to 1)
        for pname, p in model.named_parameters():
            if pname.endswith("bias"):
                p.zero_()
    return model


def batch() -> torch.Tensor:
    return torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))


# -- the hand-written reference ---------------------------------------------------------------------------------
def _norm(m: nn.Module, t: torch.Tensor) -> torch.Tensor:
    """``m(t)`` with its standard deviation (RMS) a constant in the backward pass."""
    if isinstance(m, nn.Identity):
        return t
    if isinstance(m, RmsNorm):
        y = t / (t.pow(2).mean(-1, keepdim=True) + m.eps).sqrt().detach()
        return y * m.weight
    mu = t.mean(-1, keepdim=True)
    y = (t - mu) / (t.var(-1, unbiased=False, keepdim=True) + m.eps).sqrt().detach()
    return y * m.weight + m.bias


def _half(t: torch.Tensor, share: float = 0.5) -> torch.Tensor:
    """Value ``t``, gradient ``share·g``."""
    return share * t + (1 - share) * t.detach()


def _identity(act: nn.Module, p: torch.Tensor) -> torch.Tensor:
    """Identity rule: value ``act(p)``, gradient ``act(p)/p·g``."""
    return p * (act(p) / p).detach()


def _block(blk: nn.Module, x: torch.Tensor, mode: str) -> torch.Tensor:
    a = blk.attn
    b, n, c = x.shape
    qkv = F.linear(_norm(blk.norm1, x), a.qkv.weight, a.qkv.bias).reshape(b, n, 3, a.num_heads, a.head_dim)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    q, k = _norm(a.q_norm, q), _norm(a.k_norm, k)
    if mode == "attnlrp":
        attn = ((_half(q) * a.scale) @ _half(k).transpose(-2, -1)).softmax(-1)
        ctx = _half(attn) @ _half(v)
    else:
        ctx = ((q * a.scale) @ k.transpose(-2, -1)).softmax(-1).detach() @ v
    ctx = _norm(a.norm, ctx.transpose(1, 2).reshape(b, n, c))
    x = x + blk.ls1(F.linear(ctx, a.proj.weight, a.proj.bias))
    m, n2 = blk.mlp, _norm(blk.norm2, x)
    share = 0.5 if mode == "attnlrp" else 0.0
    if isinstance(m, SwiGLU):
        z = _half(_identity(m.act, m.fc1_g(n2)), share) * _half(m.fc1_x(n2), 1 - share)
    elif isinstance(m, GluMlp):
        h1, h2 = m.fc1(n2).chunk(2, dim=-1)
        gate, value = (h2, h1) if m.gate_last else (h1, h2)
        z = _half(_identity(m.act, gate), share) * _half(value, 1 - share)
    else:
        z = _identity(m.act, m.fc1(n2))
    return x + blk.ls2(m.fc2(_norm(m.norm, z)))


def reference(model: nn.Module, x: torch.Tensor, mode: str, cls: torch.Tensor) -> torch.Tensor:
    """Relevance ``(B, T)`` at the first block's input (gradient × input, summed over channels)."""
    u = model.norm_pre(model.patch_drop(model._pos_embed(model.patch_embed(x))))
    u0 = u.detach().requires_grad_()
    h = u0
    for blk in model.blocks:
        h = _block(blk, h, mode)
    h = _norm(model.norm, h)
    p = model.num_prefix_tokens
    pooled = h[:, 0] if model.global_pool == "token" else h[:, p:].mean(1)
    logits = model.head(_norm(model.fc_norm, pooled))
    logits.gather(1, cls[:, None]).sum().backward()
    return (u0 * u0.grad).sum(-1).detach()


# -- the tests --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_the_variant_gets_the_gradient_input_lrp_methods_and_not_the_explicit_sweep(name):
    model = variant_vit(name)
    working = working_methods(model)
    assert "attnlrp" in working and "cplrp" in working
    assert "transformer_attribution" not in working
    with pytest.raises(UnsupportedModelError, match="lrp_linears.*block 0 (normalises|has a gated MLP)"):
        vitlens.explain(model, batch(), method="transformer_attribution")


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_cplrp_is_conservative_with_zero_biases(name):
    model = variant_vit(name)
    exp = vitlens.explain(model, batch(), method="cplrp")
    total = exp.token_maps.sum((1, 2)).double() + exp.remainder.double()
    torch.testing.assert_close(total, exp.scores.double(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["attnlrp", "cplrp"])
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_relevance_equals_the_hand_written_reference(name, mode):
    model = variant_vit(name, trained=True)
    x = batch()
    exp = vitlens.explain(model, x, method=mode)
    ref = reference(model, x, mode, exp.targets)
    p = model.num_prefix_tokens
    ours = exp.token_maps.flatten(1)
    scale = float(ref.abs().max())
    torch.testing.assert_close(ours, ref[:, p:], rtol=0.0, atol=2e-5 * scale)
    if p:
        torch.testing.assert_close(exp.remainder, ref[:, :p].sum(1), rtol=0.0, atol=2e-5 * scale)
    # the rules matter: the plain gradient × input differs
    u_plain = reference_plain_gap(model, x, exp.targets)
    assert float((u_plain[:, p:] - ref[:, p:]).abs().max()) > 1e-3 * scale


def reference_plain_gap(model: nn.Module, x: torch.Tensor, cls: torch.Tensor) -> torch.Tensor:
    """Plain gradient × input at the first block's input (no rule)."""
    adapter = vitlens.get_adapter(model)
    with adapter.session(capture=True) as rec:
        logits = adapter.forward(x)
        u0 = rec.blocks[0].u
        torch.autograd.backward(logits.gather(1, cls[:, None]).sum(), inputs=[u0])
    return (u0.detach() * u0.grad).sum(-1)


def test_a_gated_mlp_that_does_not_compute_act_gate_times_value_is_refused_and_hooks_removed():
    model = variant_vit("swiglu")

    def wrong(module, args):  # the hidden features are no longer act(gate)·value
        return (args[0] + 1.0,)

    handle = model.blocks[1].mlp.drop1.register_forward_pre_hook(wrong)  # runs before the rule's hook
    try:
        before = {id(m): (len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()}
        with pytest.raises(UnsupportedModelError, match="block 1: the MLP's hidden features are not act"):
            vitlens.explain(model, batch(), method="attnlrp")
        after = {id(m): (len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()}
        assert after == before
    finally:
        handle.remove()
