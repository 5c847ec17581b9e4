"""GradSkip on Hiera (``explainers/gradskip_hiera.py``; timm ``Hiera``, transformers ``HieraForImageClassification``):
the recomputed mask-unit attention is the model's, the hand-back through the pooling max is exact and conservative,
the map is complete and conserved block by block (as initialised and with trained-like parameters: non-zero biases,
LayerScale, norm weights ≠ 1; pooled skips with and without the expansion projection; all unrolls consumed by pooling
and one left), timm and HF with the same weights give the same map, batch = one by one, deterministic, one forward
and one backward, the model restored after success and after an exception, rollout/GAE still refused with the
reason."""

from __future__ import annotations

import pytest
import torch

import vitlens
from vitlens.errors import InputError, UnsupportedModelError
from vitlens.explainers import get_method
from vitlens.explainers.gradskip_hiera import attribute_mask_units, pool_contributions, pool_handback
from vitlens.models.families import trained_like
from vitlens.targets import ClassLogit

from conftest import assert_restored, sharpen

pytest.importorskip("timm")
transformers = pytest.importorskip("transformers")
from timm.models.hiera import Hiera  # noqa: E402

#: timm variants: the default (4 mask units in stage 1, global attention after), one unroll left unconsumed
#: (``q_pool=1``: the last stage widens without pooling), the pooled skip without the expansion projection (max and
#: mean side by side) and LayerScale on both branches
VARIANTS = {
    "default": {},
    "one-unroll-left": {"q_pool": 1},
    "no-expand-proj": {"use_expand_proj": False},
    "layerscale": {"init_values": 0.5},
}


def _readable(model: torch.nn.Module, fc: torch.nn.Linear, trained: bool) -> torch.nn.Module:
    """Peaked attention (q/k scaled), a classifier that reads the tokens (timm and HF initialise it at ~0, so the
    logits would be the bias), and trained-like parameters if asked."""
    with torch.no_grad():
        fc.weight.normal_(0.0, 1.0)
    model = sharpen(model.eval())
    return trained_like(model) if trained else model


def _timm(variant: str = "default", trained: bool = True, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    kw = {"q_pool": 2, **VARIANTS[variant]}
    m = Hiera(img_size=(32, 32), embed_dim=16, num_heads=1, stages=(1, 2, 1), mask_unit_size=(4, 4),
              mask_unit_attn=(True, False, False), num_classes=5, **kw)
    return _readable(m, m.head.fc, trained)


def _hf(trained: bool = True, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.HieraConfig(embed_dim=16, image_size=[32, 32], depths=[1, 2, 1], num_heads=[1, 2, 4],
                                   num_query_pool=2, masked_unit_size=[4, 4],
                                   masked_unit_attention=[True, False, False], num_labels=5)
    m = transformers.HieraForImageClassification(cfg)
    return _readable(m, m.classifier, trained)


def _hf_from_timm(src: torch.nn.Module) -> torch.nn.Module:
    """The HF model with ``src``'s weights, parameter by parameter (the layouts are the same network)."""
    hf = transformers.HieraForImageClassification(_hf(trained=False).config).eval()
    sd = src.state_dict()
    mapped = {"hiera.embeddings.position_embeddings": sd["pos_embed"],
              "hiera.embeddings.patch_embeddings.projection.weight": sd["patch_embed.proj.weight"],
              "hiera.embeddings.patch_embeddings.projection.bias": sd["patch_embed.proj.bias"],
              "hiera.pooler.layernorm.weight": sd["head.norm.weight"],
              "hiera.pooler.layernorm.bias": sd["head.norm.bias"],
              "classifier.weight": sd["head.fc.weight"], "classifier.bias": sd["head.fc.bias"]}
    names = {"norm1": "layernorm_before", "norm2": "layernorm_after", "attn.qkv": "attn.qkv", "attn.proj": "attn.proj",
             "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2", "proj": "proj"}
    where = [(s, j) for s, depth in enumerate((1, 2, 1)) for j in range(depth)]
    for i, (s, j) in enumerate(where):
        for t, h in names.items():
            for p in ("weight", "bias"):
                if f"blocks.{i}.{t}.{p}" in sd:
                    mapped[f"hiera.encoder.stages.{s}.layers.{j}.{h}.{p}"] = sd[f"blocks.{i}.{t}.{p}"]
    assert set(hf.state_dict()) == set(mapped)
    hf.load_state_dict(mapped)
    return hf


def _x(n: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def _complete_and_conserved(exp, tol: float = 1e-5) -> None:
    y = exp.scores.double()
    torch.testing.assert_close(exp.token_maps.sum((1, 2)).double(), y, rtol=tol, atol=tol)
    assert torch.equal(exp.remainder, torch.zeros_like(exp.remainder))
    totals = exp.extras["layer_totals"].double()  # (B, L+1): input of block 0 ... readout
    torch.testing.assert_close(totals, y[:, None].expand_as(totals), rtol=tol, atol=tol)


# -- the recording and the rules --------------------------------------------------------------------------------------

def test_recomputed_attention_and_its_gradient_are_the_models():
    """HF hands out its probabilities (output_attentions): the path's recomputation from the recorded qkv, with
    pooled queries per mask unit, is them, and A ⊙ ∂y/∂A from ∂y/∂O·vᵀ is the probabilities' own gradient term."""
    from vitlens.explainers.gradskip_hiera import _attention

    model = _hf()
    adapter = vitlens.get_adapter(model)
    seen: list[torch.Tensor] = []
    hooks = [blk.attn.register_forward_hook(lambda m, a, out: seen.append(out[1])) for blk in adapter.blocks()]
    try:
        with adapter.session(capture=True) as rec:
            y = model(pixel_values=_x(), output_attentions=True).logits[:, 1].sum()
            outs = [b.out for b in rec.blocks]
            grads = torch.autograd.grad(y, outs + seen)
    finally:
        for h in hooks:
            h.remove()
    n = len(outs)
    layouts = [(b.windows, b.q_stride) for b in rec.blocks]
    assert layouts == [(4, 1), (4, 4), (1, 1), (1, 4)]  # mask units (lagged one block into stage 2), then global
    for i, brec in enumerate(rec.blocks):
        attn, flow, _ = _attention(brec, grads[i])
        assert attn.shape == seen[i].shape
        torch.testing.assert_close(attn, seen[i].detach(), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(flow, seen[i].detach() * grads[n + i], rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("kind", ["proj", "cat"])
def test_pool_handback_is_exact_and_conservative(kind):
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(2, 4 * 6, 8, generator=gen, dtype=torch.float64)
    g = torch.randn(2, 6, 8 if kind == "proj" else 16, generator=gen, dtype=torch.float64)
    zw = z.reshape(2, 4, 6, 8)
    skip = zw.amax(1) if kind == "proj" else torch.cat([zw.amax(1), zw.mean(1)], -1)
    c = pool_contributions(z, g, 4, kind)
    torch.testing.assert_close(c.sum(1), (skip * g).sum(-1))  # gradient x activation through the max (and mean)
    zr = z.clone().requires_grad_(True)  # ... token by token, what autograd routes through the pool
    zrw = zr.reshape(2, 4, 6, 8)
    out = zrw.amax(1) if kind == "proj" else torch.cat([zrw.amax(1), zrw.mean(1)], -1)
    (gz,) = torch.autograd.grad((out * g).sum(), zr)
    torch.testing.assert_close(c, (z * gz).sum(-1).reshape(2, 4, 6))
    r = torch.rand(2, 6, generator=gen, dtype=torch.float64)
    back = pool_handback(r, c)
    assert back.shape == (2, 24) and (back >= 0).all()
    torch.testing.assert_close(back.sum(-1), r.sum(-1))
    flat = pool_handback(r, -c.abs())  # no positive contribution anywhere: uniform over the stride window
    torch.testing.assert_close(flat.reshape(2, 4, 6), r[:, None].expand(2, 4, 6) / 4)
    share = pool_contributions(z, g, 4, kind, rule="argmax")
    torch.testing.assert_close(share.sum(1), torch.ones(2, 6, dtype=torch.float64))


# -- completeness, conservation, equality across libraries -------------------------------------------------------------

@pytest.mark.parametrize("trained", [False, True], ids=["init", "trained-like"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_timm_map_is_complete_and_conserved_block_by_block(variant, trained):
    model = _timm(variant, trained)
    exp = vitlens.explain(model, _x(), method="gradskip", target=2)
    assert exp.token_maps.shape == (2, 8, 8) and exp.maps.shape == (2, 32, 32)
    _complete_and_conserved(exp)
    assert exp.extras["head_weights"].shape == (2, 4, 4) and exp.extras["beta_main"].shape == (2, 4, 64)
    assert exp.token_maps.flatten(1).std(1).min() > 0  # not the uniform fallback


@pytest.mark.parametrize("trained", [False, True], ids=["init", "trained-like"])
def test_hf_map_is_complete_and_conserved_block_by_block(trained):
    exp = vitlens.explain(_hf(trained), _x(), method="gradskip", target=2)
    _complete_and_conserved(exp)


@pytest.mark.parametrize("rule", ["gxa", "argmax"])
def test_both_pool_rules_are_complete(rule):
    model = _timm()
    method = get_method("gradskip")
    att, logits, tgt = attribute_mask_units(method, vitlens.get_adapter(model), _x(), ClassLogit(1), pool_rule=rule)
    y = logits[:, 1].double()
    torch.testing.assert_close(att.values.sum((1, 2)).double(), y, rtol=1e-5, atol=1e-5)
    with pytest.raises(InputError, match="pool_rule must be one of gxa, argmax"):
        attribute_mask_units(method, vitlens.get_adapter(model), _x(), ClassLogit(1), pool_rule="mean")


def test_timm_and_hf_with_the_same_weights_get_the_same_map():
    src = _timm()
    hf = _hf_from_timm(src)
    x = _x()
    with torch.no_grad():
        torch.testing.assert_close(hf(pixel_values=x).logits, src(x), rtol=1e-5, atol=1e-5)
    for opts in ({}, {"conservative": False}):
        a = vitlens.explain(src, x, method="gradskip", target=3, **opts)
        b = vitlens.explain(hf, x, method="gradskip", target=3, **opts)
        scale = float(a.token_maps.abs().max())
        torch.testing.assert_close(b.token_maps, a.token_maps, rtol=1e-4, atol=1e-5 * scale)


def test_ablations_change_the_map():
    model, x = _timm(), _x()
    ref = vitlens.explain(model, x, method="gradskip", target=2).token_maps
    for opts in ({"skip": "fixed"}, {"head_weighting": "uniform"}, {"conservative": False}):
        exp = vitlens.explain(model, x, method="gradskip", target=2, **opts)
        _complete_and_conserved(exp)
        assert not torch.allclose(exp.token_maps, ref), opts


# -- batch, determinism, cost, restoration, refusals ------------------------------------------------------------------

@pytest.mark.parametrize("make", [_timm, _hf], ids=["timm", "hf"])
def test_batch_equals_one_by_one_and_is_deterministic(make):
    model, x = make(), _x(3)
    full = vitlens.explain(model, x, method="gradskip")
    assert torch.equal(vitlens.explain(model, x, method="gradskip").maps, full.maps)
    for i in range(3):
        one = vitlens.explain(model, x[i:i + 1], method="gradskip")
        assert one.targets.tolist() == full.targets[i:i + 1].tolist()
        scale = float(full.token_maps[i].abs().max())
        torch.testing.assert_close(one.token_maps[0], full.token_maps[i], rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.parametrize("make", [_timm, _hf], ids=["timm", "hf"])
def test_exactly_one_forward_and_one_backward_per_batch(make):
    model = make()
    calls = {"fwd": 0, "bwd": 0}

    def fwd(module, args, out):
        calls["fwd"] += 1
        logits = out if isinstance(out, torch.Tensor) else out.logits
        logits.register_hook(lambda g: calls.__setitem__("bwd", calls["bwd"] + 1))

    embed = vitlens.get_adapter(model).embed
    seen: list[int] = []
    hooks = [model.register_forward_hook(fwd), embed.register_full_backward_hook(lambda *a: seen.append(1))]
    try:
        exp = vitlens.explain(model, _x(4), method="gradskip")
    finally:
        for h in hooks:
            h.remove()
    assert calls == {"fwd": 1, "bwd": 1}
    assert seen == []  # the backward stops at block 0's input
    assert exp.cost.model_calls == 1 and exp.cost.backward_calls == 1


@pytest.mark.parametrize("make", [_timm, _hf], ids=["timm", "hf"])
def test_model_restored_after_success_and_exception(make):
    model = make().train()
    assert_restored(model, lambda m: vitlens.explain(m, _x(1), method="gradskip"),
                    vitlens.get_adapter(model).blocks()[1])
    assert model.training


def test_gradskip_keeps_timms_fused_attention_and_gets_the_explicit_paths_map():
    """The path recomputes A from the recorded qkv: the forward runs the attention as built (fused), the map is the
    one computed with the explicit path; ``explicit_attention()`` (and a session without ``recompute``) switches the
    fused path off, and every switch is restored."""
    model, x = _timm(), _x()
    attns = [blk.attn for blk in model.blocks]
    seen: list[bool] = []
    hooks = [a.register_forward_hook(lambda m, args, out: seen.append(m.fused_attn)) for a in attns]
    try:
        for a in attns:
            a.fused_attn = True
        fused = vitlens.explain(model, x, method="gradskip", target=2)
        assert seen == [True] * len(attns)
        for a in attns:
            a.fused_attn = False
        explicit = vitlens.explain(model, x, method="gradskip", target=2)
    finally:
        for h in hooks:
            h.remove()
    scale = float(explicit.token_maps.abs().max())
    torch.testing.assert_close(fused.token_maps, explicit.token_maps, rtol=1e-4, atol=1e-5 * scale)
    for a in attns:
        a.fused_attn = True
    adapter = vitlens.get_adapter(model)
    with torch.no_grad():
        ref = model(x)
    with adapter.session(capture=True):
        assert not any(a.fused_attn for a in attns)
        with torch.no_grad():
            torch.testing.assert_close(adapter.forward(x), ref, rtol=1e-5, atol=1e-5)
    assert all(a.fused_attn for a in attns)


@pytest.mark.parametrize("make,name", [(_timm, "Hiera (timm-hiera)"),
                                       (_hf, "HieraForImageClassification (hf-hiera)")], ids=["timm", "hf"])
def test_rollout_and_gae_stay_refused_with_the_reason(make, name):
    model = make()
    for method in ("rollout", "gae", "attn_gradcam"):
        with pytest.raises(UnsupportedModelError) as err:
            vitlens.explain(model, _x(1), method=method)
        msg = str(err.value)
        assert msg.startswith(f"method '{method}' needs ") and name in msg and "\n" not in msg
        assert "square attention on the same tokens in successive blocks and an identity skip" in msg, msg
        assert "gradskip" in msg.split("methods that work on this model: ")[1].split(", ")
