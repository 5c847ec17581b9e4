"""LayerNorm with its standard deviation held constant in the backward pass, as one fused forward and a short backward.

``y = (x − μ)·r·w + b`` with ``r = 1/sqrt(σ² + ε)`` computed by the fused ``native_layer_norm`` kernel (the same
forward values as the module's own LayerNorm); the backward treats ``r`` as a constant, so the normalisation acts as
a linear map (centering, then scaling) and gradient × input is conserved through it (Ali et al., ICML 2022):
``∂L/∂x = r·(g·w − mean(g·w))``. Only ``r`` (and ``w``) are kept for the backward, not ``x`` and the intermediates
of a decomposed recomputation (unless ``w`` or ``b`` need gradients).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["constant_std_layer_norm"]


class _ConstantStdLayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor | None, bias: Tensor | None, shape: tuple[int, ...],
                eps: float) -> Tensor:
        out, mean, rstd = torch.native_layer_norm(x, shape, weight, bias, eps)
        affine_grad = (weight is not None and weight.requires_grad) or (bias is not None and bias.requires_grad)
        ctx.dims = tuple(range(-len(shape), 0))
        ctx.save_for_backward(weight, rstd, x if affine_grad else None, mean if affine_grad else None)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        weight, rstd, x, mean = ctx.saved_tensors
        dims = ctx.dims
        gx = None
        if ctx.needs_input_grad[0]:  # in place on a fresh product: two passes, no temporaries of the input's size
            gw = grad.clone() if weight is None else grad * weight
            gx = gw.sub_(gw.mean(dim=dims, keepdim=True)).mul_(rstd.to(gw.dtype))
        lead = tuple(range(grad.ndim - len(dims)))
        g_weight = g_bias = None
        if ctx.needs_input_grad[1]:
            g_weight = (grad * (x - mean) * rstd).sum(dim=lead)
        if ctx.needs_input_grad[2]:
            g_bias = grad.sum(dim=lead)
        return gx, g_weight, g_bias, None, None


def constant_std_layer_norm(x: Tensor, weight: Tensor | None, bias: Tensor | None, shape: tuple[int, ...],
                            eps: float) -> Tensor:
    """LayerNorm over the trailing ``shape`` dims whose backward holds the standard deviation constant."""
    return _ConstantStdLayerNorm.apply(x, weight, bias, tuple(shape), float(eps))
