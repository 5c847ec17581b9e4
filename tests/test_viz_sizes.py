"""Figures of any aspect ratio and size stay bounded; explain writes PNG, PDF or SVG at the asked resolution."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vitlens.viz import display_image, save_figure


@pytest.mark.parametrize("hw", [(1, 500), (500, 1), (3, 3), (5000, 300)])
def test_figure_size_is_bounded_for_any_aspect_ratio(tmp_path: Path, hw: tuple[int, int]) -> None:
    rng = np.random.default_rng(0)
    image = rng.integers(0, 255, (*hw, 3), dtype=np.uint8)
    path = save_figure(tmp_path / "f.png", image, rng.standard_normal(hw), title="t", caption="c", dpi=100)
    with Image.open(path) as written:
        width, height = written.size
    assert width <= 1000 and height <= 1600, (width, height)  # at 100 dpi: 8.3 x at most ~15.4 inches


def test_display_image_bounds_both_sides() -> None:
    big = np.zeros((3000, 6000, 3), np.uint8)
    assert display_image(big, 320, 2048).shape == (1024, 2048, 3)
    strip = np.zeros((1, 500, 3), np.uint8)
    assert display_image(strip, 320, 2048).shape == (4, 2000, 3)  # enlarged only as far as the long side allows
    small = np.zeros((28, 28, 3), np.uint8)
    assert display_image(small, 320, 2048).shape == (336, 336, 3)


@pytest.mark.parametrize("fmt,magic", [("pdf", b"%PDF"), ("svg", b"<?xml")])
def test_explain_writes_the_asked_format(tmp_path: Path, fmt: str, magic: bytes) -> None:
    from vitlens.cli import main

    photo = tmp_path / "p.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 32, 3), dtype=np.uint8)).save(photo)
    tiny = ["--model", "timm:vit_tiny_patch16_224", "--model-option", "pretrained=False", "--model-option",
            "img_size=32", "--model-option", "patch_size=8", "--model-option", "num_classes=6"]
    out = tmp_path / "o"
    assert main(["explain", str(photo), *tiny, "--methods", "rollout,inputxgradient", "--format", fmt,
                 "--dpi", "150", "--out", str(out), "--quiet"]) == 0
    for name in (f"p_png.rollout.{fmt}", f"p_png.rollout.view.{fmt}", f"p_png.grid.{fmt}"):
        assert (out / name).read_bytes().startswith(magic), name
    assert not list(out.glob("*.png"))


def test_explain_dpi_sets_the_raster_resolution(tmp_path: Path) -> None:
    from vitlens.cli import main

    photo = tmp_path / "p.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(photo)
    tiny = ["--model", "timm:vit_tiny_patch16_224", "--model-option", "pretrained=False", "--model-option",
            "img_size=32", "--model-option", "patch_size=8", "--model-option", "num_classes=6"]
    sizes = {}
    for dpi in (50, 100):
        out = tmp_path / str(dpi)
        assert main(["explain", str(photo), *tiny, "--methods", "rollout", "--dpi", str(dpi), "--out", str(out),
                     "--quiet"]) == 0
        with Image.open(out / "p_png.rollout.png") as written:
            sizes[dpi] = written.size
    assert sizes[100][0] == pytest.approx(2 * sizes[50][0], abs=2)
