"""Metrics that judge explanations. Each takes maps ``(B, H, W)`` from any explainer, declares its score direction
and records its protocol next to its values (see :mod:`.base`)."""

from .base import Metric, MetricResult, check_maps, get_metric, metric_names, register_metric
from .evidence import Evidence, evidence_auc, verify_evidence
from .localisation import PointingGame, boxes_to_masks, energy_inside, pointing_game
from .perturbation import FaithfulnessViolation, InsertionDeletion, PositiveNegativePerturbation
from .saco import SaCo, saco_coefficient
from .sanity import randomisation_check, reinitialise, spearman, ssim
from .segmentation import (
    Segmentation,
    average_precision,
    binarise,
    classes_in,
    minmax_normalise,
    otsu_threshold,
    pooled_scores,
    segmentation_counts,
    segmentation_per_class,
    segmentation_scores,
)

__all__ = [
    "Metric", "MetricResult", "check_maps", "get_metric", "metric_names", "register_metric",
    "PointingGame", "boxes_to_masks", "energy_inside", "pointing_game",
    "Evidence", "evidence_auc", "verify_evidence",
    "InsertionDeletion", "PositiveNegativePerturbation", "FaithfulnessViolation", "SaCo", "saco_coefficient",
    "Segmentation", "average_precision", "binarise", "classes_in", "minmax_normalise", "otsu_threshold",
    "pooled_scores", "segmentation_counts", "segmentation_per_class", "segmentation_scores",
    "randomisation_check", "reinitialise", "spearman", "ssim",
]
