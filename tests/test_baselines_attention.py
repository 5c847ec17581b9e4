"""Attention baselines (rollout, GAE, Chefer's transformer attribution, AttnLRP, CP-LRP) against reference
computations written here from the papers' descriptions: an explicit re-implementation of the tiny timm ViT's
forward pass, loops over images and layers, explicit matrices, and autograd Functions for the LRP rules. Also what
each method conserves, timm == HF, option errors and unsupported models."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import vitlens
from vitlens.errors import InputError, UnsupportedModelError

from conftest import VARIANTS, model_fingerprint, timm_to_hf_vit, tiny_vit

# one intra-op thread for the module (restored after it): tiny tensors, a shared CPU
pytestmark = pytest.mark.usefixtures("one_thread_per_module")


def batch(n: int = 3, size: int = 32, seed: int = 2) -> torch.Tensor:
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


def randomise_biases(model, seed=3, scale=0.2):
    """timm initialises biases to 0; give every linear layer and LayerNorm a bias so conservation is non-trivial."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    return model


# -- an explicit forward pass of a CLS-readout timm ViT, with pluggable operations ----------------------------------
def plain_ln(mod, x):
    return F.layer_norm(x, mod.normalized_shape, mod.weight, mod.bias, mod.eps)


def plain_core(q, k, v):
    attn = torch.softmax((q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5, dim=-1)
    return attn, attn @ v


def manual_forward(model, x, ln=plain_ln, core=plain_core, act=F.gelu):
    """Returns logits, the first block's input (a leaf) and per block a dict of the tensors it computed."""
    b = x.shape[0]
    tok = F.conv2d(x, model.patch_embed.proj.weight, model.patch_embed.proj.bias,
                   stride=model.patch_embed.patch_size).flatten(2).transpose(1, 2)
    u = torch.cat([model.cls_token.expand(b, -1, -1), tok], dim=1) + model.pos_embed
    u = u.detach().requires_grad_(True)
    u0, record = u, []
    for blk in model.blocks:
        heads = blk.attn.num_heads
        t, d = u.shape[1], u.shape[2]
        n1 = ln(blk.norm1, u)
        qkv = F.linear(n1, blk.attn.qkv.weight, blk.attn.qkv.bias).reshape(b, t, 3, heads, d // heads)
        q, k, v = (qkv[:, :, j].transpose(1, 2) for j in range(3))
        attn, ctx4 = core(q, k, v)
        ctx = ctx4.transpose(1, 2).reshape(b, t, d)
        a = F.linear(ctx, blk.attn.proj.weight, blk.attn.proj.bias)
        h = u + a
        n2 = ln(blk.norm2, h)
        p = F.linear(n2, blk.mlp.fc1.weight, blk.mlp.fc1.bias)
        z = act(p)
        m = F.linear(z, blk.mlp.fc2.weight, blk.mlp.fc2.bias)
        record.append(dict(u=u, n1=n1, q=q, k=k, v=v, attn=attn, ctx=ctx, h=h, n2=n2, z=z, blk=blk))
        u = h + m
    f = ln(model.norm, u)
    logits = F.linear(f[:, 0], model.head.weight, model.head.bias)
    return logits, u0, record, u, f


def test_manual_forward_is_the_model():
    model = tiny_vit()
    x = batch()
    with torch.no_grad():
        torch.testing.assert_close(manual_forward(model, x)[0], model(x), rtol=1e-5, atol=1e-5)


# -- rollout --------------------------------------------------------------------------------------------------------
def reference_rollout(attns, fusion, ratio, per="matrix"):
    """Per image, per layer: fuse heads, drop the ⌊ratio·T²⌋ lowest entries of the matrix (or ⌊ratio·T⌋ of each row)
    except (0, 0), add I, row-normalise, multiply; CLS row over the patch tokens."""
    b, _, t, _ = attns[0].shape
    out = []
    for i in range(b):
        joint = torch.eye(t, dtype=torch.float64)
        for a in attns:
            heads = a[i].double()
            fused = {"mean": heads.mean(0), "max": heads.max(0).values, "min": heads.min(0).values}[fusion]
            fused = fused.clone()
            if per == "matrix":
                k = int(t * t * ratio)
                order = sorted(range(t * t), key=lambda j: float(fused.flatten()[j]))[:k]
            else:
                k = int(t * ratio)
                order = [r * t + c for r in range(t) for c in sorted(range(t), key=lambda c: float(fused[r, c]))[:k]]
            for j in order:
                if j != 0:
                    fused[j // t, j % t] = 0.0
            m = torch.zeros(t, t, dtype=torch.float64)
            for r in range(t):
                row = [0.5 * float(fused[r, c]) + (0.5 if r == c else 0.0) for c in range(t)]
                s = sum(row)
                for c in range(t):
                    m[r, c] = row[c] / s
            joint = m @ joint
        out.append(joint[0, 1:])
    return torch.stack(out).float()


@pytest.mark.parametrize("fusion", ["mean", "max", "min"])
@pytest.mark.parametrize("ratio,per", [(0.0, "matrix"), (0.6, "matrix"), (0.5, "row")])
def test_rollout_matches_reference(fusion, ratio, per):
    model = tiny_vit()
    x = batch()
    with torch.no_grad():
        _, _, record, _, _ = manual_forward(model, x)
    ref = reference_rollout([r["attn"] for r in record], fusion, ratio, per)
    exp = vitlens.explain(model, x, method="rollout", head_fusion=fusion, discard_ratio=ratio, discard_per=per)
    torch.testing.assert_close(exp.token_maps.flatten(1), ref, rtol=1e-4, atol=1e-6)
    # rows of the rollout are distributions: map + prefix mass = 1
    torch.testing.assert_close(exp.token_maps.sum((1, 2)) + exp.remainder, torch.ones(3), rtol=1e-5, atol=1e-5)


def test_rollout_readouts_for_pooled_and_distilled_models():
    x = batch(2)
    for name in ["gap", "distilled", "cls+4reg"]:
        exp = vitlens.explain(VARIANTS[name](), x, method="rollout")
        torch.testing.assert_close(exp.token_maps.sum((1, 2)) + exp.remainder, torch.ones(2), rtol=1e-5, atol=1e-5)
    # pooled readout: the mean of the patch rows; with no attention mixing that is uniform
    from vitlens.explainers.rollout import readout_row
    eye = torch.eye(5).expand(2, 5, 5)
    torch.testing.assert_close(readout_row(eye, None, 1), torch.tensor([[0.0, 0.25, 0.25, 0.25, 0.25]] * 2))
    torch.testing.assert_close(readout_row(eye, (0, 1), 2), torch.tensor([[0.5, 0.5, 0.0, 0.0, 0.0]] * 2))


def test_rollout_discard_keeps_the_readout_self_attention():
    from vitlens.explainers.rollout import discard_lowest
    fused = torch.tensor([[[0.0, 0.5, 0.5], [0.2, 0.3, 0.5], [0.1, 0.12, 0.78]]])
    out = discard_lowest(fused, 0.5, protect=(0,))  # the 4 lowest: (0,0) protected, so 3 are zeroed
    assert out[0, 0, 0] == 0.0 and (out == 0).sum() == 4
    fused = fused + 0.05  # now (0, 0) is non-zero: it survives, and so does everything else but 3 entries
    out = discard_lowest(fused, 0.5, protect=(0,))
    assert out[0, 0, 0] == 0.05 and (out == 0).sum() == 3
    out = discard_lowest(fused, 0.34, protect=(0,), per="row")  # 1 per row; row 0's lowest is the protected one
    assert out[0, 0, 0] == 0.05 and (out == 0).sum() == 2 and out[0, 1, 0] == 0 and out[0, 2, 0] == 0
    assert torch.equal(discard_lowest(fused, 0.0), fused)


# -- GAE ------------------------------------------------------------------------------------------------------------
def test_gae_matches_reference():
    model = tiny_vit()
    x = batch()
    logits, _, record, _, _ = manual_forward(model, x)
    cls = logits.argmax(-1)
    y = logits.gather(1, cls[:, None]).sum()
    grads = torch.autograd.grad(y, [r["attn"] for r in record])
    t = record[0]["attn"].shape[-1]
    ref = []
    for i in range(x.shape[0]):
        rel = torch.eye(t, dtype=torch.float64)
        for r, g in zip(record, grads):
            a, ga = r["attn"][i].detach().double(), g[i].double()
            cam = torch.zeros(t, t, dtype=torch.float64)
            for h in range(a.shape[0]):
                cam += (a[h] * ga[h]).clamp(min=0) / a.shape[0]
            rel = rel + cam @ rel
        ref.append(rel[0, 1:])
    ref = torch.stack(ref).float()
    exp = vitlens.explain(model, x, method="gae")
    assert torch.equal(exp.targets, cls)
    torch.testing.assert_close(exp.token_maps.flatten(1), ref, rtol=1e-4, atol=1e-7 * float(ref.abs().max()))


# -- Chefer et al.'s transformer attribution ----------------------------------------------------------------------
def _stab(z):
    return torch.where(z == 0, torch.ones_like(z), z + 1e-9 * torch.where(z >= 0, 1.0, -1.0))


def _zrule(fn, inputs, relevance):
    """z-rule by autograd: R_i = x_i ⊙ ∂⟨fn(x), R/fn(x)⟩/∂x_i (fn's output with zeros masked)."""
    xs = [t.detach().requires_grad_(True) for t in inputs]
    z = fn(*xs)
    s = torch.where(z == 0, torch.zeros_like(z), relevance / _stab(z))
    grads = torch.autograd.grad(z, xs, s)
    return [x.detach() * g for x, g in zip(xs, grads)]


def _ab_linear(x, w, relevance):
    xp, xn = x.clamp(min=0).detach().requires_grad_(True), x.clamp(max=0).detach().requires_grad_(True)
    z = F.linear(xp, w.clamp(min=0)) + F.linear(xn, w.clamp(max=0))
    s = torch.where(z == 0, torch.zeros_like(z), relevance / _stab(z))
    gp, gn = torch.autograd.grad(z, [xp, xn], s)
    return xp.detach() * gp + xn.detach() * gn


def _add(x1, x2, relevance):
    a, b = _zrule(lambda p, q: p + q, [x1, x2], relevance)
    sa, sb, sr = a.sum(), b.sum(), relevance.sum()
    fa = sa.abs() / (sa.abs() + sb.abs()) * sr
    fb = sb.abs() / (sa.abs() + sb.abs()) * sr
    return a * fa / sa, b * fb / sb


def reference_transformer_attribution(model, x):
    """One image at a time (as the paper's code): LRP sweep by autograd z-rules, then the gradient-weighted rollout."""
    logits, _, record, last, _ = manual_forward(model, x)
    cls = logits.argmax(-1)
    grads = torch.autograd.grad(logits.gather(1, cls[:, None]).sum(), [r["attn"] for r in record])
    maps = []
    for i in range(x.shape[0]):
        one_hot = F.one_hot(cls[i:i + 1], logits.shape[1]).float()
        f = F.layer_norm(last[i:i + 1], model.norm.normalized_shape, model.norm.weight, model.norm.bias,
                         model.norm.eps)
        rel = torch.zeros_like(last[i:i + 1])
        rel[:, 0] = _ab_linear(f[:, 0].detach(), model.head.weight, one_hot)
        cams = []
        for li in range(len(record) - 1, -1, -1):
            r = {k: (v[i:i + 1].detach() if torch.is_tensor(v) else v) for k, v in record[li].items()}
            blk = r["blk"]
            out = (record[li + 1]["u"] if li + 1 < len(record) else last)[i:i + 1].detach()
            r_h, r_m = _add(r["h"], out - r["h"], rel)
            r_z = _ab_linear(r["z"], blk.mlp.fc2.weight, r_m)
            r_h = r_h + _ab_linear(r["n2"], blk.mlp.fc1.weight, r_z)
            r_u, r_a = _add(r["u"], r["h"] - r["u"], r_h)
            r_ctx = _ab_linear(r["ctx"], blk.attn.proj.weight, r_a)
            heads, d = blk.attn.num_heads, r["u"].shape[-1]
            r_ctx = r_ctx.reshape(1, -1, heads, d // heads).transpose(1, 2)
            r_attn, r_v = _zrule(lambda a, v: torch.einsum("bhij,bhjd->bhid", a, v), [r["attn"], r["v"]], r_ctx)
            r_attn, r_v = r_attn / 2, r_v / 2
            cams.append((grads[li][i] * r_attn[0]).clamp(min=0).mean(0))
            r_q, r_k = _zrule(lambda q, k: torch.einsum("bhid,bhjd->bhij", q, k), [r["q"], r["k"]], r_attn)
            r_qkv = torch.stack([r_q / 2, r_k / 2, r_v], dim=2)  # (1, H, 3, T, dh)
            r_qkv = r_qkv.permute(0, 3, 2, 1, 4).reshape(1, -1, 3 * d)
            rel = r_u + _ab_linear(r["n1"], blk.attn.qkv.weight, r_qkv)
        t = rel.shape[1]
        joint = torch.eye(t)
        for cam in cams[::-1]:
            joint = (torch.eye(t) + cam) @ joint
        maps.append(joint[0, 1:])
    return torch.stack(maps)


def test_transformer_attribution_matches_reference():
    model = randomise_biases(tiny_vit())
    x = batch()
    ref = reference_transformer_attribution(model, x)
    exp = vitlens.explain(model, x, method="transformer_attribution")
    torch.testing.assert_close(exp.token_maps.flatten(1), ref, rtol=1e-3, atol=1e-6 * float(ref.abs().max()))


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_transformer_attribution_sweep_conserves_relevance(name):
    model = randomise_biases(VARIANTS[name]())
    exp = vitlens.explain(model, batch(2), method="transformer_attribution")
    totals = exp.extras["lrp_totals"]  # one-hot start: total 1 at every block input
    assert totals.shape == (2, len(model.blocks) + 1)
    torch.testing.assert_close(totals, torch.ones_like(totals), rtol=1e-3, atol=1e-3)


def test_transformer_attribution_alpha_option():
    model = tiny_vit()
    x = batch(2)
    a = vitlens.explain(model, x, method="transformer_attribution")
    b = vitlens.explain(model, x, method="transformer_attribution", alpha=2.0)
    assert not torch.allclose(a.token_maps, b.token_maps)
    torch.testing.assert_close(b.extras["lrp_totals"], torch.ones_like(b.extras["lrp_totals"]), rtol=1e-3, atol=1e-3)


# -- AttnLRP / CP-LRP ----------------------------------------------------------------------------------------------
class _LNConstStd(torch.autograd.Function):
    """LayerNorm whose backward treats the standard deviation as a constant."""

    @staticmethod
    def forward(ctx, x, w, b, eps):
        mu = x.mean(-1, keepdim=True)
        sd = ((x - mu) ** 2).mean(-1, keepdim=True).add(eps).sqrt()
        ctx.save_for_backward(w, sd)
        return (x - mu) / sd * w + b

    @staticmethod
    def backward(ctx, g):
        w, sd = ctx.saved_tensors
        gw = g * w
        return (gw - gw.mean(-1, keepdim=True)) / sd, None, None, None


class _IdentityGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, p):
        z = F.gelu(p)
        ctx.save_for_backward(z / (p + 1e-10 * torch.where(p >= 0, 1.0, -1.0)))
        return z

    @staticmethod
    def backward(ctx, g):
        return g * ctx.saved_tensors[0]


class _Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, factor):
        ctx.factor = factor
        return t.clone()

    @staticmethod
    def backward(ctx, g):
        return g * ctx.factor, None


def _ln_rule(mod, x):
    return _LNConstStd.apply(x, mod.weight, mod.bias, mod.eps)


def _attnlrp_core(q, k, v):
    q, k = _Scale.apply(q, 0.25), _Scale.apply(k, 0.25)  # uniform rule twice (A·v, then q·kᵀ)
    attn = torch.softmax((q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5, dim=-1)
    return attn, attn @ _Scale.apply(v, 0.5)


def _cp_core(q, k, v):
    attn = torch.softmax((q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5, dim=-1).detach()
    return attn, attn @ v


def reference_lrp(model, x, core, act=_IdentityGelu.apply):
    logits, u0, _, _, _ = manual_forward(model, x, ln=_ln_rule, core=core, act=act)
    cls = logits.argmax(-1)
    (g,) = torch.autograd.grad(logits.gather(1, cls[:, None]).sum(), [u0])
    return (u0 * g).sum(-1).detach()


@pytest.mark.parametrize("method,core", [("attnlrp", _attnlrp_core), ("cplrp", _cp_core)])
@pytest.mark.parametrize("rule", ["identity", "gradient"])
def test_gradient_x_input_lrp_matches_reference(method, core, rule):
    model = randomise_biases(tiny_vit())
    x = batch()
    ref = reference_lrp(model, x, core, _IdentityGelu.apply if rule == "identity" else F.gelu)
    exp = vitlens.explain(model, x, method=method, activation_rule=rule)
    scale = float(ref.abs().max())
    torch.testing.assert_close(exp.token_maps.flatten(1), ref[:, 1:], rtol=1e-4, atol=1e-5 * scale)
    torch.testing.assert_close(exp.remainder, ref[:, 0], rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_cplrp_is_complete_without_biases(name):
    model = VARIANTS[name]()
    with torch.no_grad():  # timm starts biases at 0 but make sure: then y = Σ relevance exactly
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.zero_()
    exp = vitlens.explain(model, batch(2), method="cplrp")
    total = exp.token_maps.sum((1, 2)) + exp.remainder
    torch.testing.assert_close(total, exp.scores, rtol=1e-4, atol=1e-5 * float(exp.scores.abs().max()))


def test_cplrp_relevance_plus_bias_terms_is_the_logit():
    """With biases: y = Σ_tokens R + Σ_biases ⟨b, ∂̃y/∂b⟩ (∂̃: the rule-modified gradient), i.e. CP-LRP with the
    identity rule is a complete decomposition of y over the input tokens and the biases."""
    from vitlens.explainers.attnlrp import attention_rule, identity_rule
    from vitlens.explainers.transformer_attribution import LinearTaps

    model = randomise_biases(tiny_vit())
    x = batch(2)
    adapter = vitlens.get_adapter(model)
    biases = [p for n, p in model.named_parameters() if n.endswith("bias") and not n.startswith("patch_embed")]
    with adapter.session(capture=True, conservative=True) as rec:
        for p in biases:
            p.requires_grad_(True)
        taps = LinearTaps(adapter, rec, rewrite_ctx=attention_rule("cplrp"), rewrite_act=identity_rule)
        with taps.installed():
            logits = adapter.forward(x)
        y = logits.max(-1).values
        grads = torch.autograd.grad(y.sum(), [rec.blocks[0].u] + biases)
    rel = (rec.blocks[0].u.detach() * grads[0]).sum((1, 2))
    bias_terms = sum((p.detach() * g).sum() for p, g in zip(biases, grads[1:]))
    torch.testing.assert_close(rel.sum() + bias_terms, y.detach().sum(), rtol=1e-4, atol=1e-5)
    exp = vitlens.explain(model, x, method="cplrp")
    torch.testing.assert_close(exp.token_maps.sum((1, 2)) + exp.remainder, rel, rtol=1e-5, atol=1e-6)
    assert all(p.requires_grad for p in model.parameters())  # the session restored the model's own flags


def test_attnlrp_differs_from_cplrp_and_is_not_complete():
    """On a bias-free model CP-LRP sums to y exactly; AttnLRP does not (its softmax rule drops a bias term)."""
    model = tiny_vit()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.zero_()
    x = batch(3)
    a = vitlens.explain(model, x, method="attnlrp")
    c = vitlens.explain(model, x, method="cplrp")
    assert not torch.allclose(a.token_maps, c.token_maps, rtol=1e-3, atol=1e-6)
    torch.testing.assert_close(c.token_maps.sum((1, 2)) + c.remainder, c.scores, rtol=1e-4, atol=1e-6)
    gap = (a.token_maps.sum((1, 2)) + a.remainder - a.scores).abs()
    assert float(gap.max()) > 1e-3 * float(a.scores.abs().max())


# -- all methods: timm == HF, restoration, unsupported models, options ----------------------------------------------
ATTENTION_METHODS = ["rollout", "gae", "transformer_attribution", "attnlrp", "cplrp"]


@pytest.mark.parametrize("method", ATTENTION_METHODS)
def test_timm_and_hf_give_the_same_maps(method):
    pytest.importorskip("transformers")
    tm = randomise_biases(tiny_vit())
    hm = timm_to_hf_vit(tm)
    x = batch(2)
    a = vitlens.explain(tm, x, method=method)
    b = vitlens.explain(hm, x, method=method)
    scale = float(a.maps.abs().max())
    # the z-rule through the attention matmuls divides by small numbers: rounding differences grow there
    tol = 1e-3 if method == "transformer_attribution" else 1e-5
    torch.testing.assert_close(a.maps, b.maps, rtol=1e-4, atol=tol * scale)


@pytest.mark.parametrize("method", ["transformer_attribution", "attnlrp", "cplrp"])
def test_hf_deit_distilled(method):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.DeiTConfig(image_size=32, patch_size=8, hidden_size=48, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=96, num_labels=5)
    torch.manual_seed(0)
    model = transformers.DeiTForImageClassificationWithTeacher(cfg).eval()
    with torch.no_grad():  # HF starts CLS/DIST/position embeddings at 0: LRP then has nothing to pass relevance to
        emb = model.deit.embeddings
        for p in (emb.cls_token, emb.distillation_token, emb.position_embeddings):
            p.normal_(0, 0.5)
    exp = vitlens.explain(model, batch(2), method=method)
    assert exp.token_maps.shape == (2, 4, 4) and torch.isfinite(exp.maps).all()
    if method == "transformer_attribution":
        torch.testing.assert_close(exp.extras["lrp_totals"], torch.ones(2, 3), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("method", ["transformer_attribution", "attnlrp", "cplrp"])
def test_attention_variants_are_refused_and_the_model_restored(method):
    # q/k norms are covered since issue #25 (tests/test_lrp_variants.py); an attention gate is not
    from timm.layers import Attention

    model = tiny_vit(qk_norm=True)
    before = model_fingerprint(model)
    assert torch.isfinite(vitlens.explain(model, batch(2), method=method).maps).all()
    assert model_fingerprint(model) == before
    with torch.no_grad():
        for blk in model.blocks:  # timm's gated attention (Attention(gated=True)): sigmoid(gate(x)) · output
            gated = Attention(48, num_heads=4, qkv_bias=True, gated=True).eval()
            gated.load_state_dict(blk.attn.state_dict(), strict=False)
            blk.attn = gated
    before = model_fingerprint(model)
    with pytest.raises(UnsupportedModelError,
                       match="'lrp_linears'.*gates the attention output.*methods that work on this model: .*gradskip"):
        vitlens.explain(model, batch(2), method=method)
    assert model_fingerprint(model) == before


@pytest.mark.parametrize("method,opts,match", [
    ("rollout", {"head_fusion": "median"}, "head_fusion"),
    ("rollout", {"discard_ratio": 1.0}, "discard_ratio"),
    ("rollout", {"discard_ratio": -0.1}, "discard_ratio"),
    ("rollout", {"discard_ratio": "most"}, "discard_ratio"),
    ("rollout", {"discard_per": "column"}, "discard_per"),
    ("transformer_attribution", {"alpha": 0.5}, "alpha"),
    ("transformer_attribution", {"alpha": None}, "alpha"),
    ("attnlrp", {"activation_rule": "relu"}, "activation_rule"),
    ("cplrp", {"activation_rule": None}, "activation_rule"),
    ("gae", {"head_fusion": "mean"}, "unknown option"),
])
def test_option_errors(method, opts, match):
    with pytest.raises(InputError, match=match):
        vitlens.explain(tiny_vit(), batch(1), method=method, **opts)


def test_declared_costs():
    from vitlens.explainers import get_method
    assert get_method("rollout").declared_cost() == {"forward": 1.0, "backward": 0.0}
    assert get_method("gae").declared_cost() == {"forward": 1.0, "backward": 1.0}
    assert get_method("transformer_attribution").declared_cost()["relevance_sweep"] == 1.0
    for name in ("attnlrp", "cplrp"):
        assert get_method(name).declared_cost() == {"forward": 1.0, "backward": 1.0}
