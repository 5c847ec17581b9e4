"""LeGrad (Bousselham et al., 2024, "LeGrad: An Explainability Method for Vision Transformers via Feature Formation
Sensitivity"; reference implementation ``legrad-torch`` on PyPI).

For every block ``l`` the target score is read from that block's output through the model's own final norm, readout
and head (``s_l = y(head(norm(z_l)))``); LeGrad takes its gradient with respect to the block's attention
probabilities ``A_l`` ``(B, H, T, T)``, clamps it at zero, averages it over heads and over the query rows, and keeps
the patch-token columns; the layers' maps are summed and min-max normalised per image:

    E_l = mean_h mean_i (∂s_l/∂A_l)⁺[h, i, p:]        E = minmax(Σ_{l ≥ start_layer} E_l)

One forward and one backward pass: the residual stream entering every block is cut from the graph (a fresh leaf with
the same value), so one backward of ``Σ_l s_l`` gives each block exactly ``∂s_l/∂A_l``; each block's part of it is
its own MLP and attention output only. With a fused-attention model the forward keeps the fused kernel and
``∂s_l/∂A_l = (∂s_l/∂O_l)·V_lᵀ`` is formed from the attention output's gradient. Equations, the choices of
``legrad-torch`` and the cross-check: ``docs/methods/legrad.md``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ..errors import InputError
from ..models import Adapter
from ..models.base import recorded
from ..models.capabilities import ATTENTION, BLOCK_IO, STREAM_HEAD, TOKEN_SEQUENCE
from ..options import integer
from ..targets import Target
from .base import Attribution, Explainer, image_size
from .registry import register

__all__ = ["LeGrad", "min_max"]


def min_max(values: Tensor) -> Tensor:
    """Per image ``(v − min) / (max − min)`` over the last dimension of ``(B, N)``; zeros where ``max = min``."""
    low = values.amin(dim=-1, keepdim=True)
    span = values.amax(dim=-1, keepdim=True) - low
    return torch.where(span > 0, (values - low) / span.clamp_min(torch.finfo(values.dtype).tiny), 0.0)


@register
class LeGrad(Explainer):
    """LeGrad: per block ``l``, ``mean_h mean_i ReLU(∂s_l/∂A_l)`` on the patch columns, summed over the blocks from
    ``start_layer`` and min-max normalised per image, ``(B, gh, gw)`` in ``[0, 1]``.

    Options:
        start_layer: first block whose map enters the sum (negative counts from the end). Default 0: every block,
            as the paper aggregates "over all layers"; ``legrad-torch``'s wrapper default ``layer_index=-2`` is
            ``start_layer=-2`` (the last two blocks).
    """

    name = "legrad"
    value_kind = "nonnegative"
    description = "gradient of each layer's read-out score w.r.t. its attention map, over layers (Bousselham 2024)"
    display_name = "LeGrad"
    needs = (ATTENTION, BLOCK_IO, TOKEN_SEQUENCE, STREAM_HEAD)
    level = "token"
    defaults: dict[str, Any] = {"start_layer": 0}
    option_specs = {"start_layer": integer(unit="a block index, negative counts from the end")}

    def _first(self, n: int) -> int:
        s = self.options["start_layer"]
        if not -n <= s < n:
            raise InputError(f"start_layer {s} is out of range for a model with {n} blocks (valid: {-n}..{n - 1})")
        return s % n

    def attribute(self, adapter: Adapter, x: Tensor, target: Target) -> tuple[Attribution, Tensor, Target]:
        blocks = list(adapter.blocks())
        first = self._first(len(blocks))
        with adapter.session(capture=True, recompute=True) as rec:
            # registered after the session's capture hooks, so those record each block's input before it is cut
            handles = [blk.register_forward_pre_hook(_cut_stream, with_kwargs=True) for blk in blocks[1:]]
            try:
                logits = adapter.forward(x)
            finally:
                for h in handles:
                    h.remove()
            tgt = self.resolve_target(target, logits)
            # s_l of every block from `first` on (block l's output is block l+1's recorded input); the last block's
            # is the model's own output
            scores = [tgt(adapter.stream_logits(recorded(rec.blocks[i + 1].u, "block input")))
                      for i in range(first, len(blocks) - 1)] + [tgt(logits)]
            picked = [recorded(b.out, "attention output") if rec.recompute else recorded(b.attn, "attention")
                      for b in rec.blocks[first:]]
            grads = self.gradients(torch.stack(scores).sum(dim=0), picked)
            values = [recorded(b.value, "values") for b in rec.blocks[first:]] if rec.recompute else []
        p = adapter.num_prefix_tokens
        total = None
        for i, g in enumerate(grads):
            if values:  # ∂s/∂A = ∂s/∂O · vᵀ per head, O = (B, T_q, H·d)
                v = values[i]
                b, t, _ = g.shape
                g = g.reshape(b, t, v.shape[1], v.shape[-1]).transpose(1, 2) @ v.transpose(-2, -1)
            layer = g.float().clamp_min(0).mean(dim=1).mean(dim=1)[:, p:]  # heads, then query rows → (B, N)
            total = layer if total is None else total + layer
        assert total is not None  # at least the last block
        values_map = self.on_grid(adapter, min_max(total), image_size(x))
        return Attribution(values=values_map), logits.detach(), tgt


def _cut_stream(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Forward pre-hook: the block's input becomes a fresh leaf with the same value, so no later block's score
    reaches an earlier block's attention in the backward pass (each block gets exactly its own ``∂s_l/∂A_l``)."""
    if args:
        return (args[0].detach().requires_grad_(True), *args[1:]), kwargs
    key = next(iter(kwargs))
    return args, {**kwargs, key: kwargs[key].detach().requires_grad_(True)}
