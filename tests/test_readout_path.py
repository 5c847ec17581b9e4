"""The readout fast path for methods that read only the logits: same maps up to float rounding, fewer FLOPs."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import vitlens
from vitlens.explainers import get_method

from conftest import VARIANTS

LOGIT_ONLY = {"gradient": {}, "inputxgradient": {}, "smoothgrad": {"n": 3}, "integrated_gradients": {"n_steps": 3},
              "rise": {"n_masks": 12, "grid_size": 3, "batch_size": 6}}


def batch(n: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


class _GlobalOnly:  # FlopCounterMode's module tracker breaks autograd.grad w.r.t. a leaf input; totals suffice
    parents = {"Global"}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def run(name: str, model, x, fast: bool):
    method = get_method(name, **LOGIT_ONLY[name])
    method.readout_logit_only = fast  # instance override: the same method with the path off
    torch.manual_seed(0)
    counter = FlopCounterMode(display=False)
    counter.mod_tracker = _GlobalOnly()
    with counter:
        exp = method.explain(model, x)
    return exp, counter.get_total_flops()


@pytest.mark.parametrize("name", sorted(LOGIT_ONLY))
@pytest.mark.parametrize("variant", ["cls", "distilled"])
def test_logit_only_methods_give_the_same_maps_with_fewer_flops(name, variant):
    assert get_method(name).readout_logit_only
    model = VARIANTS[variant]()
    x = batch()
    fast, f_fast = run(name, model, x, True)
    full, f_full = run(name, model, x, False)
    scale = float(full.maps.abs().max())
    torch.testing.assert_close(fast.maps, full.maps, rtol=0, atol=1e-4 * scale)
    torch.testing.assert_close(fast.scores, full.scores, rtol=1e-5, atol=1e-6)
    assert f_fast < f_full
    assert "forward" not in vars(model.blocks[-1])  # the path is undone after the call


def test_pooled_readout_runs_the_full_model():
    model = VARIANTS["gap"]()
    x = batch()
    fast, f_fast = run("gradient", model, x, True)
    full, f_full = run("gradient", model, x, False)
    assert f_fast == f_full and torch.equal(fast.maps, full.maps)


def test_methods_that_capture_do_not_use_the_logit_only_path():
    for name in ("gradskip", "rollout", "attnlrp", "gradcam", "tis", "mutex", "vitcx", "mda"):
        assert not get_method(name).readout_logit_only, name
