"""Tests of vitlens.images: data configs, timm-exact preprocessing, loading of every input kind, and its errors."""

from __future__ import annotations

import dataclasses
import io
import subprocess
import sys
from collections.abc import Iterator
from itertools import product
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from vitlens.errors import ImageLoadError, InputError, UnsupportedModelError, VitlensError
from vitlens.images import (
    IMAGENET_DEFAULT_MEAN,
    IMAGENET_DEFAULT_STD,
    DataConfig,
    data_config,
    denormalize,
    load_images,
    normalize,
    preprocess,
)

timm = pytest.importorskip("timm")
from timm.data import create_transform  # noqa: E402

SMALL = DataConfig(input_size=(3, 32, 32), mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.3), crop_pct=0.9)
IMAGE_SHAPES = [(224, 224), (300, 200), (97, 311), (31, 40), (257, 256)]  # (H, W): square, portrait, wide, small
CROP_PCTS = [0.875, 0.9, 0.95, 1.0, 1.15]  # 1.15 > 1 makes the crop pad
INTERPOLATIONS = ["bilinear", "bicubic", "nearest"]
INPUT_SIZES = [(3, 224, 224), (3, 64, 48)]  # square and non-square model inputs
TOLERANCE = 1e-5


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(0)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Run torch single-threaded: hundreds of tiny tensor ops stall on OpenMP hand-offs when the CPUs are busy."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _noise(rng: np.random.Generator, h: int, w: int, channels: int = 3) -> np.ndarray:
    shape = (h, w) if channels == 1 else (h, w, channels)
    return rng.integers(0, 256, shape, dtype=np.uint8)


def _timm_eval(cfg: DataConfig, img: Image.Image) -> torch.Tensor:
    return create_transform(**cfg.to_dict(), is_training=False)(img)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a - b).abs().max().item()


# ---------------------------------------------------------------------------------------------------------------------
# preprocess vs timm
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("crop_mode", ["center", "squash", "border"])
def test_preprocess_matches_timm_eval_transform(crop_mode: str, rng: np.random.Generator) -> None:
    images = [Image.fromarray(_noise(rng, h, w)) for h, w in IMAGE_SHAPES]
    worst = 0.0
    for img, pct, interpolation, size in product(images, CROP_PCTS, INTERPOLATIONS, INPUT_SIZES):
        cfg = DataConfig(
            input_size=size,
            crop_pct=pct,
            interpolation=interpolation,
            crop_mode=crop_mode,
            mean=(0.48, 0.45, 0.41),
            std=(0.23, 0.22, 0.26),
        )
        out = preprocess(img, cfg)
        assert out.shape == (3, size[1], size[2]) and out.dtype == torch.float32
        worst = max(worst, _max_diff(out, _timm_eval(cfg, img)))
    assert worst < TOLERANCE  # measured: 0.0 (bit-identical)


def test_preprocess_matches_timm_default_config_of_real_architecture(rng: np.random.Generator) -> None:
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False)
    cfg = data_config(model)
    assert cfg.to_dict() == DataConfig.from_dict(timm.data.resolve_model_data_config(model)).to_dict()
    for h, w in [(240, 320), (500, 375), (224, 224), (64, 90)]:
        img = Image.fromarray(_noise(rng, h, w))
        assert _max_diff(preprocess(img, model), _timm_eval(cfg, img)) < TOLERANCE


def test_preprocess_greyscale_matches_timm_on_rgb(rng: np.random.Generator) -> None:
    # timm's transform needs RGB (its loaders call .convert("RGB")); preprocess accepts the grey image directly.
    img = Image.fromarray(_noise(rng, 120, 90, channels=1))
    assert img.mode == "L"
    for interpolation, crop_mode in product(INTERPOLATIONS, ["center", "border"]):
        cfg = SMALL.replace(interpolation=interpolation, crop_mode=crop_mode, crop_pct=1.15)
        assert _max_diff(preprocess(img, cfg), _timm_eval(cfg, img.convert("RGB"))) < TOLERANCE


def test_preprocess_opaque_rgba_matches_timm_on_rgb(rng: np.random.Generator) -> None:
    rgba = _noise(rng, 70, 50, channels=4)
    rgba[..., 3] = 255
    img = Image.fromarray(rgba)
    assert _max_diff(preprocess(img, SMALL), _timm_eval(SMALL, img.convert("RGB"))) < TOLERANCE


def test_transparency_is_composited_onto_white(rng: np.random.Generator) -> None:
    identity = DataConfig(input_size=(3, 20, 30), crop_pct=1.0, crop_mode="squash")  # no resize, no crop
    rgba = _noise(rng, 20, 30, channels=4)
    rgba[:10, :, 3] = 0  # top half fully transparent
    pixels = denormalize(load_images(rgba, identity), identity)[0]
    assert torch.allclose(pixels[:, :10], torch.ones(3, 10, 30), atol=1e-6)
    a = rgba[10:, :, 3:].astype(np.float64) / 255
    expected = (rgba[10:, :, :3] / 255) * a + (1 - a)
    got = pixels[:, 10:].permute(1, 2, 0).numpy()
    assert np.abs(got - expected).max() <= 1.5 / 255  # PIL's 8-bit compositing rounds


def test_sixteen_bit_png_is_scaled_not_clipped(tmp_path: Path) -> None:
    identity = DataConfig(input_size=(3, 8, 8), crop_pct=1.0, crop_mode="squash")
    values = np.linspace(0, 65535, 64).reshape(8, 8).astype(np.uint16)
    Image.fromarray(values).save(tmp_path / "deep.png")
    pixels = denormalize(load_images(tmp_path / "deep.png", identity), identity)[0, 0].numpy()
    assert np.abs(pixels - values / 65535).max() <= 0.5 / 255 + 1e-6


# ---------------------------------------------------------------------------------------------------------------------
# DataConfig and data_config
# ---------------------------------------------------------------------------------------------------------------------


def test_data_config_dict_round_trip_and_defaults() -> None:
    cfg = DataConfig.from_dict({"input_size": (3, 64, 48), "interpolation": "bilinear", "crop_mode": None})
    assert cfg.input_size == (3, 64, 48)
    assert cfg.mean == IMAGENET_DEFAULT_MEAN and cfg.std == IMAGENET_DEFAULT_STD
    assert cfg.crop_pct == 0.875 and cfg.crop_mode == "center"
    assert DataConfig.from_dict(cfg.to_dict()) == cfg
    assert DataConfig(input_size=96).input_size == (3, 96, 96)  # type: ignore[arg-type]
    assert data_config(cfg) is cfg
    assert data_config(cfg.to_dict()) == cfg
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.crop_pct = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(
    "bad",
    [
        {"img_size": 224},
        {"input_size": (4, 32, 32)},
        {"std": (0.5, 0.0, 0.5)},
        {"mean": (0.5, 0.5)},
        {"interpolation": "cubic"},
        {"crop_mode": "middle"},
        {"crop_pct": -1.0},
    ],
)
def test_data_config_rejects_invalid_dicts(bad: dict) -> None:
    with pytest.raises(InputError):
        DataConfig.from_dict(bad)


def test_data_config_of_timm_model_uses_its_actual_img_size() -> None:
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, depth=1)
    cfg = data_config(model)
    assert cfg.input_size == (3, 32, 32)
    assert cfg.interpolation == model.pretrained_cfg["interpolation"]


def test_data_config_of_module_with_vitlens_data_config() -> None:
    model = torch.nn.Linear(2, 2)
    model.vitlens_data_config = {"input_size": (3, 16, 16), "mean": 0.5, "std": 0.5}  # type: ignore[assignment]
    cfg = data_config(model)
    assert cfg.input_size == (3, 16, 16) and cfg.mean == (0.5, 0.5, 0.5)
    timm_model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, depth=1)
    timm_model.vitlens_data_config = {"crop_pct": 1.0}
    cfg = data_config(timm_model)
    assert cfg.crop_pct == 1.0 and cfg.input_size == (3, 32, 32)


def test_data_config_rejects_unknown_model() -> None:
    with pytest.raises(UnsupportedModelError, match="config dict"):
        data_config(torch.nn.Linear(2, 2))


def test_data_config_of_huggingface_models() -> None:
    transformers = pytest.importorskip("transformers")
    small = dict(image_size=32, patch_size=16, hidden_size=8, num_hidden_layers=1, num_attention_heads=1)
    vit = transformers.ViTModel(transformers.ViTConfig(intermediate_size=8, **small))
    cfg = data_config(vit)
    assert cfg.input_size == (3, 32, 32) and cfg.interpolation == "bilinear" and cfg.crop_pct == 1.0
    assert cfg.mean == (0.5, 0.5, 0.5) and cfg.std == (0.5, 0.5, 0.5)
    deit = transformers.DeiTModel(transformers.DeiTConfig(intermediate_size=8, **small))
    assert data_config(deit).mean == IMAGENET_DEFAULT_MEAN and data_config(deit).std == IMAGENET_DEFAULT_STD
    vit.config.vitlens_data_config = {"mean": (0.1, 0.2, 0.3)}
    assert data_config(vit).mean == (0.1, 0.2, 0.3) and data_config(vit).input_size == (3, 32, 32)


# ---------------------------------------------------------------------------------------------------------------------
# load_images: inputs
# ---------------------------------------------------------------------------------------------------------------------


def test_load_images_from_paths_pil_and_arrays_agree(tmp_path: Path, rng: np.random.Generator) -> None:
    pixels = _noise(rng, 45, 60)
    Image.fromarray(pixels).save(tmp_path / "a.png")
    expected = preprocess(Image.fromarray(pixels), SMALL)
    items: list[Any] = [str(tmp_path / "a.png"), tmp_path / "a.png", Image.fromarray(pixels), pixels, pixels / 255.0]
    for item in items:
        out = load_images(item, SMALL)
        assert out.shape == (1, 3, 32, 32) and out.dtype == torch.float32
        assert _max_diff(out[0], expected) == 0.0


def test_load_images_greyscale_and_rgba_arrays(rng: np.random.Generator) -> None:
    grey = _noise(rng, 40, 40, channels=1)
    expected = preprocess(Image.fromarray(grey).convert("RGB"), SMALL)
    for item in [grey, grey[..., None], grey.astype(np.float32) / 255]:
        assert _max_diff(load_images(item, SMALL)[0], expected) == 0.0
    rgba = _noise(rng, 40, 40, channels=4)
    assert load_images(rgba, SMALL).shape == (1, 3, 32, 32)


def test_float_pixels_are_rounded_to_8_bits(rng: np.random.Generator) -> None:
    floats = rng.random((50, 37, 3))
    as_bytes = np.rint(floats * 255).astype(np.uint8)
    assert _max_diff(load_images(floats, SMALL), load_images(as_bytes, SMALL)) == 0.0


def test_tensor_at_input_size_is_only_normalised(rng: np.random.Generator) -> None:
    t = torch.from_numpy(rng.random((2, 3, 32, 32))).float()
    out = load_images(t, SMALL)
    assert _max_diff(out, normalize(t, SMALL)) == 0.0
    assert _max_diff(load_images(t[0], SMALL)[0], normalize(t[0], SMALL)) == 0.0
    grey = t[:, :1]
    assert _max_diff(load_images(grey, SMALL), normalize(grey.expand(-1, 3, -1, -1), SMALL)) == 0.0


def test_tensor_of_other_size_gets_the_eval_transform(rng: np.random.Generator) -> None:
    pixels = _noise(rng, 50, 70)
    t = torch.from_numpy(pixels).permute(2, 0, 1)
    expected = preprocess(Image.fromarray(pixels), SMALL)
    assert _max_diff(load_images(t.float() / 255, SMALL)[0], expected) == 0.0
    assert _max_diff(load_images(t, SMALL)[0], expected) == 0.0  # uint8 tensor


def test_mixed_list_keeps_order_and_counts_batches(tmp_path: Path, rng: np.random.Generator) -> None:
    first = _noise(rng, 40, 50)
    Image.fromarray(first).save(tmp_path / "first.png")
    batch = torch.rand(2, 3, 32, 32)
    last = Image.fromarray(_noise(rng, 33, 33, channels=1))
    out = load_images((tmp_path / "first.png", batch, last), SMALL)
    assert out.shape == (4, 3, 32, 32)
    assert _max_diff(out[0], preprocess(Image.fromarray(first), SMALL)) == 0.0
    assert _max_diff(out[1:3], normalize(batch, SMALL)) == 0.0
    assert _max_diff(out[3], preprocess(last, SMALL)) == 0.0


def test_exif_orientation_is_applied(tmp_path: Path, rng: np.random.Generator) -> None:
    img = Image.fromarray(_noise(rng, 40, 60))
    exif = img.getexif()
    exif[0x0112] = 6  # rotate 90° clockwise for display
    img.save(tmp_path / "rotated.jpg", exif=exif.tobytes())
    upright = ImageOps.exif_transpose(Image.open(tmp_path / "rotated.jpg"))
    assert upright.size == (40, 60)
    cfg = SMALL.replace(crop_mode="squash", crop_pct=1.0, input_size=(3, 60, 40))
    assert _max_diff(load_images(tmp_path / "rotated.jpg", cfg)[0], preprocess(upright, cfg)) == 0.0


def test_normalize_denormalize_round_trip() -> None:
    pixels = torch.rand(2, 3, 8, 8)
    x = normalize(pixels, SMALL)
    assert torch.allclose(denormalize(x, SMALL), pixels, atol=1e-6)
    assert denormalize(torch.full((3, 4, 4), 100.0), SMALL).max() == 1.0
    assert denormalize(torch.full((3, 4, 4), -100.0), SMALL).min() == 0.0
    with pytest.raises(InputError):
        normalize(torch.rand(2, 4, 8, 8), SMALL)
    with pytest.raises(InputError, match="uint8"):
        normalize(torch.zeros(3, 8, 8, dtype=torch.uint8), SMALL)


# ---------------------------------------------------------------------------------------------------------------------
# load_images: errors (one message line each, naming the item)
# ---------------------------------------------------------------------------------------------------------------------


def _error(inputs: Any, kind: type[VitlensError] = InputError) -> str:
    with pytest.raises(kind) as info:
        load_images(inputs, SMALL)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_error_missing_file(tmp_path: Path) -> None:
    message = _error(tmp_path / "nope.png", ImageLoadError)
    assert "not found" in message and "nope.png" in message


def test_error_non_image_file(tmp_path: Path) -> None:
    (tmp_path / "notes.jpg").write_text("this is text, not a JPEG")
    message = _error([str(tmp_path / "notes.jpg")], ImageLoadError)
    assert "not an image" in message and "notes.jpg" in message and "inputs[0]" in message


def test_error_truncated_image(tmp_path: Path, rng: np.random.Generator) -> None:
    buffer = io.BytesIO()
    Image.fromarray(_noise(rng, 64, 64)).save(buffer, format="JPEG")
    (tmp_path / "cut.jpg").write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2])
    message = _error(tmp_path / "cut.jpg", ImageLoadError)
    assert "truncated" in message and "cut.jpg" in message


def test_error_directory(tmp_path: Path) -> None:
    assert "directory" in _error(tmp_path, ImageLoadError)


def test_error_array_wrong_rank() -> None:
    message = _error([np.zeros((4, 4), np.uint8), np.zeros((2, 4, 4, 3), np.uint8)])
    assert "inputs[1]" in message and "(2, 4, 4, 3)" in message


def test_error_array_wrong_channel_count() -> None:
    assert "(4, 4, 2)" in _error(np.zeros((4, 4, 2), np.uint8))


def test_error_tensor_wrong_channel_count() -> None:
    assert "(2, 8, 8)" in _error(torch.rand(2, 8, 8))


def test_error_array_dtype() -> None:
    assert "int64" in _error(np.zeros((4, 4), np.int64))


def test_error_nan_in_array() -> None:
    pixels = np.full((4, 4, 3), 0.5)
    pixels[1, 2, 0] = np.nan
    assert "NaN" in _error(pixels)


def test_error_inf_in_tensor() -> None:
    pixels = torch.full((3, 8, 8), 0.5)
    pixels[0, 0, 0] = float("inf")
    assert "infinite" in _error(pixels)


def test_error_float_array_out_of_range() -> None:
    message = _error(np.full((4, 4, 3), 128.0))
    assert "[0, 1]" in message and "128" in message


def test_error_normalised_tensor_out_of_range() -> None:
    assert "[0, 1]" in _error(normalize(torch.rand(3, 32, 32), SMALL) - 1.0)


def test_error_empty_list() -> None:
    assert "empty" in _error([])


def test_error_unsupported_type() -> None:
    assert "int" in _error([Image.new("RGB", (8, 8)), 3])


def test_runtime_needs_neither_torchvision_nor_pyplot() -> None:
    # Import these two modules without the package __init__ (whose other imports are not under test here).
    code = (
        "import importlib.util, sys, types\n"
        "package = types.ModuleType('vitlens')\n"
        "package.__path__ = list(importlib.util.find_spec('vitlens').submodule_search_locations)\n"
        "sys.modules['vitlens'] = package\n"
        "import numpy as np, vitlens.images as I, vitlens.viz as V\n"
        "x = I.load_images(np.zeros((40, 30, 3), np.uint8), {'input_size': (3, 16, 16)})\n"
        "V.overlay(I.denormalize(x, {'input_size': (3, 16, 16)})[0], np.eye(4))\n"
        "print(sorted({'torchvision', 'timm', 'transformers', 'matplotlib.pyplot'} & set(sys.modules)))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "[]"
