"""GradSkip: conservation, completeness, cost, equivariance, prefix tokens, sizes, timm == HF, ablations."""

from __future__ import annotations

import pytest
import torch

import vitlens
from vitlens.explainers.base import CostMeter
from vitlens.explainers.gradskip import gini, head_weights

from conftest import GRADSKIP_ABLATIONS, VARIANTS, options_id, tiny_vit, timm_to_hf_vit


def batch(n: int = 4, size: int = 32, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, size, size, generator=g)


def test_per_layer_conservation_and_completeness(variant):
    name, model = variant
    x = batch()
    exp = vitlens.explain(model, x, method="gradskip")
    totals = exp.extras["layer_totals"]  # (B, L+1)
    y = exp.scores
    assert totals.shape == (4, len(model.blocks) + 1)
    # every layer keeps the total relevance
    torch.testing.assert_close(totals, y[:, None].expand_as(totals), rtol=1e-5, atol=1e-6)
    # completeness at token level and at pixel level (integer upsampling factor)
    tok = exp.token_maps.sum(dim=(1, 2)) + exp.remainder
    pix = exp.maps.sum(dim=(1, 2)) + exp.remainder
    assert torch.allclose(tok, y, rtol=1e-4, atol=1e-6 * y.abs().max())
    assert torch.allclose(pix, y, rtol=1e-4, atol=1e-6 * y.abs().max())
    # relevance token by token at every depth: rows sum to the totals, the first is the map, the last the readout
    layers = exp.extras["layer_relevance"]  # (B, L+1, T)
    p = vitlens.get_adapter(model).num_prefix_tokens
    assert layers.shape[:2] == totals.shape and layers.shape[2] == p + exp.token_maps[0].numel()
    torch.testing.assert_close(layers.sum(-1), totals)
    torch.testing.assert_close(layers[:, 0, p:].reshape(exp.token_maps.shape), exp.token_maps)
    torch.testing.assert_close(layers[:, 0, :p].sum(-1), exp.remainder)


@pytest.mark.parametrize("name,prefix", [("gap", 0), ("cls", 1), ("distilled", 2), ("cls+4reg", 5), ("gap+4reg", 4)])
def test_prefix_tokens_are_derived_from_the_model(name, prefix):
    model = VARIANTS[name]()
    adapter = vitlens.get_adapter(model)
    assert adapter.num_prefix_tokens == prefix
    exp = vitlens.explain(model, batch(2))
    assert exp.token_maps.shape == (2, 4, 4)
    assert exp.maps.shape == (2, 32, 32)
    if prefix == 0:
        assert torch.all(exp.remainder == 0)


def test_distilled_readout_splits_between_cls_and_dist():
    model = VARIANTS["distilled"]()
    adapter = vitlens.get_adapter(model)
    assert adapter.readout_tokens == (0, 1)


def test_exactly_one_forward_and_one_backward_per_batch():
    model = tiny_vit()
    calls = {"fwd": 0, "bwd": 0}

    def fwd(module, args, out):
        calls["fwd"] += 1
        out.register_hook(lambda g: calls.__setitem__("bwd", calls["bwd"] + 1))

    h = model.register_forward_hook(fwd)
    try:
        exp = vitlens.explain(model, batch(6))
    finally:
        h.remove()
    assert calls == {"fwd": 1, "bwd": 1}
    assert exp.cost.model_calls == 1 and exp.cost.backward_calls == 1
    assert exp.cost.forward_passes == 1.0 and exp.cost.backward_passes == 1.0
    # with chunks of 2 images: three batched calls, still one pass per image
    exp = vitlens.explain(model, batch(6), batch_size=2)
    assert exp.cost.model_calls == 3 and exp.cost.forward_passes == 1.0


def test_backward_stops_at_the_first_block():
    model = tiny_vit()
    seen = []
    h = model.patch_embed.proj.register_full_backward_hook(lambda m, gi, go: seen.append(1))
    try:
        vitlens.explain(model, batch(2))
    finally:
        h.remove()
    assert seen == []


def test_batch_equals_one_by_one(variant):
    _, model = variant
    x = batch(5)
    full = vitlens.explain(model, x)
    for i in range(5):
        one = vitlens.explain(model, x[i:i + 1])
        torch.testing.assert_close(one.maps[0], full.maps[i], rtol=1e-4, atol=1e-6 * full.maps.abs().max())
        torch.testing.assert_close(one.remainder[0], full.remainder[i], rtol=1e-4, atol=1e-7)


def test_deterministic():
    model = tiny_vit()
    x = batch(3)
    a, b = vitlens.explain(model, x), vitlens.explain(model, x)
    assert torch.equal(a.maps, b.maps)


def test_dynamic_img_size_other_input_size():
    model = tiny_vit(dynamic_img_size=True)
    for size in [(32, 32), (48, 40), (64, 64)]:
        x = torch.randn(2, 3, *size)
        exp = vitlens.explain(model, x)
        assert exp.maps.shape == (2, *size)
        assert exp.token_maps.shape == (2, size[0] // 8, size[1] // 8)
        tot = exp.token_maps.sum(dim=(1, 2)) + exp.remainder
        torch.testing.assert_close(tot, exp.scores, rtol=1e-4, atol=1e-6)


def test_fixed_size_model_rejects_other_sizes():
    with pytest.raises(vitlens.InputError, match="expects 32x32"):
        vitlens.explain(tiny_vit(), torch.randn(1, 3, 48, 48))


def test_timm_and_hf_vit_of_the_same_weights_give_the_same_maps():
    pytest.importorskip("transformers")
    tm = tiny_vit()
    hm = timm_to_hf_vit(tm)
    x = batch(3)
    with torch.no_grad():
        torch.testing.assert_close(tm(x), hm(pixel_values=x).logits, rtol=1e-5, atol=1e-5)
    a = vitlens.explain(tm, x)
    b = vitlens.explain(hm, x)
    scale = a.maps.abs().max()
    torch.testing.assert_close(a.maps, b.maps, rtol=1e-4, atol=1e-5 * scale)
    torch.testing.assert_close(a.remainder, b.remainder, rtol=1e-4, atol=1e-5 * scale)
    # a different input size through HF's position-embedding interpolation, which the user asks for
    hm.vitlens_interpolate_pos_encoding = True
    e = vitlens.explain(hm, torch.randn(2, 3, 48, 40))
    assert e.token_maps.shape == (2, 6, 5)


def test_hf_deit_distilled():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.DeiTConfig(image_size=32, patch_size=8, hidden_size=48, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=96, num_labels=5)
    torch.manual_seed(0)
    model = transformers.DeiTForImageClassificationWithTeacher(cfg).eval()
    adapter = vitlens.get_adapter(model)
    assert adapter.num_prefix_tokens == 2 and adapter.readout_tokens == (0, 1)
    exp = vitlens.explain(model, batch(2))
    torch.testing.assert_close(exp.token_maps.sum((1, 2)) + exp.remainder, exp.scores, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("opts", GRADSKIP_ABLATIONS, ids=options_id)
def test_each_ablation_switch_changes_the_map(opts):
    model = tiny_vit(depth=4)
    x = batch(3)
    base = vitlens.explain(model, x)
    other = vitlens.explain(model, x, **opts)
    assert not torch.allclose(base.token_maps, other.token_maps, rtol=1e-3, atol=1e-6), opts
    # every ablation still conserves relevance
    torch.testing.assert_close(other.token_maps.sum((1, 2)) + other.remainder, other.scores, rtol=1e-4, atol=1e-6)


def test_alpha_extremes_equal_the_single_score_modes():
    model = tiny_vit()
    x = batch(3)
    for alpha, mode in [(0.0, "sparsity"), (1.0, "gradient")]:
        a = vitlens.explain(model, x, alpha=alpha)
        b = vitlens.explain(model, x, head_weighting=mode)
        torch.testing.assert_close(a.maps, b.maps, rtol=0, atol=0)


def test_head_subset_string_form():
    model = tiny_vit()
    x = batch(2)
    a = vitlens.explain(model, x, head_subset="top25")
    b = vitlens.explain(model, x, head_subset=("top", 0.25))
    assert torch.equal(a.maps, b.maps)


def test_head_weights_sum_to_one_and_threshold_filters():
    attn = torch.softmax(torch.randn(2, 6, 10, 10) * 3, dim=-1)
    grad = torch.randn(2, 6, 10, 10)
    grad[:, 0] *= 1e-4  # a head with (almost) no gradient flow
    w = head_weights(attn, grad, "gradient", grad_threshold=0.1)
    torch.testing.assert_close(w.sum(-1), torch.ones(2))
    assert torch.all(w[:, 0] == 0)
    for mode in ["adaptive", "uniform", "sparsity"]:
        torch.testing.assert_close(head_weights(attn, grad, mode).sum(-1), torch.ones(2))
    sub = head_weights(attn, grad, "adaptive", head_subset=("top", 0.5))
    assert int((sub > 0).sum(-1).max()) <= 3


def test_gini_values():
    n = 8
    uniform = torch.full((n,), 1.0 / n)
    spike = torch.zeros(n)
    spike[3] = 1.0
    assert abs(float(gini(uniform))) < 1e-6
    assert abs(float(gini(spike)) - (n - 1) / n) < 1e-6
    assert float(gini(torch.zeros(n))) == 0.0
    # invariant to order and scale
    p = torch.rand(n)
    assert abs(float(gini(p)) - float(gini(p[torch.randperm(n)] * 7))) < 1e-6


def test_maps_are_nonnegative_for_positive_scores():
    model = tiny_vit()
    exp = vitlens.explain(model, batch(4))
    for i in range(4):
        if exp.scores[i] > 0:
            assert float(exp.token_maps[i].min()) >= 0


def test_cost_meter_counts_images():
    model = tiny_vit()
    with CostMeter(model) as m:
        with torch.no_grad():
            model(batch(3))
            model(batch(2))
    c = m.cost(5)
    assert c.model_calls == 2 and c.forward_passes == 1.0 and c.backward_calls == 0
