"""Data sources for benchmarks: turn a ``--data`` spec into batches of preprocessed images with ground truth.

Specs: ``scenes`` (synthetic scenes; settings ``seed``, ``size``), e.g. ``scenes:seed=7``. Loaders for the papers'
real data sets plug in here (``vitlens.data.loaders``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ..errors import InputError

__all__ = ["open_source", "SceneSource"]


class SceneSource:
    """Synthetic scenes (exact masks and boxes), generated once and preprocessed for the model."""

    def __init__(self, model: nn.Module, n: int, seed: int = 2026, size: int | None = None) -> None:
        from ..data import make_scenes
        from ..images import data_config, load_images

        cfg = data_config(model)
        size = size or cfg.input_size[-1]
        self.scenes = make_scenes(n=n, seed=seed, size=size)
        self.x = load_images(self.scenes.images, cfg)
        self.seed = seed

    def __len__(self) -> int:
        return len(self.scenes)

    def batch(self, idx: list[int]) -> dict[str, Any]:
        ix = torch.as_tensor(idx)
        return {
            "x": self.x[ix],
            "pixels": self.scenes.images[ix],
            "labels": self.scenes.labels[ix],
            "masks": self.scenes.masks[ix],
            "boxes": self.scenes.boxes[ix],
            "ids": [f"scene-{self.seed}-{i}" for i in idx],
        }


def open_source(spec: str, model: nn.Module, n: int | None = None, seed: int = 0) -> Any:
    from .runner import parse_spec

    name, opts = parse_spec(spec)
    if name == "scenes":
        return SceneSource(model, n=n or 200, seed=int(opts.get("seed", 2026)), size=opts.get("size"))
    raise InputError(f"unknown data source {name!r}; available: scenes")
