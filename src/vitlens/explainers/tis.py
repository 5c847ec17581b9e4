"""TIS: Transformer Input Sampling (Englebert, Stassin, Nanfack, Mahmoudi, Siebert, Cornu & De Vleeschouwer,
ICCV Workshops 2023).

1. One forward records the output of every transformer block; concatenated over blocks they give, for each patch
   token, ``L·D`` activations. Read the other way round, every activation channel is a vector over the ``N`` patch
   tokens (prefix tokens dropped): ``L·D`` points in ``ℝ^N``.
2. k-means (Euclidean, ``n_masks`` clusters) over these points; each centroid is a "raw mask" over the tokens.
3. Each raw mask becomes a binary mask that keeps its ``⌊r·N⌋`` highest tokens (``r = token_ratio``).
4. The model runs on the kept tokens only (tokens dropped after the embeddings, each keeping its own position
   embedding; prefix tokens always kept — :meth:`Adapter.keep_tokens`); the mask's score is the softmax probability
   of the target class.
5. Saliency of token ``j`` = ``Σ_m score_m · mask_m[j] / Σ_m mask_m[j]`` (score-weighted mask sum divided by the
   coverage); a token no mask keeps gets 0.

Cost: 1 forward + ``n_masks`` forwards on ``⌊r·N⌋`` patch tokens (+ prefix tokens), plus the k-means
(``2·(L·D)·n_masks·N`` FLOPs per Lloyd iteration). Paper settings: 2048 masks, r = 25 %.

This module also holds the helpers TIS shares with MUTEX (scoring token subsets, coverage-normalised averaging).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..errors import InputError
from ..models import Adapter
from ..models.base import recorded
from ..models.capabilities import BLOCK_IO, TOKENS, TOKEN_SEQUENCE
from ..targets import Target
from ..options import choice, integer, number, seed
from ._perturbation import SCORE_KINDS, coverage_average, resolve, score_needs, score_token_subsets
from ._random import image_generator
from .base import Attribution, Explainer, image_size
from .registry import register

__all__ = ["TIS", "kmeans", "score_token_subsets", "coverage_average", "block_outputs"]


def kmeans(points: Tensor, k: int, generator: torch.Generator, max_iter: int = 100,
           tol: float = 1e-4) -> tuple[Tensor, int]:
    """Lloyd's k-means on ``points`` ``(P, d)``: returns the centroids ``(k, d)`` and the iterations run.

    Initialisation: ``k`` distinct points drawn with ``generator``. Each iteration assigns every point to its nearest
    centroid (squared Euclidean distance via one matrix product) and moves each centroid to the mean of its points;
    a centroid without points stays where it is. Stops when the summed squared centroid shift is ``≤ tol`` or after
    ``max_iter`` iterations.
    """
    n = points.shape[0]
    if not 1 <= k <= n:
        raise InputError(f"k-means needs 1 <= n_masks <= {n} (the number of activation channels), got {k}")
    c = points[torch.randperm(n, generator=generator)[:k].to(points.device)].clone()
    sq = (points * points).sum(dim=1, keepdim=True)
    it = 0
    for it in range(1, max_iter + 1):
        dist = sq - 2.0 * (points @ c.T) + (c * c).sum(dim=1)[None]
        assign = dist.argmin(dim=1)
        sums = torch.zeros_like(c).index_add_(0, assign, points)
        counts = torch.bincount(assign, minlength=k).to(points.dtype)[:, None]
        new = torch.where(counts > 0, sums / counts.clamp_min(1.0), c)
        shift = float(((new - c) ** 2).sum())
        c = new
        if shift <= tol:
            break
    return c, it


def block_outputs(rec) -> Tensor:
    """Outputs of all blocks concatenated over channels ``(B, T, L·D)`` from a capture :class:`Recording`
    (block ``i``'s output is block ``i+1``'s residual input ``u``; the last one is ``final``)."""
    outputs = [recorded(b.u, "block input") for b in rec.blocks[1:]] + [recorded(rec.final, "final residual stream")]
    return torch.cat([t.detach() for t in outputs], dim=-1)


@register
class TIS(Explainer):
    """Transformer Input Sampling: token masks from k-means over block activations, scored on the kept tokens.

    Options:
        n_masks: number of k-means clusters = masks (paper: 2048; at most ``L·D``).
        token_ratio: fraction ``r`` of patch tokens each mask keeps (paper: 0.25).
        max_iter, tol: k-means stopping rule (Lloyd iterations; summed squared centroid shift).
        score: ``"probability"`` (paper) or ``"target"``. seed: k-means initialisation seed (per image).
        batch_size: most masked images in one forward call.
    """

    name = "tis"
    value_kind = "probability"

    @classmethod
    def value_kind_for(cls, options: Any) -> str:
        """An expected class probability (``score='probability'``), else a mean of the target's own score."""
        return cls.value_kind if options.get("score", "probability") == "probability" else "score"

    description = "token masks from clustered activations, scored on the kept tokens"
    needs = (TOKENS, BLOCK_IO, TOKEN_SEQUENCE)
    display_name = "TIS"
    level = "token"
    defaults: dict[str, Any] = {
        "n_masks": 2048,
        "token_ratio": 0.25,
        "max_iter": 100,
        "tol": 1e-4,
        "score": "probability",
        "seed": 0,
        "batch_size": 64,
    }
    option_specs = {
        "n_masks": integer(1, unit="k-means clusters, at most the activation channels"),
        "token_ratio": number(0, 1, low_open=True),
        "max_iter": integer(1),
        "tol": number(0),
        "score": choice(*SCORE_KINDS),
        "seed": seed(),
        "batch_size": integer(1),
    }
    fast_options: dict[str, Any] = {"n_masks": 8, "max_iter": 20, "batch_size": 8}

    def required(self) -> tuple[str | tuple[str, ...], ...]:
        """``score='probability'`` (a softmax over classes) also needs class logits."""
        return self.needs + score_needs(self.options["score"])

    def declared_cost(self) -> dict[str, float]:
        """1 forward for the activations + ``n_masks`` forwards on ``⌊r·N⌋`` tokens (``token_fraction`` ≈ r)."""
        return {"forward": 1.0 + self.options["n_masks"], "backward": 0.0,
                "token_fraction": float(self.options["token_ratio"])}

    def attribute(self, adapter: Adapter, x: Tensor, target: Target) -> tuple[Attribution, Tensor, Target]:
        o = self.options
        gh, gw = adapter.grid(image_size(x))
        p = adapter.num_prefix_tokens
        rows, acts = [], []
        with torch.no_grad():
            for xi in x:  # one by one: activations (and so the clusters) do not depend on the batch
                with adapter.session(capture=True) as rec:
                    rows.append(adapter.forward(xi[None]))
                    acts.append(block_outputs(rec)[0, p:].float())  # (N, L·D)
        logits = torch.cat(rows)
        tgt = resolve(target, logits)
        n_tokens = gh * gw
        k = max(1, int(float(o["token_ratio"]) * n_tokens))
        values, all_scores = [], []
        with adapter.session(capture=False), torch.no_grad():
            for i, xi in enumerate(x):
                centroids, _ = kmeans(acts[i].T.contiguous(), int(o["n_masks"]), image_generator(xi, o["seed"]),
                                      int(o["max_iter"]), float(o["tol"]))
                keep = centroids.argsort(dim=1, descending=True, stable=True)[:, :k]  # (n_masks, k)
                masks = torch.zeros_like(centroids).scatter_(1, keep, 1.0)
                scores = score_token_subsets(adapter, xi, keep, tgt, i, o["score"], int(o["batch_size"]))
                values.append(coverage_average(masks, scores).reshape(gh, gw))
                all_scores.append(scores)
        att = Attribution(values=torch.stack(values), extras={"mask_scores": torch.stack(all_scores)})
        return att, logits, tgt
