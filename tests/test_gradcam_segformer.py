"""Grad-CAM and Finer-CAM on HF SegFormer (Seg-Grad-CAM): the decode head's fused feature map as the feature layer,
maps equal to a by-hand computation and to pytorch-grad-cam, cost, batch = one-by-one, two input sizes, restoration,
and Finer-CAM's segmentation contrast."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import vitlens
from vitlens.targets import SegmentationTarget

from conftest import model_fingerprint

transformers = pytest.importorskip("transformers")

from test_gradskip_segformer import (  # noqa: E402
    CONFIGS,
    Boom,
    ExplodingTarget,
    images,
    majority_classes,
    restoration_setup,
    tiny_segformer,
)

SIZES = [(64, 48), (66, 50)]  # an integer and a non-integer stage-1 factor


def by_hand(model: nn.Module, x: torch.Tensor, score) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Grad-CAM by definition with a plain forward hook: ``A`` = the classifier's input ``(B, C, h, w)``,
    ``w_k = mean_p ∂y/∂A_k[p]``, map = ``ReLU(Σ_k w_k A_k)``. ``score(logits) → (B,)``. Returns (map, A, logits)."""
    seen = {}
    handle = model.decode_head.classifier.register_forward_hook(lambda mod, args, out: seen.__setitem__("a", args[0]))
    try:
        logits = model(pixel_values=x).logits
    finally:
        handle.remove()
    a = seen["a"]
    grad = torch.autograd.grad(score(logits).sum(), a)[0]
    cam = (grad.mean((2, 3), keepdim=True) * a).sum(1).clamp_min(0)
    return cam.detach(), a.detach(), logits.detach()


def assert_maps_equal(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape
    assert float((ours - ref).abs().max()) <= 1e-5
    assert float((ours - ref).abs().max()) <= 1e-5 * float(ref.abs().max())


# -- the feature layer ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_feature_layer_is_the_classifier_input_on_the_logit_grid(kind, size):
    model = tiny_segformer(kind)
    adapter = vitlens.get_adapter(model, require="features")
    assert {"attention", "stages", "features"} <= adapter.capabilities
    assert list(adapter.feature_layers()) == [model.decode_head.classifier]
    x = images(2, size)
    with adapter.session(capture=True) as rec:
        logits = adapter.forward(x)
    (feats,) = rec.features
    gh, gw = adapter.grid(size)
    assert logits.shape[-2:] == (gh, gw)
    assert feats.shape == (2, gh * gw, model.config.decoder_hidden_size)
    # the recorded node is exactly what the classifier reads (and the logits are those of a plain call; the session
    # only switches attention to the eager path, equal up to float rounding)
    with torch.no_grad():
        again = model.decode_head.classifier(feats.transpose(1, 2).reshape(2, -1, gh, gw))
        plain = model(pixel_values=x).logits
    torch.testing.assert_close(logits.detach(), again, rtol=0, atol=0)
    torch.testing.assert_close(logits.detach(), plain, rtol=1e-5, atol=1e-6)
    assert torch.autograd.grad(logits[:, 0].sum(), feats)[0].abs().sum() > 0


# -- Grad-CAM -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("kind", ["4stage-sr4", "2stage-sr2"])
def test_gradcam_equals_the_definition(kind, size):
    model = tiny_segformer(kind)
    x = images(3, size)
    target = SegmentationTarget(majority_classes(model, x))
    exp = vitlens.explain(model, x, method="gradcam", target=target)
    gh, gw = vitlens.get_adapter(model).grid(size)
    assert exp.token_maps.shape == (3, gh, gw) and exp.maps.shape == (3, *size)
    ref, _, logits = by_hand(model, x, lambda z: target.resolve(z)(z))
    assert float(ref.max()) > 0
    assert_maps_equal(exp.token_maps, ref)
    torch.testing.assert_close(exp.scores, target.resolve(logits)(logits))
    assert exp.remainder is None and exp.targets.tolist() == target.resolve(logits).classes.tolist()
    same = vitlens.explain(model, x, method="gradcam", target=target, layer=0)
    torch.testing.assert_close(same.token_maps, exp.token_maps, rtol=0, atol=0)


def test_gradcam_with_an_input_resolution_region_equals_the_definition():
    """A region at input resolution: the logits are upsampled before the sum, so the gradient on the feature map is
    no longer a 0/1 mask — still the definition."""
    model = tiny_segformer("4stage-sr4")
    x = images(2, (64, 48))
    region = torch.zeros(64, 48, dtype=torch.bool)
    region[10:41, 5:30] = True
    target = SegmentationTarget([1, 3], region)
    exp = vitlens.explain(model, x, method="gradcam", target=target)
    ref, _, _ = by_hand(model, x, lambda z: target.resolve(z)(z))
    assert_maps_equal(exp.token_maps, ref)


def test_gradcam_at_the_decode_head_is_the_bias_free_logit_map():
    """At this layer Grad-CAM has a closed form: the classifier is a 1×1 convolution, so ``∂y/∂A_k[p] = W[c, k]``
    on the region's pixels and 0 elsewhere, and the map is ``ReLU(z_c − b_c) · |Ω| / N``."""
    model = tiny_segformer("4stage-sr4")
    x = images(3, (64, 48))
    target = SegmentationTarget(majority_classes(model, x))
    exp = vitlens.explain(model, x, method="gradcam", target=target)
    with torch.no_grad():
        logits = model(pixel_values=x).logits
    t = target.resolve(logits)
    rows = torch.arange(3)
    bias = model.decode_head.classifier.bias[t.classes].detach()
    share = t.mask.flatten(1).float().mean(1)
    closed = (logits[rows, t.classes] - bias[:, None, None]).clamp_min(0) * share[:, None, None]
    assert_maps_equal(exp.token_maps, closed)


def test_gradcam_cost_is_one_forward_and_one_backward():
    model = tiny_segformer("2stage-sr2")
    x = images(3)
    for method in ("gradcam", "finercam"):
        exp = vitlens.explain(model, x, method=method, target=SegmentationTarget(1))
        c = exp.cost
        assert (c.forward_passes, c.backward_passes, c.model_calls, c.backward_calls) == (1, 1, 1, 1), method


@pytest.mark.parametrize("method", ["gradcam", "finercam"])
def test_batch_equals_one_by_one_and_chunks(method):
    model = tiny_segformer("4stage-sr4")
    x = images(3, (66, 50))
    classes = majority_classes(model, x)
    whole = vitlens.explain(model, x, method=method, target=SegmentationTarget(classes))
    singles = [vitlens.explain(model, x[i:i + 1], method=method, target=SegmentationTarget(classes[i]))
               for i in range(3)]
    chunked = vitlens.explain(model, x, method=method, target=SegmentationTarget(classes), batch_size=2)
    for i, one in enumerate(singles):
        torch.testing.assert_close(whole.token_maps[i:i + 1], one.token_maps, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(whole.scores[i:i + 1], one.scores, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(whole.token_maps, chunked.token_maps, rtol=1e-5, atol=1e-7)
    if method == "finercam":
        assert torch.equal(whole.extras["references"], torch.cat([o.extras["references"] for o in singles]))


def test_layer_out_of_range_names_the_feature_layers():
    with pytest.raises(vitlens.InputError, match="1 feature layers"):
        vitlens.explain(tiny_segformer("2stage-sr2"), images(1), method="gradcam", target=SegmentationTarget(1),
                        layer=1)


# -- restoration ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("train_mode", [False, True])
def test_model_restored_after_success_and_exception(train_mode):
    model, x, before = restoration_setup(train_mode)
    for method in ("gradcam", "finercam"):
        vitlens.explain(model, x, method=method, target=SegmentationTarget(1))
        assert model_fingerprint(model) == before, method
        with pytest.raises(Boom):
            vitlens.explain(model, x, method=method, target=ExplodingTarget(1))
        assert model_fingerprint(model) == before, method
    # raised inside the session by Finer-CAM's own retargeting
    with pytest.raises(vitlens.TargetError, match="use weighting='mean'"):
        vitlens.explain(model, x, method="finercam", target=SegmentationTarget(1), weighting="probability")
    assert model_fingerprint(model) == before


# -- Finer-CAM ------------------------------------------------------------------------------------------------------

def test_finercam_contrasts_the_class_with_its_closest_classes_on_the_region():
    model = tiny_segformer("4stage-sr4", num_labels=6)
    x = images(3, (64, 48))
    target = SegmentationTarget(majority_classes(model, x))
    exp = vitlens.explain(model, x, method="finercam", target=target, gamma=0.7)
    with torch.no_grad():
        logits = model(pixel_values=x).logits
    t = target.resolve(logits)
    region = t.mask.float()
    sums = (logits * region[:, None]).sum((2, 3))  # (B, K): every class's logits summed over the class-c region
    refs = exp.extras["references"]
    assert refs.shape == (3, 3)
    for b in range(3):  # the references are the 3 other classes whose region sums are closest to the target's
        c = int(t.classes[b])
        gap = (sums[b] - sums[b, c]).abs()
        gap[c] = float("inf")
        assert refs[b].tolist() == gap.argsort(stable=True)[:3].tolist()
    expected = sums.gather(1, t.classes[:, None])[:, 0] - 0.7 * sums.gather(1, refs).mean(1)
    torch.testing.assert_close(exp.scores, expected, rtol=1e-5, atol=1e-5)

    def contrast(z):
        zc = z[torch.arange(3), t.classes]
        zd = torch.stack([z[torch.arange(3), refs[:, j]] for j in range(3)], 1).mean(1)
        return ((zc - 0.7 * zd) * region).sum((1, 2))

    ref, _, _ = by_hand(model, x, contrast)
    assert_maps_equal(exp.token_maps, ref)


def test_finercam_with_gamma_zero_is_gradcam():
    model = tiny_segformer("4stage-sr4")
    x = images(2, (66, 50))
    target = SegmentationTarget(majority_classes(model, x))
    a = vitlens.explain(model, x, method="finercam", target=target, gamma=0.0)
    b = vitlens.explain(model, x, method="gradcam", target=target)
    torch.testing.assert_close(a.token_maps, b.token_maps, rtol=1e-6, atol=1e-8)


def test_single_sequence_methods_still_refuse_segformer():
    for name in ("attn_gradcam", "rollout"):
        with pytest.raises(vitlens.UnsupportedModelError, match="token_sequence.*methods that work on this model: .*gradcam"):
            vitlens.explain(tiny_segformer("2stage-sr2"), images(1), method=name, target=SegmentationTarget(1))


# -- pytorch-grad-cam -------------------------------------------------------------------------------------------------

class Logits(nn.Module):
    """The SegFormer as pytorch-grad-cam expects a model: images → a logits tensor ``(B, K, h, w)``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=x).logits


def _peer_raw(cam, x):
    """pytorch-grad-cam's un-normalised map of the last call (its own get_cam_image, then its ReLU)."""
    import numpy as np

    acts = cam.activations_and_grads.activations[0].numpy()
    grads = cam.activations_and_grads.gradients[0].numpy()
    return np.maximum(cam.get_cam_image(x, None, None, acts, grads), 0)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_gradcam_matches_pytorch_grad_cam_semantic_segmentation(size):
    """pytorch-grad-cam's ``GradCAM`` with its ``SemanticSegmentationTarget`` (sum of the class's logits over a
    mask) on the layer whose output is the classifier's input (``decode_head.dropout``, identity in eval mode)."""
    pgc = pytest.importorskip("pytorch_grad_cam")
    import numpy as np
    from pytorch_grad_cam.utils.image import scale_cam_image
    from pytorch_grad_cam.utils.model_targets import SemanticSegmentationTarget

    model = tiny_segformer("4stage-sr4")
    x = images(3, size)
    target = SegmentationTarget(majority_classes(model, x))
    exp = vitlens.explain(model, x, method="gradcam", target=target)
    with torch.no_grad():
        t = target.resolve(model(pixel_values=x).logits)
    peer_targets = [SemanticSegmentationTarget(int(c), m.float().numpy()) for c, m in zip(t.classes, t.mask)]
    cam = pgc.GradCAM(Logits(model), [model.decode_head.dropout])
    try:
        public = cam(x, targets=peer_targets)
        raw = _peer_raw(cam, x)
    finally:
        cam.activations_and_grads.release()
    ours = exp.token_maps.numpy()
    assert np.abs(ours - raw).max() <= 1e-5 * np.abs(raw).max()
    # its public output: the map min-max scaled and resized to the input (OpenCV), then scaled again after its
    # (single-)layer aggregation; the same post-processing applied to ours
    np.testing.assert_allclose(scale_cam_image(scale_cam_image(ours, (size[1], size[0]))), public, atol=1e-4)
