"""RISE: randomized input sampling for explanation (Petsiuk, Das & Saenko, BMVC 2018).

``N`` random binary ``s×s`` grids (each cell kept with probability ``p``) are bilinearly upsampled to
``((s+1)·⌈H/s⌉, (s+1)·⌈W/s⌉)`` and cropped at a random shift of less than one cell, giving smooth masks ``M_n``
``(H, W)``. The saliency is the expected target score under masking,
``S = Σ_n f(x ⊙ M_n) · M_n / (N · p)``, with ``f`` the softmax probability of the target class. As in the reference
code, masking multiplies the *preprocessed* (normalised) input, so a masked pixel becomes ``fill`` (default 0) in the
model's input space, i.e. the dataset mean colour for mean/std-normalised inputs — not black. ``1 + N`` forwards.

The helpers the perturbation methods share (per-image generators, the score of a target on rows that all belong to
one image) live in :mod:`._random` and :mod:`._perturbation`; they are re-exported here for compatibility.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..models import Adapter
from ..targets import Target
from ._perturbation import score_needs, SCORE_KINDS, check_positive_int, check_score, resolve, target_scores
from ..options import choice, grid_cells, integer, number, seed
from ._random import image_generator
from .base import Attribution, Explainer
from .registry import register

__all__ = ["RISE", "SCORE_KINDS", "image_generator", "target_scores", "rise_masks", "resolve", "check_positive_int",
           "check_score"]

def rise_masks(grids: Tensor, shifts: Tensor, size: tuple[int, int]) -> Tensor:
    """RISE masks ``(n, H, W)`` in [0, 1] from binary grids ``(n, s, s)`` and integer shifts ``(n, 2)``.

    Each grid is bilinearly upsampled (half-pixel centres, edge values held: the same as the reference's
    ``skimage.transform.resize(order=1, mode='reflect')``) to ``(s+1)`` cells of ``⌈H/s⌉×⌈W/s⌉`` pixels and cropped
    at ``(shift_h, shift_w)``.
    """
    n, s, _ = grids.shape
    h, w = size
    ch, cw = math.ceil(h / s), math.ceil(w / s)
    up = F.interpolate(grids[:, None].float(), size=((s + 1) * ch, (s + 1) * cw), mode="bilinear",
                       align_corners=False)[:, 0]
    rows = shifts[:, 0:1] + torch.arange(h)[None]  # (n, H)
    cols = shifts[:, 1:2] + torch.arange(w)[None]  # (n, W)
    return up[torch.arange(n)[:, None, None], rows[:, :, None], cols[:, None, :]]


#: the most masks RISE accepts (each is one forward pass per image): a bound on the work, not on the maths
MAX_MASKS = 1_000_000

@register
class RISE(Explainer):
    """RISE saliency ``(B, H, W)``: the mean target score over random smooth masks, weighted by each mask.

    Options:
        n_masks: number of masks ``N`` (paper: 4000). grid_size: cells per side ``s`` (paper: 7).
        p_keep: probability that a cell is kept (paper: 0.5).
        fill: value of masked pixels in the model's input space (reference: 0 in the normalised input).
        score: ``"probability"`` (softmax of the target class, paper) or ``"target"`` (the target's own score).
        seed: masks are drawn from a generator seeded by ``seed`` and a hash of each image.
        batch_size: most images in one forward call.
    """

    readout_logit_only = True  # logits only: the readout fast path applies (base.Explainer)

    name = "rise"
    value_kind = "probability"

    @classmethod
    def value_kind_for(cls, options: Any) -> str:
        """An expected class probability (``score='probability'``), else a mean of the target's own score."""
        return cls.value_kind if options.get("score", "probability") == "probability" else "score"

    description = "mean class score over random smooth masks"
    display_name = "RISE"
    level = "pixel"
    defaults: dict[str, Any] = {
        "n_masks": 4000,
        "grid_size": 7,
        "p_keep": 0.5,
        "fill": 0.0,
        "score": "probability",
        "seed": 0,
        "batch_size": 64,
    }
    option_specs = {
        # bounded work: each mask is one forward pass per image
        "n_masks": integer(1, MAX_MASKS, unit=f"one forward pass per image each: at most {MAX_MASKS:,}; the paper "
                                              "uses 4,000"),
        "grid_size": grid_cells(pair=False),
        "p_keep": number(0, 1, low_open=True),
        "fill": number(),
        "score": choice(*SCORE_KINDS),
        "seed": seed(),
        "batch_size": integer(1),
    }
    fast_options: dict[str, Any] = {"n_masks": 24, "grid_size": 3, "batch_size": 16}

    def required(self) -> tuple[str | tuple[str, ...], ...]:
        """``score='probability'`` (a softmax over classes) also needs class logits."""
        return self.needs + score_needs(self.options["score"])

    def declared_cost(self) -> dict[str, float]:
        return {"forward": 1.0 + self.options["n_masks"], "backward": 0.0}

    def attribute(self, adapter: Adapter, x: Tensor, target: Target) -> tuple[Attribution, Tensor, Target]:
        with adapter.session(capture=False), torch.no_grad():
            logits = torch.cat([adapter.forward(xi[None]) for xi in x])  # one by one: batch-independent numerics
            tgt = resolve(target, logits)
            maps = torch.stack([self._saliency(adapter, xi, tgt, i) for i, xi in enumerate(x)])
        return Attribution(values=maps), logits, tgt

    def _saliency(self, adapter: Adapter, image: Tensor, tgt: Target, index: int) -> Tensor:
        o = self.options
        n, s, p = int(o["n_masks"]), int(o["grid_size"]), float(o["p_keep"])
        h, w = image.shape[-2:]
        gen = image_generator(image, o["seed"])
        grids = (torch.rand(n, s, s, generator=gen) < p).float()
        shifts = torch.stack([torch.randint(0, math.ceil(h / s), (n,), generator=gen),
                              torch.randint(0, math.ceil(w / s), (n,), generator=gen)], dim=1)
        fill = float(o["fill"])
        total = torch.zeros(h * w, device=image.device)
        for start in range(0, n, int(o["batch_size"])):
            stop = min(start + int(o["batch_size"]), n)
            m = rise_masks(grids[start:stop], shifts[start:stop], (h, w)).to(image.device)
            xin = image[None] * m[:, None] if fill == 0.0 else image[None] * m[:, None] + fill * (1 - m[:, None])
            scores = target_scores(adapter.forward(xin.to(image.dtype)), tgt, index, o["score"])
            total += scores @ m.flatten(1)
        return (total / (n * p)).reshape(h, w)
