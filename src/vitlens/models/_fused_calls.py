"""Recording a fused attention that is called as a function inside the attention module (timm ``Eva``: rotary
embeddings are applied to the queries and keys between their projection and ``scaled_dot_product_attention``, so no
module boundary holds the tensors the softmax really sees).

Within a ``recompute`` session (:meth:`~vitlens.models.base.Adapter.session`) a :class:`FusedAttentionCalls` mode
(a ``TorchFunctionMode``: scoped to the session, entered and left with it, nothing patched) watches for
``torch.nn.functional.scaled_dot_product_attention`` while one of the watched attention modules runs. For that call
it records the block's queries and keys as the kernel receives them (after RoPE), the values and the softmax scale.
When :attr:`~vitlens.models.base.Recording.on_probabilities` is set the call returns
:class:`~._probabilities_backward.AttentionInBackward` around the fused kernel's output, so the backward hands the
block's ``A`` and ``A ⊙ ∂y/∂A`` to the consumer (GradSkip) and the forward stores no ``(B, H, T, T)`` tensor. Every
other call passes through unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from ..errors import UnsupportedModelError
from ._probabilities_backward import AttentionInBackward
from .base import Recording

__all__ = ["FusedAttentionCalls", "install"]

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


class FusedAttentionCalls(TorchFunctionMode):
    """The fused attention calls of the watched blocks, recorded (and rerouted) into ``rec`` (see the module)."""

    def __init__(self, rec: Recording) -> None:
        super().__init__()
        self.rec = rec
        self.block: int | None = None  # the watched attention module that is running, if any

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention or self.block is None:
            return func(*args, **kwargs)
        return self._attention(func, self.block, dict(zip(_SDPA_ARGS, args)) | kwargs)

    def _attention(self, func: Any, i: int, call: dict[str, Any]) -> Tensor:
        q, k, v = call["query"], call["key"], call["value"]
        if call.get("attn_mask") is not None or call.get("is_causal") or call.get("dropout_p") \
                or call.get("enable_gqa") or q.ndim != 4 or q.shape != k.shape or q.shape != v.shape:
            raise UnsupportedModelError(
                f"block {i}: its fused attention is called with a mask, causal masking, dropout or grouped queries "
                "(or q, k, v of different shapes); vitlens recomputes plain softmax(q·kᵀ·scale) probabilities: "
                "switch the model's fused attention off (timm: the attention modules' fused_attn = False)")
        scale = call.get("scale")
        scale = float(q.shape[-1] ** -0.5) if scale is None else float(scale)
        blk = self.rec.blocks[i]
        blk.query, blk.key, blk.value, blk.scale = q.detach(), k.detach(), v.detach(), scale
        sink = self.rec.on_probabilities
        if sink is None or not torch.is_grad_enabled():
            return func(q, k, v, scale=call.get("scale"))
        with torch.no_grad():
            out = func(q.detach(), k.detach(), v.detach(), scale=call.get("scale"))
        blk.probabilities_in_backward = True
        return AttentionInBackward.apply(out, q, k, v, scale, i, sink)


class _Left:
    """A hook-like handle (``remove()``) that leaves the mode: the session removes its hooks in ``finally``."""

    def __init__(self, mode: FusedAttentionCalls) -> None:
        self.mode: FusedAttentionCalls | None = mode

    def remove(self) -> None:
        if self.mode is not None:
            mode, self.mode = self.mode, None
            mode.__exit__(None, None, None)


def install(rec: Recording, attentions: list[nn.Module], outputs: list[nn.Module], hooks: list) -> None:
    """Watch ``attentions[i]``'s fused attention call (block ``i``) and record the input of ``outputs[i]`` (the
    attention output ``(B, T, H·d)`` before the output projection) as ``rec.blocks[i].out``; appends the hooks and
    the mode's handle to ``hooks`` (the session removes them, also after an exception)."""
    mode = FusedAttentionCalls(rec)

    def enter(module: nn.Module, args: tuple, i: int) -> None:
        mode.block = i

    def leave(module: nn.Module, args: tuple, out: Any) -> None:
        mode.block = None

    def output(module: nn.Module, args: tuple, i: int) -> None:
        rec.blocks[i].out = args[0]

    for i, (attn, out) in enumerate(zip(attentions, outputs)):
        hooks.append(attn.register_forward_pre_hook(lambda m, a, i=i: enter(m, a, i)))
        hooks.append(attn.register_forward_hook(leave))
        hooks.append(out.register_forward_pre_hook(lambda m, a, i=i: output(m, a, i)))
    mode.__enter__()
    hooks.append(_Left(mode))
