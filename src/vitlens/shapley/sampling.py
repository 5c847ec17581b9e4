"""The random patch subsets of ViT-Shapley's two trainings, each drawn from a generator keyed by
``(seed, phase, step, image index)`` — never a global RNG — so a run is reproducible, resumes bit for bit, and gives the
same subsets under any number of processes.

* :func:`uniform_subsets` (surrogate): the subset size ``k`` uniform in ``0..n``, then ``k`` patches uniformly
  (every size equally likely, as the paper's surrogate training samples them).
* :func:`shapley_subsets` (explainer): ``k`` in ``1..n−1`` with probability ``∝ (n − 1) / (k (n − k))``, the Shapley
  kernel summed over the subsets of each size (KernelSHAP's and FastSHAP's distribution), ``k`` patches uniformly;
  ``paired`` adds each subset's complement (antithetic sampling, as the paper's explainer training).
* :func:`shapley_kernel_sizes`: that size distribution.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

__all__ = ["generator", "shapley_kernel_sizes", "shapley_subsets", "uniform_subsets"]

#: phase keys of the generators (distinct streams for the two trainings, validation and the benchmark)
PHASES = {"surrogate": 1, "explainer": 2, "validation": 3, "kernelshap": 4}


def generator(seed: int, phase: str, step: int, index: int) -> torch.Generator:
    """A CPU generator seeded from ``(seed, phase, step, index)`` through NumPy's ``SeedSequence``."""
    entropy = [int(seed) & 0xFFFFFFFF, PHASES[phase], int(step), int(index)]
    value = int(np.random.SeedSequence(entropy).generate_state(2, np.uint32).astype(np.uint64) @ [1, 1 << 32])
    return torch.Generator().manual_seed(value & ((1 << 63) - 1))


def _subset(n: int, k: int, g: torch.Generator) -> Tensor:
    """A uniformly random subset of ``k`` of ``n`` players as a ``(n,)`` 0/1 float mask."""
    out = torch.zeros(n)
    out[torch.randperm(n, generator=g)[:k]] = 1.0
    return out


def uniform_subsets(n: int, count: int, g: torch.Generator) -> Tensor:
    """``count`` masks ``(count, n)`` whose sizes are uniform in ``0..n``."""
    sizes = torch.randint(0, n + 1, (count,), generator=g)
    return torch.stack([_subset(n, int(k), g) for k in sizes])


def shapley_kernel_sizes(n: int) -> Tensor:
    """The distribution ``(n − 1,)`` of subset sizes ``k = 1..n−1`` under the Shapley kernel, ``∝ 1 / (k (n − k))``."""
    k = torch.arange(1, n, dtype=torch.float64)
    w = 1.0 / (k * (n - k))
    return w / w.sum()


def shapley_subsets(n: int, count: int, g: torch.Generator, paired: bool = True) -> Tensor:
    """``count`` masks ``(count, n)`` drawn from the Shapley kernel; with ``paired`` (``count`` even) the second half
    are the complements of the first half, in order."""
    if n < 2:
        raise ValueError(f"the Shapley kernel needs at least 2 players, got {n}")
    if paired and count % 2:
        raise ValueError(f"paired sampling needs an even number of subsets, got {count}")
    base = count // 2 if paired else count
    sizes = torch.multinomial(shapley_kernel_sizes(n).float(), base, replacement=True, generator=g) + 1
    masks = torch.stack([_subset(n, int(k), g) for k in sizes])
    return torch.cat([masks, 1.0 - masks]) if paired else masks
