"""Half precision, autocast, float64 inputs and ``torch.no_grad()`` callers (docs/methods/gradskip.md, "Precision").

Completeness tolerances (relative to ``|y|``) stated per dtype, for GradSkip, whose propagation runs in at least
float32 whatever the model's dtype: 1e-5 for float16 / bfloat16 / float64 models and under ``torch.autocast(bfloat16)``
(the caller's autocast applies to the model's forward passes only, ``Adapter.caller_autocast``).
"""

from __future__ import annotations

import copy

import pytest
import torch

import vitlens
from vitlens.explainers import get_method
from vitlens.explainers.gradskip import gini
from vitlens.explainers.registry import requirements
from vitlens.models.base import conservative_layernorm_hook, normalisation_layers

from conftest import model_fingerprint, tiny_vit

METHODS = sorted(n for n in requirements() if n != "aha")  # AHA needs a trained explainer network
COMPLETENESS_TOL = {torch.float16: 1e-5, torch.bfloat16: 1e-5, torch.float64: 1e-5, "autocast": 1e-5}


def _x(n=2, size=32, seed=0):
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


def _explain(model, x, name, dtype, **kw):
    method = get_method(name, **{**type(get_method(name)).fast_options, **kw})
    if dtype == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return method.explain(model, x)
    return method.explain(model.to(dtype), x)


def _corr(a, b):
    a, b = a.flatten(1).double(), b.flatten(1).double()
    a, b = a - a.mean(1, keepdim=True), b - b.mean(1, keepdim=True)
    return (a * b).sum(1) / (a.norm(dim=1) * b.norm(dim=1))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, "autocast"], ids=["fp16", "bf16", "autocast-bf16"])
@pytest.mark.parametrize("name", METHODS)
def test_every_method_gives_finite_maps_in_half_precision(name, dtype):
    model = tiny_vit()
    exp = _explain(copy.deepcopy(model), _x(), name, dtype)
    assert exp.maps.shape == (2, 32, 32) and exp.maps.dtype == torch.float32
    assert torch.isfinite(exp.maps).all(), f"{name} gives non-finite maps in {dtype}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64, "autocast"],
                         ids=["fp16", "bf16", "fp64", "autocast-bf16"])
def test_gradskip_half_precision_matches_float32_and_conserves(dtype):
    torch.manual_seed(0)
    model = tiny_vit(img_size=64, embed_dim=64, depth=4, num_classes=10)
    x = _x(4, 64)
    ref = vitlens.explain(model, x, method="gradskip", target=3)
    if dtype == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            exp = vitlens.explain(model, x, method="gradskip", target=3)
    else:
        exp = vitlens.explain(copy.deepcopy(model).to(dtype), x, method="gradskip", target=3)
    assert _corr(exp.token_maps, ref.token_maps).min() >= 0.99
    total = exp.token_maps.sum((1, 2)).double() + exp.remainder.double()
    y = exp.scores.double()
    assert ((total - y).abs() / y.abs().clamp_min(1e-6)).max() <= COMPLETENESS_TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_input_is_cast_to_the_model_dtype(dtype):
    model = tiny_vit()
    ref = vitlens.explain(model, _x(), method="gradskip")
    exp = vitlens.explain(model, _x().to(dtype), method="gradskip")  # fp32 model, other input dtype
    assert torch.isfinite(exp.maps).all()
    assert _corr(exp.token_maps, ref.token_maps).min() > 0.99


@pytest.mark.parametrize("name", ["gradskip", "gradient", "integrated_gradients", "gae", "gradcam", "attnlrp"])
def test_gradient_methods_work_inside_no_grad(name):
    model = tiny_vit()
    x = _x()
    ref = get_method(name).explain(model, x)
    with torch.no_grad():
        exp = get_method(name).explain(model, x)
        assert not torch.is_grad_enabled()  # the caller's mode is restored after the call
    torch.testing.assert_close(exp.maps, ref.maps)


def test_model_restored_after_half_precision_explanation():
    model = tiny_vit().to(torch.float16)
    before = model_fingerprint(model)
    vitlens.explain(model, _x(), method="gradskip")
    assert model_fingerprint(model) == before


def test_gini_accepts_bfloat16():
    p = torch.rand(3, 4, 7)
    torch.testing.assert_close(gini(p.to(torch.bfloat16)).float(), gini(p), atol=2e-2, rtol=0)


@pytest.mark.parametrize("kind", ["torch", "timm"])
def test_conservative_hook_covers_rmsnorm(kind):
    if kind == "torch":
        norm = torch.nn.RMSNorm(16, eps=1e-6)
    else:
        from timm.layers import RmsNorm

        norm = RmsNorm(16, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(5, 16, requires_grad=True)
    y = norm(x)
    z = conservative_layernorm_hook(norm, (x,), y)
    torch.testing.assert_close(z, y, rtol=1e-5, atol=1e-6)
    # with the scale detached the map is linear: gradient x input sums to the output's weighted sum
    w = torch.randn(5, 16)
    (g,) = torch.autograd.grad((z * w).sum(), [x])
    torch.testing.assert_close((g * x).sum(), (z * w).sum(), rtol=1e-5, atol=1e-5)
    ln = torch.nn.LayerNorm(16)
    assert normalisation_layers(torch.nn.Sequential(norm, torch.nn.ReLU(), ln)) == [norm, ln]


def test_autocast_reaches_the_model_and_is_restored():
    model = tiny_vit()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        exp = vitlens.explain(model, _x(), method="gradskip")
        assert torch.is_autocast_enabled("cpu")  # the caller's autocast is back after the call
    assert exp.scores.dtype == torch.bfloat16  # the forward ran under it
    assert exp.maps.dtype == torch.float32 and torch.isfinite(exp.maps).all()
    assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_metrics_and_sanity_check_on_half_precision_models(dtype):
    from vitlens.metrics import InsertionDeletion, randomisation_check

    model = tiny_vit().to(dtype)
    model.vitlens_data_config = {"input_size": (3, 32, 32), "mean": (0.5,) * 3, "std": (0.5,) * 3}
    x = _x()
    exp = vitlens.explain(model, x, method="gradskip")
    res = InsertionDeletion(steps=4)(exp.maps, model=model, x=x, targets=exp.targets)
    assert all(torch.isfinite(v).all() for v in res.values.values())
    out = randomisation_check(model, x, method="gradskip")
    assert out["stages"][0] == "head" and torch.isfinite(out["spearman"]).all()
