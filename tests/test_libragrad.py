"""LibraGrad: FullGrad-completeness where the paper promises it, the authors' own numbers pinned on a fixed model,
and the three methods' settings being their base methods'."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch import nn

import vitlens
from vitlens.explainers import get_method
from vitlens.explainers._libragrad import libra_rules
from vitlens.explainers.registry import method_classes
from vitlens.models import get_adapter

from conftest import tiny_deit_distilled, tiny_vit

LIBRA = {"libragrad_inputxgradient": "inputxgradient", "libragrad_ig": "integrated_gradients",
         "libragrad_gradcam": "gradcam"}


def _swiglu_qknorm():
    from timm.layers import SwiGLUPacked

    return tiny_vit(mlp_layer=SwiGLUPacked, mlp_ratio=2.0, qk_norm=True)


_MODELS = {"cls": tiny_vit, "distilled": tiny_deit_distilled,
           "gap+reg": partial(tiny_vit, class_token=False, global_pool="avg", reg_tokens=2),
           "swiglu+qknorm": _swiglu_qknorm}


@pytest.mark.parametrize("variant", list(_MODELS))
def test_fullgrad_completeness(variant):
    """Under the rules the network is linear in (input, biases) in the backward sense: the logit equals the input ×
    gradient sum plus every bias (linear and norm biases, position embeddings, CLS/register tokens) × its gradient.
    float64 weights of a larger spread than the init, so the check is not trivially small."""
    model = _MODELS[variant]().double()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    bias_names = ("bias", "pos_embed", "cls_token", "dist_token", "reg_token")
    saved = {p: p.requires_grad for p in model.parameters()}
    biases = [p for n, p in model.named_parameters() if n.split(".")[-1] in bias_names]
    try:
        for p in model.parameters():
            p.requires_grad_(p in set(biases))
        for i in range(len(x)):
            with libra_rules(get_adapter(model)):
                xi = x[i:i + 1].clone().requires_grad_(True)
                y = model(xi)[0, 2]
                grads = torch.autograd.grad(y, [xi, *biases], allow_unused=True)
            total = (xi * grads[0]).sum() + sum((b * g).sum() for b, g in zip(biases, grads[1:]) if g is not None)
            total, y = float(total.detach()), float(y.detach())
            assert abs(total - y) < 1e-8 * max(1.0, abs(y)), (total, y)
    finally:
        for p, flag in saved.items():
            p.requires_grad_(flag)
    # and the method's map is that input × gradient (the plain gradient's is not complete)
    e = get_method("libragrad_inputxgradient").explain(model, x, target=[2, 2])
    plain = get_method("inputxgradient").explain(model, x, target=[2, 2])
    assert not torch.allclose(e.maps, plain.maps)


#: the authors' code (GitHub NightMachinery/decompv-libragrad-v1 with their timm fork
#: NightMachinery/pytorch-image-models-libragrad-v1 and NightMachinery/PyNight, run in a scratch venv):
#: ``configure_gradient_modes(gradient_mode_brand="LX1", softmax_mode="S0", mlp_mul_gbrand=None)`` (their
#: ``LibraGrad`` preset on a plain-MLP ViT, explaining the logit) on their ``VisionTransformer`` loaded with
#: ``tiny_vit()``'s state dict, the batch ``randn(2, 3, 32, 32)`` of seed 0, target = predicted class.
#: ``AUTHORS_IXG``: ``(x · ∂̃y/∂x).sum(channels)[:, ::8, ::8]``; ``AUTHORS_GRAD_U``: ``∂̃y/∂u`` at the last block's
#: input, ``[:, ::5, ::12]``. Script: benchmarks/libragrad_authors_crosscheck.py.
AUTHORS_IXG = [-8.4017089e-04, 2.7587477e-04, 9.3453785e-04, 1.6482749e-03, -6.0478793e-05, 1.5988636e-04,
               -3.4701868e-04, -5.5580400e-04, -8.3983364e-04, -1.0418848e-04, -2.0257367e-03, 3.8938748e-04,
               -8.6667750e-04, -3.7464418e-04, -2.5740592e-05, -1.7795430e-03, -3.3116126e-03, -3.3612936e-04,
               -1.5334316e-04, 3.0202320e-04, -1.1195138e-04, -1.6674532e-03, 7.6204975e-05, -1.2645824e-03,
               -3.4238675e-03, -3.2319177e-03, -1.1713484e-03, 9.1461808e-04, -4.0998586e-04, 3.5857834e-04,
               1.1727067e-03, -2.2649732e-03]
AUTHORS_GRAD_U = [-7.5879389e-01, -1.1493444e-01, -8.5228801e-02, -8.4303951e-01, -1.9489207e-03, 4.2067780e-03,
                  2.1911096e-03, 2.4378812e-04, -2.9418296e-03, 5.1628691e-03, 2.7542210e-03, 2.1533838e-04,
                  -3.7697672e-03, 6.7307698e-03, 3.4143680e-03, -4.4443783e-05, -9.1698730e-01, 2.0355278e-01,
                  -4.4346386e-01, -2.7427289e-01, 1.1251884e-03, -2.3714085e-03, -7.3571492e-04, 4.2574218e-04,
                  7.3830655e-04, -2.4211793e-03, -6.5255060e-04, 6.6129211e-04, 7.9686771e-04, -2.6811224e-03,
                  -4.6947337e-04, 6.5091375e-04]


def test_matches_the_authors_code():
    model = tiny_vit()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    e = get_method("libragrad_inputxgradient").explain(model, x)
    assert e.targets.tolist() == [4, 1]
    torch.testing.assert_close(e.maps[:, ::8, ::8].flatten(), torch.tensor(AUTHORS_IXG), atol=2e-8, rtol=1e-4)
    feats = {}
    hook = model.blocks[-1].register_forward_pre_hook(lambda m, args: feats.__setitem__("u", args[0]))
    try:
        with libra_rules(get_adapter(model)):
            xg = x.clone().requires_grad_(True)
            logits = model(xg)
    finally:
        hook.remove()
    (g,) = torch.autograd.grad(logits[torch.arange(2), e.targets].sum(), feats["u"])
    torch.testing.assert_close(g[:, ::5, ::12].flatten(), torch.tensor(AUTHORS_GRAD_U), atol=2e-6, rtol=1e-4)


@pytest.mark.parametrize("name", list(LIBRA))
def test_settings_are_the_base_methods(name):
    cls, base = method_classes()[name], method_classes()[LIBRA[name]]
    assert cls.defaults == base.defaults and cls.fast_options == base.fast_options and cls.level == base.level
    assert get_method(name).declared_cost() == get_method(LIBRA[name]).declared_cost()
    assert name in vitlens.methods()


def test_rules_leave_no_hook_and_refuse_models_without_declared_linears():
    model = tiny_vit()
    before = {n: (dict(m._forward_hooks), dict(m._forward_pre_hooks)) for n, m in model.named_modules()}
    with pytest.raises(RuntimeError, match="boom"):
        with libra_rules(get_adapter(model)):
            raise RuntimeError("boom")
    after = {n: (dict(m._forward_hooks), dict(m._forward_pre_hooks)) for n, m in model.named_modules()}
    assert before == after
    cnn = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))
    with pytest.raises(vitlens.UnsupportedModelError, match="libragrad_inputxgradient"):
        get_method("libragrad_inputxgradient").explain(cnn, torch.randn(1, 3, 16, 16))
