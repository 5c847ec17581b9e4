"""MUTEX: MUltiplex Transformer EXplainer (Marchetti, Traini, Ursino & Virgili, Neural Computing & Applications
37, 2025).

The attention of every block becomes one layer of a multiplex graph whose nodes are the patch tokens; node
centralities across the layers choose token masks, and the model scores each mask on the kept tokens only.
The published description leaves details open; every choice made here is listed in
``docs/methods/perturbation_methods.md`` ("MUTEX: gaps filled"). As implemented:

1. One forward captures the attention probabilities ``A_l`` ``(H, T, T)`` of every block ``l``.
2. Per block and per head aggregation ``g ∈ {min, max, sum}`` over heads: ``W_l = g_h A_l[h]``, restricted to
   patch tokens (rows and columns of the prefix tokens — CLS, DIST, registers — dropped) and without self-loops.
   Edge ``i → j`` has weight ``W_l[i, j]`` (query ``i`` attends to key ``j``).
3. Weak edges are cut: edges below the mean off-diagonal weight of that layer (``edge_cut="mean"``; or below a
   quantile ``q`` of them, ``edge_cut=q``) are removed.
4. Centralities per layer: weighted in-degree (attention a token receives, column sums) and out-degree (row sums);
   ``weighted=False`` counts edges instead (networkx's degree centrality up to the constant ``1/(N−1)``).
5. Each node's ``L`` per-layer values are summarised by 9 statistics: mean, median, standard deviation, minimum,
   maximum, 25th and 75th percentile, skewness, excess kurtosis.
6. 3 aggregations × 2 centralities × 9 statistics = 54 token scores; each gives a binary mask keeping the tokens
   above its ``quantile`` (the ``N − ⌊q·N⌋`` highest; default q = 0.5: half the tokens; scores equal to 6
   significant digits are ties, broken by token index).
7. Each mask is scored by the model on the kept tokens (:meth:`Adapter.keep_tokens`; softmax probability of the
   target class) and the saliency is the score-weighted mask average ``Σ_m s_m·mask_m / Σ_m mask_m``.

Cost: 1 forward (with attention capture) + 54 forwards on about half the patch tokens.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..errors import InputError
from ..models import Adapter
from ..models.base import recorded
from ..models.capabilities import ATTENTION, TOKENS, TOKEN_SEQUENCE
from ..targets import Target
from ..options import any_of, choice, flag, integer, number, subset
from ._perturbation import SCORE_KINDS, coverage_average, resolve, score_needs, score_token_subsets
from .base import Attribution, Explainer, image_size
from .registry import register

__all__ = ["MUTEX", "AGGREGATIONS", "CENTRALITIES", "STATISTICS", "multiplex_scores", "layer_statistics", "top_tokens"]

AGGREGATIONS = ("min", "max", "sum")
CENTRALITIES = ("in", "out")
STATISTICS = ("mean", "median", "std", "min", "max", "q25", "q75", "skew", "kurtosis")


def layer_statistics(values: Tensor, names: tuple[str, ...] = STATISTICS) -> Tensor:
    """Statistics over the layer dimension of ``values`` ``(..., L, N)`` → ``(..., S, N)``, in the order of
    ``names``. Standard deviation, skewness and kurtosis use population moments; with zero variance the last two are
    0."""
    mean = values.mean(dim=-2)
    centred = values - mean[..., None, :]
    m2 = (centred ** 2).mean(dim=-2)
    std = m2.sqrt()
    safe = torch.where(m2 > 0, m2, torch.ones_like(m2))
    out = []
    for name in names:
        if name == "mean":
            out.append(mean)
        elif name == "median":
            out.append(values.quantile(0.5, dim=-2))
        elif name == "std":
            out.append(std)
        elif name == "min":
            out.append(values.amin(dim=-2))
        elif name == "max":
            out.append(values.amax(dim=-2))
        elif name == "q25":
            out.append(values.quantile(0.25, dim=-2))
        elif name == "q75":
            out.append(values.quantile(0.75, dim=-2))
        elif name == "skew":
            out.append(torch.where(m2 > 0, (centred ** 3).mean(dim=-2) / safe ** 1.5, torch.zeros_like(m2)))
        elif name == "kurtosis":
            out.append(torch.where(m2 > 0, (centred ** 4).mean(dim=-2) / safe ** 2 - 3.0, torch.zeros_like(m2)))
        else:
            raise InputError(f"unknown statistic {name!r}; statistics are {STATISTICS}")
    return torch.stack(out, dim=-2)


def multiplex_scores(attn: Tensor, num_prefix: int, aggregations: tuple[str, ...] = AGGREGATIONS,
                     centralities: tuple[str, ...] = CENTRALITIES, statistics: tuple[str, ...] = STATISTICS,
                     edge_cut: str | float | None = "mean", weighted: bool = True) -> Tensor:
    """Token scores ``(len(aggregations)·len(centralities)·len(statistics), N)`` for one image.

    ``attn``: ``(L, H, T, T)`` attention probabilities of all blocks. Order of the rows: aggregation, then
    centrality, then statistic (row-major).
    """
    a = attn[:, :, num_prefix:, num_prefix:].double()  # (L, H, N, N); float64: higher moments are ill-conditioned
    n = a.shape[-1]
    off = ~torch.eye(n, dtype=torch.bool, device=a.device)
    rows = []
    for agg in aggregations:
        w = {"min": lambda t: t.amin(dim=1), "max": lambda t: t.amax(dim=1), "sum": lambda t: t.sum(dim=1)}[agg](a)
        w = w * off  # no self-loops
        if edge_cut is not None and n > 1:
            edges = w[:, off]  # (L, N·(N−1))
            thr = edges.mean(dim=1) if edge_cut == "mean" else edges.quantile(float(edge_cut), dim=1)
            strong = (w >= thr[:, None, None]) & off
            w = torch.where(strong, w, torch.zeros_like(w))
            if not weighted:
                w = strong.to(w.dtype)
        elif not weighted:
            w = (w > 0).to(w.dtype)
        for cent in centralities:
            degree = w.sum(dim=1) if cent == "in" else w.sum(dim=2)  # (L, N): column (in) or row (out) sums
            rows.append(layer_statistics(degree, statistics))
    return torch.cat(rows, dim=0)


def top_tokens(scores: Tensor, k: int, digits: int = 6) -> Tensor:
    """Indices ``(M, k)`` of the ``k`` highest scores of each row of ``scores`` ``(M, N)``.

    Scores equal to ``digits`` significant digits (relative to the row's largest magnitude) are ties, broken by
    token index, so float rounding (batch size, attention implementation) never decides a mask — e.g. the excess
    kurtosis of 3 layers is −1.5 for every token.
    """
    scale = scores.abs().amax(dim=1, keepdim=True).clamp_min(1e-30)
    rounded = torch.round(scores / scale * 10.0**digits)
    return rounded.argsort(dim=1, descending=True, stable=True)[:, :k]


@register
class MUTEX(Explainer):
    """MUTEX: token masks from multiplex-graph centralities of the attention, scored on the kept tokens.

    Options:
        aggregations: head aggregations (paper: min, max, sum). centralities: ``"in"``/``"out"`` degree.
        statistics: summaries over layers (9; see :data:`STATISTICS`).
        quantile: each mask keeps the tokens above this quantile of its score (default 0.5 → half the tokens).
        edge_cut: ``"mean"`` (cut edges below the layer's mean weight), a quantile in [0, 1), or ``None``.
        weighted: weighted degrees (strength) or edge counts.
        score: ``"probability"`` (paper) or ``"target"``. batch_size: most masked images in one forward call.
    """

    name = "mutex"
    value_kind = "probability"

    @classmethod
    def value_kind_for(cls, options: Any) -> str:
        """An expected class probability (``score='probability'``), else a mean of the target's own score."""
        return cls.value_kind if options.get("score", "probability") == "probability" else "score"

    description = "token masks from attention-graph centralities"
    needs = (TOKENS, ATTENTION, TOKEN_SEQUENCE)
    display_name = "MUTEX"
    level = "token"
    defaults: dict[str, Any] = {
        "aggregations": AGGREGATIONS,
        "centralities": CENTRALITIES,
        "statistics": STATISTICS,
        "quantile": 0.5,
        "edge_cut": "mean",
        "weighted": True,
        "score": "probability",
        "batch_size": 64,
    }
    option_specs = {
        "aggregations": subset(*AGGREGATIONS),
        "centralities": subset(*CENTRALITIES),
        "statistics": subset(*STATISTICS),
        "quantile": number(0, 1, high_open=True),
        "edge_cut": any_of(choice("mean", none=True), number(0, 1, high_open=True)),
        "weighted": flag(),
        "score": choice(*SCORE_KINDS),
        "batch_size": integer(1),
    }
    fast_options: dict[str, Any] = {}

    def required(self) -> tuple[str | tuple[str, ...], ...]:
        """``score='probability'`` (a softmax over classes) also needs class logits."""
        return self.needs + score_needs(self.options["score"])

    @property
    def n_masks(self) -> int:
        o = self.options
        return len(o["aggregations"]) * len(o["centralities"]) * len(o["statistics"])

    def declared_cost(self) -> dict[str, float]:
        """1 forward (attention capture) + one forward per mask on ``1 − quantile`` of the patch tokens."""
        return {"forward": 1.0 + self.n_masks, "backward": 0.0, "token_fraction": 1.0 - float(self.options["quantile"])}

    def attribute(self, adapter: Adapter, x: Tensor, target: Target) -> tuple[Attribution, Tensor, Target]:
        o = self.options
        gh, gw = adapter.grid(image_size(x))
        p = adapter.num_prefix_tokens
        rows, node_scores = [], []
        with torch.no_grad():
            for xi in x:  # one by one: the graphs do not depend on the batch
                with adapter.session(capture=True) as rec:
                    rows.append(adapter.forward(xi[None]))
                    attn = torch.stack([recorded(b.attn, "attention")[0].detach() for b in rec.blocks])  # (L, H, T, T)
                node_scores.append(multiplex_scores(attn, p, o["aggregations"], o["centralities"], o["statistics"],
                                                    o["edge_cut"], bool(o["weighted"])))
        logits = torch.cat(rows)
        tgt = resolve(target, logits)
        n = gh * gw
        k = max(1, n - int(float(o["quantile"]) * n))
        values, all_scores = [], []
        with adapter.session(capture=False), torch.no_grad():
            for i, xi in enumerate(x):
                keep = top_tokens(node_scores[i], k)  # (n_masks, k)
                masks = torch.zeros(node_scores[i].shape, device=keep.device).scatter_(1, keep, 1.0)
                scores = score_token_subsets(adapter, xi, keep, tgt, i, o["score"], int(o["batch_size"]))
                values.append(coverage_average(masks, scores).reshape(gh, gw))
                all_scores.append(scores)
        att = Attribution(values=torch.stack(values), extras={"mask_scores": torch.stack(all_scores)})
        return att, logits, tgt
