"""Self-describing metrics: each declares its outputs with their score direction and records its protocol.

A metric takes maps ``(B, H, W)`` from any explainer (vitlens or not) and returns a :class:`MetricResult` holding
per-image values for each of its outputs, the direction of each (higher or lower is better), the exact protocol
(settings) used, and optionally per-image curves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from ..errors import InputError
from ..targets import TargetSpec

__all__ = ["Metric", "MetricResult", "check_maps", "register_metric", "get_metric", "metric_names"]


@dataclass
class MetricResult:
    """Per-image results of one metric on one batch.

    Attributes:
        metric: the metric's registered name.
        values: output name → ``(B,)`` float tensor (NaN where an image is skipped by the protocol).
        higher_is_better: output name → score direction.
        protocol: JSON-friendly settings that define the numbers (compare only results with equal protocols).
        curves: optional output name → ``(B, S)`` curves, with ``curve_x`` ``(S,)`` their abscissa.
    """

    metric: str
    values: dict[str, Tensor]
    higher_is_better: dict[str, bool]
    protocol: dict[str, Any]
    curves: dict[str, Tensor] = field(default_factory=dict)
    curve_x: Tensor | None = None

    def mean(self) -> dict[str, float]:
        """Mean of each output over images (NaNs — skipped images — ignored)."""
        return {k: float(torch.nanmean(v.float())) for k, v in self.values.items()}


class Metric:
    """Base class. Subclasses set ``name`` and ``outputs`` (output name → higher is better), keep their settings in
    ``self.settings`` and implement :meth:`compute`.

    ``targets`` are what explainers take (:data:`vitlens.targets.TargetSpec`): class indices (an int, a sequence or
    a ``(B,)`` tensor) or a :class:`~vitlens.targets.Target` object, whose class per image the metric scores.
    """

    name: ClassVar[str] = ""
    outputs: ClassVar[dict[str, bool]] = {}
    #: what the metric needs besides maps: any of "model", "x", "targets", "masks", "boxes".
    needs: ClassVar[frozenset[str]] = frozenset()
    #: ground truth of which at least one is needed (e.g. masks or boxes), checked by the benchmark before it runs.
    needs_any: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, **settings: Any) -> None:
        self.settings: dict[str, Any] = settings

    def protocol(self) -> dict[str, Any]:
        return {"metric": self.name, **self.settings}

    def compute(self, maps: Tensor, *, model: nn.Module | None = None, x: Tensor | None = None,
                targets: TargetSpec = None, masks: Tensor | None = None,
                boxes: Tensor | None = None) -> MetricResult:
        raise NotImplementedError

    def __call__(self, maps: Tensor, **kwargs: Any) -> MetricResult:
        missing = [k for k in sorted(self.needs) if kwargs.get(k) is None]
        if missing:
            raise InputError(f"metric '{self.name}' needs {', '.join(missing)}")
        return self.compute(maps, **kwargs)

    def result(self, values: dict[str, Tensor], **extra: Any) -> MetricResult:
        return MetricResult(self.name, values, {k: self.outputs[k] for k in values}, self.protocol(), **extra)


_METRICS: dict[str, type[Metric]] = {}


def register_metric(cls: type[Metric]) -> type[Metric]:
    """Class decorator registering a metric under its ``name``."""
    _METRICS[cls.name] = cls
    return cls


def get_metric(name: str, **settings: Any) -> Metric:
    """The metric ``name`` with ``settings``; unknown metrics and unknown setting names are one-line errors."""
    from ..options import check_known, signature_settings

    try:
        cls = _METRICS[name]
    except KeyError:
        import difflib

        close = difflib.get_close_matches(str(name).lower(), metric_names(), n=3, cutoff=0.6)
        hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise InputError(f"unknown metric {name!r}; available: {', '.join(metric_names())}{hint}") from None
    names, open_ended = signature_settings(cls)
    if not open_ended:
        check_known("setting", f"metric '{name}'", settings, names)
    return cls(**settings)


def metric_names() -> list[str]:
    return sorted(_METRICS)


def check_maps(maps: Tensor, batch: int | None = None, size: tuple[int, int] | None = None) -> Tensor:
    """Validate maps ``(B, H, W)``: finite, matching batch size and spatial size. Returns float maps."""
    if not isinstance(maps, Tensor):
        raise InputError(f"maps must be a torch.Tensor (B, H, W), got {type(maps).__name__}")
    if maps.ndim != 3:
        raise InputError(f"maps must have shape (B, H, W); got {tuple(maps.shape)}")
    if batch is not None and maps.shape[0] != batch:
        raise InputError(f"{maps.shape[0]} maps given for a batch of {batch} images")
    if size is not None and tuple(maps.shape[-2:]) != tuple(size):
        raise InputError(f"maps are {tuple(maps.shape[-2:])}, images are {tuple(size)}: maps must be at input size")
    if not bool(torch.isfinite(maps).all()):
        raise InputError("maps contain NaN or inf values")
    return maps.float()
