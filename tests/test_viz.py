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
from vitlens.viz import normalize_map, overlay, save_grid, save_overlay, to_uint8


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
        assert written.size == (150, 100)  # 3 columns x 2 rows of 1 inch at 50 dpi
    assert dict.__getitem__(matplotlib.rcParams, "backend") == backend


def test_save_grid_rejects_mismatched_lengths(tmp_path: Path, image: torch.Tensor, heatmap: torch.Tensor) -> None:
    with pytest.raises(InputError, match="2 image"):
        save_grid(tmp_path / "g.png", [image, image], {"m": [heatmap]})
    with pytest.raises(InputError, match="titles"):
        save_grid(tmp_path / "g.png", [image], {"m": [heatmap]}, titles=["only one"])
    with pytest.raises(InputError, match="row_labels"):
        save_grid(tmp_path / "g.png", [image], {"m": [heatmap]}, row_labels=["a", "b"])
