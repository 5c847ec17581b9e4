"""Targets: resolution, validation, per-sample classes, probability and contrast."""

from __future__ import annotations

import pytest
import torch

import vitlens
from vitlens.targets import ClassLogit, ClassProbability, Contrast, make_target

from conftest import tiny_vit

LOGITS = torch.tensor([[1.0, 3.0, 2.0], [5.0, 0.0, 4.0]])


def test_predicted_class_by_default():
    t = make_target(None).resolve(LOGITS)
    assert t.classes.tolist() == [1, 0]
    assert t(LOGITS).tolist() == [3.0, 5.0]


def test_int_and_per_sample():
    assert make_target(2).resolve(LOGITS).classes.tolist() == [2, 2]
    assert make_target([2, 1]).resolve(LOGITS).classes.tolist() == [2, 1]
    assert make_target(torch.tensor([0, 2])).resolve(LOGITS)(LOGITS).tolist() == [1.0, 4.0]


def test_probability_and_contrast():
    p = ClassProbability(1).resolve(LOGITS)(LOGITS)
    torch.testing.assert_close(p, LOGITS.softmax(-1)[:, 1])
    c = Contrast().resolve(LOGITS)
    assert c.versus.tolist() == [2, 2]  # runner-ups
    torch.testing.assert_close(c(LOGITS), torch.tensor([1.0, 1.0]))
    c = Contrast(0, 1, gamma=0.5).resolve(LOGITS)
    torch.testing.assert_close(c(LOGITS), torch.tensor([1.0 - 1.5, 5.0]))


@pytest.mark.parametrize("spec,msg", [
    (3, "class 3 is out of range for a model with 3 classes"),
    (-1, "class -1 is out of range"),
    ([0, 1, 2], "3 class indices given for a batch of 2"),
    (torch.tensor([0.5, 1.0]), "must be integers"),
])
def test_bad_targets(spec, msg):
    with pytest.raises(vitlens.TargetError, match=msg):
        make_target(spec).resolve(LOGITS)


def test_bad_target_kinds():
    with pytest.raises(vitlens.TargetError, match="float"):
        make_target(1.0)
    with pytest.raises(vitlens.TargetError, match="unknown target"):
        make_target("cat")


def test_targets_through_explain():
    model = tiny_vit()
    x = torch.randn(3, 3, 32, 32)
    exp = vitlens.explain(model, x, target=[4, 0, 2])
    assert exp.targets.tolist() == [4, 0, 2]
    with torch.no_grad():
        logits = model(x)
    torch.testing.assert_close(exp.scores, logits[torch.arange(3), exp.targets])
    exp = vitlens.explain(model, x, target=ClassProbability())
    torch.testing.assert_close(exp.token_maps.sum((1, 2)) + exp.remainder, exp.scores, rtol=1e-4, atol=1e-7)
    assert float(exp.scores.max()) <= 1.0
    # per-sample targets survive chunking
    chunked = vitlens.explain(model, x, target=[4, 0, 2], batch_size=2)
    assert chunked.targets.tolist() == [4, 0, 2]
    torch.testing.assert_close(chunked.maps, vitlens.explain(model, x, target=[4, 0, 2]).maps)
    with pytest.raises(vitlens.TargetError, match="out of range for a model with 5 classes"):
        vitlens.explain(model, x, target=5)


@pytest.mark.parametrize("target", [ClassLogit(1), ClassProbability(), Contrast(0, 2),
                                    vitlens.targets.SegmentationTarget(1)])
def test_score_and_select_of_an_unresolved_target_name_the_missing_step(target):
    logits = LOGITS if not isinstance(target, vitlens.targets.SegmentationTarget) else LOGITS[:, :, None, None]
    with pytest.raises(vitlens.TargetError, match="is not resolved: call it on the logits"):
        target.score(logits)
    with pytest.raises(vitlens.TargetError, match="is not resolved"):
        target.select(slice(0, 1))
    resolved = target.resolve(logits)
    assert torch.equal(resolved.select(slice(0, 1)).score(logits[:1]), resolved.score(logits)[:1])


def test_resolved_classes_are_the_resolved_targets_classes():
    with pytest.raises(vitlens.TargetError, match="ClassLogit is not resolved"):
        ClassLogit(1).resolved_classes()
    assert ClassLogit(None).resolve(LOGITS).resolved_classes().tolist() == [1, 0]
