"""ViT-CX: causal explanation of vision transformers (Xie, Li, Ma, Wang, Li & Zhang, IJCAI 2023).

1. One forward captures the patch embeddings at a layer (default: the input of the last block, i.e. of its first
   LayerNorm — the project spec's choice; the reference code hooks that LayerNorm's *output*, see the method page).
   Each of the ``D`` channels, reshaped to the token grid and bilinearly upsampled to the input size, is a candidate
   mask; each is min–max normalised to [0, 1] over its pixels.
2. Agglomerative clustering of the ``D`` masks (cosine distance, complete linkage, merge while the distance is below
   ``distance_threshold`` = 0.1); each cluster mask is the sum of its members, min–max normalised again.
3. Causal impact of cluster mask ``M_i`` with Gaussian noise ``ε_i ~ N(0, σ²)`` (σ = 0.1, in the model's input
   space) on the masked-out part, as in the reference code:
   ``S_i = p(x ⊙ M_i + ε_i ⊙ (1 − M_i)) − p(x + ε_i ⊙ (1 − M_i)) + p(x)``, ``p`` the softmax probability of the
   target class. The middle term removes the effect of the noise itself (``noise_correction=False`` drops it:
   ``S_i = p(x ⊙ M_i + ε_i ⊙ (1 − M_i))``, half the forwards).
4. Saliency per pixel ``= Σ_i S_i · M_i / Σ_i M_i / n`` (coverage-normalised; uncovered pixels get 0).

Cost: ``1 + 2·n_clusters`` forwards (``1 + n_clusters`` without the noise correction); ``n_clusters`` depends on the
image and the model, so :meth:`ViTCX.declared_cost` reports the mean over the images of the last call.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import InputError, VitlensError
from ..models import Adapter
from ..models.base import recorded
from ..models.capabilities import BLOCK_IO, TOKEN_SEQUENCE
from ..targets import Target
from ..options import choice, flag, integer, number, seed
from ._perturbation import SCORE_KINDS, resolve, score_needs, target_scores
from ._random import image_generator
from .base import Attribution, Explainer, Explanation, image_size
from .registry import register

__all__ = ["ViTCX", "feature_masks", "cluster_masks"]


def _minmax_rows(m: Tensor) -> Tensor:
    """Min–max normalise each row to [0, 1]; constant rows become 0."""
    lo = m.amin(dim=1, keepdim=True)
    rng = m.amax(dim=1, keepdim=True) - lo
    return torch.where(rng > 0, (m - lo) / rng.clamp_min(torch.finfo(m.dtype).tiny), torch.zeros_like(m))


def feature_masks(tokens: Tensor, grid: tuple[int, int], size: tuple[int, int]) -> Tensor:
    """Candidate masks ``(D, H·W)`` from patch-token features ``(N, D)`` on a ``grid``: each channel upsampled
    bilinearly (half-pixel centres) to ``size`` and min–max normalised."""
    gh, gw = grid
    fmap = tokens.T.reshape(1, -1, gh, gw).float()
    up = F.interpolate(fmap, size=size, mode="bilinear", align_corners=False)[0]
    return _minmax_rows(up.flatten(1))


def cluster_masks(masks: Tensor, threshold: float) -> tuple[Tensor, Tensor]:
    """Agglomerative clustering (cosine distance, complete linkage, ``distance_threshold``) of ``masks`` ``(D, P)``.

    Returns the labels ``(D,)`` and the normalised cluster masks ``(n_clusters, P)`` (sum of members, min–max).
    """
    try:
        from sklearn.cluster import AgglomerativeClustering
    except ImportError:  # pragma: no cover - scikit-learn is an optional dependency
        raise VitlensError("method 'vitcx' needs scikit-learn: pip install scikit-learn") from None
    d = masks.shape[0]
    if d < 2:
        labels = torch.zeros(d, dtype=torch.long)
    else:
        unit = masks / masks.norm(dim=1, keepdim=True).clamp_min(1e-12)
        dist = (1.0 - unit @ unit.T).clamp(0.0, 2.0)
        dist = 0.5 * (dist + dist.T)
        dist.fill_diagonal_(0.0)
        model = AgglomerativeClustering(n_clusters=None, distance_threshold=float(threshold), metric="precomputed",
                                        linkage="complete")
        labels = torch.as_tensor(model.fit(dist.double().cpu().numpy()).labels_, dtype=torch.long)
    n_clusters = int(labels.max()) + 1
    summed = torch.zeros(n_clusters, masks.shape[1], dtype=masks.dtype, device=masks.device)
    summed.index_add_(0, labels.to(masks.device), masks)
    return labels, _minmax_rows(summed)


@register
class ViTCX(Explainer):
    """ViT-CX saliency ``(B, H, W)`` from clustered patch-embedding masks and their causal impact.

    Options:
        layer: block whose residual input (= the input of its first LayerNorm) gives the features (default -1).
        distance_threshold: clustering threshold on the cosine distance (paper: 0.1).
        noise_std: standard deviation of the Gaussian noise on the masked-out part (reference: 0.1).
        noise_correction: subtract the noise-only score (reference code; 2 forwards per cluster) or not.
        score: ``"probability"`` (paper) or ``"target"``. seed: noise seed (per image).
        batch_size: most images in one forward call.
    """

    name = "vitcx"
    value_kind = "probability"

    @classmethod
    def value_kind_for(cls, options: Any) -> str:
        """An expected class probability (``score='probability'``), else a mean of the target's own score."""
        return cls.value_kind if options.get("score", "probability") == "probability" else "score"

    description = "masks from clustered patch embeddings and their causal impact"
    needs = (BLOCK_IO, TOKEN_SEQUENCE)
    display_name = "ViT-CX"
    level = "pixel"
    defaults: dict[str, Any] = {
        "layer": -1,
        "distance_threshold": 0.1,
        "noise_std": 0.1,
        "noise_correction": True,
        "score": "probability",
        "seed": 0,
        "batch_size": 64,
    }
    option_specs = {
        "layer": integer(unit="a block index, negative counts from the end"),
        "distance_threshold": number(0, 2, low_open=True),
        "noise_std": number(0),
        "noise_correction": flag(),
        "score": choice(*SCORE_KINDS),
        "seed": seed(),
        "batch_size": integer(1),
    }
    fast_options: dict[str, Any] = {"batch_size": 64}

    def required(self) -> tuple[str | tuple[str, ...], ...]:
        """``score='probability'`` (a softmax over classes) also needs class logits."""
        return self.needs + score_needs(self.options["score"])

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._n_clusters: list[int] = []

    def explain(self, *args: Any, **kwargs: Any) -> Explanation:
        self._n_clusters = []
        return super().explain(*args, **kwargs)

    __call__ = explain

    def declared_cost(self) -> dict[str, float]:
        """``1 + (2 or 1)·n_clusters`` forwards per image, ``n_clusters`` averaged over the last call's images
        (NaN before the first call: the count depends on the image)."""
        n = sum(self._n_clusters) / len(self._n_clusters) if self._n_clusters else float("nan")
        per = 2.0 if self.options["noise_correction"] else 1.0
        return {"forward": 1.0 + per * n, "backward": 0.0, "n_clusters": n}

    def attribute(self, adapter: Adapter, x: Tensor, target: Target) -> tuple[Attribution, Tensor, Target]:
        o = self.options
        hw = image_size(x)
        grid = adapter.grid(hw)
        p = adapter.num_prefix_tokens
        n_blocks = len(adapter.blocks())
        layer = int(o["layer"])
        if not -n_blocks <= layer < n_blocks:
            raise InputError(f"layer {layer} is out of range for a model with {n_blocks} blocks")
        rows, feats = [], []
        with torch.no_grad():
            for xi in x:  # one by one: features (and so the clusters) do not depend on the batch
                with adapter.session(capture=True) as rec:
                    rows.append(adapter.forward(xi[None]))
                    feats.append(recorded(rec.blocks[layer].u, "block input")[0, p:].detach())
        logits = torch.cat(rows)
        tgt = resolve(target, logits)
        maps, counts = [], []
        with adapter.session(capture=False), torch.no_grad():
            for i, xi in enumerate(x):
                _, masks = cluster_masks(feature_masks(feats[i], grid, hw), float(o["distance_threshold"]))
                p_x = target_scores(logits[i:i + 1], tgt, i, o["score"])[0]
                impact = self._impact(adapter, xi, masks, tgt, i, p_x)
                coverage = masks.sum(dim=0)
                sal = torch.where(coverage > 0, (impact @ masks) / coverage.clamp_min(1e-12),
                                  torch.zeros_like(coverage))
                maps.append((sal / masks.shape[0]).reshape(hw))
                counts.append(masks.shape[0])
        self._n_clusters.extend(counts)
        extras = {"n_clusters": torch.tensor(counts, dtype=torch.long)}
        return Attribution(values=torch.stack(maps), extras=extras), logits, tgt

    def _impact(self, adapter: Adapter, image: Tensor, masks: Tensor, tgt: Target, index: int, p_x: Tensor) -> Tensor:
        """Causal impact ``S_i`` ``(n,)`` of each cluster mask (``masks`` ``(n, H·W)``)."""
        o = self.options
        n = masks.shape[0]
        c, h, w = image.shape
        gen = image_generator(image, o["seed"])
        seeds = torch.randint(0, 2**62, (n,), generator=gen).tolist()  # one noise stream per mask
        correct = bool(o["noise_correction"])
        per_call = max(1, int(o["batch_size"]) // 2) if correct else int(o["batch_size"])
        out = []
        for start in range(0, n, per_call):
            stop = min(start + per_call, n)
            m = masks[start:stop].reshape(-1, 1, h, w).to(image.dtype)
            noise = torch.stack([torch.randn(c, h, w, generator=torch.Generator().manual_seed(s))
                                 for s in seeds[start:stop]]).to(image.device, image.dtype) * float(o["noise_std"])
            outside = noise * (1 - m)
            batch = image[None] * m + outside
            if correct:
                batch = torch.cat([batch, image[None] + outside])
            scores = target_scores(adapter.forward(batch), tgt, index, o["score"])
            b = stop - start
            out.append(scores[:b] - scores[b:] + p_x if correct else scores)
        return torch.cat(out)
