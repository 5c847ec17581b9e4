"""Plain names for what a benchmark measured: column titles, groups, one sentence per metric, protocols in words.

The report and the Markdown summary use these instead of internal spec strings such as
``insertion_deletion[preset=aha]/ins_minus_del``. Unknown metrics fall back to their output name, so a new metric
shows up (under "Other") without being listed here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

__all__ = ["Column", "column_info", "is_proportion", "metric_title", "metric_sentence", "protocol_words",
           "GROUP_ORDER", "GROUP_QUESTION"]

#: Groups in table order, and the question each answers.
GROUP_ORDER = ("Faithfulness", "Evidence", "Localisation", "Segmentation", "Other", "Cost")
GROUP_QUESTION = {
    "Faithfulness": "does the map rank pixels by their effect on the prediction?",
    "Evidence": "is the relevance on what the model provably used?",
    "Localisation": "does the map point at the object?",
    "Segmentation": "does the map, thresholded, cover the object?",
    "Other": "other measurements",
    "Cost": "what one map costs",
}

# (metric, output) -> (plain name, group, position within the group)
_OUTPUTS: dict[tuple[str, str], tuple[str, str, int]] = {
    ("insertion_deletion", "deletion"): ("deletion", "Faithfulness", 0),
    ("insertion_deletion", "insertion"): ("insertion", "Faithfulness", 1),
    ("insertion_deletion", "ins_minus_del"): ("insertion − deletion", "Faithfulness", 2),
    ("pos_neg_perturbation", "pos_auc"): ("positive perturbation", "Faithfulness", 3),
    ("pos_neg_perturbation", "neg_auc"): ("negative perturbation", "Faithfulness", 4),
    ("pos_neg_perturbation", "neg_minus_pos"): ("negative − positive", "Faithfulness", 5),
    ("faithfulness_violation", "violation"): ("violation", "Faithfulness", 6),
    ("saco", "saco"): ("SaCo", "Faithfulness", 7),
    ("pointing_game", "pointing_game"): ("pointing game", "Localisation", 0),
    ("pointing_game", "energy_inside"): ("relevance in object", "Localisation", 1),
    ("evidence", "evidence_share"): ("relevance on evidence", "Evidence", 0),
    ("evidence", "evidence_pointing"): ("pointing at evidence", "Evidence", 1),
    ("evidence", "evidence_auc"): ("evidence rank AUC", "Evidence", 2),
    ("segmentation", "pa"): ("pixel accuracy", "Segmentation", 0),
    ("segmentation", "iou_fg"): ("IoU object", "Segmentation", 1),
    ("segmentation", "iou_bg"): ("IoU background", "Segmentation", 2),
    ("segmentation", "miou"): ("mIoU", "Segmentation", 3),
    ("segmentation", "ap"): ("average precision", "Segmentation", 4),
}

#: (metric, output) pairs whose per-image value is a hit (1) or a miss (0): their mean is a proportion.
_PROPORTIONS = {("pointing_game", "pointing_game"), ("evidence", "evidence_pointing")}


def is_proportion(metric: str, output: str) -> bool:
    """Whether ``metric``'s ``output`` is a hit or a miss per image (its interval is then a Wilson interval)."""
    return (metric, output) in _PROPORTIONS


_SENTENCES = {
    "insertion_deletion": (
        "Deletion removes the pixels the map ranks most relevant first and records the class score as they go; "
        "insertion starts from a blank image and puts them back in the same order. The numbers are areas under "
        "these curves: a faithful map makes the score fall fast (low deletion) and rise fast (high insertion)."
    ),
    "pos_neg_perturbation": (
        "Positive perturbation removes the most relevant tokens first (the score should fall: low area), negative "
        "perturbation the least relevant first (the score should stay: high area)."
    ),
    "faithfulness_violation": (
        "Share of perturbation steps where removing relevance moved the score the wrong way (lower is better)."
    ),
    "saco": (
        "SaCo: the map's pixels cut into ten groups by salience, each group replaced alone; every pair of groups "
        "counts, weighted by their salience difference, +1 when the more salient group moved the score at least as "
        "much, -1 otherwise (1 = every group in order, -1 = reversed, 0 = no better than chance)."
    ),
    "pointing_game": (
        "Pointing game: a hit when the map's maximum lies on the object; relevance in object: the share of the "
        "positive relevance that falls inside the object's mask."
    ),
    "evidence": (
        "On images where the model's use of the evidence was verified (removing it flips the prediction): the share "
        "of the positive relevance on that evidence, whether the map's maximum lies on it, and the probability that "
        "a random evidence pixel outranks a random other pixel (0.5 = chance)."
    ),
    "segmentation": (
        "The map is thresholded (Otsu) into object / background and compared with the object's mask: pixel "
        "accuracy, intersection over union, and the threshold-free average precision."
    ),
}


@dataclass(frozen=True)
class Column:
    """One column of the ranked table: ``key`` as in ``summary.json`` (``'metric[settings]/output'``)."""

    key: str
    metric: str
    settings: str
    output: str
    name: str
    group: str
    position: int
    higher_is_better: bool

    @property
    def title(self) -> str:
        """Plain name with its direction, e.g. ``'deletion ↓'``."""
        return f"{self.name} {'↑' if self.higher_is_better else '↓'}"


def column_info(key: str, higher_is_better: bool) -> Column:
    """The :class:`Column` of a ``summary.json`` key such as ``'insertion_deletion[preset=aha]/deletion'``."""
    spec, _, output = key.rpartition("/")
    metric, _, rest = spec.partition("[")
    settings = rest[:-1].replace(",", ", ") if rest.endswith("]") else ""
    name, group, position = _OUTPUTS.get((metric, output), (output.replace("_", " "), "Other", 99))
    return Column(key, metric, settings, output, name, group, position, higher_is_better)


_TITLES = {
    "insertion_deletion": "Deletion and insertion",
    "pos_neg_perturbation": "Positive and negative perturbation",
    "faithfulness_violation": "Faithfulness violation",
    "saco": "Salience-guided faithfulness coefficient (SaCo)",
    "pointing_game": "Pointing game and relevance in object",
    "segmentation": "Attribution as segmentation",
}


def metric_title(label: str) -> str:
    """``'insertion_deletion[preset=aha]'`` → ``'Deletion and insertion (preset=aha)'``."""
    metric, _, rest = label.partition("[")
    title = _TITLES.get(metric, metric.replace("_", " ").capitalize())
    return title + (f" ({rest[:-1].replace(',', ', ')})" if rest.endswith("]") else "")


def metric_sentence(metric: str) -> str:
    """What the metric measures, in one or two sentences."""
    return _SENTENCES.get(metric, f"{metric.replace('_', ' ')} (see docs/metrics.md).")


def protocol_words(protocol: str | dict[str, Any]) -> str:
    """The stored protocol of a metric (its JSON) in words."""
    p = json.loads(protocol) if isinstance(protocol, str) else dict(protocol)
    metric = p.get("metric")
    if metric == "insertion_deletion":
        fs = p.get("feature_size") or [1, 1]
        unit = "pixel" if list(fs) == [1, 1] else f"{fs[0]}×{fs[1]}-pixel cell"
        return (f"{p.get('num_features')} features (one per {unit}), {p.get('steps')} steps; deleted pixels "
                f"become the {p.get('deletion_baseline')} image, insertion starts from the "
                f"{p.get('insertion_baseline')} image; the score is the class {p.get('score')}"
                + (f" (preset '{p['preset']}')" if p.get("preset") else "") + ".")
    if metric == "pointing_game":
        tol = p.get("tolerance") or 0
        return f"a hit when the maximum lies within {tol:g} px of the object's mask" + (
            f"; images whose object covers more than {p['skip_large']:.0%} of the image are skipped"
            if p.get("skip_large") else "") + "."
    skip = {"metric", "data_config", "data_mean", "data_std"}
    parts = [f"{k.replace('_', ' ')} {v}" for k, v in sorted(p.items()) if k not in skip and v not in (None, [])]
    return "; ".join(parts) + "." if parts else "defaults."
