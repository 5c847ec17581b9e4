"""Adapter for timm's CaiT (``Cait``): self-attention blocks on the patch tokens, then class-attention blocks that
update the CLS token only.

A CaiT runs in two phases. **Self-attention (SA) blocks** ``LayerScaleBlock`` see the ``N`` patch tokens only (no CLS):
``h = u + γ₁ ⊙ TalkingHeadAttn(norm1(u))``, ``out = h + γ₂ ⊙ mlp(norm2(h))``. Talking-heads attention mixes the heads
twice: ``S = proj_l(q·kᵀ·scale)`` (a linear map over heads, before the softmax), ``P = softmax(S)``, and
``A' = proj_w(P)`` (another linear map over heads, after it): ``A'`` is the tensor that multiplies the values
(``out = A' @ v``); its rows need not sum to 1 and may be negative. **Class-attention (CA) blocks**
``LayerScaleBlockClassAttn`` take the patch tokens ``x`` (the SA stage's output, unchanged by every CA block) and the CLS
stream ``c`` (the learned ``cls_token`` at the first one): ``h = c + γ₁ ⊙ ClassAttn(norm1([c, x]))`` with the query from
CLS only, so the attention is one row ``(B, H, 1, 1 + N)`` over ``[CLS, patches]`` (a softmax: probabilities);
``c' = h + γ₂ ⊙ mlp(norm2(h))``. The final norm and the head read ``[c, x]``: token 0 (``global_pool='token'``) or
the patch mean (``'avg'``).

What a session records (:class:`CaitRecording`, the block order of :meth:`TimmCaitAdapter.blocks`): first one
:class:`~.base.BlockRecord` per SA block (``attn`` = ``A'`` ``(B, H, N, N)``, read at ``attn_drop``, part of the graph;
``value`` ``(B, H, N, d)`` detached; ``u``, ``h`` ``(B, N, D)``), then one per CA block (``attn`` ``(B, H, 1, 1 + N)``
read at ``attn_drop`` on the explicit path; ``value`` ``(B, H, 1 + N, d)``; ``u`` the CLS stream entering the block,
``h`` the CLS stream after the attention residual, both ``(B, 1, D)``); ``final``: ``[CLS, patches]`` ``(B, 1 + N, D)``
before the final norm. How GradSkip, rollout and GAE go through both phases: ``docs/methods/gradskip_cait.md``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from torch import Tensor, nn

from ..errors import InputError, UnsupportedModelError
from .base import Adapter, BlockRecord, Recording, int_pair, switched
from .capabilities import (ATTENTION, BLOCK_IO, CLASS_ATTENTION, CLASS_LOGITS, FEATURE_MAPS, FEATURES, LRP_LINEARS,
                           TOKEN_GRID, TOKEN_SEQUENCE, TOKENS)

__all__ = ["TimmCaitAdapter", "CaitRecording", "CAIT_CAPABILITY_NOTES"]

_LRP = ("talking-heads attention mixes the heads linearly before and after the softmax, and the class-attention "
        "blocks update the CLS token only; LRP rules are written for the plain ViT block (qkv, proj, fc1, fc2 "
        "as nn.Linear calls, softmax(q·kᵀ/√d) per head)")
_SPLIT = "CaiT's self-attention blocks hold the patch tokens only and its class-attention blocks the CLS token only"
#: what CaiT does not offer, and why
CAIT_CAPABILITY_NOTES = {
    LRP_LINEARS: _LRP,
    TOKEN_SEQUENCE: _SPLIT,
    TOKENS: f"{_SPLIT}, so dropping patch tokens does not give one shorter sequence through every block",
    FEATURE_MAPS: f"its timm feature_info names token blocks (B, N, D) without a grid layout; {_SPLIT}",
}


@dataclass
class CaitRecording(Recording):
    """The self-attention blocks' records, then the class-attention blocks' (see the module docstring);
    ``self_attention``: how many of :attr:`blocks` are self-attention blocks."""

    self_attention: int = 0


def _is(module: Any, name: str) -> bool:
    return type(module).__name__ == name and type(module).__module__.startswith("timm.")


class TimmCaitAdapter(Adapter):
    """timm ``Cait`` (CaiT): talking-heads self-attention on the patch tokens, then class-attention blocks on CLS."""

    model: Any  # a timm Cait: its parts are read by attribute after __init__ checked the layout
    family = "timm-cait"
    capabilities = frozenset({CLASS_LOGITS, ATTENTION, BLOCK_IO, CLASS_ATTENTION, FEATURES, TOKEN_GRID})
    capability_notes = CAIT_CAPABILITY_NOTES

    @staticmethod
    def matches(model: nn.Module) -> bool:
        return _is(model, "Cait")

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        m = self.model
        if len(m.blocks) == 0:
            raise UnsupportedModelError("Cait without self-attention blocks (depth=0) is not supported")
        for i, blk in enumerate(m.blocks):
            if not (_is(blk, "LayerScaleBlock") and _is(blk.attn, "TalkingHeadAttn")
                    and isinstance(blk.attn.attn_drop, nn.Dropout) and isinstance(blk.attn.qkv, nn.Linear)):
                raise UnsupportedModelError(f"Cait block {i} is {type(blk).__name__} with "
                                            f"{type(getattr(blk, 'attn', None)).__name__}; the timm-cait adapter reads "
                                            "LayerScaleBlock with TalkingHeadAttn")
        for j, blk in enumerate(m.blocks_token_only or []):
            if not (_is(blk, "LayerScaleBlockClassAttn") and _is(blk.attn, "ClassAttn")
                    and isinstance(blk.attn.attn_drop, nn.Dropout) and isinstance(blk.attn.v, nn.Linear)):
                raise UnsupportedModelError(f"Cait class-attention block {j} is {type(blk).__name__} with "
                                            f"{type(getattr(blk, 'attn', None)).__name__}; the timm-cait adapter reads "
                                            "LayerScaleBlockClassAttn with ClassAttn")
        pool = getattr(m, "global_pool", "token")
        if pool not in ("token", "avg"):
            raise UnsupportedModelError(f"Cait with global_pool={pool!r}: only the 'token' and 'avg' classifiers are "
                                        "supported")
        if pool == "token" and not len(m.blocks_token_only or []):
            raise UnsupportedModelError("Cait with global_pool='token' and no class-attention blocks: the head reads "
                                        "the learned CLS token, which no block updates")
        self.num_prefix_tokens = 1  # the final stream is [CLS, patches]
        self.readout_tokens = (0,) if pool == "token" else None
        self.num_classes = int(m.num_classes)
        pe = m.patch_embed
        self.patch_size = int_pair(pe.patch_size)
        self.in_chans = int(pe.proj.in_channels)
        self.default_size = None if pe.img_size is None else int_pair(pe.img_size)
        self.any_size = False  # the position embedding is a fixed table of the configured grid

    # -- layout ----------------------------------------------------------------------------------------------------
    @property
    def num_self_attention_blocks(self) -> int:
        """How many of :meth:`blocks` are self-attention blocks (the rest are class-attention blocks)."""
        return len(self.model.blocks)

    def blocks(self) -> Sequence[nn.Module]:
        """The self-attention blocks, then the class-attention blocks (forward order)."""
        return list(self.model.blocks) + list(self.model.blocks_token_only or [])

    def feature_layers(self) -> Sequence[nn.Module]:
        """The self-attention blocks (layer ``l``: the patch tokens entering SA block ``l``, no prefix token)."""
        return list(self.model.blocks)

    def feature_prefix_tokens(self) -> int:
        return 0

    def grid(self, input_hw: tuple[int, int]) -> tuple[int, int]:
        return int_pair(self.model.patch_embed.grid_size)

    def check_input(self, x: Tensor) -> None:
        super().check_input(x)
        hw = tuple(x.shape[-2:])
        if self.default_size is not None and hw != tuple(self.default_size):
            raise InputError(f"Cait expects {self.default_size[0]}x{self.default_size[1]} inputs; got {hw[0]}x{hw[1]} "
                             "(its position embedding is a fixed table)")

    # -- capture ---------------------------------------------------------------------------------------------------
    def _new_recording(self) -> CaitRecording:
        return CaitRecording(self_attention=self.num_self_attention_blocks)

    @contextlib.contextmanager
    def _explicit_attention(self) -> Iterator[None]:
        # TalkingHeadAttn has no fused path; ClassAttn has one (fused_attn), switched off for the session
        with switched([blk.attn for blk in self.model.blocks_token_only or []], "fused_attn", False):
            yield

    def _install_capture(self, rec: Recording, hooks: list) -> None:
        blocks: list[Any] = list(self.blocks())  # timm types a block's parts as plain nn.Module attributes
        rec.blocks.extend(BlockRecord() for _ in blocks)
        n_sa = self.num_self_attention_blocks
        for i, blk in enumerate(blocks):
            heads = int(blk.attn.num_heads)
            if i < n_sa:
                hooks.append(blk.register_forward_pre_hook(self._leaf_first_block_hook(rec, i), with_kwargs=True))
                hooks.append(blk.attn.qkv.register_forward_hook(_value_hook(rec, i, heads, 3)))
            else:
                hooks.append(blk.register_forward_pre_hook(_cls_stream_hook(rec, i), with_kwargs=True))
                hooks.append(blk.attn.v.register_forward_hook(_value_hook(rec, i, heads, 1)))
            hooks.append(blk.norm2.register_forward_pre_hook(self._record_h_hook(rec, i)))
            hooks.append(blk.attn.attn_drop.register_forward_hook(_mixing_hook(rec, i)))

        def final_hook(module: nn.Module, args: tuple) -> None:
            rec.final = args[0]

        hooks.append(self.model.norm.register_forward_pre_hook(final_hook))


def _mixing_hook(rec: Recording, index: int) -> Callable:
    """``attn_drop``'s output: the tensor that multiplies the values (SA: ``proj_w(softmax)``; CA: the softmax)."""

    def hook(module: nn.Module, args: tuple, output: Tensor) -> None:
        rec.blocks[index].attn = output

    return hook


def _value_hook(rec: Recording, index: int, heads: int, parts: int) -> Callable:
    """The values ``(B, H, T, d)`` from the output of ``qkv`` (``parts=3``, the last third) or ``v`` (``parts=1``)."""

    def hook(module: nn.Module, args: tuple, output: Tensor) -> None:
        b, n, width = output.shape
        d = width // parts
        v = output.detach()[..., (parts - 1) * d:].reshape(b, n, heads, d // heads)
        rec.blocks[index].value = v.permute(0, 2, 1, 3)

    return hook


def _cls_stream_hook(rec: Recording, index: int) -> Callable:
    """Pre-hook of a class-attention block ``forward(x, x_cls)``: records the CLS stream entering it as ``u``."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        c = args[1] if len(args) > 1 else kwargs["x_cls"]
        rec.blocks[index].u = c

    return hook
