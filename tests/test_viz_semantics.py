"""Colour semantics declared by the methods: every registered method says what its values mean, figures draw a
method the same way on every image by that declaration, and colour bars say what they clip and hide."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import vitlens
from vitlens.explainers import get_method
from vitlens.explainers.registry import VALUE_KINDS, method_classes, value_kind
from vitlens.viz import (
    Scale,
    clip_note,
    default_style,
    kind_normalize,
    map_scale,
    overlay_with_scale,
    save_figure,
    save_grid,
    tick_labels,
    wrap_phrases,
)

from conftest import tiny_vit

METHODS = vitlens.methods()


@pytest.mark.parametrize("name", METHODS)
def test_every_method_declares_what_its_values_mean(name: str) -> None:
    cls = method_classes()[name]
    assert cls.value_kind in VALUE_KINDS, f"{name} declares no value_kind (one of {VALUE_KINDS})"
    assert cls.value_kind_for(dict(cls.defaults)) in VALUE_KINDS
    assert value_kind(name) == cls.value_kind


def test_kinds_that_depend_on_options() -> None:
    assert value_kind("gradient") == "nonnegative" and value_kind("gradient[reduce=sum]") == "signed"
    assert value_kind("smoothgrad[reduce='sum']") == "signed"
    assert value_kind("rise") == "probability" and value_kind("rise[score=target]") == "score"
    assert value_kind("not_a_method") is None


# methods whose declared kind is checked against the maps they make on a tiny ViT (AHA needs trained weights)
_RUNNABLE = [m for m in METHODS if m not in ("aha",) and method_classes()[m].value_kind in ("nonnegative",
                                                                                             "probability")]


@pytest.mark.parametrize("name", _RUNNABLE)
def test_declared_kind_holds_on_real_maps(name: str) -> None:
    cls = method_classes()[name]
    method = get_method(name, **cls.fast_options)
    exp = method.explain(tiny_vit(), torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0)))
    maps = exp.maps
    top = float(maps.abs().max())
    if cls.value_kind == "nonnegative":
        assert float(maps.min()) >= -1e-6 * max(top, 1e-12), name
    else:  # a probability averaged over masks; ViT-CX adds p(x) to a difference of two probabilities
        assert -1.0 - 1e-6 <= float(maps.min()) and float(maps.max()) <= 2.0 + 1e-6, name


def test_each_kind_gets_its_scale() -> None:
    assert kind_normalize("signed") == "signed" and kind_normalize("nonnegative") == "positive"
    assert kind_normalize("probability") == kind_normalize("score") == "minmax" and kind_normalize(None) == "auto"
    assert default_style("pixel", "signed") == "blend" and default_style("pixel", "nonnegative") == "abs"
    assert default_style("pixel", "probability") == "overlay" and default_style("token", "signed") == "overlay"


def test_rise_like_map_is_sequential_and_signed_map_is_diverging_on_every_image() -> None:
    image = np.full((16, 16, 3), 128, np.uint8)
    rng = np.random.default_rng(0)
    probability = 0.41 + 0.5 * rng.random((16, 16))  # all positive: never a diverging scale
    _, scale, cmap = overlay_with_scale(image, probability, normalize=kind_normalize("probability"))
    assert scale.mode == "minmax" and cmap.name == "inferno"
    # a signed method whose map is almost all positive on this image (-2.1e-6 minimum) stays signed
    nearly = rng.random((16, 16))
    nearly[0, 0] = -2.1e-6
    _, scale, cmap = overlay_with_scale(image, nearly, normalize=kind_normalize("signed"))
    assert scale.mode == "signed" and cmap.name == "RdBu_r"


def test_positive_scale_says_what_it_hides() -> None:
    arr = np.linspace(-0.1, 1.0, 100).reshape(10, 10)
    scale = map_scale(arr, "positive", clip=99.5)
    assert scale.vmin == 0.0 and scale.clipped() == (True, True)
    note = clip_note(scale)
    assert "99.5th percentile" in note and "below 0 drawn as 0" in note and "−0.1" in note


def test_one_tick_format_per_bar() -> None:
    labels, factor = tick_labels([0.0, 1.9e-4, 3.82e-4])
    assert factor == "×10⁻⁴" and labels == ["0", "1.90", "3.82"]
    labels, factor = tick_labels([-0.307, 0.0, 0.307], signed=True)
    assert factor == "" and labels == ["−0.307", "0", "+0.307"]
    labels, _ = tick_labels([0.0000356, 0.0000561])
    assert len({len(t.split(".")[-1]) for t in labels}) == 1  # the same number of decimals on every tick


def test_captions_wrap_between_phrases() -> None:
    text = "tiger cat (class 282), p = 0.93 — on the original image (uncoloured: cropped away before the model)"
    lines = wrap_phrases(text, 46).splitlines()
    assert all(len(line) <= 46 for line in lines)
    assert any(line.endswith("p = 0.93") for line in lines)  # never "p =" / "0.93" on two lines
    assert "(uncoloured: cropped away before the model)" in lines


def _grid_pixels(path: Path) -> np.ndarray:
    with Image.open(path) as img:
        return np.asarray(img.convert("RGB"))


def test_api_grid_draws_pixel_maps_on_grey_by_default(tmp_path: Path) -> None:
    photo = np.zeros((32, 32, 3), np.uint8)
    photo[..., 1] = 200  # a green photo: a colour overlay would keep it green where relevance is 0
    signed = np.zeros((32, 32))
    signed[:4, :4] = 1.0
    save_grid(tmp_path / "g.png", [photo], {"inputxgradient": [signed]}, dpi=100, colorbar=False)
    cells = _grid_pixels(tmp_path / "g.png")
    h, w = cells.shape[:2]
    right = cells[h // 2:, w // 2 + 20:w - 20].reshape(-1, 3).astype(int)
    grey = np.abs(right[:, 1] - right[:, 0]) < 10
    assert grey.mean() > 0.5  # the grey copy under the zero-relevance part, as vitlens explain draws it


def test_shared_scale_gives_one_range_per_row(tmp_path: Path) -> None:
    photo = np.full((32, 32, 3), 100, np.uint8)
    small, big = np.full((32, 32), 0.1), np.full((32, 32), 1.0)
    small[0, 0] = big[0, 0] = 0.0
    path = save_grid(tmp_path / "s.png", [photo], {"rollout": [small], "gae": [big]}, shared_scale=True,
                     clip=None)
    cells = _grid_pixels(path)
    w = cells.shape[1]
    # on one scale the small map is darker than the large one (each on its own scale they would look alike)
    mid = cells.shape[0] // 2
    col = w // 4  # the first method column's centre is near 3/8 of the width, the second's near 5/8
    a = cells[mid, int(w * 0.37)].astype(int).sum()
    b = cells[mid, int(w * 0.62)].astype(int).sum()
    assert b > a + 60, (a, b, col)


def test_default_dpi_draws_every_panel_at_least_the_input_size(tmp_path: Path) -> None:
    from vitlens.viz.figures import _panel_dpi  # noqa: F401 - the rule is checked through the written file

    rng = np.random.default_rng(0)
    images = rng.integers(0, 255, (2, 224, 224, 3), dtype=np.uint8)
    maps = {"gradcam": rng.random((2, 14, 14)), "rise": rng.random((2, 224, 224))}
    path = save_grid(tmp_path / "g.png", list(images), maps, col_size=2.0)
    with Image.open(path) as img:
        width = img.size[0]
    assert width >= 3 * 224  # three panels of >= 224 px each (at 100 dpi they were 204 px)


def test_scale_records_its_clipping() -> None:
    arr = np.concatenate([np.linspace(-0.307, 0.33, 999), [0.33]]).reshape(10, 100)
    scale = map_scale(arr, "signed", clip=99.5)
    assert isinstance(scale, Scale) and scale.clip == 99.5
    assert scale.data_min == pytest.approx(-0.307) and scale.data_max == pytest.approx(0.33)
    assert scale.clipped() == (False, True)  # |-0.307| is under the 99.5th percentile of |h|, 0.33 above it
    assert map_scale(arr, "signed", clip=None).clipped() == (False, False)


def test_save_figure_uses_the_methods_declaration(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    photo = np.full((32, 32, 3), 128, np.uint8)
    rise_map = 0.41 + 0.52 * rng.random((32, 32))
    path = save_figure(tmp_path / "r.png", photo, rise_map, method="rise", caption="class 3")
    pixels = _grid_pixels(path)
    bar = pixels[:, int(0.8 * pixels.shape[1]):].reshape(-1, 3).astype(int)
    blue = (bar[:, 2] > 150) & (bar[:, 0] < 90)
    assert not blue.any()  # inferno, not the diverging bar's "blue against the class"


def test_a_relative_sequential_bar_says_when_values_are_negative() -> None:
    scale = map_scale(np.linspace(-0.2, 1.0, 100).reshape(10, 10), "minmax", clip=None)
    assert "below 0" in clip_note(scale, relative=True, below_zero=True)
    assert clip_note(map_scale(np.linspace(0.4, 0.9, 100).reshape(10, 10), "minmax", clip=None), relative=True) == ""
