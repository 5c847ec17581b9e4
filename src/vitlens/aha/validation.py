"""Hard validation of an AHA explainer during training: :func:`validate` (deletion/insertion of its maps on held-out
images, sharded over processes, under one or several deletion references: the validation matrix the shipped
checkpoint is chosen on) and :func:`best_pool` (the output pooling that validation prefers)."""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import torch
from torch import Tensor

from ..runtime import DistributedRun
from .evaluation import deletion_insertion
from .network import SPREADS, AHANet
from .soft_metrics import reference

__all__ = ["LabelledImages", "all_reduce_sum", "best_pool", "choose_spread", "validate"]


def all_reduce_sum(t: Tensor, dist_info: DistributedRun) -> Tensor:
    """Sum ``t`` over the processes in place (a no-op for one process); returns ``t``."""
    if dist_info.active:
        import torch.distributed as dist

        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


class LabelledImages(Protocol):
    """What training and validation read: ``len(data)`` and ``data[i] → (image (C, H, W), label)`` (the datasets of
    :mod:`vitlens.aha.data`, a ``torch.utils.data.Dataset`` with a length)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> tuple[Tensor, int]: ...


def validate(net: AHANet, data: LabelledImages, dist_info: DistributedRun, batch: int = 50,
             chunk: int = 512, pools: Sequence[str] | None = None, references: Sequence[str] | None = None,
             mean_std: tuple[Sequence[float], Sequence[float]] | None = None,
             mean_img: Tensor | None = None, progress: bool = False) -> dict[str, float]:
    """Hard deletion/insertion (:func:`~vitlens.aha.evaluation.deletion_insertion`) of the explainer's maps for the
    predicted class on ``data`` (sharded over processes), averaged over images.

    ``pools``: the output poolings to measure (default: the net's own); the first gives ``deletion``/``insertion``/
    ``difference``, every other ``P`` gives ``deletion_P`` etc. (e.g. ``difference_tokens``).
    ``references``: the deletion references (:data:`~vitlens.aha.soft_metrics.REFERENCES`; default ``("mean",)``);
    with several, each headline number is the mean over the references and ``difference@R`` (``difference_P@R``)
    is reference ``R`` alone: a validation *matrix*, so that the explainer is not chosen on one protocol.
    ``mean_std``: the target's normalisation (for ``black``); ``mean_img``: the dataset's mean image (``meanimage``).
    ``progress``: a progress bar over this process's validation images (its own line, removed when done).
    """
    pools = list(pools or [net.output_pool])
    refs = list(references or ["mean"])
    ms = mean_std or ((0.0, 0.0, 0.0), (1.0, 1.0, 1.0))
    idx = list(range(dist_info.rank, len(data), dist_info.world))
    device = next(net.decoder.parameters()).device
    sums = torch.zeros(len(pools), len(refs), 4, dtype=torch.float64)
    from tqdm.auto import tqdm

    bar = tqdm(total=len(idx), desc="validation", unit="image", leave=False, disable=not progress,
               dynamic_ncols=True)
    for s in range(0, len(idx), batch):
        items = [data[i] for i in idx[s:s + batch]]
        x = torch.stack([it[0] for it in items]).to(device)
        with torch.no_grad():
            feats, logits = net.features(x)
            cls = logits.argmax(-1)
            raw = net.decoder(feats, cls, tuple(x.shape[-2:]))
        for j, kind in enumerate(refs):
            ref = reference(x, kind, ms[0], ms[1], mean_image=mean_img)
            for k, pool in enumerate(pools):
                r = deletion_insertion(net.target, x, net.finish(raw, pool), cls, chunk=chunk, ref=ref)
                sums[k, j] += torch.tensor([float(r["deletion"].sum()), float(r["insertion"].sum()),
                                            float(r["difference"].sum()), len(items)], dtype=torch.float64)
        bar.update(len(items))
    bar.close()
    sums = all_reduce_sum(sums.to(device), dist_info).cpu()
    out: dict[str, Any] = {}
    for k, pool in enumerate(pools):
        n = max(1.0, float(sums[k, 0, 3]))
        sfx = "" if k == 0 else f"_{pool}"
        mean = sums[k, :, :3].mean(0) / n
        out.update({f"deletion{sfx}": float(mean[0]), f"insertion{sfx}": float(mean[1]),
                    f"difference{sfx}": float(mean[2])})
        if len(refs) > 1:
            for j, kind in enumerate(refs):
                out[f"difference{sfx}@{kind}"] = float(sums[k, j, 2] / n)
    out["n"] = int(sums[0, 0, 3])
    if len(refs) > 1:
        out["references"] = refs
    return out


def best_pool(v: dict[str, Any], pools: Sequence[str]) -> str:
    """The output pooling with the highest held-out insertion − deletion in validation record ``v``."""
    scores = {p: v["difference" if k == 0 else f"difference_{p}"] for k, p in enumerate(pools)}
    return max(scores, key=lambda p: scores[p])


def choose_spread(net: AHANet, data: LabelledImages, dist_info: DistributedRun, base: dict[str, Any] | None = None,
                  spreads: Sequence[float] = SPREADS, **validate_kw: Any) -> dict[str, Any]:
    """Choose :attr:`AHANet.spread` of a ``tokens``-pooled explainer on held-out ``data``: the ``λ`` of ``spreads``
    with the highest insertion − deletion (mean over the references), the smallest on a tie. Sets ``net.spread``
    and returns the record the model card shows: ``spread``, ``spread_scores`` (``{"λ": score}``) and
    ``spread_refs`` (each reference at the chosen ``λ``, with several references).

    ``base``: a :func:`validate` record of ``net`` with the ``tokens`` pooling first in its pools and
    ``net.spread`` as it is now (the training's last validation), so that value is not measured twice.
    ``validate_kw``: passed to :func:`validate` (``references``, ``mean_std``, ``mean_img``, ``chunk``).
    """
    if net.output_pool != "tokens":
        raise ValueError(f"spread applies to the tokens pooling; this explainer's is {net.output_pool!r}")
    start = net.spread
    records: dict[float, dict[str, Any]] = {}
    if base is not None:
        records[start] = base
    try:
        for lam in spreads:
            if lam not in records:
                net.spread = lam
                records[lam] = validate(net, data, dist_info, pools=["tokens"], **validate_kw)
    finally:
        net.spread = start
    scores = {lam: float(records[lam]["difference"]) for lam in spreads}
    best = max(spreads, key=lambda lam: (scores[lam], -lam))
    net.spread = best
    out: dict[str, Any] = {"spread": best, "spread_scores": {f"{lam:g}": scores[lam] for lam in spreads}}
    refs = records[best].get("references")
    if refs:
        out["spread_refs"] = {r: float(records[best][f"difference@{r}"]) for r in refs}
    return out
