"""Metrics that judge explanations. Each takes maps ``(B, H, W)`` from any explainer, declares its score direction
and records its protocol next to its values (see :mod:`.base`)."""

from .base import Metric, MetricResult, check_maps, get_metric, metric_names, register_metric
from .localisation import PointingGame, boxes_to_masks, energy_inside, pointing_game

__all__ = [
    "Metric", "MetricResult", "check_maps", "get_metric", "metric_names", "register_metric",
    "PointingGame", "boxes_to_masks", "energy_inside", "pointing_game",
]
