"""Cross-check of ``attnlrp`` / ``cplrp`` through the timm block variants (q/k norms, SwiGLU, AIMv2-style RmsNorm +
SwiGLU + qk_norm) against LXT's own rules, in a separate interpreter (LXT's patches cannot be undone; set-up as in
``tests/test_lxt_crosscheck.py``: ``VITLENS_LXT_PYTHON`` or the checkout's ``.venv-lxt``; without either the test is
skipped).

LXT ships no map for timm ViTs; the reference timm model is patched with LXT's own functions: ``layer_norm_forward``
and ``rms_norm_forward`` (identity rule on the scaling: every LayerNorm / RmsNorm, the q/k norms included),
``gated_mlp_forward`` (AttnLRP: identity rule on the gate's SiLU, uniform rule ``divide_gradient(·, 2)`` on the product)
or ``cp_gated_mlp_forward`` (CP-LRP: the gate is a constant) on timm's ``SwiGLU`` (its maps named as LXT's LLaMA MLP
expects), ``non_linear_forward`` on GELU, and ``wrap_attention_forward`` / ``cp_wrap_attention_forward`` around
``scaled_dot_product_attention`` of the normed queries and keys (the only glue written here: timm's ``Attention``
forward with the call routed through LXT's wrapper). Relevance is gradient × input at the first block's input.
"""

from __future__ import annotations

import pytest

from test_lxt_crosscheck import LXT_PYTHON, run_lxt_script

pytestmark = pytest.mark.slow

SCRIPT = r'''
import json, sys
import torch
import torch.nn.functional as F

torch.set_num_threads(1)
mode = sys.argv[1]

import vitlens
from timm.layers import Attention, RmsNorm, SwiGLU
from timm.layers import LayerNorm as TimmLayerNorm
from timm.models.vision_transformer import VisionTransformer

VARIANTS = {"qk_norm": dict(qk_norm=True), "swiglu": dict(mlp_layer=SwiGLU, mlp_ratio=2.0),
            "aimv2": dict(norm_layer=RmsNorm, mlp_layer=SwiGLU, qk_norm=True, class_token=False, global_pool="avg")}


def build(name, seed=0, dim=48):
    torch.manual_seed(seed)
    m = VisionTransformer(img_size=32, patch_size=8, embed_dim=dim, depth=3, num_heads=4, num_classes=7,
                          qkv_bias=True, **VARIANTS[name]).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("qkv.weight"):
                p[: 2 * dim].mul_(4.0)
            if n.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
            if n in ("cls_token", "pos_embed"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            if "norm" in n and n.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            if n.endswith("fc1_g.weight"):  # SwiGLU initialises the gate at 1e-6 (a constant gate): make it matter
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return m


def ours(model, x, method, **kw):
    e = vitlens.explain(model, x, method=method, **kw)
    p = model.num_prefix_tokens
    rem = e.remainder[:, None] if p else e.token_maps.new_zeros(x.shape[0], 0)
    return torch.cat([rem, e.token_maps.flatten(1)], dim=1)


def compare(a, ref):
    diff = (a - ref).abs().max().item()
    return {"max_abs_diff": diff, "rel_diff": diff / ref.abs().max().item()}


x = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(7))
models = {name: build(name) for name in VARIANTS}
mine = {name: ours(m, x, mode) for name, m in models.items()}
near = {name: {"other_rule": ours(m, x, "cplrp" if mode == "attnlrp" else "attnlrp"),
               "plain_activation": ours(m, x, mode, activation_rule="gradient")} for name, m in models.items()}

from lxt.efficient.patches import (cp_gated_mlp_forward, cp_wrap_attention_forward, gated_mlp_forward,
                                   layer_norm_forward, non_linear_forward, patch_method, rms_norm_forward,
                                   wrap_attention_forward)

torch.nn.LayerNorm.forward = layer_norm_forward
TimmLayerNorm.forward = layer_norm_forward
RmsNorm.variance_epsilon = property(lambda self: self.eps)
RmsNorm.forward = rms_norm_forward
for alias, name in (("gate_proj", "fc1_g"), ("up_proj", "fc1_x"), ("act_fn", "act"), ("down_proj", "fc2")):
    setattr(SwiGLU, alias, property(lambda self, name=name: getattr(self, name)))
SwiGLU.forward = gated_mlp_forward if mode == "attnlrp" else cp_gated_mlp_forward
patch_method(non_linear_forward, torch.nn.GELU, keep_original=True)
wrap = wrap_attention_forward if mode == "attnlrp" else cp_wrap_attention_forward
sdpa = wrap(lambda module, q, k, v: F.scaled_dot_product_attention(q, k, v))


def attention_forward(self, x, attn_mask=None, is_causal=False):
    b, n, _ = x.shape
    q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    out = sdpa(self, self.q_norm(q), self.k_norm(k), v).transpose(1, 2).reshape(b, n, self.attn_dim)
    return self.proj_drop(self.proj(self.norm(out)))


Attention.forward = attention_forward
report = {"mode": mode}
for name, m in models.items():
    box = {}

    def leaf(module, args, out):
        box["u"] = out.detach().requires_grad_(True)
        return box["u"]

    h = m.norm_pre.register_forward_hook(leaf)
    try:
        logits = m(x)
    finally:
        h.remove()
    y = logits.gather(1, logits.argmax(-1, keepdim=True)).sum()
    (g,) = torch.autograd.grad(y, [box["u"]])
    ref = (box["u"] * g).sum(-1).detach()
    p = m.num_prefix_tokens
    ref = torch.cat([ref[:, :p].sum(1, keepdim=True), ref[:, p:]], dim=1) if p else ref
    report[name] = {"vitlens_vs_lxt": compare(mine[name], ref),
                    "near_misses_rel_diff": {k: compare(v, ref)["rel_diff"] for k, v in near[name].items()}}
print("RESULT " + json.dumps(report))
'''


@pytest.mark.skipif(not LXT_PYTHON, reason="set VITLENS_LXT_PYTHON to a python with lxt and transformers<5")
@pytest.mark.parametrize("mode", ["attnlrp", "cplrp"])
def test_variants_match_lxt_rules(mode, tmp_path):
    report = run_lxt_script(SCRIPT, mode, tmp_path)
    for name in ("qk_norm", "swiglu", "aimv2"):
        entry = report[name]
        assert entry["vitlens_vs_lxt"]["rel_diff"] < 1e-5, (name, entry)
        misses = dict(entry["near_misses_rel_diff"])
        if mode == "cplrp" and name != "qk_norm":  # CP-LRP's gate is a constant: no gradient reaches its SiLU, so
            assert misses.pop("plain_activation") < 1e-5, (name, entry)  # the activation rule changes nothing
        assert min(misses.values()) > 1e-3, (name, entry)
