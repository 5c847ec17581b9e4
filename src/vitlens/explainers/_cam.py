"""What the class-activation methods share (:mod:`.gradcam`, :mod:`.finercam`, :mod:`.attn_gradcam`): the feature
layer a capture session records, Grad-CAM on token features, and the base class that picks one layer by the ``layer``
option. Package-internal.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ..errors import InputError
from ..models import Adapter
from ..options import integer
from .base import Explainer

__all__ = ["OneLayerCAM", "features_at", "token_gradcam"]


def features_at(rec: Any, i: int) -> Tensor:
    """Feature layer ``i`` of a capture session, ``(B, T, D)``: ``rec.features[i]`` where the family records
    features of its own (SegFormer: the decode head's fused feature map), else the residual input of block ``i``
    (ViTs; a CNN records its one feature map as block 0)."""
    own = getattr(rec, "features", None)
    return own[i] if own is not None else rec.blocks[i].u


def token_gradcam(u: Tensor, grad: Tensor, num_prefix: int) -> Tensor:
    """Grad-CAM on token features: ``ReLU(Σ_k w_k · u[:, p:, k])`` with ``w_k = mean over patch tokens of ∂y/∂u_k``.

    ``u``, ``grad``: ``(B, T, D)``; returns ``(B, N)`` for the ``N = T − p`` patch tokens.
    """
    feats, g = u[:, num_prefix:], grad[:, num_prefix:]
    weights = g.mean(dim=1, keepdim=True)  # (B, 1, D): gradient averaged over patch tokens
    return (feats * weights).sum(dim=-1).clamp_min(0)


class OneLayerCAM(Explainer):
    """The machinery of the class-activation methods: one feature layer, chosen by the ``layer`` option (an int block
    index, negative counting from the end), on the model's token grid."""

    level = "token"
    #: checked against the model's layers when it arrives (:meth:`layer_index`)
    option_specs = {"layer": integer(unit="a block index, negative counts from the end")}

    def layer_index(self, adapter: Adapter) -> int:
        """The ``layer`` option as a non-negative index into ``adapter.feature_layers()`` (checked against it)."""
        layer, n = self.options["layer"], len(adapter.feature_layers())
        if not -n <= layer < n:
            own = type(adapter).feature_layers is not Adapter.feature_layers  # CNN, SegFormer: not the blocks
            kind = "feature layers" if own else "blocks"
            raise InputError(f"layer {layer} is out of range for a model with {n} {kind} (valid: {-n}..{n - 1})")
        return layer % n
