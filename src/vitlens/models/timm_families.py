"""Adapters for timm's single-sequence ViT families beyond ``VisionTransformer``: ``Eva`` (EVA, EVA02, DINOv3, PE:
RoPE, SwiGLU, sub-LN, gated attention), ``Beit`` (relative position bias inside the softmax) and
``VisionTransformerRelPos``. They share the capture in :mod:`._sequence`; timm's explicit attention path is switched on
through each attention module's ``fused_attn`` flag for the duration of a session (restored in ``finally``).

Families vitlens does not propagate through (``XCiT``, ``LeViT``, ``PiT``, ``ConViT``) are listed in
:data:`REFUSED` with the reason; they get the generic adapter, and methods that need attention say why and name the
methods that work.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from torch import Tensor, nn

from ..errors import UnsupportedModelError
from ._sequence import BlockParts, SequenceAdapter, not_plain, value_weights
from .capabilities import LRP_LINEARS, TOKENS
from ._fused_calls import install
from .base import Adapter, Recording, int_pair

__all__ = ["TimmEvaAdapter", "TimmBeitAdapter", "TimmRelPosAdapter", "REFUSED", "patch_embedding"]

#: timm / HF class name → why relevance propagation is not offered (model-agnostic methods still work).
REFUSED = {
    "Xcit": "cross-covariance attention mixes channels, not tokens",
    "LevitDistilled": "convolutional stages with attention-bias subsampling change the token set between stages",
    "Levit": "convolutional stages with attention-bias subsampling change the token set between stages",
    "PoolingVisionTransformer": "PiT pools tokens with strided convolutions between stages",
    "ConVit": "gated positional self-attention mixes a learned positional attention into the softmax per head",
}


def _timm_class(module_name: str, class_name: str) -> type | None:
    try:
        mod = __import__(f"timm.models.{module_name}", fromlist=[class_name])
    except ImportError:  # pragma: no cover - timm is an optional extra
        return None
    return getattr(mod, class_name, None)


def patch_embedding(model: nn.Module) -> Any:
    """The patch embedding of a single-sequence model: the module timm names ``patch_embed`` where it is there, else
    the one submodule laid out like one (a ``patch_size`` and a convolution ``proj``: timm's ``PatchEmbed`` under
    another name, as a new family may call it); :class:`UnsupportedModelError` if there is none or several."""
    named = getattr(model, "patch_embed", None)
    if isinstance(named, nn.Module):
        return named
    found = [(n, m) for n, m in model.named_modules() if m is not model and hasattr(m, "patch_size")
             and isinstance(getattr(m, "proj", None), nn.Conv2d)]
    if len(found) != 1:
        what = "no module" if not found else f"{len(found)} modules ({', '.join(n for n, _ in found[:4])})"
        raise UnsupportedModelError(f"{type(model).__name__}: found {what} laid out as a patch embedding (a "
                                    "patch_size and a convolution 'proj'); a sequence family needs exactly one")
    return found[0][1]


class _TimmSequenceAdapter(SequenceAdapter):
    """Common layout of the timm families here: a patch embedding (:func:`patch_embedding`: ``patch_embed`` or the one
    module laid out as one), ``blocks`` (pre-norm, ``norm1/attn/norm2``), ``num_prefix_tokens``, ``global_pool``."""

    block_types: tuple[str, ...] = ()
    #: ``(module under timm.models, class name)`` of the family's model class (what :meth:`matches` recognises)
    timm_class: tuple[str, str] = ("", "")
    #: whether the model takes only the input size it was built for (relative position bias tables)
    fixed_size: bool = False

    @classmethod
    def matches(cls, model: nn.Module) -> bool:
        family = _timm_class(*cls.timm_class) if cls.timm_class[0] else None
        return family is not None and isinstance(model, family)

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        for i, blk in enumerate(self.model.blocks):
            if type(blk).__name__ not in self.block_types or not hasattr(blk, "norm2"):
                raise UnsupportedModelError(
                    f"{type(model).__name__} block {i} is {type(blk).__name__}; the {self.family} adapter reads "
                    f"pre-norm blocks ({', '.join(self.block_types)})"
                )
            if not hasattr(blk.attn, "fused_attn") or not isinstance(blk.attn.attn_drop, nn.Dropout):
                raise UnsupportedModelError(f"{type(model).__name__} block {i}: no explicit attention path")
            if int(getattr(blk.attn, "num_kv_heads", blk.attn.num_heads)) != int(blk.attn.num_heads):
                raise UnsupportedModelError(f"{type(model).__name__} block {i}: grouped-query attention "
                                            "(fewer key/value heads than query heads) is not supported")
        self.num_prefix_tokens = int(getattr(model, "num_prefix_tokens", 1))
        self.num_classes = int(self.model.num_classes)
        pool = getattr(model, "global_pool", "token")
        self.readout_tokens = (0,) if pool == "token" and getattr(model, "cls_token", None) is not None else None
        pe = self.patch_embed = patch_embedding(model)
        self.patch_size = int_pair(pe.patch_size)
        self.in_chans = int(pe.proj.in_channels)
        self.any_size = not self.fixed_size and (bool(getattr(model, "dynamic_img_size", False)) or pe.img_size is None)
        self.default_size = None if pe.img_size is None else int_pair(pe.img_size)
        self._parts = [BlockParts(block=blk, attention=blk.attn, probs_at=blk.attn.attn_drop, probs_index=None,
                                  norm2=blk.norm2, value=value_weights(blk.attn), heads=int(blk.attn.num_heads))
                       for blk in self.model.blocks]

    def parts(self) -> list[BlockParts]:
        return self._parts

    def grid(self, input_hw: tuple[int, int]) -> tuple[int, int]:
        pe = self.patch_embed
        if self.any_size and hasattr(pe, "dynamic_feat_size"):  # dynamic size (padding included)
            return int_pair(pe.dynamic_feat_size(tuple(input_hw)))
        return super().grid(input_hw)

    def check_input(self, x: Tensor) -> None:
        if self.any_size and getattr(self.patch_embed, "dynamic_img_pad", False):
            Adapter.check_input(self, x)  # channels only: any size is padded to the patch grid
            return
        super().check_input(x)

    @contextlib.contextmanager
    def _explicit_attention(self) -> Iterator[None]:
        with self._flags([blk.attn for blk in self.model.blocks], "fused_attn", False):
            yield


class TimmEvaAdapter(_TimmSequenceAdapter):
    """timm ``Eva`` (EVA, EVA02, DINOv3, PE): RoPE on queries/keys, SwiGLU MLPs, optional sub-LN and attention gate;
    the attention probabilities are read after RoPE and the softmax. No token dropping (RoPE is tied to positions)."""

    family = "timm-eva"
    block_types = ("EvaBlock",)
    capability_notes = {TOKENS: "RoPE is tied to the token grid, so tokens cannot be dropped",
                        LRP_LINEARS: not_plain("RoPE rotates queries and keys between their projection and "
                                               "q·kᵀ (no LRP rule through the rotation here), and q/v biases are "
                                               "added through F.linear")}
    timm_class = ("eva", "Eva")
    fused_call_records_values = True

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        for p in self._parts:  # fused qkv: the values are read from its output where q_norm receives q (a view)
            q_norm = getattr(p.attention, "q_norm", None)
            if isinstance(getattr(p.attention, "qkv", None), nn.Linear) and isinstance(q_norm, nn.Module):
                p.qkv_view_at = q_norm

    def recomputes_attention(self) -> bool:
        """Every block runs timm's fused attention (``fused_attn``, the default) and has the ``norm`` whose input
        is the attention output: a ``recompute`` session keeps it and records what enters the kernel
        (:mod:`._fused_calls`; GradSkip's probabilities then come from the attention's own backward)."""
        return all(bool(p.attention.fused_attn) and isinstance(getattr(p.attention, "norm", None), nn.Module)
                   for p in self._parts)

    def _install_capture(self, rec: Recording, hooks: list) -> None:
        super()._install_capture(rec, hooks)
        if rec.recompute:
            attentions = [p.attention for p in self._parts]
            install(rec, attentions, [a.get_submodule("norm") for a in attentions], hooks)


class _TimmRelativeBiasAdapter(_TimmSequenceAdapter):
    """What timm's relative-position-bias families share: the bias tables are built for the full token grid, so the
    input size is fixed and tokens cannot be dropped."""

    capability_notes = {TOKENS: "the relative position bias is built for the full token grid"}
    fixed_size = True


class TimmBeitAdapter(_TimmRelativeBiasAdapter):
    """timm ``Beit`` (BEiT, BEiT v2): relative position bias added inside the softmax, per block or shared; the
    probabilities include it. Fixed input size (the bias tables are built for the model's token grid)."""

    family = "timm-beit"
    block_types = ("Block",)
    capability_notes = {**_TimmRelativeBiasAdapter.capability_notes, LRP_LINEARS: not_plain(
        "a relative position bias enters the softmax and q/v biases are added through F.linear")}
    timm_class = ("beit", "Beit")


class TimmRelPosAdapter(_TimmRelativeBiasAdapter):
    """timm ``VisionTransformerRelPos``: relative position bias (or MLP log-coordinate bias) inside the softmax, per
    block or shared. Fixed input size; pre-norm ``RelPosBlock`` only (``ResPostRelPosBlock`` is refused)."""

    family = "timm-vit-relpos"
    block_types = ("RelPosBlock",)
    capability_notes = {**_TimmRelativeBiasAdapter.capability_notes,
                        LRP_LINEARS: not_plain("a relative position bias enters the softmax")}
    timm_class = ("vision_transformer_relpos", "VisionTransformerRelPos")
