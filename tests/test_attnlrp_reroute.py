"""AttnLRP and CP-LRP carry their attention rule on the model's own attention (issue #26): scaling the gradient of
the projected q, k, v (``QKV_GRADIENT``) gives the gradients of the explicit rewrite (:func:`attention_rule`, which
recomputes ``softmax(q·kᵀ/√d)·v`` with the rule's gradient path) up to float rounding, on timm's fused qkv and on
HF's separate projections, with the model's fused attention left on."""

from __future__ import annotations

import pytest
import torch

import vitlens
from vitlens.explainers._lrp import LinearTaps
from vitlens.explainers._gradient_input_lrp import QKV_GRADIENT, attention_rule, identity_rule

from conftest import tiny_vit
from test_baselines_attention import batch, randomise_biases


def relevance(model, x, **taps_kw) -> torch.Tensor:
    adapter = vitlens.get_adapter(model)
    with adapter.session(capture=True, conservative=True, recompute=True) as rec:
        taps = LinearTaps(adapter, rec, rewrite_act=identity_rule, **taps_kw)
        with taps.installed():
            logits = adapter.forward(x)
        u0 = rec.blocks[0].u
        torch.autograd.backward(logits.max(-1).values.sum(), inputs=[u0])
    return (u0.detach() * u0.grad).sum(-1)


def models():
    tm = randomise_biases(tiny_vit())
    out = [("timm", tm)]
    try:
        from timm_to_hf import timm_to_hf_vit

        out.append(("hf", timm_to_hf_vit(tm)))
    except ImportError:  # transformers is an optional extra
        pass
    return out


@pytest.mark.parametrize("mode", sorted(QKV_GRADIENT))
def test_scaled_projection_gradients_equal_the_explicit_rewrite(mode):
    x = batch(2)
    for name, model in models():
        fused = [getattr(getattr(b, "attn", None), "fused_attn", None) for b in getattr(model, "blocks", [])]
        rerouted = relevance(model, x, qkv_grad=QKV_GRADIENT[mode])
        explicit = relevance(model, x, rewrite_ctx=attention_rule(mode))
        plain = relevance(model, x)
        scale = float(explicit.abs().max())
        torch.testing.assert_close(rerouted, explicit, rtol=0.0, atol=1e-5 * scale, msg=name)
        assert float((plain - explicit).abs().max()) > 1e-3 * scale  # the rule changes the relevance
        assert [getattr(getattr(b, "attn", None), "fused_attn", None)
                for b in getattr(model, "blocks", [])] == fused


def test_methods_keep_the_fused_attention_and_restore_the_model():
    from conftest import model_fingerprint

    model = tiny_vit()
    before = model_fingerprint(model)
    seen: list[bool] = []
    handles = [b.attn.register_forward_pre_hook(lambda m, a: seen.append(bool(m.fused_attn))) for b in model.blocks]
    try:
        for method in ("attnlrp", "cplrp"):
            vitlens.explain(model, batch(2), method=method)
    finally:
        for h in handles:
            h.remove()
    assert seen == [True] * (2 * len(model.blocks))
    assert model_fingerprint(model) == before


def test_identity_rule_ratio_is_z_over_p_plus_signed_eps_and_zero_at_zero():
    """The identity rule's backward ratio (issue #26 made it four passes): ``z / (p + eps·sign p)`` where ``p ≠ 0``,
    exactly 0 where ``p`` is ``+0`` or ``−0``, the same values bit for bit as the definition with a mask."""
    from vitlens.explainers._gradient_input_lrp import RATIO_EPS

    g = torch.Generator().manual_seed(0)
    p = torch.randn(2, 5, 64, generator=g)
    p[0, 0, :4] = torch.tensor([0.0, -0.0, 1e-30, -1e-30])
    p = p.requires_grad_()
    z = torch.nn.functional.gelu(p)
    out = identity_rule(p, z)
    torch.testing.assert_close(out, z, rtol=0.0, atol=0.0)  # the value is the activation's
    (grad,) = torch.autograd.grad(out, p, torch.ones_like(out))
    pd, zd = p.detach(), z.detach()
    expected = torch.where(pd == 0, torch.zeros_like(pd), zd / (pd + torch.full_like(pd, RATIO_EPS).copysign(pd)))
    assert torch.equal(grad, expected)
    assert grad[0, 0, :2].tolist() == [0.0, 0.0] and bool(torch.isfinite(grad).all())
