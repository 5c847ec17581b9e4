"""Properties every registered method must have (run for each method in ``vitlens.methods()``).

Shapes, determinism (with the method's seed), batch equivariance, any prefix-token count, a non-default input size,
and the model left unchanged after an exception. Expensive methods declare cheap ``fast_options`` for these tests.
"""

from __future__ import annotations

import pytest
import torch

import vitlens
from vitlens.explainers import get_method
from vitlens.explainers.registry import _METHODS
from vitlens.targets import ClassLogit

from conftest import VARIANTS, model_fingerprint, tiny_vit

METHODS = vitlens.methods()


def make(name: str, **extra):
    cls = _METHODS[name]
    return get_method(name, **{**cls.fast_options, **extra})


def x_batch(n=3, size=32, seed=0):
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", METHODS)
def test_shapes_and_fields(name):
    model = tiny_vit()
    exp = make(name).explain(model, x_batch())
    assert exp.maps.shape == (3, 32, 32) and exp.maps.dtype == torch.float32
    assert exp.token_maps.shape == (3, 4, 4)
    assert exp.targets.shape == (3,) and exp.scores.shape == (3,)
    assert torch.isfinite(exp.maps).all()
    assert exp.method == name
    assert exp.cost.forward_passes >= 1


@pytest.mark.parametrize("name", METHODS)
def test_deterministic(name):
    model = tiny_vit()
    x = x_batch()
    a = make(name).explain(model, x)
    b = make(name).explain(model, x)
    torch.testing.assert_close(a.maps, b.maps, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", METHODS)
def test_batch_equivariance(name):
    if not _METHODS[name].batch_equivariant:
        pytest.skip(f"{name} draws its randomness per call (documented), not per image")
    model = tiny_vit()
    x = x_batch(3)
    full = make(name).explain(model, x)
    for i in range(3):
        one = make(name).explain(model, x[i:i + 1])
        scale = full.maps[i].abs().max().clamp_min(1e-12)
        torch.testing.assert_close(one.maps[0], full.maps[i], rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("name", METHODS)
def test_any_prefix_token_count(name, variant):
    model = VARIANTS[variant]()
    exp = make(name).explain(model, x_batch(2))
    assert exp.maps.shape == (2, 32, 32) and torch.isfinite(exp.maps).all()


@pytest.mark.parametrize("name", METHODS)
def test_non_default_input_size(name):
    model = tiny_vit(dynamic_img_size=True)
    exp = make(name).explain(model, torch.randn(2, 3, 48, 40))
    assert exp.maps.shape == (2, 48, 40) and exp.token_maps.shape == (2, 6, 5)


class _Boom(RuntimeError):
    pass


class _ExplodingTarget(ClassLogit):
    def score(self, logits):
        raise _Boom("fails mid-explanation")


@pytest.mark.parametrize("name", METHODS)
def test_model_restored_after_exception(name):
    model = tiny_vit()
    model.blocks[0].attn.fused_attn = True
    before = model_fingerprint(model)
    with pytest.raises(_Boom):
        make(name).explain(model, x_batch(2), target=_ExplodingTarget(1))
    assert model_fingerprint(model) == before
    make(name).explain(model, x_batch(2))
    assert model_fingerprint(model) == before


@pytest.mark.parametrize("name", METHODS)
def test_declared_cost_matches_measured(name):
    model = tiny_vit()
    method = make(name)
    exp = method.explain(model, x_batch(2))
    declared = method.declared_cost()
    assert exp.cost.forward_passes == pytest.approx(declared["forward"])
    assert exp.cost.backward_passes == pytest.approx(declared["backward"])
