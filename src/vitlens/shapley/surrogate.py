"""The surrogate of ViT-Shapley (Covert, Lundberg & Lee, ICLR 2023): the classifier evaluated with patches held out.

A held-out patch is removed twice over, so that nothing of it reaches the output:

* its pixels are set to 0 (the normalised data mean) before the patch embedding — a convolutional stem (``shapes-vit``'s
  three stride-2 convolutions) lets a token see its neighbours' pixels, and those must not leak a held-out patch;
* its token is masked out of every attention (an additive ``−inf`` on its key column, the authors' attention masking,
  paper Appendix A), so no token, the readout included, ever reads it. The prefix tokens (class, distillation,
  registers) are always visible.

For a class-token readout this is the model run on the visible tokens alone (token dropping), up to float rounding;
for a mean-pooled readout (``global_pool="avg"``) the mean is taken over the visible patch tokens only.
:func:`masked_logits` is that evaluation; :func:`patch_layout` reads the token grid it needs from the model.
:class:`MaskedClassifier` wraps it as a module (what ``DistributedDataParallel`` wraps when the surrogate trains).

The value of a patch subset ``S`` for class ``c`` is the surrogate's softmax probability ``v_c(S) = p_c(x_S)``;
the surrogate is fine-tuned so that ``p(x_S)`` matches the original model's ``p(x)`` in KL over random subsets
(:func:`vitlens.shapley.sampling.uniform_subsets`), as in the paper's eq. (2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..errors import InputError, UnsupportedModelError

__all__ = ["MaskedClassifier", "PatchLayout", "masked_logits", "patch_layout"]

#: the readouts :func:`masked_logits` knows how to restrict to the visible tokens
POOLS = ("token", "avg")


@dataclass(frozen=True)
class PatchLayout:
    """The players of the game: a ``grid`` of ``gh × gw`` patches of ``patch`` pixels on an image of ``size``, after
    ``prefix`` always-visible tokens."""

    grid: tuple[int, int]
    patch: tuple[int, int]
    size: tuple[int, int]
    prefix: int

    @property
    def n(self) -> int:
        """Number of players (patches)."""
        return self.grid[0] * self.grid[1]


def patch_layout(model: nn.Module, hw: tuple[int, int] | None = None) -> PatchLayout:
    """The token grid of a timm ``VisionTransformer`` (or a subclass: DeiT, distilled DeiT, registers) at its input size,
    or at ``hw`` for a model built with ``dynamic_img_size`` (another size is an :class:`InputError`).

    Raises :class:`UnsupportedModelError` for any other model, or a readout other than the class token or the mean of
    the patch tokens (the only ones whose restriction to the visible tokens is defined here)."""
    from timm.models.vision_transformer import VisionTransformer

    if not isinstance(model, VisionTransformer):
        raise UnsupportedModelError(f"ViT-Shapley's surrogate needs a timm VisionTransformer (ViT, DeiT); "
                                    f"{type(model).__name__} is not one")
    pool = getattr(model, "global_pool", "token")
    if pool not in POOLS or getattr(model, "attn_pool", None) is not None:
        raise UnsupportedModelError(f"ViT-Shapley's surrogate reads a class-token or mean-pooled readout; this model's "
                                    f"global_pool is {pool!r}")
    pe = model.patch_embed
    grid = tuple(int(g) for g in pe.grid_size)
    patch = tuple(int(p) for p in pe.patch_size)
    size = tuple(int(s) for s in pe.img_size)
    if hw is not None and tuple(int(v) for v in hw) != size:
        if not getattr(model, "dynamic_img_size", False):
            raise InputError(f"ViT-Shapley evaluates the model at its input size {size[0]}×{size[1]}; got images of "
                             f"{hw[0]}×{hw[1]}")
        size = (int(hw[0]), int(hw[1]))
        grid = (size[0] // patch[0], size[1] // patch[1])
    if grid[0] * patch[0] != size[0] or grid[1] * patch[1] != size[1]:
        raise UnsupportedModelError(f"the token grid {grid} of {patch}-pixel patches does not tile the {size} input")
    return PatchLayout(grid=(grid[0], grid[1]), patch=(patch[0], patch[1]), size=(size[0], size[1]),
                       prefix=int(model.num_prefix_tokens))


def masked_logits(model: nn.Module, x: Tensor, keep: Tensor, layout: PatchLayout | None = None) -> Tensor:
    """The logits ``(B, K)`` of ``model`` on ``x`` ``(B, C, H, W)`` with only the patches ``keep`` ``(B, n)`` (1 or
    ``True``: visible, 0: held out; row-major over the token grid) present.

    ``keep`` all ones gives ``model(x)`` exactly (the mask is all zeros and the pixels unchanged). Differentiable with
    respect to the model's parameters and ``x``.
    """
    b = x.shape[0]
    lay = layout if layout is not None and tuple(x.shape[-2:]) == layout.size else \
        patch_layout(model, (int(x.shape[-2]), int(x.shape[-1])))
    if keep.shape != (b, lay.n):
        raise InputError(f"keep must be (batch, {lay.n}) for the {lay.grid[0]}×{lay.grid[1]} patches; got "
                         f"{tuple(keep.shape)}")
    vis = keep.to(device=x.device, dtype=torch.bool)
    pixels = vis.view(b, 1, *lay.grid).repeat_interleave(lay.patch[0], 2).repeat_interleave(lay.patch[1], 3)
    x = x * pixels.to(x.dtype)
    tokens = torch.cat([torch.ones(b, lay.prefix, dtype=torch.bool, device=x.device), vis], dim=1)
    # no token visible at all (no prefix tokens, empty subset): attention over everything keeps the rows finite; the
    # readout below then weighs no token (the mean of nothing is the zero vector)
    tokens = tokens | ~tokens.any(dim=1, keepdim=True)
    bias = torch.zeros(b, 1, 1, tokens.shape[1], dtype=x.dtype, device=x.device)
    bias = bias.masked_fill(~tokens[:, None, None, :], float("-inf"))
    feats = model.forward_features(x, attn_mask=bias)  # type: ignore[operator]
    if getattr(model, "global_pool", "token") == "token":
        return model.forward_head(feats)  # type: ignore[operator]
    w = vis.to(feats.dtype)[:, :, None]
    pooled = (feats[:, lay.prefix:] * w).sum(1) / w.sum(1).clamp_min(1.0)  # no patch visible: the zero vector
    return model.head(model.head_drop(model.fc_norm(pooled)))  # type: ignore[operator]


class MaskedClassifier(nn.Module):
    """``forward(x, keep)`` = :func:`masked_logits` of the wrapped ``model`` (a module, so DDP can wrap it)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.layout = patch_layout(model)

    def forward(self, x: Tensor, keep: Tensor) -> Tensor:
        return masked_logits(self.model, x, keep, self.layout)
