"""Reference Shapley values of the surrogate's game: KernelSHAP (Lundberg & Lee, 2017) with paired sampling (Covert &
Lee, 2021), and exact values by enumeration for small games — what ViT-Shapley's estimates are measured against
(the paper's "ground truth": KernelSHAP run until it converges).

KernelSHAP solves the Shapley kernel's constrained weighted least squares on sampled subsets ``z ∈ {0,1}^n`` drawn from
the kernel's distribution (:func:`~vitlens.shapley.sampling.shapley_subsets`)::

    A = mean(z zᵀ),  b = mean(z (v(z) − v(∅))),
    φ = A⁻¹ (b − 1 · (1ᵀA⁻¹b − (v(1) − v(∅))) / (1ᵀA⁻¹1))

so ``Σ φ = v(1) − v(∅)`` exactly. :func:`surrogate_game` turns an explainer's surrogate and an image into the game
``masks (m, n) → probabilities (m, K)``.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor, nn

from .sampling import generator, shapley_subsets
from .surrogate import masked_logits, patch_layout

__all__ = ["exact_shapley", "kernelshap", "surrogate_game"]

Game = Callable[[Tensor], Tensor]


def surrogate_game(surrogate: nn.Module, x: Tensor, batch: int = 256) -> Game:
    """The game of image ``x`` ``(1, C, H, W)``: masks ``(m, n)`` → the surrogate's softmax probabilities ``(m, K)``
    (float64, evaluated ``batch`` masks at a time, no gradients)."""
    lay = patch_layout(surrogate, (int(x.shape[-2]), int(x.shape[-1])))

    @torch.no_grad()
    def game(masks: Tensor) -> Tensor:
        out = []
        for s in range(0, masks.shape[0], batch):
            m = masks[s:s + batch].to(x.device)
            out.append(masked_logits(surrogate, x.expand(m.shape[0], -1, -1, -1), m, lay).double().softmax(-1).cpu())
        return torch.cat(out)

    return game


def _solve(a: Tensor, b: Tensor, total: Tensor) -> Tensor:
    """The constrained least-squares solution for ``A`` ``(n, n)``, ``b`` ``(n, K)`` and ``v(1) − v(∅)`` ``(K,)``
    (through the pseudo-inverse of ``A``: with fewer distinct subsets than players ``A`` is singular and the
    minimum-norm solution is taken)."""
    ones = torch.ones(a.shape[0], 1, dtype=a.dtype)
    a_pinv = torch.linalg.pinv(a, hermitian=True)
    a_inv_b = a_pinv @ b
    a_inv_1 = a_pinv @ ones
    return a_inv_b - a_inv_1 @ ((ones.T @ a_inv_b - total[None]) / (ones.T @ a_inv_1))


def kernelshap(game: Game, n: int, samples: int, seed: int = 0, batch: int = 512,
               checkpoints: tuple[int, ...] = ()) -> tuple[Tensor, dict[int, Tensor]]:
    """KernelSHAP estimate ``(n, K)`` of ``game``'s Shapley values from ``samples`` paired Shapley-kernel subsets
    (keyed by ``seed``: the same seed gives the same subsets); also the estimates after each of ``checkpoints``
    sample counts (e.g. half the samples, to see convergence), ``{count: (n, K)}``."""
    v0 = game(torch.zeros(1, n))[0]
    v1 = game(torch.ones(1, n))[0]
    a = torch.zeros(n, n, dtype=torch.float64)
    b = torch.zeros(n, v0.shape[0], dtype=torch.float64)
    seen, chunk_i, at = 0, 0, {}
    wanted = sorted({c for c in checkpoints if 0 < c < samples} | {samples})
    while seen < samples:
        stop = next(c for c in wanted if c > seen)
        m = min(batch, stop - seen)
        m += m % 2
        z = shapley_subsets(n, m, generator(seed, "kernelshap", chunk_i, n)).double()
        chunk_i += 1
        v = game(z.float())
        a += z.T @ z
        b += z.T @ (v - v0[None])
        seen += m
        if seen in wanted or seen >= stop:
            at[stop] = _solve(a / seen, b / seen, v1 - v0)
    return at[samples], {c: at[c] for c in wanted if c != samples}


def exact_shapley(game: Game, n: int, batch: int = 4096) -> Tensor:
    """Exact Shapley values ``(n, K)`` by enumerating all ``2^n`` subsets (``n ≤ 20``): subset ``j``'s player ``i`` is
    bit ``i`` of ``j``."""
    if n > 20:
        raise ValueError(f"exact Shapley values enumerate 2^n subsets; n = {n} is too many")
    idx = torch.arange(2 ** n)
    rows = ((idx[:, None] >> torch.arange(n)[None]) & 1).float()  # (2^n, n)
    values = torch.cat([game(rows[s:s + batch]) for s in range(0, rows.shape[0], batch)])  # (2^n, K)
    size = rows.sum(1).long()
    weight = torch.tensor([math.factorial(k) * math.factorial(n - k - 1) / math.factorial(n) for k in range(n)],
                          dtype=torch.float64)
    phi = torch.zeros(n, values.shape[1], dtype=torch.float64)
    for i in range(n):
        without = idx[(idx >> i) & 1 == 0]
        phi[i] = (weight[size[without]][:, None] * (values[without | (1 << i)] - values[without])).sum(0)
    return phi
