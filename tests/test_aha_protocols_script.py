"""The protocol matrix script's evaluation images: a replication from image ``first`` on scores the images a larger
run would score there, and never reaches the digits AHA validates on (issue #27)."""

from __future__ import annotations

import pytest
import torch

from conftest import load_benchmark  # noqa: E402

import vitlens


@pytest.mark.parametrize("name", ["shapes-vit", "digits-vit", "planted-vit"])
def test_eval_images_from_first_are_the_tail_of_a_larger_run(name):
    script = load_benchmark("aha_protocols")
    model = vitlens.load_model(name).eval()
    whole = script.eval_images(name, model, 5)
    tail = script.eval_images(name, model, 3, first=2)
    assert tail.shape[0] == 3
    assert torch.equal(tail, whole[2:])


def test_eval_digits_stop_before_the_validation_digits():
    script = load_benchmark("aha_protocols")
    model = vitlens.load_model("digits-vit").eval()
    with pytest.raises(SystemExit, match="validation digits"):
        script.eval_images("digits-vit", model, 10, first=script.DIGITS_VAL_FROM - 5)
