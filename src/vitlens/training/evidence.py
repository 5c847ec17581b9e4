"""What the models trained on evidence scenes use: the causal check written into their cards, and the data sentences
of the training cards (``python -m vitlens.training.shapes``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

__all__ = ["DATA_SENTENCE", "MAKER", "evidence_card_lines", "evidence_record"]

DATA_SENTENCE = {
    "shapes": ("`vitlens.data.make_scenes`: {size}×{size} cluttered synthetic scenes (smooth noise and gradient "
               "backgrounds, 1–3 distractors: bars, dots, strokes) with one class-defining object per image, random "
               "colour/texture, rotation, position and area (7–28% of the image)."),
    "planted": ("`vitlens.data.evidence.make_planted_scenes` (cue_frac 0.5): the {size}×{size} shape scenes of "
                "`make_scenes`; in half of the images a small two-colour checkerboard cue (8×8 px) naming a random "
                "class is planted away from the object, and then *it* decides the label (in 5 of 6 of those images "
                "it conflicts with the object). Removing the cue gives back the plain scene exactly."),
    "cues": ("`vitlens.data.evidence.make_cue_scenes`: {size}×{size} cluttered scenes with 8 classes, each decided "
             "by a different kind of evidence: shape (star, cross), texture (stripes, checker disks), colour "
             "(saturated red / blue square or triangle; nothing else is near those colours), count (two / four "
             "small squares)."),
}
MAKER = {"shapes": "make_scenes", "planted": "make_planted_scenes", "cues": "make_cue_scenes"}




def evidence_record(build: Callable[[], torch.nn.Module], weights: Path, kind: str, n: int, seed: int
                    ) -> dict[str, Any]:
    """The shipped model's use of the evidence on ``n`` test scenes of ``kind`` (``planted`` or ``cues``), checked
    causally by removing it (:func:`vitlens.metrics.evidence_use`)."""
    from vitlens.data.evidence import make_cue_scenes, make_planted_scenes
    from vitlens.metrics.evidence import evidence_use
    from vitlens.training.common import load_stored

    model = load_stored(build, weights)
    sc = make_planted_scenes(n, seed=seed) if kind == "planted" else make_cue_scenes(n, seed=seed)
    return {**evidence_use(model, sc), "seed": seed}


def evidence_card_lines(rec: dict[str, Any] | None) -> list[str]:
    """The card's "What the model uses" section (empty for models without a record)."""
    if not rec:
        return []
    lines = ["", "## What the model uses (causal check on the test scenes)", ""]
    if "cue_flip_rate" in rec:
        lines += [
            f"On {rec['n']:,} test scenes: accuracy {rec['accuracy_with_cue']:.1%} where a cue is planted (the cue "
            f"decides) and {rec['accuracy_without_cue']:.1%} where none is (the object decides). Of the "
            f"{rec['conflicting']} scenes whose cue conflicts with the object the model follows the cue in "
            f"{rec['follows_cue']:.1%}; removing the cue flips {rec['cue_flip_rate']:.1%} of those back to the "
            f"object's class ({rec['cue_verified']} cue-decided verified). Removing the object changes "
            f"{rec['object_flip_rate']:.1%} of the correct no-cue predictions ({rec['object_verified']} "
            "object-decided verified). Only verified images count in the evidence benchmarks.",
        ]
    else:
        lines += [
            f"On {rec['n']:,} test scenes: accuracy {rec['accuracy']:.1%}; removing the class's evidence changes "
            f"{rec['evidence_flip_rate']:.1%} of the correct predictions ({rec['verified']} verified).",
        ]
    return lines
