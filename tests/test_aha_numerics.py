"""The AHA training step after the cost work of issue #26 computes what it computed before, up to float rounding.

The same few steps (the bundled ``shapes-vit``, every deletion reference, one class per image and the authors' two
classes with Gumbel noise) run through :func:`vitlens.aha.loop.training_loss` and through the earlier code kept in
``tests/aha_reference.py``: at every step the losses and the gradients agree to rounding at the gradients' scale.
Adam turns a gradient at rounding level into a whole step of either sign (``tests/test_aha.py``, the distributed
test), so the two paths are compared step by step from the same weights, not over a whole run.
The loss values of the earlier code are pinned as well, so that the two paths cannot drift together.
"""

from __future__ import annotations

import pytest
import torch

import vitlens
from vitlens.aha.config import OPTION_VALUES
from vitlens.aha.network import AHANet
from vitlens.aha.train import AHATrainConfig, mean_std, training_loss
from vitlens.explainers import get_method
from vitlens.images import data_config

import aha_reference

pytestmark = pytest.mark.usefixtures("one_thread_per_module")

#: (recipe, the reference of each step): every reference with one class per image (mean and black twice: the second
#: time from the logits kept by the first); the authors' recipe (two classes per image, Gumbel noise)
CASES = [("tracked", ("mean", "black", "blur", "meanimage", "mean", "black")), ("authors", ("black", "blur"))]

#: the earlier code has vitlens's own definitions only: the authors' recipe runs with them (a map per class)
VITLENS_OPTIONS = {**{k: v[0] for k, v in OPTION_VALUES.items()}, "grid_offset": True}

#: the losses of the code before issue #26 (computed with it on the same inputs), per case and step
PINNED = {"tracked": [1.0935892, 0.7422731, 0.6091455, 0.9059185, 0.7315534, 0.8183661], "authors": [1.0710479, 0.9226714]}


def _inputs():
    model = vitlens.load_model("shapes-vit")
    scenes = vitlens.data.make_scenes(n=4, seed=3)
    x = vitlens.load_images(scenes.images, model)
    return model, x, torch.as_tensor(scenes.labels)


def _loss(net: AHANet, x, labels, step: int, cfg: AHATrainConfig, fast: bool, cache: dict):
    norm = mean_std(net.target)
    if fast:
        return training_loss(net, net.decoder, x, labels, list(range(4)), step, cfg, 0.1, norm, mean_img=x.mean(0),
                             ref_cache=cache)[0]
    return aha_reference.training_loss(net, x, labels, list(range(4)), step, cfg, 0.1, norm, mean_img=x.mean(0))[0]


@pytest.mark.parametrize("recipe,refs", CASES)
def test_training_steps_equal_the_earlier_code(recipe, refs):
    """Every step from the same weights: the loss and the decoder's gradients of both paths agree to rounding (at
    the gradients' scale); the run then steps with the earlier code's gradients (AdamW, clipping as in training)."""
    model, x, labels = _inputs()
    net = AHANet(model, width=8, seed=0)
    opt = torch.optim.AdamW(net.decoder.parameters(), lr=1e-3, weight_decay=1e-3)
    losses, cache = [], {}
    with net.target_adapter.session(capture=False):
        for step, ref in enumerate(refs):
            cfg = AHATrainConfig.preset(recipe, m=4, references=(ref,), batch_size=4, width=8, **VITLENS_OPTIONS)
            got = {}
            for fast in (True, False):
                opt.zero_grad(set_to_none=True)
                loss = _loss(net, x, labels, step, cfg, fast, cache)
                loss.backward()
                got[fast] = (float(loss.detach()), {k: p.grad.clone() for k, p in net.decoder.named_parameters()})
            assert got[True][0] == pytest.approx(got[False][0], rel=1e-5, abs=1e-7), (step, ref)
            scale = max(float(g.abs().max()) for g in got[False][1].values())
            for name, g in got[False][1].items():
                torch.testing.assert_close(got[True][1][name], g, rtol=0, atol=1e-4 * scale, msg=f"{step} {ref} {name}")
            torch.nn.utils.clip_grad_norm_(net.decoder.parameters(), 1.0)
            opt.step()
            losses.append(got[False][0])
    # The first step starts from the seeded weights: pinned to rounding. Later steps follow AdamW, which turns a
    # rounding-level gradient difference into a whole step of either sign, so they depend on the machine's float
    # kernels: on one 2-core machine the tracked case's sixth loss was 0.6 % off the value pinned on another (step 2:
    # 4e-5, step 3: 9e-4). They are pinned loosely; the step-by-step agreement above is the tight check.
    assert losses[0] == pytest.approx(PINNED[recipe][0], rel=1e-5)
    assert losses[1:] == pytest.approx(PINNED[recipe][1:], rel=3e-2)
    assert sorted(cache) == (["black", "mean", "meanimage"] if recipe == "tracked" else ["black"])


@pytest.mark.parametrize("name", ["shapes-vit", "shapes-deit", "shapes-vit-gap-reg", "digits-vit", "planted-vit"])
def test_shipped_maps_equal_the_earlier_decoder(name):
    """The T = 0 map (features and decoder under ``torch.inference_mode``; the decoder's class half of the mixing
    layer once per image, its 1×1 convs before the resizes) equals, to rounding, the earlier decoder's map computed
    on the training path (autograd recording, ``tests/aha_reference.py``) from the shipped weights; the class it
    explains is a plain forward's prediction."""
    model = vitlens.load_model(name)
    adapter = vitlens.get_adapter(model)
    hw = data_config(model).size_hw
    x = torch.randn(4, 3, *hw, generator=torch.Generator().manual_seed(5))
    exp = vitlens.explain(model, x, method="aha", refine_steps=0)
    net = get_method("aha")._network(model)
    with adapter.session(capture=False), torch.enable_grad():
        feats, logits = net.features(x)
        want = net.finish(aha_reference.decoder_forward(net.decoder, feats, exp.targets, hw))
        with torch.no_grad():
            plain = model(x)
    assert want.requires_grad  # the training path: the decoder's parameters record their gradients
    want = want.detach()
    torch.testing.assert_close(exp.maps, want, rtol=0, atol=1e-5 * float(want.abs().max()))
    assert torch.equal(exp.targets, plain.argmax(-1))
    assert exp.cost.forward_passes == 1 and exp.cost.backward_passes == 0
