"""Tests of vitlens.viz: overlays, grids and image conversion."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
import pytest
import torch
from PIL import Image

from vitlens.errors import InputError
from vitlens.images import data_config, load_images
from vitlens.viz import (
    is_signed,
    map_to_original,
    normalize_map,
    overlay,
    save_figure,
    save_grid,
    save_overlay,
    scale_map,
    split_label,
    to_uint8,
    upsample_image,
)


@pytest.fixture
def image() -> torch.Tensor:
    return torch.rand(3, 48, 40, generator=torch.Generator().manual_seed(0))


@pytest.fixture
def heatmap() -> torch.Tensor:
    return torch.randn(48, 40, generator=torch.Generator().manual_seed(1))


def test_to_uint8_layouts_agree(image: torch.Tensor) -> None:
    expected = to_uint8(image)
    assert expected.shape == (48, 40, 3) and expected.dtype == np.uint8
    hwc = image.permute(1, 2, 0).numpy()
    assert np.array_equal(to_uint8(hwc), expected)
    assert np.array_equal(to_uint8(image[None]), expected)
    assert np.array_equal(to_uint8(expected), expected)
    assert np.array_equal(to_uint8(Image.fromarray(expected)), expected)
    grey = to_uint8(image[:1])
    assert grey.shape == (48, 40, 3) and np.array_equal(grey[..., 0], grey[..., 2])


def test_to_uint8_rejects_normalised_input(image: torch.Tensor) -> None:
    with pytest.raises(InputError, match="denormalize"):
        to_uint8((image - 0.5) / 0.2)


def test_overlay_shape_dtype_and_range(image: torch.Tensor, heatmap: torch.Tensor) -> None:
    for normalize in ("minmax", "abs", "none"):
        out = overlay(image, heatmap, normalize=normalize)
        assert out.shape == (48, 40, 3) and out.dtype == np.uint8


def test_overlay_alpha_zero_is_the_image(image: torch.Tensor, heatmap: torch.Tensor) -> None:
    assert np.array_equal(overlay(image, heatmap, alpha=0.0), to_uint8(image))
    pixels = to_uint8(image)
    assert np.array_equal(overlay(pixels, heatmap, alpha=0.0), pixels)


def test_overlay_alpha_one_is_the_colour_map(image: torch.Tensor) -> None:
    ramp = np.linspace(0, 1, 40)[None].repeat(48, 0)
    expected = np.rint(matplotlib.colormaps["viridis"](ramp)[..., :3] * 255).astype(np.uint8)
    assert np.array_equal(overlay(image, ramp, alpha=1.0, cmap="viridis", normalize="none"), expected)


def test_constant_map_gives_no_nan(image: torch.Tensor) -> None:
    for normalize in ("minmax", "abs", "none"):
        assert not np.isnan(normalize_map(np.full((7, 7), 3.0), normalize)).any()
        out = overlay(image, torch.full((7, 7), 3.0), normalize=normalize)
        assert out.shape == (48, 40, 3)
    assert np.array_equal(normalize_map(np.zeros((5, 5)), "abs"), np.zeros((5, 5)))


def test_heatmap_is_resized_to_the_image(image: torch.Tensor) -> None:
    patch_map = torch.zeros(1, 6, 5)
    patch_map[0, :3] = 1.0  # top half hot
    out = overlay(image, patch_map, alpha=1.0, cmap="gray")
    assert out.shape == (48, 40, 3)
    assert out[:20].mean() > 200 and out[-20:].mean() < 50


def test_normalize_map_modes() -> None:
    signed = np.array([[-2.0, 0.0], [1.0, 2.0]])
    assert np.allclose(normalize_map(signed, "minmax"), [[0.0, 0.5], [0.75, 1.0]])
    assert np.allclose(normalize_map(signed, "abs"), [[1.0, 0.0], [0.5, 1.0]])
    assert np.allclose(normalize_map(signed, "none"), [[0.0, 0.0], [1.0, 1.0]])
    with pytest.raises(InputError):
        normalize_map(signed, "zscore")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs",
    [{"alpha": 1.5}, {"cmap": "no-such-map"}, {"heatmap": np.full((4, 4), np.nan)}, {"heatmap": np.zeros((2, 3, 4))}],
)
def test_overlay_rejects_bad_arguments(image: torch.Tensor, kwargs: dict) -> None:
    arguments = {"heatmap": np.zeros((4, 4)), **kwargs}
    with pytest.raises(InputError):
        overlay(image, **arguments)


def test_save_overlay_writes_readable_png(tmp_path: Path, image: torch.Tensor, heatmap: torch.Tensor) -> None:
    path = save_overlay(tmp_path / "out" / "map.png", image, heatmap, alpha=0.3, metadata={"method": "test"})
    with Image.open(path) as written:
        assert written.size == (40, 48) and written.mode == "RGB"
        assert written.info["method"] == "test"
        assert np.array_equal(np.asarray(written), overlay(image, heatmap, alpha=0.3))


def test_save_grid_writes_png_without_touching_the_backend(
    tmp_path: Path, image: torch.Tensor, heatmap: torch.Tensor
) -> None:
    backend = dict.__getitem__(matplotlib.rcParams, "backend")
    images = torch.stack([image, image.flip(-1)])
    maps: dict[str, Any] = {"random": torch.stack([heatmap, heatmap.abs()]), "patches": [np.ones((6, 5)), np.eye(6, 5)]}
    path = save_grid(tmp_path / "grid.png", images, maps, row_labels=["a", "b"], col_size=1.0, dpi=50)
    with Image.open(path) as written:
        assert written.format == "PNG"
        width, height = written.size
        assert width == 170  # 3 columns of 1 inch at 50 dpi + the row labels' margin
        assert height > 100  # 2 rows of 1 inch + titles and colour bars
    assert dict.__getitem__(matplotlib.rcParams, "backend") == backend


def test_save_grid_rejects_mismatched_lengths(tmp_path: Path, image: torch.Tensor, heatmap: torch.Tensor) -> None:
    with pytest.raises(InputError, match="2 image"):
        save_grid(tmp_path / "g.png", [image, image], {"m": [heatmap]})
    with pytest.raises(InputError, match="titles"):
        save_grid(tmp_path / "g.png", [image], {"m": [heatmap]}, titles=["only one"])
    with pytest.raises(InputError, match="row_labels"):
        save_grid(tmp_path / "g.png", [image], {"m": [heatmap]}, row_labels=["a", "b"])
    with pytest.raises(InputError, match="captions"):
        save_grid(tmp_path / "g.png", [image], {"m": [heatmap]}, captions=["a", "b"])


def test_signed_maps_are_centred_at_zero() -> None:
    signed = np.array([[-1.0, 0.0], [0.5, 2.0]])
    values, scale = scale_map(signed, "auto")
    assert scale.mode == "signed" and scale.vmin == -2.0 and scale.vmax == 2.0
    assert np.allclose(values, [[0.25, 0.5], [0.625, 1.0]])  # 0 -> the middle of the diverging map
    assert not is_signed(np.array([[0.0, 1.0], [2.0, 3.0]]))
    assert scale_map(np.array([[0.0, 1.0], [2.0, 3.0]]), "auto")[1].mode == "minmax"


def test_zero_relevance_leaves_the_image_unchanged_in_signed_overlays(image: torch.Tensor) -> None:
    signed = torch.zeros(48, 40)
    signed[:10] = 1.0
    signed[-10:] = -1.0
    out = overlay(image, signed, alpha=0.5)
    pixels = to_uint8(image)
    assert np.array_equal(out[20:30], pixels[20:30])
    assert out[:10, :, 0].mean() > out[:10, :, 2].mean()  # positive -> red
    assert out[-10:, :, 2].mean() > out[-10:, :, 0].mean()  # negative -> blue


def test_percentile_clipping_saturates_outliers() -> None:
    arr = np.ones((10, 10))
    arr[0, 0] = 1000.0
    plain = normalize_map(arr, "abs")
    clipped = normalize_map(arr, "abs", clip=95)
    assert plain[5, 5] < 0.01 and clipped[5, 5] == 1.0 and clipped[0, 0] == 1.0
    with pytest.raises(InputError, match="clip"):
        normalize_map(arr, "abs", clip=0)


def test_upsample_keeps_pixels_as_squares() -> None:
    small = (np.arange(12, dtype=np.uint8).reshape(2, 2, 3) * 20)
    big = upsample_image(small, 5)
    assert big.shape == (6, 6, 3)
    assert np.array_equal(big[::3, ::3], small)


def test_map_to_original_inverts_the_centre_crop() -> None:
    cfg = data_config({"input_size": (3, 32, 32), "crop_pct": 1.0, "crop_mode": "center"})
    view = np.zeros((32, 32))
    view[:, :16] = 1.0  # left half of what the model saw
    placed = map_to_original(view, (40, 80), cfg)  # a wide image: its sides were cut off
    assert placed.shape == (40, 80)
    assert np.isnan(placed[:, :15]).all() and np.isnan(placed[:, -15:]).all()  # never seen
    assert np.nanmean(placed[:, 22:38]) > 0.95 and np.nanmean(placed[:, 42:58]) < 0.05
    # The same geometry as the preprocessing: a marker at the view's left edge lands at x = 20 of the original.
    marker = np.zeros((40, 80, 3), np.uint8)
    marker[:, 20:22] = 255
    x = load_images(marker, cfg)
    assert float(x[0, 0, :, :2].mean()) > float(x[0, 0, :, 4:].mean())


def test_save_figure_has_colour_bar_and_caption(tmp_path: Path, image: torch.Tensor, heatmap: torch.Tensor) -> None:
    path = save_figure(tmp_path / "fig.png", image, heatmap, title="gradskip", caption="ring, p = 0.92",
                       metadata={"method": "gradskip"})
    with Image.open(path) as written:
        assert written.info["method"] == "gradskip"
        width, height = written.size
        assert width > 2 * 320  # image + overlay panels at a readable size, and the colour bar
        pixels = np.asarray(written.convert("RGB"))
    # The signed map used the diverging colour bar: both strong red and strong blue columns exist on the right.
    bar = pixels[:, int(width * 0.8):]  # the bar and its label (longer since it states the clipping)
    assert ((bar[..., 0] > 150) & (bar[..., 2] < 90)).any() and ((bar[..., 2] > 150) & (bar[..., 0] < 90)).any()


def test_split_label() -> None:
    assert split_label("gradskip[alpha=0,skip=fixed]") == ("gradskip", "alpha=0, skip=fixed")
    assert split_label("rollout") == ("rollout", "")
