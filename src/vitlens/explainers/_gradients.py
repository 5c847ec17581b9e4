"""Input-gradient steps shared by the gradient methods (input × gradient, gradient, SmoothGrad, Integrated
Gradients) and the channel reductions of gradient and SmoothGrad. Package-internal.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from ..errors import InputError
from ..models import Adapter
from ..targets import Target
from .base import Explainer, check_choices

__all__ = ["input_gradient", "input_gradients", "clean_forward", "check_rows", "reduce_channels", "check_reduce",
           "REDUCTIONS"]


def input_gradient(adapter: Adapter, x: Tensor, target: Target) -> tuple[Tensor, Tensor, Tensor, Target]:
    """One forward and one backward: returns ``(x, ∇x y, logits, resolved target)``."""
    with adapter.session(capture=False) as _:
        xg = x.detach().clone().requires_grad_(True)
        logits = adapter.forward(xg)
        tgt = Explainer.resolve_target(target, logits)
        (grad,) = torch.autograd.grad(tgt(logits).sum(), [xg])
    return xg.detach(), grad, logits.detach(), tgt


def input_gradients(adapter: Adapter, points: Callable[[int, int], Tensor], n: int, batch: int, target: Target,
                    rows_per_call: int | None) -> Tensor:
    """Gradient of a resolved ``target`` at ``n`` sets of points, one set per image of the batch.

    Args:
        points: ``points(start, stop)`` returns sets ``start … stop − 1`` as ``(stop − start, B, C, H, W)``; set ``k``
            holds the ``k``-th point (noisy copy, path point) of every image. Called with increasing, contiguous
            ranges, so the points are made only when needed (memory) and random draws keep their order.
        n, batch: number of sets and images ``B``.
        target: the target resolved for the batch of ``B`` images; it is applied to each set's ``(B, K)`` logits, so
            any :class:`Target` works.
        rows_per_call: model rows per call, rounded down to whole sets (at least one set of ``B`` rows), as
            Captum's ``internal_batch_size``; ``None``: all ``n·B`` rows in one call. Rows never interact, so results
            do not depend on it beyond float rounding.

    Returns the gradients ``(n, B, C, H, W)``. Must be called inside an open ``adapter.session(capture=False)``.
    """
    sets = n if rows_per_call is None else max(1, int(rows_per_call) // batch)
    grads = []
    for start in range(0, n, sets):
        chunk = points(start, min(start + sets, n))
        s = chunk.shape[0]
        xs = chunk.reshape(s * batch, *chunk.shape[2:]).detach().requires_grad_(True)
        out = adapter.forward(xs)
        logits = out.reshape(s, batch, *out.shape[1:])  # (B, K) or per-pixel (B, K, h, w) logits per set
        score: Tensor = sum(target(logits[k]).sum() for k in range(s))  # type: ignore[assignment]  # s >= 1
        (g,) = torch.autograd.grad(score, [xs])
        grads.append(g.reshape(chunk.shape))
    return torch.cat(grads)


def clean_forward(adapter: Adapter, x: Tensor, target: Target) -> tuple[Tensor, Target]:
    """One gradient-free forward on the clean batch: its logits and the resolved target."""
    with torch.no_grad():
        logits = adapter.forward(x)
    return logits, Explainer.resolve_target(target, logits)


def check_rows(value: Any, name: str) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise InputError(f"{name} must be None or a positive int, got {value!r}")


#: channel reductions of a ``(B, C, H, W)`` gradient to a ``(B, H, W)`` map.
REDUCTIONS = ("max_abs", "sum_abs", "sum")


def reduce_channels(grad: Tensor, how: str) -> Tensor:
    """``(B, C, H, W)`` → ``(B, H, W)``: ``max_abs`` = ``max_c |g_c|`` (Simonyan et al.), ``sum_abs`` = ``Σ_c |g_c|``,
    ``sum`` = ``Σ_c g_c`` (signed)."""
    if how == "max_abs":
        return grad.abs().amax(dim=1)
    if how == "sum_abs":
        return grad.abs().sum(dim=1)
    if how == "sum":
        return grad.sum(dim=1)
    raise InputError(f"reduce must be one of {REDUCTIONS}, got {how!r}")


def check_reduce(options: dict[str, Any]) -> None:
    """Refuse a ``reduce`` option that is not one of :data:`REDUCTIONS` (one line naming the choices)."""
    check_choices(options, reduce=REDUCTIONS)
