"""Adapter for timm ``CoaT`` (``coat_lite_*``: serial blocks only; ``coat_tiny/mini/small``: serial, then parallel
blocks): one token layer for class-activation maps; its attention is not propagated, and the capability notes say
why.

A CoaT stage embeds its tokens with a patch-embedding convolution, prepends a class token, and runs *serial
blocks*: a convolutional position encoding (``ConvPosEnc``: a 3×3 depthwise convolution on the token grid, with a
skip), then *factorized* attention (``FactorAttnConvRelPosEnc``: the softmax is taken over the keys' token axis, on
its own, and ``softmax(K)ᵀ·V`` is multiplied by the queries — there is no token-by-token attention matrix) plus a
convolutional relative position encoding (depthwise convolutions of the values, multiplied by the queries), then an
MLP. The full CoaT models add *parallel blocks* that run scales 2–4 side by side and exchange features between them
(bilinear up- and down-sampling), and the head aggregates the class tokens of those three scales with a 1-d
convolution. vitlens' relevance rules need attention probabilities between tokens; there are none here, so no
attention is recorded.

Grad-CAM's layer: the tokens every path to the prediction passes through, ``(B, 1 + h·w, C)`` with the class token
first (left out of the map). CoaT-Lite: the input of the last serial block of stage 4, whose factorized attention
mixes the patch tokens into the class token the head reads (the final norm's input would give the patch tokens no
gradient under the class-token readout). CoaT: the output of stage 2's serial blocks (the stride-8 grid), because the
head reads three scales after parallel blocks that exchange features between them and scales 3 and 4 are made from
scale 2; no later single tensor carries the prediction. Input sizes: the patch embeddings accept ``img_size`` only
(the model's own check); another size is tried once and refused with the model's words.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..errors import UnsupportedModelError
from ._feature_layer import FeatureLayerAdapter
from ._stages import stage_grids
from .base import int_pair

__all__ = ["TimmCoaTAdapter"]

_FACTORIZED = ("CoaT's serial blocks use factorized attention (a softmax over the keys' token axis alone, "
               "softmax(K)ᵀV multiplied by the queries: no token-by-token attention matrix) with a convolutional "
               "relative position encoding and a depthwise-convolution position encoding before every block")
_PARALLEL = (", and its parallel blocks run scales 2-4 side by side, exchanging features between them by up- and "
             "down-sampling, before a head that aggregates three class tokens")
_END = "; vitlens' relevance rules need attention probabilities between tokens, so no attention is recorded"


class TimmCoaTAdapter(FeatureLayerAdapter):
    """timm ``CoaT`` (CoaT, CoaT-Lite): class logits and one feature layer of tokens (module docstring)."""

    family = "timm-coat"
    layout = "tokens"

    @staticmethod
    def matches(model: nn.Module) -> bool:
        return (type(model).__name__ == "CoaT" and type(model).__module__.startswith("timm.")
                and all(hasattr(model, f"serial_blocks{i}") for i in (1, 2, 3, 4)))

    def __init__(self, model: nn.Module) -> None:
        m: nn.Module = model
        if getattr(m, "return_interm_layers", False):
            raise UnsupportedModelError("return_interm_layers=True: the model outputs its features, not class logits")
        self.parallel = getattr(m, "parallel_blocks", None) is not None
        why = _FACTORIZED + (_PARALLEL if self.parallel else "") + _END
        embeds: list[Any] = [getattr(m, f"patch_embed{i}", None) for i in (1, 2, 3, 4)]
        if any(e is None for e in embeds):
            raise UnsupportedModelError("CoaT with pruned stages (a patch embedding is None)")
        super().__init__(model, why, "its position-encoding convolutions need the full token grid: tokens cannot be "
                                     "dropped", int_pair(tuple(getattr(embeds[0], "img_size"))))
        self.num_prefix_tokens = 1
        self.any_size = False  # the patch embedding checks img_size
        self.readout_tokens = (0,) if getattr(m, "global_pool", "token") == "token" else None
        stages = 2 if self.parallel else 4
        self.embeds = [e.proj for e in embeds[:stages]]
        self.on_output = self.parallel
        self._layer = getattr(m, f"serial_blocks{stages}")[-1]

    def feature_module(self) -> nn.Module:
        """CoaT-Lite: the last serial block of stage 4 (its input); CoaT: the last serial block of stage 2 (its
        output)."""
        return self._layer

    def token_grid(self, input_hw: tuple[int, int]) -> tuple[int, int]:
        """The feature layer's grid: the patch embeddings' convolutions up to its stage, applied in turn."""
        return stage_grids(self.embeds, input_hw)[-1]
