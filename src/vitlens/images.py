"""Loading and preprocessing images with the model's own data configuration.

The first stage of ``image → model adapter → explainer → map → metric/report``: turn files, PIL images, arrays and
tensors into a normalised ``(B, 3, H, W)`` float32 batch exactly as the model was evaluated.

:func:`preprocess` reproduces timm's evaluation transform (``timm.data.create_transform(**cfg, is_training=False)``)
with PIL, numpy and torch only; torchvision is not needed at run time. For a PIL image the result is bit-identical to
timm's (``tests/test_images.py`` checks this). The geometry rules it mirrors, for ``input_size = (3, H, W)`` and
``scale = (floor(H / crop_pct), floor(W / crop_pct))``:

* ``crop_mode='center'``: if ``scale`` is square, resize the shorter side to ``scale[0]`` (the longer side becomes
  ``int(scale * long / short)``, truncated); otherwise resize by ``min(h / scale_h, w / scale_w)`` with each side
  rounded (Python ``round``). Then centre-crop ``(H, W)``, zero-padding first if the resized image is smaller.
* ``crop_mode='squash'``: resize to exactly ``scale`` (aspect ratio not kept), then centre-crop as above.
* ``crop_mode='border'``: resize by ``max(h / scale_h, w / scale_w)`` (the longer side fits), then centre-crop or
  pad to ``(H, W)`` with the colour ``round(255 * mean)``.

Crop offsets are ``round((size - crop) / 2)``; padding puts the odd pixel on the right/bottom. Resampling is PIL's
(antialiased for bilinear/bicubic), then ``x / 255`` in float32, then ``(x - mean) / std`` in float32.

Documented choices:

* **Transparency** (RGBA, LA, palette images with a transparent colour, float/uint8 arrays with 4 channels) is
  composited onto **white**, as HuggingFace's ``convert_to_rgb`` does. Dropping alpha would expose whatever colour
  the encoder stored under transparent pixels (often black), which is not what the picture looks like.
* **Greyscale** is replicated to three channels.
* **16-bit images** (PIL modes ``I;16*``, e.g. 16-bit PNG) are scaled by ``1/257`` to 8 bits instead of PIL's
  clipping. **32-bit integer and float images** (modes ``I`` and ``F``, e.g. TIFF) have no fixed range: each is
  scaled by its own range, its minimum to 0 and its maximum to 255 (a constant image keeps its value; a float one in
  [0, 1] is multiplied by 255); NaN or infinite pixels are refused.
* **EXIF orientation** is applied by :func:`load_images` to files and PIL images (as image viewers and HuggingFace's
  ``load_image`` do); :func:`preprocess` itself is the pure transform of the pixels it is given.
* **Float pixels** (arrays, and tensors that need resizing) are rounded to 8 bits (``round(255 * x)``, an error of at
  most ``0.5 / 255`` per input pixel) and then follow the same PIL path, so the result is exactly timm's transform of
  that 8-bit picture, and float pixels on the ``k / 255`` grid match loading the same pixels from a file bit for bit.
  Resampling in PIL's float mode instead was measured against this path: ~1.4/255 apart on smooth images, but up to
  10/255 on high-frequency content with bicubic, because PIL's 8-bit path clips the overshoot between its horizontal
  and vertical passes; the 8-bit path is chosen because it is the one the model was evaluated with.
* **Tensors** are treated as already-prepared pixel grids: a ``(3, H, W)`` / ``(B, 3, H, W)`` tensor whose size equals
  the config's input size is only normalised (no resize, no crop). Any other tensor, and every PIL image, file and
  numpy array, goes through the full evaluation transform.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from vitlens.errors import ImageLoadError, InputError
from vitlens.preprocessing import (  # re-exported: vitlens.images.DataConfig is public
    IMAGENET_DEFAULT_MEAN,
    IMAGENET_DEFAULT_STD,
    DataConfig,
)

__all__ = [
    "DataConfig",
    "ImageInput",
    "IMAGENET_DEFAULT_MEAN",
    "IMAGENET_DEFAULT_STD",
    "data_config",
    "preprocess",
    "load_images",
    "normalize",
    "denormalize",
]

#: the PIL filter of each interpolation name a DataConfig accepts (vitlens.preprocessing.INTERPOLATIONS)
_INTERPOLATIONS: dict[str, Image.Resampling] = {
    "nearest": Image.Resampling.NEAREST,
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "box": Image.Resampling.BOX,
    "hamming": Image.Resampling.HAMMING,
    "lanczos": Image.Resampling.LANCZOS,
}
_ACCEPTED_HINT = "a path, PIL image, numpy array (H,W)/(H,W,1|3|4), or tensor (3,H,W)/(B,3,H,W)"

ImageInput = str | Path | Image.Image | np.ndarray | torch.Tensor
"""One input accepted by :func:`load_images`; a list or tuple of these (mixed) is accepted too."""


# --------------------------------------------------------------------------------------------------------------------
# Data config
# --------------------------------------------------------------------------------------------------------------------


def data_config(model_or_config: DataConfig | Mapping[str, Any] | torch.nn.Module) -> DataConfig:
    """The :class:`DataConfig` of a model, or a config given directly.

    Accepts, in this order of precedence:

    * a :class:`DataConfig` (returned as is) or a dict in timm's format (see :meth:`DataConfig.from_dict`);
    * any ``nn.Module`` carrying a ``vitlens_data_config`` attribute (dict or DataConfig): its keys override what
      would otherwise be derived for the model (timm's defaults for a model of no known family);
    * a timm model: ``timm.data.resolve_model_data_config(model)``, with ``input_size`` taken from the model's fixed
      ``patch_embed.img_size`` when that differs from the pretrained config's;
    * a HuggingFace vision model (``transformers.PreTrainedModel`` with ``config.image_size``): that size, bilinear,
      ``crop_pct=1.0``, ``crop_mode='squash'`` (the ViT processors resize to the square size without cropping),
      ImageNet mean/std for ``model_type == 'deit'`` and 0.5/0.5 otherwise; DINOv2, CLIP, SigLIP and BEiT get their
      own processors' defaults (``vitlens.models.hf_families.processor_defaults``); ``model.config`` carrying a
      ``vitlens_data_config`` dict overrides them.

    Raises:
        UnsupportedModelError: for anything else.
    """
    if isinstance(model_or_config, DataConfig):
        return model_or_config
    if isinstance(model_or_config, Mapping):
        return DataConfig.from_dict(model_or_config)
    from vitlens.models.data_configs import model_data_config  # the model families' knowledge

    return model_data_config(model_or_config)


# --------------------------------------------------------------------------------------------------------------------
# Geometry (timm's eval transform)
# --------------------------------------------------------------------------------------------------------------------


def resize_shape(h: int, w: int, cfg: DataConfig) -> tuple[int, int]:
    """Size ``(h', w')`` the image is resized to before the centre crop/pad, by timm's rules (see module doc)."""
    out_h, out_w = cfg.size_hw
    scale_h, scale_w = math.floor(out_h / cfg.crop_pct), math.floor(out_w / cfg.crop_pct)
    if cfg.crop_mode == "squash":
        return scale_h, scale_w
    if cfg.crop_mode == "center" and scale_h == scale_w:
        # torchvision Resize(int): shorter side to `scale`, longer side truncated.
        short, long = (w, h) if w <= h else (h, w)
        new_short, new_long = scale_h, int(scale_h * long / short)
        return (new_long, new_short) if w <= h else (new_short, new_long)
    # timm ResizeKeepRatio: 'center' fits the shorter side (longest=0), 'border' the longer one (longest=1).
    ratio_h, ratio_w = h / scale_h, w / scale_w
    ratio = max(ratio_h, ratio_w) if cfg.crop_mode == "border" else min(ratio_h, ratio_w)
    # max(1, ...) only matters for extreme aspect ratios, where timm itself would fail on a zero-size resize.
    return max(1, round(h / ratio)), max(1, round(w / ratio))


def _pad_fill(cfg: DataConfig) -> tuple[int, int, int]:
    """8-bit colour of padding: the mean colour for 'border' (as timm), black for the others (torchvision)."""
    if cfg.crop_mode == "border":
        return (round(255 * cfg.mean[0]), round(255 * cfg.mean[1]), round(255 * cfg.mean[2]))
    return (0, 0, 0)


def crop_or_pad(arr: np.ndarray, out_hw: tuple[int, int], fill: Sequence[float]) -> np.ndarray:
    """Centre-crop ``arr`` (h, w, C) to ``out_hw``, padding with ``fill`` (len C) first where it is smaller."""
    out_h, out_w = out_hw
    h, w = arr.shape[:2]
    if out_h > h or out_w > w:
        top = (out_h - h) // 2 if out_h > h else 0
        left = (out_w - w) // 2 if out_w > w else 0
        new_h, new_w = max(h, out_h), max(w, out_w)
        padded = np.empty((new_h, new_w, arr.shape[2]), dtype=arr.dtype)
        padded[...] = np.asarray(fill, dtype=arr.dtype)
        padded[top : top + h, left : left + w] = arr
        arr, h, w = padded, new_h, new_w
    top = int(round((h - out_h) / 2.0))
    left = int(round((w - out_w) / 2.0))
    return arr[top : top + out_h, left : left + out_w]


def _chw01(pixels: np.ndarray) -> torch.Tensor:
    """``(H, W, 3)`` uint8 → ``(3, H, W)`` float32 in [0, 1], scaled by 1/255 in float32 as torchvision's
    ``to_tensor`` does (a fresh, writable copy)."""
    return torch.from_numpy(np.array(pixels, copy=True)).permute(2, 0, 1).to(torch.float32).div(255)


def _geometry_uint8(img: Image.Image, cfg: DataConfig) -> np.ndarray:
    """Resize + crop an RGB PIL image; returns ``(H, W, 3)`` uint8."""
    new_h, new_w = resize_shape(img.height, img.width, cfg)
    if (new_h, new_w) != (img.height, img.width):
        img = img.resize((new_w, new_h), _INTERPOLATIONS[cfg.interpolation])
    return crop_or_pad(np.asarray(img, dtype=np.uint8), cfg.size_hw, _pad_fill(cfg))


# --------------------------------------------------------------------------------------------------------------------
# Colour handling
# --------------------------------------------------------------------------------------------------------------------


def _deep_to_uint8(img: Image.Image) -> np.ndarray:
    """8-bit grey of a 16-bit, 32-bit integer or float image: ``I;16*`` by ``1/257`` (its format's range); ``I``
    (32-bit integers, e.g. TIFF) and ``F`` (float, e.g. TIFF) by the image's own range, min to max → 0 to 255 (they
    have no fixed range: a float image in [0, 1] or a 12-bit one would otherwise be black); a constant image keeps
    its value, clipped to 0–255 (``F`` in [0, 1] times 255). NaN or infinite values are refused."""
    arr = np.asarray(img).astype(np.float64)
    if img.mode.startswith("I;16"):
        return np.clip(np.rint(arr / 257.0), 0, 255).astype(np.uint8)
    if not np.isfinite(arr).all():
        raise ImageLoadError(f"a float (mode {img.mode}) image with NaN or infinite pixels cannot be shown or "
                             "explained")
    lo, hi = float(arr.min()), float(arr.max())
    if hi > lo:
        arr = (arr - lo) * (255.0 / (hi - lo))
    elif img.mode == "F" and 0.0 <= lo <= 1.0:
        arr = arr * 255.0
    return np.clip(np.rint(arr), 0, 255).astype(np.uint8)


def to_rgb(img: Image.Image) -> Image.Image:
    """An RGB PIL image: transparency composited onto white, greyscale replicated, 16-bit scaled to 8-bit."""
    if img.mode == "RGB":
        return img
    if img.mode in ("I", "F") or img.mode.startswith("I;16"):
        img = Image.fromarray(_deep_to_uint8(img))
    if img.mode == "La":  # premultiplied alpha: PIL converts it to nothing but LA
        img = img.convert("LA")
    if "A" in img.getbands() or "a" in img.getbands() or "transparency" in img.info:  # 'a': premultiplied alpha
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img.convert("RGB")


def preprocess(img: Image.Image, cfg: DataConfig | Mapping[str, Any] | torch.nn.Module) -> torch.Tensor:
    """Apply the model's evaluation transform to one PIL image.

    Equal (bit for bit, on CPU) to ``timm.data.create_transform(**cfg.to_dict(), is_training=False)`` applied to
    ``img`` converted to RGB; see the module doc for the rules and the colour conversion.

    Args:
        img: a PIL image of any mode.
        cfg: the data config (or anything :func:`data_config` accepts).

    Returns:
        ``(3, H, W)`` float32 normalised tensor, ``(H, W) = cfg.input_size[1:]``.
    """
    if not isinstance(img, Image.Image):
        raise InputError(f"preprocess expects a PIL image, got {type(img).__name__}; use load_images for other inputs")
    cfg = data_config(cfg)
    return normalize(_chw01(_geometry_uint8(to_rgb(img), cfg)), cfg)


# --------------------------------------------------------------------------------------------------------------------
# Normalisation
# --------------------------------------------------------------------------------------------------------------------


def _stats(x: torch.Tensor, cfg: DataConfig) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dim() < 3 or x.shape[-3] != 3:
        raise InputError(f"expected images of shape (3, H, W) or (B, 3, H, W), got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise InputError(f"expected floating-point images, got {x.dtype} (divide 0-255 pixels by 255 first)")
    mean = torch.tensor(cfg.mean, dtype=x.dtype, device=x.device).view(3, 1, 1)
    std = torch.tensor(cfg.std, dtype=x.dtype, device=x.device).view(3, 1, 1)
    return mean, std


def normalize(images01: torch.Tensor, cfg: DataConfig | Mapping[str, Any] | torch.nn.Module) -> torch.Tensor:
    """``(images01 - mean) / std``: pixels in ``[0, 1]`` of shape ``(3, H, W)`` or ``(B, 3, H, W)`` to model input.

    Computed in the input's floating dtype on its device; same shape out.
    """
    cfg = data_config(cfg)
    mean, std = _stats(images01, cfg)
    return (images01 - mean) / std


def denormalize(x: torch.Tensor, cfg: DataConfig | Mapping[str, Any] | torch.nn.Module) -> torch.Tensor:
    """``x * std + mean`` clamped to ``[0, 1]``: model input ``(3, H, W)`` / ``(B, 3, H, W)`` back to pixels.

    Used for overlays and for the pixel-space baselines of metrics. Same shape, dtype and device as ``x``.
    """
    cfg = data_config(cfg)
    mean, std = _stats(x, cfg)
    return (x * std + mean).clamp_(0.0, 1.0)


# --------------------------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------------------------


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def open_image_file(path: Path, label: str) -> Image.Image:
    if not path.exists():
        raise ImageLoadError(f"{label}: image file not found")
    if path.is_dir():
        raise ImageLoadError(f"{label}: is a directory, not an image file")
    from .files import open_regular

    try:  # a FIFO, socket or device is refused at once, never waited on
        with open_regular(path, label, ImageLoadError) as f:  # our handle: the decoded image outlives it
            img = Image.open(f)
            img.load()  # decode now so truncated/corrupt data fails here, not later
    except ImageLoadError:  # (a ValueError: not the decoder's)
        raise
    except UnidentifiedImageError:
        raise ImageLoadError(f"{label}: not an image file (Pillow cannot identify its format)") from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise ImageLoadError(f"{label}: cannot decode image file (truncated or corrupt): {_one_line(exc)}") from exc
    return img


def oriented(img: Image.Image) -> Image.Image:
    """``img`` turned upright by its EXIF orientation; ``img`` itself (no copy: a full-size photo is not held twice)
    when it has none."""
    return img if img.getexif().get(0x0112, 1) in (None, 1) else ImageOps.exif_transpose(img)


def display_pixels(path: Path, label: str, max_side: int) -> np.ndarray:
    """``(H', W', 3)`` uint8 of an image file for display: EXIF-oriented, colours as :func:`to_rgb`, the longer side
    shrunk to ``max_side`` (antialiased) where it is longer, the aspect ratio kept (each side rounded).

    A huge photo is never held at full size beyond its decoding: JPEGs are decoded at a reduced scale (PIL's
    ``draft``, 1/2 to 1/8, never below the display size) and every format is resized as 8-bit pixels; so an
    8000x8000 photo costs tens of MB here, not the GBs of a float copy.
    """
    if not path.exists():
        raise ImageLoadError(f"{label}: image file not found")
    from .files import open_regular

    try:
        with open_regular(path, label, ImageLoadError) as f:
            img: Image.Image = Image.open(f)
            w, h = img.size
            longest = max(w, h)
            size = (w, h) if longest <= max_side else (max(1, round(w * max_side / longest)),
                                                       max(1, round(h * max_side / longest)))
            if size != (w, h) and img.format == "JPEG":
                img.draft("RGB", size)  # decode at 1/k scale, still at least `size`
            img.load()
    except ImageLoadError:  # (a ValueError: not the decoder's)
        raise
    except UnidentifiedImageError:
        raise ImageLoadError(f"{label}: not an image file (Pillow cannot identify its format)") from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise ImageLoadError(f"{label}: cannot decode image file (truncated or corrupt): {_one_line(exc)}") from exc
    img = to_rgb(oriented(img))
    if img.size != size and img.size != size[::-1]:  # (a rotation by EXIF swaps the sides)
        img = img.resize(size if (img.width >= img.height) == (w >= h) else size[::-1], Image.Resampling.LANCZOS)
    return np.asarray(img, dtype=np.uint8)


def _check_unit_pixels(label: str, what: str, finite: bool, lo: float, hi: float, hint: str) -> None:
    """Float pixels must be finite and within [0, 1]; ``what`` names the container, ``hint`` leads the advice."""
    if not finite:
        raise InputError(f"{label}: {what} contains NaN or infinite values")
    if lo < 0.0 or hi > 1.0:
        raise InputError(
            f"{label}: float pixel values must lie in [0, 1], got range [{lo:.4g}, {hi:.4g}] "
            f"({hint}pass raw pixels, not normalised ones)"
        )


def _float_pixels(arr: np.ndarray, label: str) -> np.ndarray:
    """Validate float pixels: finite and within [0, 1]."""
    finite = bool(np.all(np.isfinite(arr)))
    lo, hi = (float(arr.min()), float(arr.max())) if finite else (0.0, 1.0)
    _check_unit_pixels(label, "array", finite, lo, hi, "divide 0-255 data by 255; ")
    return arr


def _from_hwc(arr: np.ndarray, cfg: DataConfig) -> torch.Tensor:
    """``(h, w, C)`` pixels, C in {1, 3, 4}, uint8 or float in [0, 1] (validated) → ``(3, H, W)`` float32 in [0, 1]."""
    u8 = arr if arr.dtype == np.uint8 else np.rint(arr.astype(np.float64) * 255.0).astype(np.uint8)
    plane = u8[..., 0] if u8.shape[2] == 1 else u8
    return _chw01(_geometry_uint8(to_rgb(Image.fromarray(np.ascontiguousarray(plane))), cfg))


def _load_array(arr: np.ndarray, cfg: DataConfig, label: str) -> torch.Tensor:
    if arr.size == 0:
        raise InputError(f"{label}: array is empty (shape {arr.shape})")
    if arr.ndim == 2:
        arr = arr[..., None]
    if arr.ndim != 3 or arr.shape[2] not in (1, 3, 4):
        raise InputError(
            f"{label}: array of shape {arr.shape} is not an image; expected (H, W), (H, W, 1), (H, W, 3) or (H, W, 4)"
        )
    if arr.dtype != np.uint8:
        if not np.issubdtype(arr.dtype, np.floating):
            raise InputError(f"{label}: array dtype {arr.dtype} not supported; use uint8 (0-255) or float in [0, 1]")
        arr = _float_pixels(arr, label)
    return _from_hwc(arr, cfg)[None]


def _load_tensor(t: torch.Tensor, cfg: DataConfig, label: str) -> torch.Tensor:
    shape = tuple(t.shape)
    t = t.detach().cpu()
    if t.dim() == 3:
        t = t[None]
    if t.dim() != 4 or t.shape[1] not in (1, 3):
        raise InputError(f"{label}: tensor of shape {shape} is not an image batch; expected (3, H, W) or (B, 3, H, W)")
    if t.numel() == 0:
        raise InputError(f"{label}: tensor is empty (shape {shape})")
    if t.dtype == torch.uint8:
        t = t.to(torch.float32).div(255)
    elif t.is_floating_point():
        t = t.to(torch.float32)
        finite = bool(torch.isfinite(t).all())
        lo, hi = (float(t.min()), float(t.max())) if finite else (0.0, 1.0)
        _check_unit_pixels(label, "tensor", finite, lo, hi, "")
    else:
        raise InputError(f"{label}: tensor dtype {t.dtype} not supported; use float in [0, 1] or uint8")
    if tuple(t.shape[-2:]) == cfg.size_hw:
        return t.expand(-1, 3, -1, -1) if t.shape[1] == 1 else t
    return torch.stack([_from_hwc(img.permute(1, 2, 0).numpy(), cfg) for img in t])


def _load_one(item: Any, cfg: DataConfig, label: str) -> torch.Tensor:
    """One input → ``(n, 3, H, W)`` float32 pixels in [0, 1] (n > 1 only for a batched tensor)."""
    if isinstance(item, (str, Path)):
        path = Path(item)
        img = oriented(open_image_file(path, f"{label} '{path}'"))
        return _load_pil(img, cfg)
    if isinstance(item, Image.Image):
        try:
            item.load()
        except (ValueError, OSError) as exc:  # closed (``Operation on closed image``) or truncated
            raise ImageLoadError(f"{label}: cannot read this PIL image ({_one_line(exc)}); pass an open image, "
                                 "e.g. a .copy() made before closing it") from None
        return _load_pil(oriented(item), cfg)
    if isinstance(item, np.ndarray):
        return _load_array(item, cfg, label)
    if isinstance(item, torch.Tensor):
        return _load_tensor(item, cfg, label)
    raise InputError(f"{label}: unsupported input type {type(item).__name__}; expected {_ACCEPTED_HINT}")


def _load_pil(img: Image.Image, cfg: DataConfig) -> torch.Tensor:
    return _chw01(_geometry_uint8(to_rgb(img), cfg))[None]


def load_images(
    inputs: ImageInput | Sequence[ImageInput],
    model_or_config: DataConfig | Mapping[str, Any] | torch.nn.Module,
) -> torch.Tensor:
    """Load and preprocess images into one normalised model-input batch.

    Args:
        inputs: one of, or a list/tuple (mixed) of: a file path (``str``/``Path``); a PIL image; a numpy array
            ``(H, W)``, ``(H, W, 1)``, ``(H, W, 3)`` or ``(H, W, 4)``, uint8 or float in ``[0, 1]``; a tensor
            ``(3, H, W)`` / ``(B, 3, H, W)`` (also 1 channel), float in ``[0, 1]`` or uint8. Files, PIL images and
            arrays get the full evaluation transform (:func:`preprocess`); tensors already at the input size are
            only normalised. See the module doc for colour, alpha, EXIF and float-resizing choices.
        model_or_config: the model, or its data config (anything :func:`data_config` accepts).

    Returns:
        ``(B, 3, H, W)`` float32 CPU tensor, normalised with the config's mean/std; B counts every image (a batched
        tensor contributes its B).

    Raises:
        ImageLoadError: a file is missing, not an image, or truncated/corrupt.
        InputError: empty input, an array/tensor of wrong rank, channel count or dtype, non-finite values, or float
            values outside ``[0, 1]``. Messages name the offending item (``inputs[i]``).
    """
    cfg = data_config(model_or_config)
    if isinstance(inputs, (list, tuple)):
        if len(inputs) == 0:
            raise InputError("no images given: inputs is an empty list")
        items = [(item, f"inputs[{i}]") for i, item in enumerate(inputs)]
    else:
        items = [(inputs, "input")]
    batch = torch.cat([_load_one(item, cfg, label) for item, label in items], dim=0)
    return normalize(batch.contiguous(), cfg)


# resize_shape, crop_or_pad, to_rgb, open_image_file and display_pixels are package-internal helpers (vitlens.data.loaders, vitlens.viz);
# the underscore name stays for vitlens.viz until it imports to_rgb.
_to_rgb = to_rgb
