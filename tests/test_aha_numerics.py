"""The AHA training step after the cost work of issue #26 computes what it computed before, up to float rounding.

The same few steps (the bundled ``shapes-vit``, every deletion reference, one class per image and the authors' two
classes with Gumbel noise) run through :func:`vitlens.aha.loop.training_loss` and through the earlier code kept in
``tests/aha_reference.py``: the first step's gradients agree to rounding at the gradients' scale, the losses of every
step agree, and the weights follow the rule of the distributed test (``tests/test_aha.py``): Adam turns a gradient at
rounding level into a whole step of either sign, so a few weights may differ by up to ``2·lr``, most by nothing.
The loss values of the earlier code are pinned as well, so that the two paths cannot drift together.
"""

from __future__ import annotations

import pytest
import torch

import vitlens
from vitlens.aha.network import AHANet
from vitlens.aha.train import AHATrainConfig, mean_std, training_loss

import aha_reference

pytestmark = pytest.mark.usefixtures("one_thread_per_module")

#: (recipe, the reference of each step): every reference once with one class per image; the authors' recipe (two
#: classes per image, Gumbel noise) on the references it draws from
CASES = [("tracked", ("mean", "black", "blur", "meanimage")), ("authors", ("black", "blur"))]

#: the losses of the code before issue #26 (computed with it on the same inputs), per case and step
PINNED = {"tracked": [1.0935892, 0.7422731, 0.6091455, 0.9059185], "authors": [1.0710479, 0.9226714]}


def _inputs():
    model = vitlens.load_model("shapes-vit")
    scenes = vitlens.data.make_scenes(n=4, seed=3)
    x = vitlens.load_images(scenes.images, model)
    return model, x, torch.as_tensor(scenes.labels)


def _train(recipe: str, refs: tuple[str, ...], fast: bool) -> tuple[list[float], list[dict], AHANet]:
    """Steps ``0..len(refs)-1`` (step ``s`` on reference ``refs[s]``) with AdamW and clipping as in training; returns
    the losses, the first step's decoder gradients and the network."""
    model, x, labels = _inputs()
    net = AHANet(model, width=8, seed=0)
    opt = torch.optim.AdamW(net.decoder.parameters(), lr=1e-3, weight_decay=1e-3)
    losses, grads = [], []
    norm = mean_std(model)
    with net.target_adapter.session(capture=False):
        for step, ref in enumerate(refs):
            cfg = AHATrainConfig.preset(recipe, m=4, references=(ref,), batch_size=4, width=8)
            if fast:
                loss, _, _ = training_loss(net, net.decoder, x, labels, list(range(4)), step, cfg, 0.1, norm,
                                           mean_img=x.mean(0))
            else:
                loss, _ = aha_reference.training_loss(net, x, labels, list(range(4)), step, cfg, 0.1, norm,
                                                      mean_img=x.mean(0))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if step == 0:
                grads = [{k: p.grad.clone() for k, p in net.decoder.named_parameters()}]
            torch.nn.utils.clip_grad_norm_(net.decoder.parameters(), 1.0)
            opt.step()
            losses.append(float(loss.detach()))
    return losses, grads, net


@pytest.mark.parametrize("recipe,refs", CASES)
def test_training_steps_equal_the_earlier_code(recipe, refs):
    new_losses, new_grads, new_net = _train(recipe, refs, fast=True)
    old_losses, old_grads, old_net = _train(recipe, refs, fast=False)
    assert old_losses == pytest.approx(PINNED[recipe], rel=1e-4)
    assert new_losses == pytest.approx(old_losses, rel=1e-5, abs=1e-7)
    scale = max(float(g.abs().max()) for g in old_grads[0].values())
    for name, g in old_grads[0].items():  # the same weights: rounding at the gradients' scale
        torch.testing.assert_close(new_grads[0][name], g, rtol=0, atol=1e-4 * scale, msg=name)
    lr = 1e-3
    diffs = torch.cat([(a - b).abs().flatten() for a, b in zip(new_net.state_dict().values(),
                                                                old_net.state_dict().values())])
    assert float((diffs > lr / 10).float().mean()) < 0.01, float((diffs > lr / 10).float().mean())
    assert float(diffs.mean()) < lr / 100, float(diffs.mean())
