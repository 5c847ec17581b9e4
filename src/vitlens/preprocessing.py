"""The preprocessing a model expects, in timm's terms: :class:`DataConfig` and its defaults.

A leaf module (it imports nothing else of vitlens but the errors): :mod:`vitlens.images` applies a config to
pictures, and the model adapters (:meth:`vitlens.models.Adapter.data_config`, ``vitlens/models/data_configs.py``)
derive one from a model.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Iterable

from vitlens.errors import InputError

__all__ = [
    "DataConfig",
    "apply_overrides",
    "int_pair",
    "CONFIG_KEYS",
    "CROP_MODES",
    "INTERPOLATIONS",
    "IMAGENET_DEFAULT_MEAN",
    "IMAGENET_DEFAULT_STD",
    "HF_VIT_MEAN",
    "HF_VIT_STD",
]

IMAGENET_DEFAULT_MEAN: tuple[float, float, float] = (0.485, 0.456, 0.406)
IMAGENET_DEFAULT_STD: tuple[float, float, float] = (0.229, 0.224, 0.225)
HF_VIT_MEAN: tuple[float, float, float] = (0.5, 0.5, 0.5)
HF_VIT_STD: tuple[float, float, float] = (0.5, 0.5, 0.5)

# timm's defaults for keys a config dict leaves out (timm.data.resolve_data_config).
DEFAULT_INPUT_SIZE: tuple[int, int, int] = (3, 224, 224)
DEFAULT_INTERPOLATION = "bicubic"
DEFAULT_CROP_PCT = 0.875
DEFAULT_CROP_MODE = "center"

#: PIL resampling filters a config may name (timm accepts the same names).
INTERPOLATIONS = ("nearest", "bilinear", "bicubic", "box", "hamming", "lanczos")
CROP_MODES = ("center", "squash", "border")
CONFIG_KEYS = ("input_size", "interpolation", "mean", "std", "crop_pct", "crop_mode")


def _triple(value: Any, name: str) -> tuple[float, float, float]:
    if isinstance(value, (int, float)):
        values = [float(value)] * 3
    else:
        try:
            values = [float(v) for v in value]
        except (TypeError, ValueError):
            raise InputError(f"data config '{name}' must be a number or 3 numbers, got {value!r}") from None
        if len(values) == 1:
            values = values * 3
    if len(values) != 3 or not all(math.isfinite(v) for v in values):
        raise InputError(f"data config '{name}' must be 3 finite numbers (one per RGB channel), got {value!r}")
    return (values[0], values[1], values[2])


@dataclass(frozen=True)
class DataConfig:
    """How a model expects its input images, in timm's terms.

    Attributes:
        input_size: ``(3, H, W)``, the model's input resolution in pixels.
        mean: per-channel mean subtracted after scaling pixels to ``[0, 1]``.
        std: per-channel standard deviation divided by after subtracting ``mean`` (all > 0).
        interpolation: PIL resampling filter: ``'bilinear'``, ``'bicubic'``, ``'nearest'`` (also ``'box'``,
            ``'hamming'``, ``'lanczos'``, which timm accepts too).
        crop_pct: fraction of the resized image kept by the crop, > 0 (> 1 pads instead of cropping).
        crop_mode: ``'center'`` (keep aspect, crop), ``'squash'`` (stretch, crop) or ``'border'`` (keep aspect,
            fit the longer side, pad with the mean colour).
    """

    input_size: tuple[int, int, int] = DEFAULT_INPUT_SIZE
    mean: tuple[float, float, float] = IMAGENET_DEFAULT_MEAN
    std: tuple[float, float, float] = IMAGENET_DEFAULT_STD
    interpolation: str = DEFAULT_INTERPOLATION
    crop_pct: float = DEFAULT_CROP_PCT
    crop_mode: str = DEFAULT_CROP_MODE

    def __post_init__(self) -> None:
        given: Any = self.input_size
        if isinstance(given, int):
            given = (3, given, given)
        try:
            size = tuple(int(s) for s in given)
        except (TypeError, ValueError):
            raise InputError(f"data config 'input_size' must be (3, H, W), got {self.input_size!r}") from None
        if len(size) == 2:
            size = (3, *size)
        if len(size) != 3 or size[0] != 3 or size[1] < 1 or size[2] < 1:
            raise InputError(f"data config 'input_size' must be (3, H, W) with H, W >= 1, got {self.input_size!r}")
        mean = _triple(self.mean, "mean")
        std = _triple(self.std, "std")
        if min(std) <= 0:
            raise InputError(f"data config 'std' must be > 0, got {self.std!r}")
        interpolation = str(self.interpolation).lower()
        if interpolation not in INTERPOLATIONS:
            raise InputError(
                f"data config 'interpolation' must be one of {sorted(INTERPOLATIONS)}, got {self.interpolation!r}"
            )
        crop_pct = DEFAULT_CROP_PCT if self.crop_pct is None else float(self.crop_pct)
        if not (math.isfinite(crop_pct) and crop_pct > 0):
            raise InputError(f"data config 'crop_pct' must be a number > 0, got {self.crop_pct!r}")
        crop_mode = DEFAULT_CROP_MODE if self.crop_mode is None else str(self.crop_mode)
        if crop_mode not in CROP_MODES:
            raise InputError(f"data config 'crop_mode' must be one of {list(CROP_MODES)}, got {self.crop_mode!r}")
        object.__setattr__(self, "input_size", size)
        object.__setattr__(self, "mean", mean)
        object.__setattr__(self, "std", std)
        object.__setattr__(self, "interpolation", interpolation)
        object.__setattr__(self, "crop_pct", crop_pct)
        object.__setattr__(self, "crop_mode", crop_mode)

    @property
    def size_hw(self) -> tuple[int, int]:
        """``(H, W)`` of the model input."""
        return (self.input_size[1], self.input_size[2])

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> DataConfig:
        """Build from a dict in timm's format (``timm.data.resolve_data_config`` output).

        Missing keys take timm's defaults (input ``(3, 224, 224)``, bicubic, ImageNet mean/std, crop_pct 0.875,
        centre crop); a ``None`` value counts as missing. Unknown keys raise :class:`InputError` so typos are not
        silently ignored.
        """
        if not isinstance(config, Mapping):
            raise InputError(f"data config must be a dict, got {type(config).__name__}")
        unknown = sorted(set(config) - set(CONFIG_KEYS))
        if unknown:
            raise InputError(f"unknown data config key(s) {unknown}; expected a subset of {list(CONFIG_KEYS)}")
        given = {k: v for k, v in config.items() if v is not None}
        return cls(**given)

    def to_dict(self) -> dict[str, Any]:
        """The config as a dict in timm's format; ``timm.data.create_transform(**cfg.to_dict())`` accepts it."""
        return {
            "input_size": self.input_size,
            "interpolation": self.interpolation,
            "mean": self.mean,
            "std": self.std,
            "crop_pct": self.crop_pct,
            "crop_mode": self.crop_mode,
        }

    def replace(self, **changes: Any) -> DataConfig:
        """A copy with some fields changed (validated like the constructor)."""
        return dataclasses.replace(self, **changes)


def apply_overrides(base: DataConfig, extra: Any, owner: str) -> DataConfig:
    """``base`` with the keys of a ``vitlens_data_config`` dict found on ``owner`` applied on top."""
    if isinstance(extra, DataConfig):
        return extra
    if not isinstance(extra, Mapping):
        raise InputError(f"{owner}.vitlens_data_config must be a dict or DataConfig, got {type(extra).__name__}")
    unknown = sorted(set(extra) - set(CONFIG_KEYS))
    if unknown:
        raise InputError(f"{owner}.vitlens_data_config has unknown key(s) {unknown}")
    return base.replace(**{k: v for k, v in extra.items() if v is not None})


def int_pair(value: Iterable[Any] | int) -> tuple[int, int]:
    """``(h, w)`` as two Python ints, from any two-element sequence (``torch.Size``, tuple, list of ints or
    0-d tensors) or one int (a square size): how spatial sizes and token grids are passed around."""
    if isinstance(value, int):
        return value, value
    if isinstance(value, numbers.Integral):  # numpy integers
        return int(value), int(value)
    h, w = value
    return int(h), int(w)
