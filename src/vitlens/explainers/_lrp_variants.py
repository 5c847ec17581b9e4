"""The gradient × input LRP rules (:mod:`.attnlrp`, :mod:`.cplrp`) through the variants of the plain pre-norm block
that an adapter declares (:class:`vitlens.models.base.LRPLinears`): q/k norms, scale norms and gated MLPs.
Package-internal; installed by :class:`._lrp.LinearTaps` for each block that is not plain.

- **q/k norms and scale norms** (LayerNorm / RMSNorm on the queries and keys per head, on the attention output before
  the output projection, on the MLP's hidden features before its second map): the identity rule of AttnLRP for
  LayerNorm — the division by the standard deviation (RMS) is a constant in the backward pass, so the norm is a linear
  map there. The session's conservative mode already does this for every normalisation the adapter lists; the q/k
  norms sit between the projection (whose gradient the attention rule scales) and the softmax, a linear map in the
  backward pass, so the scaled gradients still give the uniform rule on ``q̂·k̂ᵀ`` of the normed queries and keys.
  Nothing is installed for them here; :class:`._lrp.LinearTaps` applies them when it checks the attention.
- **gated MLP** ``fc2(act(g) ⊙ x)`` (SwiGLU, ``GluMlp``): the product of the two branches takes the product rule —
  its relevance ``R`` goes ``s·R`` to the gate branch and ``(1 − s)·R`` to the value branch (AttnLRP's uniform rule
  for a multiplication: ``s = ½``; CP-LRP treats the gate as a constant, as it does the attention probabilities:
  ``s = 0``) — and the activation on the gate the identity rule, as in the plain MLP.
- **plain MLP with a hidden norm** (``scale_mlp_norm``): the identity rule at the activation's own output (the plain
  block's rewrite at the second map's input would pass through the norm).

Each hook checks what it rewrites: the product's value must be ``act(g)·x`` of the declared maps, else the block is
refused (:class:`UnsupportedModelError`). All hooks go into the caller's handle list and are removed with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor, nn

from ..errors import UnsupportedModelError
from ..models.base import LRPLinears

__all__ = ["VariantRules", "GATE_SHARE", "gated_product", "gate_value_weights", "normed"]

#: the share of a gated product's relevance that goes to the gate branch: AttnLRP's uniform rule halves it, CP-LRP
#: treats the gate as a constant (all relevance to the value branch)
GATE_SHARE = {"attnlrp": 0.5, "cplrp": 0.0}


class _GatedProduct(torch.autograd.Function):
    """Value ``z`` (``= a·x``, no gradient); gradient ``s·x·g`` to ``a`` and ``(1 − s)·a·g`` to ``x``: relevance
    ``a·∂`` = ``s·z·g`` to the gate, ``x·∂ = (1 − s)·z·g`` to the value branch (the product rule)."""

    @staticmethod
    def forward(ctx: Any, z: Tensor, a: Tensor, x: Tensor, share: float) -> Tensor:
        ctx.share = share
        ctx.save_for_backward(a.detach(), x.detach())
        return z.view_as(z)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[None, Tensor | None, Tensor, None]:
        a, x = ctx.saved_tensors
        share = ctx.share
        to_gate = None if share == 0.0 else g * x * share
        return None, to_gate, g * a * (1.0 - share), None


def gated_product(z: Tensor, a: Tensor, x: Tensor, share: float) -> Tensor:
    """``z = a·x`` in the forward pass; the product rule in the backward pass (see :class:`_GatedProduct`)."""
    return _GatedProduct.apply(z.detach(), a, x, float(share))


@dataclass
class VariantRules:
    """The rules for the variant blocks: ``gate_share`` (:data:`GATE_SHARE`) and ``act_rule(p, act(p)) -> t`` (the
    identity rule on the activation, or ``None``: its plain gradient). ``check_only``: install only the check that a
    gated MLP computes ``act(g)·x`` and leave the backward plain (for the explicit relevance sweep, which applies its
    rules to the recorded tensors itself)."""

    gate_share: float
    act_rule: Callable[[Tensor, Tensor], Tensor] | None
    check_only: bool = False

    def install(self, index: int, lin: LRPLinears, handles: list) -> None:
        """Register block ``index``'s hooks (appended to ``handles``)."""
        if lin.act is None or lin.after_act is None:
            raise UnsupportedModelError(f"block {index}: its adapter declares no MLP activation to apply the rules at")
        if not lin.gated:
            if self.act_rule is not None and not self.check_only:
                rule = self.act_rule
                handles.append(lin.act.register_forward_hook(lambda m, args, out: rule(args[0], out)))
            return
        self._install_gated(index, lin, handles)

    def _install_gated(self, index: int, lin: LRPLinears, handles: list) -> None:
        act, after = lin.act, lin.after_act
        assert act is not None and after is not None  # install() checked them
        seen: dict[str, Tensor] = {}
        rule, share, check_only = (None if self.check_only else self.act_rule), self.gate_share, self.check_only
        value_map: nn.Module = lin.fc1

        def value_hook(module: nn.Module, args: tuple, out: Tensor) -> None:
            if lin.packed_gate is None:
                seen["x"] = out
            else:  # one map: [gate, value] (packed_gate "first") or [value, gate] ("last")
                first, second = out.chunk(2, dim=-1)
                seen["x"] = second if lin.packed_gate == "first" else first

        def act_hook(module: nn.Module, args: tuple, out: Tensor) -> Tensor | None:
            new = out if rule is None else rule(args[0], out)
            seen["a"] = new
            return None if rule is None else new

        def product_hook(module: nn.Module, args: tuple) -> tuple | None:
            z, a, x = args[0], seen.pop("a", None), seen.pop("x", None)
            if a is None or x is None or a.shape != z.shape or x.shape != z.shape:
                raise UnsupportedModelError(
                    f"block {index}: the MLP's hidden features are not act(gate)·value of its declared maps; vitlens "
                    "cannot apply the product rule")
            with torch.no_grad():
                err = float((a.detach() * x.detach() - z.detach()).abs().max())
                tol = max(1e-4, 4 * torch.finfo(z.dtype).eps) * float(z.detach().abs().max()) + 1e-6
            if not err <= tol:
                raise UnsupportedModelError(
                    f"block {index}: the MLP's hidden features are not act(gate)·value of its declared maps (max "
                    f"error {err:.2e}); vitlens cannot apply the product rule")
            return None if check_only else (gated_product(z, a, x, share), *args[1:])

        handles.append(value_map.register_forward_hook(value_hook))
        handles.append(act.register_forward_hook(act_hook))
        handles.append(after.register_forward_pre_hook(product_hook))


def gate_value_weights(lin: LRPLinears) -> tuple[Tensor, Tensor]:
    """The weight rows of a gated MLP's gate and value maps ``(hidden, D)`` each (halves of one packed map)."""
    if lin.gate is not None:
        return lin.gate.weight, lin.fc1.weight
    w = lin.fc1.weight
    first, second = w[: w.shape[0] // 2], w[w.shape[0] // 2:]
    return (first, second) if lin.packed_gate == "first" else (second, first)


def normed(norm: nn.Module | None, t: Tensor) -> Tensor:
    """``norm(t)`` without its hooks (no capture or conservative hook fires); ``None``: ``t``."""
    return t if norm is None else norm.forward(t)
