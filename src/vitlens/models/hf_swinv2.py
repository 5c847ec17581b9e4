"""Adapter for HuggingFace's Swin Transformer V2 (``Swinv2ForImageClassification``): the HF Swin layout of
:mod:`.hf_swin` (tokens ``(B, H·W, C)`` with the grid alongside, padding before the cyclic shift, patch merging at
the end of a stage, ``layernorm`` → average pool → ``classifier``), with V2's block: scaled-cosine attention with a
log-spaced continuous position bias (both before the softmax, so the probabilities the block mixes values with are
what is recorded) and residual post-norm (``h = u + layernorm_before(attention(u))``, read at the MLP's input
``intermediate``). transformers keeps V2 in its 4.x layer layout (``attention.self.query/key/value``): the
probabilities are returned only when the forward is asked for them, which the adapter does while it captures.

Windows and shifts are fixed when the model is built (from ``image_size``): at other input sizes the layers pad to a
multiple of their window and keep it, so any multiple of the patch size runs. Propagation:
``docs/methods/gradskip_swin.md`` (section "Swin V2").
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from torch import Tensor, nn

from ..errors import InputError, UnsupportedModelError
from .base import Adapter, int_pair, logits_of
from .hf_swin import HFSwinAdapter

__all__ = ["HFSwinV2Adapter"]


class HFSwinV2Adapter(HFSwinAdapter):
    """HuggingFace ``Swinv2ForImageClassification``: GradSkip, rollout and GAE through windows and merges,
    Grad-CAM/Finer-CAM on the last stage, as for HF Swin."""

    family = "hf-swinv2"
    _backbone_name = "swinv2"
    _merging = "Swinv2PatchMerging"

    @staticmethod
    def matches(model: nn.Module) -> bool:
        return (type(model).__name__ == "Swinv2ForImageClassification"
                and type(model).__module__.startswith("transformers.") and hasattr(model, "config"))

    def __init__(self, model: nn.Module) -> None:
        self._capturing = False
        super().__init__(model)

    def _check_block(self, s: int, j: int, blk: Any) -> None:
        att = getattr(getattr(blk, "attention", None), "self", None)
        if not (isinstance(getattr(att, "value", None), nn.Linear) and hasattr(att, "logit_scale")
                and hasattr(att, "continuous_position_bias_mlp") and isinstance(getattr(blk, "intermediate", None),
                                                                                nn.Module)
                and hasattr(blk, "shift_size") and hasattr(blk, "window_size")):
            raise UnsupportedModelError(
                f"HF Swinv2 stage {s} block {j} ({type(blk).__name__}) is not a Swinv2Layer with scaled-cosine "
                "Swinv2SelfAttention (query/key/value, logit_scale, continuous_position_bias_mlp)")

    def _h_site(self, blk: Any) -> nn.Module:
        return blk.intermediate  # post-norm: the MLP reads h itself (layernorm_after normalises the MLP's output)

    def _value_of(self, blk: Any) -> tuple[nn.Module, int, int]:
        att = blk.attention.self
        return att.value, int(att.num_attention_heads), int(att.attention_head_size)

    def check_input(self, x: Tensor) -> None:
        Adapter.check_input(self, x)  # windows are fixed at build time: no window to shrink, any padded grid runs
        h, w = int_pair(x.shape[-2:])
        ph, pw = self.patch_size
        if h % ph or w % pw:
            raise InputError(f"input size {h}x{w} is not a multiple of the patch size {ph}x{pw}")

    def _forward(self, x: Tensor) -> Tensor:
        kwargs: dict[str, Any] = {"output_attentions": True} if self._capturing else {}
        if tuple(x.shape[-2:]) != self.default_size and self.model.config.use_absolute_embeddings:
            kwargs["interpolate_pos_encoding"] = True
        return logits_of(self.model(pixel_values=x, **kwargs))

    @contextlib.contextmanager
    def _explicit_attention(self) -> Iterator[None]:
        with super()._explicit_attention():
            self._capturing = True
            try:
                yield
            finally:
                self._capturing = False
