"""Adapters for timm ``VisionTransformer``s built with other block classes (``block_fn=`` / ``attn_layer=``).

- :class:`TimmParallelViTAdapter`: ``ParallelScalingBlock`` (ViT-22B style, separate output projections): attention
  and MLP both read the same normed block input and the residual sum has three terms, ``x = u + a + m``. It records
  the attention as the ``timm-vit`` adapter does, ``h`` = the block output and ``mlp`` = the MLP branch ``m``
  (:class:`~.base.BlockRecord`), so attention methods and GradSkip (whose skip gate then splits the three terms,
  docs/methods/gradskip.md) run on it.
- :class:`TimmBlockFeaturesAdapter`: blocks whose attention the attention methods cannot read — ``DiffAttention``
  (two softmax maps subtracted), ``DiffParallelScalingBlock``, ``ParallelThingsBlock`` (several attention modules
  in parallel, outputs summed). It provides the residual stream, features, token grid and token dropping (Grad-CAM,
  AHA, the perturbation methods), and says why it provides no attention.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from torch import nn

from ..errors import UnsupportedModelError
from .base import BlockRecord, LRPLinears, Recording, switched
from .capabilities import ATTENTION, LRP_LINEARS, LRP_VARIANT_LINEARS
from .timm_vit import TimmViTAdapter

__all__ = ["TimmParallelViTAdapter", "TimmBlockFeaturesAdapter"]

_PARALLEL_LRP = ("attention and MLP read the same block input in parallel (ParallelScalingBlock, one fused input "
                 "projection); the LRP rules are written for the sequential pre-norm block")
_DIFF = ("DiffAttention subtracts two softmax maps (A₁ − λ·A₂): its attention weights are signed and their rows sum "
         "to 1 − λ, not 1, while the attention rules (rollout's and GAE's row-stochastic products, GradSkip's "
         "positive flow and Gini sparsity, the LRP softmax rules) are written for one probability map per head")
_THINGS = ("ParallelThingsBlock runs several attention modules side by side on the same input and sums their outputs; "
           "the attention rules are written for one attention module (one map per head) per block")


def _vit_blocks(model: nn.Module) -> list[nn.Module] | None:
    try:
        from timm.models.vision_transformer import VisionTransformer
    except ImportError:  # pragma: no cover - timm is an optional extra
        return None
    return list(model.blocks) if isinstance(model, VisionTransformer) else None


def _is_parallel_scaling(blk: nn.Module) -> bool:
    from timm.models.vision_transformer import ParallelScalingBlock

    return type(blk) is ParallelScalingBlock


class TimmParallelViTAdapter(TimmViTAdapter):
    """timm ``VisionTransformer`` whose blocks are all ``ParallelScalingBlock`` (separate output projections)."""

    family = "timm-vit-parallel"
    capabilities = TimmViTAdapter.capabilities - {LRP_LINEARS, LRP_VARIANT_LINEARS}
    capability_notes = {**TimmViTAdapter.capability_notes, LRP_LINEARS: _PARALLEL_LRP,
                        LRP_VARIANT_LINEARS: _PARALLEL_LRP}

    @staticmethod
    def matches(model: nn.Module) -> bool:
        blocks = _vit_blocks(model)
        return bool(blocks) and all(_is_parallel_scaling(b) for b in blocks or [])

    def _check_blocks(self) -> None:
        for i, blk in enumerate(self.model.blocks):
            if getattr(blk, "out_proj", None) is not None:
                raise UnsupportedModelError(
                    f"timm model block {i} is a ParallelScalingBlock with one fused output projection "
                    "(fuse_out_proj=True): the attention and MLP contributions to the residual cannot be told apart")

    def _declare_lrp(self) -> None:
        return None  # the class declares neither LRP capability

    def lrp_linears(self) -> list[LRPLinears]:
        raise UnsupportedModelError(_PARALLEL_LRP)

    @contextlib.contextmanager
    def readout_only(self, all_queries: bool = True) -> Iterator[bool]:
        yield False  # the readout fast path is written for the sequential Block

    @contextlib.contextmanager
    def _explicit_attention(self) -> Iterator[None]:
        with switched(list(self.model.blocks), "fused_attn", False):
            yield

    def recomputes_attention(self) -> bool:
        return all(bool(blk.fused_attn) for blk in self.model.blocks)

    def _install_capture(self, rec: Recording, hooks: list) -> None:
        blocks = list(self.model.blocks)
        rec.blocks.extend(BlockRecord() for _ in blocks)
        for i, blk in enumerate(blocks):
            hooks.append(blk.register_forward_pre_hook(self._leaf_first_block_hook(rec, i), with_kwargs=True))
            hooks.extend(_parallel_hooks(rec, i, blk))

        def final_hook(module, args, output):
            rec.final = output

        hooks.append(blocks[-1].register_forward_hook(final_hook))


def _parallel_hooks(rec: Recording, i: int, blk: Any) -> list:
    """Block ``i``'s capture: ``h`` (the block output), ``mlp`` (the MLP branch as added to the residual), the values,
    and either the attention probabilities (explicit path) or the queries, keys, scale and attention output (fused
    path, ``rec.recompute``)."""
    heads, dh = blk.num_heads, blk.head_dim

    def out_hook(module, args, output):
        rec.blocks[i].h = output

    def mlp_hook(module, args, output):
        rec.blocks[i].mlp = blk.drop_path(blk.ls(output)).detach()

    def value_hook(module, args, output):
        b, n, _ = output.shape
        v = output.detach().split(blk.in_split, dim=-1)[3]
        rec.blocks[i].value = v.reshape(b, n, heads, dh).transpose(1, 2)

    hooks = [blk.register_forward_hook(out_hook), blk.mlp_out_proj.register_forward_hook(mlp_hook),
             blk.in_proj.register_forward_hook(value_hook)]
    if not rec.recompute:
        def attn_hook(module, args, output):
            rec.blocks[i].attn = output

        return hooks + [blk.attn_drop.register_forward_hook(attn_hook)]
    rec.blocks[i].scale = float(blk.scale)

    def query_hook(module, args, output):
        rec.blocks[i].query = output.detach().transpose(1, 2)  # (B, N, H, d) → (B, H, N, d)

    def key_hook(module, args, output):
        rec.blocks[i].key = output.detach().transpose(1, 2)

    def ctx_hook(module, args):
        rec.blocks[i].out = args[0]

    return hooks + [blk.q_norm.register_forward_hook(query_hook), blk.k_norm.register_forward_hook(key_hook),
                    blk.attn_out_proj.register_forward_pre_hook(ctx_hook)]


def _no_attention_reason(blocks: list[nn.Module]) -> str | None:
    """Why the attention methods cannot read these blocks (``None``: not blocks of this adapter)."""
    from timm.layers import Attention, DiffAttention
    from timm.models.vision_transformer import Block, DiffParallelScalingBlock, ParallelThingsBlock

    reasons = []
    for blk in blocks:
        if type(blk) is Block and type(blk.attn) is DiffAttention:
            reasons.append(_DIFF)
        elif type(blk) is DiffParallelScalingBlock:
            reasons.append(_DIFF)
        elif type(blk) is ParallelThingsBlock and all(type(a.attn) in (Attention, DiffAttention) for a in blk.attns):
            reasons.append(_THINGS)
        elif not (type(blk) is Block and type(blk.attn) is Attention):
            return None
    return next((r for r in reasons), None)


class TimmBlockFeaturesAdapter(TimmViTAdapter):
    """timm ``VisionTransformer`` with ``DiffAttention`` / ``DiffParallelScalingBlock`` / ``ParallelThingsBlock``
    blocks: the residual stream and features, no attention."""

    family = "timm-vit-blocks"
    capabilities = TimmViTAdapter.capabilities - {ATTENTION, LRP_LINEARS, LRP_VARIANT_LINEARS}

    @staticmethod
    def matches(model: nn.Module) -> bool:
        blocks = _vit_blocks(model)
        return bool(blocks) and _no_attention_reason(blocks or []) is not None

    def _check_blocks(self) -> None:
        why = _no_attention_reason(list(self.model.blocks))
        if why is None:  # pragma: no cover - matches() said otherwise
            raise UnsupportedModelError("the timm model's blocks are not ones this adapter reads")
        note = f"{why}; without attention maps the LRP rules do not apply either"
        self.capability_notes = {**self.capability_notes, ATTENTION: why, LRP_LINEARS: note,
                                 LRP_VARIANT_LINEARS: note}

    def _declare_lrp(self) -> None:
        return None

    def lrp_linears(self) -> list[LRPLinears]:
        raise UnsupportedModelError(self.capability_notes[LRP_LINEARS])

    @contextlib.contextmanager
    def readout_only(self, all_queries: bool = True) -> Iterator[bool]:
        yield False

    @contextlib.contextmanager
    def _explicit_attention(self) -> Iterator[None]:
        yield  # no attention is recorded: the blocks run as the model has them

    def recomputes_attention(self) -> bool:
        return False

    def _install_capture(self, rec: Recording, hooks: list) -> None:
        blocks = list(self.model.blocks)
        rec.blocks.extend(BlockRecord() for _ in blocks)
        for i, blk in enumerate(blocks):
            hooks.append(blk.register_forward_pre_hook(self._leaf_first_block_hook(rec, i), with_kwargs=True))
            norm2 = getattr(blk, "norm2", None)
            if norm2 is None and getattr(blk, "ffns", None) is not None:
                norm2 = blk.ffns[0].norm  # ParallelThingsBlock: the MLPs read the stream after the attentions
            if norm2 is not None:
                hooks.append(norm2.register_forward_pre_hook(self._record_h_hook(rec, i)))

        def final_hook(module, args, output):
            rec.final = output

        hooks.append(blocks[-1].register_forward_hook(final_hook))
