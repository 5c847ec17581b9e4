"""Styles for pixel-level maps (blend: signed colours on grey; abs: |h| on grey), smoothing, and their defaults."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vitlens.errors import InputError
from vitlens.viz import default_style, overlay, overlay_with_scale, save_figure, save_grid, smooth_map


@pytest.fixture
def photo() -> np.ndarray:
    rng = np.random.default_rng(0)
    img = np.zeros((32, 32, 3), np.uint8)
    img[..., 0] = 200  # a saturated red photo: colours of the map must not get lost in it
    img[..., 1] = rng.integers(0, 60, (32, 32))
    return img


def test_blend_draws_signed_colours_on_grey(photo: np.ndarray) -> None:
    h = np.zeros((32, 32))
    h[4:8, 4:8], h[20:24, 20:24] = 1.0, -1.0
    out, scale, cmap = overlay_with_scale(photo, h, style="blend")
    assert scale.mode == "signed" and cmap.name == "RdBu_r"
    untouched = out[12:16, 12:16].astype(int)
    assert np.ptp(untouched, axis=-1).max() <= 1  # zero relevance: the image in grey
    pos, neg = out[5, 5].astype(int), out[21, 21].astype(int)
    assert pos[0] > pos[2] + 60 and neg[2] > neg[0] + 60  # red for, blue against


def test_abs_style_shows_magnitude_of_both_signs(photo: np.ndarray) -> None:
    h = np.zeros((32, 32))
    h[4:8, 4:8], h[20:24, 20:24] = 1.0, -1.0
    out, scale, _ = overlay_with_scale(photo, h, style="abs")
    assert scale.mode == "abs" and scale.vmin == 0.0
    assert np.array_equal(out[5, 5], out[21, 21])  # same |h|, same colour
    assert not np.array_equal(out[5, 5], out[12, 12])


def test_pixel_level_methods_get_blend_by_default() -> None:
    import vitlens  # noqa: F401  (registers the methods)
    from vitlens.explainers.registry import method_classes

    classes = method_classes()
    assert default_style(classes["inputxgradient"].level) == "blend"
    assert default_style(classes["integrated_gradients"].level) == "blend"
    assert default_style(classes["gradcam"].level) == "overlay"


def test_smoothing_keeps_constants_and_nan_and_spreads_a_spike() -> None:
    const = np.full((10, 12), 2.0)
    assert np.allclose(smooth_map(const, 1.5), 2.0)
    spike = np.zeros((31, 31))  # the spike is far from the edges (which are normalised by their weight)
    spike[15, 15] = 1.0
    out = smooth_map(spike, 2.0)
    assert out.sum() == pytest.approx(1.0, rel=1e-6) and 0 < out[15, 15] < 0.1 and out[15, 18] > 0
    holed = const.copy()
    holed[:, :3] = np.nan
    smoothed = smooth_map(holed, 1.0)
    assert np.isnan(smoothed[:, :3]).all() and np.allclose(smoothed[:, 3:], 2.0)
    with pytest.raises(InputError, match="sigma"):
        smooth_map(const, -1.0)


def test_every_style_has_colour_bar_and_caption(tmp_path: Path, photo: np.ndarray) -> None:
    h = np.random.default_rng(1).standard_normal((32, 32))
    sizes = []
    for style in ("overlay", "blend", "abs"):
        path = save_figure(tmp_path / f"{style}.png", photo, h, style=style, smooth=1.0, title="IG",
                           caption="class 3, p = 0.50")
        with Image.open(path) as written:
            pixels = np.asarray(written.convert("RGB"))
        sizes.append(pixels.shape)
        right = pixels[:, int(0.85 * pixels.shape[1]):]
        assert (np.ptp(right.astype(int), axis=-1) > 60).sum() > 200  # a coloured colour bar on the right
    grid = save_grid(tmp_path / "grid.png", [photo], {"a": [h], "b": [h]}, styles={"a": "blend", "b": "abs"})
    assert grid.exists()
    with pytest.raises(InputError, match="style"):
        overlay(photo, h, style="speckle")  # type: ignore[arg-type]


def test_explain_records_the_style(tmp_path: Path) -> None:
    from vitlens.cli import main

    photo = tmp_path / "p.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(photo)
    tiny = ["--model", "timm:vit_tiny_patch16_224", "--model-option", "pretrained=False", "--model-option",
            "img_size=32", "--model-option", "patch_size=8", "--model-option", "num_classes=6"]
    assert main(["explain", str(photo), *tiny, "--methods", "inputxgradient,rollout", "--smooth", "1",
                 "--out", str(tmp_path / "o"), "--quiet"]) == 0
    pix = json.loads((tmp_path / "o" / "p_png.inputxgradient.json").read_text())["colour"]
    tok = json.loads((tmp_path / "o" / "p_png.rollout.json").read_text())["colour"]
    assert (pix["style"], pix["scale"]["mode"], pix["smooth_sigma"]) == ("blend", "signed", 1.0)
    assert tok["style"] == "overlay"
    assert main(["explain", str(photo), *tiny, "--style", "abs", "--out", str(tmp_path / "a"), "--quiet"]) == 0
    assert json.loads(next((tmp_path / "a").glob("*.gradskip.json")).read_text())["colour"]["scale"]["mode"] == "abs"
    assert main(["explain", str(photo), *tiny, "--smooth", "-1", "--out", str(tmp_path / "b")]) != 0


def test_display_names_come_from_the_methods() -> None:
    import vitlens  # noqa: F401  (registers the methods)
    from vitlens.explainers import display_label, display_parts

    assert display_label("gradcam") == "Grad-CAM"
    assert display_label("integrated_gradients") == "Integrated Gradients"
    assert display_label("inputxgradient") == "Input × Gradient"
    assert display_label("aha[refine_steps=0]") == "AHA (T = 0)"
    assert display_parts("gradskip[alpha=0,skip=fixed]") == ("GradSkip", "alpha = 0, skip = fixed")
    assert display_label("my_method[x=1]") == "my_method (x = 1)"  # unknown: the code name is kept
    assert display_label("image") == "image"
