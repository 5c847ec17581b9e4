"""AttnLRP and CP-LRP through the timm ``Block`` variants (issue #25, item 3): q/k norms (``qk_norm=True``, LayerNorm
and RmsNorm), BEiT3's scale norms, gated MLPs (``SwiGLUPacked`` = ``GluMlp``, ``SwiGLU``) and the aimv2 layout
(RmsNorm + SwiGLU, no CLS token, mean readout), on real timm ``VisionTransformer``s with tiny configs.

Checked: (1) CP-LRP is conservative (relevance sums to the logit) with zero biases; (2) both methods equal a
hand-written reference — the model's forward written out from its parameters, with the rules as detach arithmetic
(norms: constant std, identity rule ``act(p)/p``, uniform rule halving both factors of ``q̂·k̂ᵀ``, ``A·v`` and the
gated product ``act(g)·x``; CP-LRP: constant attention and gate) — on trained-like parameters; (3) Transformer
Attribution's explicit sweep (norms pass relevance unchanged, the z-rule through ``q̂·k̂ᵀ`` of the normed queries and
keys, half of a gated product's relevance to each factor) equals the same sweep written with autograd z-rules and
conserves relevance at every block with zero biases.
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


def variant_vit(name: str, trained: bool = False, **over) -> nn.Module:
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    args = dict(img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=4, num_classes=5, qkv_bias=True)
    model = sharpen(VisionTransformer(**{**args, **VARIANTS[name], **over})).eval()
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
def test_the_variant_gets_every_lrp_method(name):
    model = variant_vit(name)
    assert {"attnlrp", "cplrp", "transformer_attribution"} <= set(working_methods(model))
    caps = vitlens.get_adapter(model).capabilities
    assert "lrp_variant_linears" in caps and "lrp_linears" not in caps  # not the plain block


# -- transformer attribution: the explicit sweep, written out with autograd z-rules --------------------------------
def _forward_records(model: nn.Module, x: torch.Tensor):
    """The model's forward from its parameters (plain gradients), recording what the sweep reads."""
    h = model.norm_pre(model.patch_drop(model._pos_embed(model.patch_embed(x))))
    recs = []
    for blk in model.blocks:
        a, r = blk.attn, {"u": h}
        b, n, c = h.shape
        r["n1"] = blk.norm1(h)
        q, k, v = F.linear(r["n1"], a.qkv.weight, a.qkv.bias).reshape(b, n, 3, a.num_heads, a.head_dim) \
            .permute(2, 0, 3, 1, 4).unbind(0)
        r["q"], r["k"], r["v"] = a.q_norm(q), a.k_norm(k), v
        r["attn"] = ((r["q"] * a.scale) @ r["k"].transpose(-2, -1)).softmax(-1)
        r["ctx"] = a.norm((r["attn"] @ v).transpose(1, 2).reshape(b, n, c))
        r["h"] = h = h + blk.ls1(a.proj(r["ctx"]))
        m = blk.mlp
        r["n2"] = n2 = blk.norm2(h)
        if isinstance(m, SwiGLU):
            z = m.act(m.fc1_g(n2)) * m.fc1_x(n2)
        elif isinstance(m, GluMlp):
            h1, h2 = m.fc1(n2).chunk(2, dim=-1)
            z = h1 * m.act(h2) if m.gate_last else m.act(h1) * h2
        else:
            z = m.act(m.fc1(n2))
        r["z"] = m.norm(z)
        h = h + blk.ls2(m.fc2(r["z"]))
        recs.append(r)
    pooled_in = model.norm(h)
    p = model.num_prefix_tokens
    pooled = pooled_in[:, 0] if model.global_pool == "token" else pooled_in[:, p:].mean(1)
    feat = model.fc_norm(pooled)
    return model.head(feat), recs, h, feat


def reference_transformer_attribution(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    from test_baselines_attention import _ab_linear, _add, _zrule

    logits, recs, last, feat = _forward_records(model, x)
    cls = logits.argmax(-1)
    grads = torch.autograd.grad(logits.gather(1, cls[:, None]).sum(), [r["attn"] for r in recs])
    p, maps = model.num_prefix_tokens, []
    for i in range(x.shape[0]):
        r_feat = _ab_linear(feat[i:i + 1].detach(), model.head.weight, F.one_hot(cls[i:i + 1], logits.shape[1]).float())
        rel = torch.zeros_like(last[i:i + 1]).detach()
        if model.global_pool == "token":
            rel[:, 0] = r_feat
        else:
            rel[:, p:] = r_feat[:, None] / (rel.shape[1] - p)
        cams = []
        for li in range(len(recs) - 1, -1, -1):
            r = {k: v[i:i + 1].detach() for k, v in recs[li].items()}
            blk = model.blocks[li]
            out = (recs[li + 1]["u"] if li + 1 < len(recs) else last)[i:i + 1].detach()
            r_h, r_m = _add(r["h"], out - r["h"], rel)
            r_z = _ab_linear(r["z"], blk.mlp.fc2.weight, r_m)  # hidden norm, activation: identity
            m = blk.mlp
            if isinstance(m, (SwiGLU, GluMlp)):  # the product: half of the relevance to each factor
                if isinstance(m, SwiGLU):
                    ws = [m.fc1_g.weight, m.fc1_x.weight]
                else:
                    ws = list(m.fc1.weight.chunk(2, dim=0))
                r_h = r_h + sum(_ab_linear(r["n2"], w, r_z / 2) for w in ws)
            else:
                r_h = r_h + _ab_linear(r["n2"], m.fc1.weight, r_z)
            r_u, r_a = _add(r["u"], r["h"] - r["u"], r_h)
            heads, d = blk.attn.num_heads, r["u"].shape[-1]
            r_ctx = _ab_linear(r["ctx"], blk.attn.proj.weight, r_a).reshape(1, -1, heads, d // heads).transpose(1, 2)
            r_attn, r_v = _zrule(lambda a, v: a @ v, [r["attn"], r["v"]], r_ctx)
            r_attn, r_v = r_attn / 2, r_v / 2
            cams.append((grads[li][i] * r_attn[0]).clamp(min=0).mean(0))
            r_q, r_k = _zrule(lambda q, k: q @ k.transpose(-2, -1), [r["q"], r["k"]], r_attn)  # normed q̂, k̂
            r_qkv = torch.stack([r_q / 2, r_k / 2, r_v], dim=2).permute(0, 3, 2, 1, 4).reshape(1, -1, 3 * d)
            rel = r_u + _ab_linear(r["n1"], blk.attn.qkv.weight, r_qkv)  # q/k norms, LN₁: identity
        joint = torch.eye(rel.shape[1])
        for cam in cams[::-1]:
            joint = (torch.eye(rel.shape[1]) + cam) @ joint
        # pooled readout: the row of R - I (the identity's 1/N on every token says nothing about the image)
        maps.append(joint[0, p:] if model.global_pool == "token" else (joint - torch.eye(rel.shape[1]))[p:].mean(0)[p:])
    return torch.stack(maps)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_transformer_attribution_equals_the_reference_and_conserves(name):
    # a CLS readout: with a mean readout the one-hot start spreads over all tokens and the map is ≈ uniform (the
    # rolled-out terms are ~1e-7 of it), which would not tell the rules apart
    model = variant_vit(name, trained=True, class_token=True, global_pool="token")
    x = batch()
    exp = vitlens.explain(model, x, method="transformer_attribution")
    ref = reference_transformer_attribution(model, x)
    assert float(ref.abs().max()) > 1e-5
    torch.testing.assert_close(exp.token_maps.flatten(1), ref, rtol=1e-3, atol=1e-5 * float(ref.abs().max()))
    pooled = variant_vit(name, trained=True)  # the variant's own readout: the same sweep, compared too
    torch.testing.assert_close(vitlens.explain(pooled, x, method="transformer_attribution").token_maps.flatten(1),
                               reference_transformer_attribution(pooled, x), rtol=1e-3, atol=1e-9)
    zero_biases = vitlens.explain(variant_vit(name), x, method="transformer_attribution")
    totals = zero_biases.extras["lrp_totals"]  # one-hot start, zero biases: total 1 at every block input
    torch.testing.assert_close(totals, torch.ones_like(totals), rtol=1e-3, atol=1e-3)


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
