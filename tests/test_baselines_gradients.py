"""Gradient and CAM baselines: cross-checks against Captum and pytorch-grad-cam, hand-checkable cases on tiny
analytic models, IG completeness, and errors for bad options."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import vitlens
from vitlens.errors import InputError, TargetError, UnsupportedModelError
from vitlens.targets import Target
from vitlens.explainers.integrated_gradients import QUADRATURES, baseline_for, quadrature

from conftest import VARIANTS, timm_to_hf_vit, tiny_vit

# one intra-op thread for the module (restored after it): tiny tensors, a shared CPU
pytestmark = pytest.mark.usefixtures("one_thread_per_module")


def batch(n: int = 3, size: int = 32, seed: int = 0, c: int = 3) -> torch.Tensor:
    return torch.randn(n, c, size, size, generator=torch.Generator().manual_seed(seed))


def rel_err(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


# ---------------------------------------------------------------------------------------------------------------------
# tiny analytic models (generic adapter: any nn.Module mapping images to logits)
# ---------------------------------------------------------------------------------------------------------------------
class Linear(nn.Module):
    """``y = W · vec(x) + b`` with 3 classes."""

    def __init__(self, c: int = 3, size: int = 4, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = nn.Parameter(torch.randn(3, c, size, size, generator=g))
        self.b = nn.Parameter(torch.randn(3, generator=g))

    def forward(self, x):
        return torch.einsum("kchw,bchw->bk", self.w, x) + self.b


class Quadratic(nn.Module):
    """Class 0: ``Σ x²``; class 1: ``Σ x``."""

    def forward(self, x):
        return torch.stack([(x**2).flatten(1).sum(1), x.flatten(1).sum(1)], dim=1)


def test_gradient_of_a_linear_model_is_its_weights():
    model = Linear()
    x = batch(2, 4)
    for reduce, expect in [("max_abs", model.w[1].abs().amax(0)), ("sum_abs", model.w[1].abs().sum(0)),
                           ("sum", model.w[1].sum(0))]:
        exp = vitlens.explain(model, x, "gradient", 1, reduce=reduce)
        torch.testing.assert_close(exp.maps, expect.detach().expand(2, 4, 4))
    assert exp.cost.forward_passes == 1 and exp.cost.backward_passes == 1


def test_smoothgrad_of_a_linear_model_equals_the_gradient():
    model = Linear()
    x = batch(2, 4)
    sg = vitlens.explain(model, x, "smoothgrad", 2, n=5, noise=0.3)
    g = vitlens.explain(model, x, "gradient", 2)
    torch.testing.assert_close(sg.maps, g.maps)
    assert sg.cost.forward_passes == 6 and sg.cost.backward_passes == 5


def test_smoothgrad_noise_is_seeded_per_image():
    method = vitlens.explainers.get_method("smoothgrad", n=3, noise=0.2, seed=7)
    x = batch(2, 8)
    eps = method.noise(x)
    assert eps.shape == (3, 2, 3, 8, 8)
    torch.testing.assert_close(method.noise(x[1:]), eps[:, 1:])  # image 1's noise does not depend on image 0
    other = vitlens.explainers.get_method("smoothgrad", n=3, noise=0.2, seed=8).noise(x)
    assert not torch.allclose(eps, other)
    # σ is the fraction of each image's value range
    rng = (x[0].max() - x[0].min()).item()
    assert eps[:, 0].std().item() == pytest.approx(0.2 * rng, rel=0.1)
    assert torch.count_nonzero(vitlens.explainers.get_method("smoothgrad", n=2, noise=0.0).noise(x)) == 0


def test_smoothgrad_internal_batch_size_does_not_change_results():
    model = tiny_vit()
    x = batch(2)
    a = vitlens.explain(model, x, "smoothgrad", n=5, internal_batch_size=None)
    b = vitlens.explain(model, x, "smoothgrad", n=5, internal_batch_size=3)  # one noisy set (2 rows) per call
    torch.testing.assert_close(a.maps, b.maps, rtol=1e-4, atol=1e-6)
    assert a.cost.model_calls == 2 and b.cost.model_calls == 1 + 5


def test_smoothgrad_with_zero_noise_is_the_gradient_on_a_vit():
    model = tiny_vit()
    x = batch(2)
    sg = vitlens.explain(model, x, "smoothgrad", n=3, noise=0.0)
    g = vitlens.explain(model, x, "gradient")
    torch.testing.assert_close(sg.maps, g.maps, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("rule,factor", [
    ("riemann_left", lambda n: (n - 1) / n), ("riemann_right", lambda n: (n + 1) / n),
    ("riemann_middle", lambda n: 1.0), ("riemann_trapezoid", lambda n: 1.0), ("gausslegendre", lambda n: 1.0),
])
def test_integrated_gradients_of_a_square_by_hand(rule, factor):
    # f = Σ x², baseline 0: ∂f/∂x (αx) = 2αx, so IG = x² · (2 Σ_k w_k α_k): left (n−1)/n, right (n+1)/n, exact for
    # the midpoint, trapezoid and Gauss-Legendre rules (the integrand is linear in α).
    x = batch(2, 4)
    n = 5
    exp = vitlens.explain(Quadratic(), x, "integrated_gradients", 0, n_steps=n, rule=rule, baseline="zero")
    torch.testing.assert_close(exp.maps, (x**2).sum(1) * factor(n), rtol=1e-5, atol=1e-6)


def test_integrated_gradients_of_a_linear_model_is_exact():
    # linear f: IG = (x − x') ⊙ W for any rule whose weights sum to 1, and completeness holds exactly
    model = Linear()
    x = batch(2, 4)
    base = torch.full((3, 1, 1), 0.5)
    for rule in QUADRATURES:
        exp = vitlens.explain(model, x, "integrated_gradients", 0, n_steps=3, rule=rule, baseline=base)
        torch.testing.assert_close(exp.maps, ((x - 0.5) * model.w[0]).sum(1).detach(), rtol=1e-5, atol=1e-5)
        with torch.no_grad():
            gap = model(x)[:, 0] - model(torch.full_like(x, 0.5))[:, 0]
        torch.testing.assert_close(exp.maps.sum((1, 2)), gap, rtol=1e-5, atol=1e-5)


def test_quadrature_rules():
    for rule in QUADRATURES:
        a, w = quadrature(rule, 6)
        assert len(a) == len(w) == 6 and sum(w) == pytest.approx(1.0) and 0 <= min(a) and max(a) <= 1
    assert quadrature("riemann_right", 4)[0] == [0.25, 0.5, 0.75, 1.0]
    assert quadrature("riemann_left", 4)[0] == [0.0, 0.25, 0.5, 0.75]
    assert quadrature("riemann_trapezoid", 3) == ([0.0, 0.5, 1.0], [0.25, 0.5, 0.25])
    a, w = quadrature("gausslegendre", 3)  # exact for degree ≤ 5: ∫ α⁵ = 1/6
    assert sum(wi * ai**5 for ai, wi in zip(a, w)) == pytest.approx(1 / 6)


# ---------------------------------------------------------------------------------------------------------------------
# IG completeness on a ViT: Σ IG → y(x) − y(x'), with the error shrinking as the rule's order says
# ---------------------------------------------------------------------------------------------------------------------
def _completeness_error(model, x, classes, n, rule):
    exp = vitlens.explain(model, x, "integrated_gradients", classes, n_steps=n, rule=rule, baseline="zero",
                          internal_batch_size=None)
    with torch.no_grad():
        idx = torch.arange(x.shape[0])
        gap = model(x)[idx, classes] - model(torch.zeros_like(x))[idx, classes]
    return float(((exp.maps.sum((1, 2)) - gap).abs() / gap.abs()).max())


def test_integrated_gradients_completeness_improves_with_steps():
    model = tiny_vit()
    x = batch(3)
    classes = torch.tensor([0, 1, 2])
    right = [_completeness_error(model, x, classes, n, "riemann_right") for n in (8, 32)]
    assert right[0] < 3 / 8 and right[1] < 3 / 32 and right[1] < right[0] / 2  # first order: error ~ 1/n
    middle = [_completeness_error(model, x, classes, n, "riemann_middle") for n in (8, 32)]
    assert middle[0] < 10 / 8**2 and middle[1] < 10 / 32**2  # second order: error ~ 1/n²
    assert _completeness_error(model, x, classes, 16, "gausslegendre") < 1e-3


# ---------------------------------------------------------------------------------------------------------------------
# Captum
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rule", QUADRATURES)
@pytest.mark.parametrize("baseline", ["black", "zero"])
def test_integrated_gradients_matches_captum(rule, baseline):
    captum_attr = pytest.importorskip("captum.attr")
    model = tiny_vit()
    model.vitlens_data_config = {"mean": (0.485, 0.456, 0.406), "std": (0.229, 0.224, 0.225)}
    x = batch(3)
    targets = [1, 2, 3]
    n = 8
    exp = vitlens.explain(model, x, "integrated_gradients", targets, n_steps=n, rule=rule, baseline=baseline,
                          internal_batch_size=5)
    base = baseline_for(vitlens.get_adapter(model), x, baseline)
    if baseline == "black":
        black = -torch.tensor([0.485, 0.456, 0.406]) / torch.tensor([0.229, 0.224, 0.225])
        assert torch.allclose(base[0, :, 0, 0], black)
    ref = captum_attr.IntegratedGradients(model).attribute(x, baselines=base, target=targets, n_steps=n,
                                                            method=rule).sum(1)
    if rule == "riemann_trapezoid":
        # Captum's trapezoid rule puts n nodes on [0, 1] (spacing 1/(n−1)) but weights them 1/n (halved at the
        # ends), so its weights sum to (n−1)/n; ours sum to 1 (the composite trapezoid rule).
        ref = ref * n / (n - 1)
    assert rel_err(exp.maps, ref) < 1e-4


def test_integrated_gradients_matches_captum_on_a_generic_model_and_tensor_baseline():
    captum_attr = pytest.importorskip("captum.attr")
    model = Linear(size=6)
    model.w.data = model.w.data.sin()  # keep it simple but non-trivial
    x = batch(2, 6)
    base = torch.linspace(-1, 1, 6)[None, None].expand(3, 6, 6)
    exp = vitlens.explain(model, x, "integrated_gradients", [2, 0], n_steps=7, rule="gausslegendre", baseline=base)
    ref = captum_attr.IntegratedGradients(model).attribute(x, baselines=base[None].expand_as(x), target=[2, 0],
                                                            n_steps=7, method="gausslegendre").sum(1)
    assert rel_err(exp.maps, ref) < 1e-4


def test_integrated_gradients_internal_batch_size_does_not_change_results():
    model = tiny_vit()
    x = batch(2)
    a = vitlens.explain(model, x, "integrated_gradients", n_steps=6, internal_batch_size=None)
    b = vitlens.explain(model, x, "integrated_gradients", n_steps=6, internal_batch_size=1)
    torch.testing.assert_close(a.maps, b.maps, rtol=1e-4, atol=1e-6)
    assert b.cost.model_calls == 1 + 6 and a.cost.model_calls == 2  # at least one whole step (B rows) per call
    c = vitlens.explain(model, x, "integrated_gradients", n_steps=6, internal_batch_size=5)
    assert c.cost.model_calls == 1 + 3
    torch.testing.assert_close(a.maps, c.maps, rtol=1e-4, atol=1e-6)
    assert a.cost.forward_passes == b.cost.forward_passes == 7


class _TwoLogits(Target):
    """A custom target without ``select``: ``y_0 + y_1``."""

    def resolve(self, logits):
        t = _TwoLogits()
        t.classes = torch.zeros(logits.shape[0], dtype=torch.long)
        return t

    def score(self, logits):
        return logits[:, 0] + logits[:, 1]


def test_any_target_object_works_for_many_point_methods():
    model = Linear()
    x = batch(2, 4)
    ig = vitlens.explain(model, x, "integrated_gradients", _TwoLogits(), n_steps=3, baseline="zero",
                         internal_batch_size=2)
    torch.testing.assert_close(ig.maps, (x * (model.w[0] + model.w[1])).sum(1).detach(), rtol=1e-5, atol=1e-5)
    sg = vitlens.explain(model, x, "smoothgrad", _TwoLogits(), n=3, reduce="sum")
    torch.testing.assert_close(sg.maps, (model.w[0] + model.w[1]).sum(0).detach().expand(2, 4, 4))


def test_integrated_gradients_of_a_probability_matches_captum():
    captum_attr = pytest.importorskip("captum.attr")
    model = tiny_vit()
    x = batch(2)
    exp = vitlens.explain(model, x, "integrated_gradients", vitlens.ClassProbability([3, 0]), n_steps=6,
                          rule="riemann_middle", baseline="zero")
    ref = captum_attr.IntegratedGradients(nn.Sequential(model, nn.Softmax(dim=-1))).attribute(
        x, baselines=torch.zeros_like(x), target=[3, 0], n_steps=6, method="riemann_middle").sum(1)
    assert rel_err(exp.maps, ref) < 1e-4


def test_black_baseline_without_a_data_config_is_zero():
    x = batch(2, 4)
    adapter = vitlens.get_adapter(Linear())
    assert torch.count_nonzero(baseline_for(adapter, x, "black")) == 0
    assert torch.count_nonzero(baseline_for(vitlens.get_adapter(tiny_vit()), batch(2), "black")) == 0


# ---------------------------------------------------------------------------------------------------------------------
# pytorch-grad-cam
# ---------------------------------------------------------------------------------------------------------------------
def _reshape(prefix: int, grid=(4, 4)):
    def transform(t):
        b, _, d = t.shape
        return t[:, prefix:].reshape(b, *grid, d).permute(0, 3, 1, 2)

    return transform


def _gradcam_raw(cam, x):
    """pytorch-grad-cam's un-normalised map of the last call (its own get_cam_image, then its ReLU)."""
    acts = cam.activations_and_grads.activations[0].numpy()
    grads = cam.activations_and_grads.gradients[0].numpy()
    return np.maximum(cam.get_cam_image(x, None, None, acts, grads), 0)


@pytest.mark.parametrize("name", ["cls", "gap", "distilled", "cls+4reg"])
@pytest.mark.parametrize("layer", [-1, 1])
def test_gradcam_matches_pytorch_grad_cam(name, layer):
    pgc = pytest.importorskip("pytorch_grad_cam")
    from pytorch_grad_cam.utils.image import scale_cam_image
    from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

    model = VARIANTS[name]()
    x = batch(3)
    exp = vitlens.explain(model, x, "gradcam", layer=layer)
    prefix = vitlens.get_adapter(model).num_prefix_tokens
    # pytorch-grad-cam reads a layer's OUTPUT: the output of block l−1 is exactly the residual input of block l
    # (the input of its first LayerNorm), which is what vitlens reads for layer=l.
    peer_layer = model.blocks[layer - 1]
    cam = pgc.GradCAM(model, [peer_layer], reshape_transform=_reshape(prefix))
    try:
        public = cam(x, targets=[ClassifierOutputTarget(int(c)) for c in exp.targets])
        raw = _gradcam_raw(cam, x)
    finally:
        cam.activations_and_grads.release()
    ours = exp.token_maps.numpy()
    assert rel_err(ours, raw) < 1e-4
    # the library's public output is its map min-max scaled and resized (twice): the same post-processing of ours
    np.testing.assert_allclose(scale_cam_image(scale_cam_image(ours, (32, 32))), public, atol=1e-4)


@pytest.mark.parametrize("name", ["cls", "gap"])
def test_finercam_probability_weighting_matches_pytorch_grad_cam(name):
    pgc = pytest.importorskip("pytorch_grad_cam")
    model = VARIANTS[name]()
    x = batch(3)
    exp = vitlens.explain(model, x, "finercam", weighting="probability", gamma=0.7)
    prefix = vitlens.get_adapter(model).num_prefix_tokens
    cam = pgc.FinerCAM(model, [model.blocks[-2]], reshape_transform=_reshape(prefix))
    try:
        cam(x, targets=None, alpha=0.7)
        raw = _gradcam_raw(cam.base_cam, x)
    finally:
        cam.base_cam.activations_and_grads.release()
    assert rel_err(exp.token_maps, raw) < 1e-4


def test_finercam_mean_weighting_is_gradcam_of_the_averaged_differences():
    pgc = pytest.importorskip("pytorch_grad_cam")
    model = tiny_vit()
    x = batch(3)
    exp = vitlens.explain(model, x, "finercam")
    with torch.no_grad():
        logits = model(x)
    refs = exp.extras["references"]
    assert refs.shape == (3, 3)
    # the predicted class's references are its runner-ups
    torch.testing.assert_close(refs, logits.argsort(dim=1, descending=True)[:, 1:4])
    targets = [(lambda out, c=int(c), d=r.tolist(): (out[..., c:c + 1] - out[..., d]).mean(-1))
               for c, r in zip(exp.targets, refs)]
    cam = pgc.GradCAM(model, [model.blocks[-2]], reshape_transform=_reshape(1))
    try:
        cam(x, targets=targets)
        raw = _gradcam_raw(cam, x)
    finally:
        cam.activations_and_grads.release()
    assert rel_err(exp.token_maps, raw) < 1e-4
    expected_scores = logits.gather(1, exp.targets[:, None])[:, 0] - logits.gather(1, refs).mean(1)
    torch.testing.assert_close(exp.scores, expected_scores)


def test_finercam_with_gamma_zero_is_gradcam():
    model = tiny_vit()
    x = batch(2)
    a = vitlens.explain(model, x, "finercam", gamma=0.0)
    b = vitlens.explain(model, x, "gradcam")
    torch.testing.assert_close(a.token_maps, b.token_maps)


def test_finercam_references_for_a_non_predicted_target_and_few_classes():
    model = tiny_vit(num_classes=3)
    x = batch(2)
    exp = vitlens.explain(model, x, "finercam", 0)
    assert exp.extras["references"].shape == (2, 2)  # capped at K − 1
    assert (exp.extras["references"] != 0).all()


def test_attention_gradcam_by_hand():
    model = tiny_vit()
    x = batch(2)
    exp = vitlens.explain(model, x, "attn_gradcam", [1, 4])
    # independent computation with plain hooks on timm's explicit attention path
    probe = tiny_vit()
    saved = {}
    probe.blocks[-1].attn.fused_attn = False
    hook = probe.blocks[-1].attn.attn_drop.register_forward_hook(lambda m, i, o: saved.setdefault("a", o))
    try:
        out = probe(x)
        saved["a"].retain_grad()
        out[[0, 1], [1, 4]].sum().backward()
    finally:
        hook.remove()
    a, g = saved["a"][:, :, 0, 1:], saved["a"].grad[:, :, 0, 1:]  # (B, heads, 16): CLS row over patch tokens
    expect = (g.mean(-1, keepdim=True) * a).mean(1).clamp_min(0).reshape(2, 4, 4)
    torch.testing.assert_close(exp.token_maps, expect.detach(), rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("method", ["gradcam", "finercam", "attn_gradcam", "gradient", "integrated_gradients"])
def test_timm_and_hf_give_the_same_maps(method):
    pytest.importorskip("transformers")
    tm = tiny_vit()
    hm = timm_to_hf_vit(tm)
    x = batch(2)
    # (the HF ViT has a data config, 0.5/0.5, the bare timm model none: compare IG with the same zero baseline)
    opts = {"n_steps": 4, "baseline": "zero"} if method == "integrated_gradients" else {}
    a = vitlens.explain(tm, x, method, **opts)
    b = vitlens.explain(hm, x, method, **opts)
    assert rel_err(b.maps, a.maps) < 1e-3


# ---------------------------------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method,options", [
    ("gradient", {"reduce": "mean"}),
    ("smoothgrad", {"n": 0}),
    ("smoothgrad", {"noise": -0.1}),
    ("smoothgrad", {"noise": "high"}),
    ("smoothgrad", {"seed": 1.5}),
    ("smoothgrad", {"internal_batch_size": 0}),
    ("integrated_gradients", {"n_steps": 0}),
    ("integrated_gradients", {"n_steps": 2.5}),
    ("integrated_gradients", {"rule": "simpson"}),
    ("integrated_gradients", {"rule": "riemann_trapezoid", "n_steps": 1}),
    ("integrated_gradients", {"baseline": "white"}),
    ("integrated_gradients", {"baseline": float("nan")}),
    ("integrated_gradients", {"internal_batch_size": -1}),
    ("integrated_gradients", {"method": "gausslegendre"}),
    ("gradcam", {"layer": "last"}),
    ("gradcam", {"layer": 1.0}),
    ("finercam", {"references": 0}),
    ("finercam", {"gamma": float("inf")}),
    ("finercam", {"gamma": "strong"}),
    ("finercam", {"weighting": "softmax"}),
    ("attn_gradcam", {"layer": None}),
])
def test_bad_options_raise_input_error(method, options):
    with pytest.raises(InputError):
        vitlens.explainers.get_method(method, **options)


@pytest.mark.parametrize("method", ["gradcam", "finercam", "attn_gradcam"])
def test_layer_out_of_range(method):
    with pytest.raises(InputError, match="out of range"):
        vitlens.explain(tiny_vit(), batch(1), method, layer=3)


def test_ig_baseline_of_the_wrong_shape():
    with pytest.raises(InputError, match="broadcast"):
        vitlens.explain(tiny_vit(), batch(1), "integrated_gradients", n_steps=2, baseline=torch.zeros(2, 5, 5))


def test_ig_black_baseline_needs_matching_channels():
    model = tiny_vit(in_chans=1)
    model.vitlens_data_config = {"mean": (0.5, 0.5, 0.5), "std": (0.5, 0.5, 0.5)}
    with pytest.raises(InputError, match="channels"):
        vitlens.explain(model, batch(1, c=1), "integrated_gradients", n_steps=2)


@pytest.mark.parametrize("method", ["gradcam", "finercam", "attn_gradcam"])
def test_cams_need_a_token_model(method):
    with pytest.raises(UnsupportedModelError):
        vitlens.explain(Linear(), batch(1, 4), method)


def test_finercam_needs_two_classes():
    with pytest.raises(TargetError):
        vitlens.explain(tiny_vit(num_classes=1), batch(1), "finercam")
