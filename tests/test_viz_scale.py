"""Colour scaling over the pixels that have a value: a map on the uncropped original (NaN where the model saw
nothing) and the same map on the model's view get the same colour range."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vitlens.images import data_config
from vitlens.viz import map_scale, map_to_original, overlay, overlay_with_scale, scale_map

# A wide original whose sides the model never saw: 40 columns of 80 are NaN once the map is placed back.
CFG = data_config({"input_size": (3, 32, 32), "crop_pct": 1.0, "crop_mode": "center"})
ORIGINAL_HW = (40, 80)


def _maps() -> dict[str, np.ndarray]:
    yy, xx = np.mgrid[0:32, 0:32] / 31.0
    return {
        "offset": 5.0 + 2.0 * xx + yy,  # all positive, far from 0: 0 must not enter the range
        "signed": np.sin(6.0 * xx) * np.cos(4.0 * yy),
        "constant": np.full((32, 32), 3.0),
    }


@pytest.mark.parametrize("name", ["offset", "signed", "constant"])
@pytest.mark.parametrize("clip", [None, 99.5])
def test_original_and_view_get_the_same_colour_range(name: str, clip: float | None) -> None:
    view = _maps()[name]
    placed = map_to_original(view, ORIGINAL_HW, CFG)
    assert np.isnan(placed).mean() > 0.4  # the uncovered area is really there
    on_view, on_original = map_scale(view, "auto", clip), map_scale(placed, "auto", clip)
    assert on_view.mode == on_original.mode
    # equal up to map_to_original's bilinear resampling (2x here), never pulled towards 0 by the uncovered area
    span = max(abs(on_view.vmax), abs(on_view.vmin), 1e-12)
    assert on_original.vmin == pytest.approx(on_view.vmin, abs=0.02 * span)
    assert on_original.vmax == pytest.approx(on_view.vmax, abs=0.02 * span)
    if name == "offset":
        assert on_original.vmin > 4.9  # the old scaling counted NaN as 0 and started the colour bar at 0
    if name == "constant":
        assert on_original.vmin == on_original.vmax == 3.0


def test_uncovered_area_is_left_out_of_the_percentile_clip() -> None:
    view = _maps()["offset"]
    placed = map_to_original(view, ORIGINAL_HW, CFG)
    values, scale = scale_map(placed, "minmax", clip=99.0)
    covered = np.isfinite(placed)
    assert np.isnan(values[~covered]).all()
    assert scale.vmin == pytest.approx(float(np.percentile(placed[covered], 1.0)))
    # the covered part spans the whole colour map (it is not a flat box at the top of a range that starts at 0)
    assert values[covered].min() == 0.0 and values[covered].max() == 1.0


def test_offset_map_on_the_original_shows_its_structure() -> None:
    view = _maps()["offset"]
    placed = map_to_original(view, ORIGINAL_HW, CFG)
    image = np.full((*ORIGINAL_HW, 3), 128, np.uint8)
    out = overlay(image, placed, alpha=1.0, normalize="minmax")
    covered = out[:, 25:55].reshape(-1, 3).astype(int)
    assert np.ptp(covered, axis=0).max() > 100  # the gradient of the map is visible, not one flat colour
    assert (out[:, :15] == 128).all()  # the uncovered area is the image, uncoloured


def test_fixed_scale_is_used_as_given() -> None:
    view = _maps()["signed"]
    fixed = map_scale(view, "signed")
    image = np.zeros((32, 32, 3), np.uint8)
    a, used, _ = overlay_with_scale(image, view, scale=fixed)
    b, _, _ = overlay_with_scale(image, view, normalize="minmax", clip=50.0, scale=fixed)
    assert used == fixed and np.array_equal(a, b)


def test_explain_writes_both_figures_on_one_recorded_scale(tmp_path: Path) -> None:
    from vitlens.cli import main

    photo = tmp_path / "wide.png"
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (32, 96, 3), dtype=np.uint8)).save(photo)
    args = ["explain", str(photo), "--model", "timm:vit_tiny_patch16_224", "--model-option", "pretrained=False",
            "--model-option", "img_size=32", "--model-option", "patch_size=8", "--model-option", "num_classes=6",
            "--methods", "rollout", "--out", str(tmp_path / "out"), "--quiet"]
    assert main(args) == 0
    info = json.loads(next((tmp_path / "out").glob("*.rollout.json")).read_text())
    scale = info["colour"]["scale"]
    assert scale["mode"] == "positive" and scale["vmax"] >= scale["vmin"] == 0.0  # rollout: declared non-negative
    assert info["colour"]["clip"] == 99.5
