"""Faithfulness against *verified* evidence: what a model provably used, and how much of a map is on it.

The scenes of :mod:`vitlens.data.evidence` plant the evidence, and :func:`verify_evidence` checks its use causally:
a prediction counts as *cue-decided* only if the model predicts the planted cue's class while the object says
another class, and predicts the object's class once the cue is removed (the prediction flips back); it counts as
*object-decided* only if, with no cue in the image, the model predicts the object's class and no longer does once
the object is removed. On those images — and only those — the evidence mask is known to be what the model used, so
a map can be judged against it by

- ``evidence_share``: share of the positive relevance inside the evidence (:func:`energy_inside`);
- ``evidence_pointing``: the map's maximum lies on the evidence (:func:`pointing_game`, optional tolerance);
- ``evidence_auc``: rank measure — the probability that a random evidence pixel outranks a random other pixel
  (ROC AUC of the map as a detector of the evidence; ties count half; 0.5 = no better than chance, 1 = every
  evidence pixel above every other pixel). Unlike the share, it does not depend on the map's scale or sign
  convention beyond the order.

Higher is better for all three.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ..errors import InputError
from .base import Metric, MetricResult, check_maps, register_metric
from .localisation import energy_inside, pointing_game

__all__ = ["Evidence", "evidence_auc", "evidence_use", "verify_evidence"]


def evidence_auc(maps: Tensor, masks: Tensor) -> Tensor:
    """Per image ``(B,)``: P(map value of a random evidence pixel > that of a random other pixel), ties counting ½.

    Computed from the average ranks of the pixel values (Mann–Whitney U ÷ (P·N)). NaN where the mask is empty or
    covers the whole image.
    """
    maps = check_maps(maps)
    if masks.shape != maps.shape:
        raise InputError(f"masks must have the maps' shape {tuple(maps.shape)}; got {tuple(masks.shape)}")
    masks = masks.to(device=maps.device, dtype=torch.bool)
    out = torch.full((maps.shape[0],), float("nan"), dtype=torch.float64, device=maps.device)
    for i in range(maps.shape[0]):
        v, m = maps[i].flatten().double(), masks[i].flatten()
        p = int(m.sum())
        n = v.numel() - p
        if p == 0 or n == 0:
            continue
        vals, order = torch.sort(v)
        _, inverse, counts = torch.unique_consecutive(vals, return_inverse=True, return_counts=True)
        ends = torch.cumsum(counts, 0).double()
        avg_rank = ends - (counts.double() - 1) / 2  # 1-based average rank of each tie group
        ranks = torch.empty_like(v)
        ranks[order] = avg_rank[inverse]
        u = float(ranks[m].sum()) - p * (p + 1) / 2
        out[i] = u / (p * n)
    return out.float()


@register_metric
class Evidence(Metric):
    """Share of positive relevance, pointing game and rank AUC on the evidence mask (``masks``).

    Meant for verified evidence (the ``planted`` and ``cues`` data sources of ``vitlens bench`` give the deciding
    evidence of verified predictions as the masks). Setting: ``tolerance`` (pixels) of the pointing game.
    """

    name = "evidence"
    outputs = {"evidence_share": True, "evidence_pointing": True, "evidence_auc": True}
    needs = frozenset({"masks"})

    def __init__(self, tolerance: float = 0.0) -> None:
        from ..options import check_number

        tolerance = check_number("tolerance", tolerance, low=0, owner="metric 'evidence'")
        super().__init__(tolerance=tolerance)

    def compute(self, maps: Tensor, *, masks: Tensor | None = None, **_: object) -> MetricResult:
        if masks is None:
            raise InputError("metric 'evidence' needs masks (the evidence the model used)")
        masks = masks.to(maps.device)
        return self.result({
            "evidence_share": energy_inside(maps, masks),
            "evidence_pointing": pointing_game(maps, masks, self.settings["tolerance"]),
            "evidence_auc": evidence_auc(maps, masks),
        })


@torch.no_grad()
def _predict(model: nn.Module, images: Tensor, batch: int) -> Tensor:
    from ..images import load_images
    from ..models.base import logits_of

    out = []
    for s in range(0, len(images), batch):
        x = load_images(images[s:s + batch], model)
        out.append(logits_of(model(x)).argmax(-1).cpu())
    return torch.cat(out)


def verify_evidence(model: nn.Module, scenes: Any, batch: int = 250) -> dict[str, Tensor]:
    """Check causally which evidence ``model`` used on :class:`vitlens.data.evidence.EvidenceScenes`.

    Returns per image ``(N,)`` tensors: ``pred`` (prediction on the scene), ``pred_without`` (on the scene without its
    deciding evidence: the cue where one decides, else the object), ``cue_verified`` (cue-decided: a conflicting cue
    is planted, ``pred`` is the cue's class and ``pred_without`` the object's), ``object_verified`` (no cue, ``pred``
    is the object's class and ``pred_without`` is not), and ``verified`` (either). Cue scenes (no planted cue) have
    ``object_verified`` only: ``pred`` is the label and removing the class's evidence changes it.
    """
    was_training = model.training
    model.eval()
    try:
        pred = _predict(model, scenes.images, batch)
        pred_without = _predict(model, scenes.without_evidence().images, batch)
    finally:
        model.train(was_training)
    has_cue = scenes.cue_labels >= 0
    conflict = has_cue & (scenes.cue_labels != scenes.object_labels)
    cue_ok = conflict & (pred == scenes.cue_labels) & (pred_without == scenes.object_labels)
    obj_ok = ~has_cue & (pred == scenes.object_labels) & (pred_without != scenes.object_labels)
    return {"pred": pred, "pred_without": pred_without, "cue_verified": cue_ok, "object_verified": obj_ok,
            "verified": cue_ok | obj_ok, "conflict": conflict, "has_cue": has_cue}


def evidence_use(model: nn.Module, scenes: Any, batch: int = 250) -> dict[str, Any]:
    """What ``model`` uses on ``scenes`` (:class:`vitlens.data.evidence.EvidenceScenes`), summarised from
    :func:`verify_evidence`: the numbers the model cards and the evidence benchmark report.

    Planted scenes: ``accuracy`` (label = the cue where one is planted), ``accuracy_with_cue``,
    ``accuracy_without_cue`` (scenes without a cue), ``accuracy_cue_removed`` (every scene with its cue removed),
    ``conflicting`` / ``no_cue`` (counts), ``follows_cue`` (share of conflicting scenes predicted as the cue's class),
    ``cue_flip_rate`` (share of those that flip back to the object's class once the cue is removed),
    ``object_flip_rate`` (share of correct no-cue predictions that change once the object is removed),
    ``cue_verified`` / ``object_verified`` (counts). Cue scenes: ``accuracy``, ``evidence_flip_rate``, ``verified``.
    """
    v = verify_evidence(model, scenes, batch)
    has, conflict = v["has_cue"], v["conflict"]
    right = v["pred"] == scenes.labels
    rec: dict[str, Any] = {"n": len(scenes), "accuracy": float(right.float().mean())}
    if scenes.kind != "planted":
        rec.update({"evidence_flip_rate": float(v["object_verified"].sum() / right.sum().clamp_min(1)),
                    "verified": int(v["object_verified"].sum())})
        return rec
    follows = conflict & (v["pred"] == scenes.cue_labels)
    plain = torch.where(has, v["pred_without"], v["pred"])  # every scene with its cue removed
    rec.update({
        "accuracy_with_cue": float(right[has].float().mean()),
        "accuracy_without_cue": float(right[~has].float().mean()),
        "accuracy_cue_removed": float((plain == scenes.object_labels).float().mean()),
        "conflicting": int(conflict.sum()),
        "no_cue": int((~has).sum()),
        "follows_cue": float(follows.sum() / conflict.sum().clamp_min(1)),
        "cue_flip_rate": float(v["cue_verified"].sum() / follows.sum().clamp_min(1)),
        "object_flip_rate": float(v["object_verified"].sum() / (~has & right).sum().clamp_min(1)),
        "cue_verified": int(v["cue_verified"].sum()),
        "object_verified": int(v["object_verified"].sum()),
    })
    return rec
