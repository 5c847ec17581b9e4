"""Per-image randomness shared by the sampling methods (random map, SmoothGrad, RISE, ViT-CX). Package-internal.

Every image draws from its own CPU generator, seeded by the method's ``seed`` and a hash of the image's values: the
same image always draws the same numbers, whatever batch it comes in (deterministic and batch-equivariant results).
"""

from __future__ import annotations

import hashlib

import torch
from torch import Tensor

__all__ = ["image_seed", "image_generator"]


def image_seed(image: Tensor, seed: int) -> int:
    """A 63-bit seed from ``seed`` and a hash of ``image``'s values."""
    data = image.detach().cpu().contiguous()
    if data.dtype == torch.bfloat16:  # numpy has no bfloat16: hash its bits
        data = data.view(torch.int16)
    digest = hashlib.blake2b(data.numpy().tobytes(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") ^ (seed * 0x9E3779B97F4A7C15)) % (2**63)


def image_generator(image: Tensor, seed: int) -> torch.Generator:
    """A CPU generator seeded by ``seed`` and a hash of the image's values: the same image always draws the same
    random numbers, whatever batch it comes in (so results are deterministic and batch-equivariant)."""
    return torch.Generator().manual_seed(image_seed(image, int(seed)))
