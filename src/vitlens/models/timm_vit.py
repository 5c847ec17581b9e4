"""Adapter for timm's ``VisionTransformer`` family (ViT, DeiT incl. distilled, register tokens, pooled readouts)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

from torch import Tensor, nn

from ..errors import InputError, UnsupportedModelError
from .capabilities import (ATTENTION, ATTENTION_MASK, BLOCK_IO, CLASS_LOGITS, FEATURE_MAPS, FEATURES, LINEAR_HEAD,
                           LRP_LINEARS, LRP_VARIANT_LINEARS, STREAM_HEAD, TOKEN_GRID, TOKEN_SEQUENCE, TOKENS)
from ._timm_block_variants import block_linears, variant_of
from ._probabilities_backward import ProbabilitiesInBackward
from ._readout import readout_only
from .base import Adapter, BlockRecord, LRPLinears, Recording, int_pair, normalisation_layers, switched

__all__ = ["TimmViTAdapter", "stem_channels"]


def _is_timm_vit(model: nn.Module) -> bool:
    try:
        from timm.models.vision_transformer import VisionTransformer
    except ImportError:  # pragma: no cover - timm is an optional extra
        return False
    return isinstance(model, VisionTransformer)


def stem_channels(patch_embed: nn.Module) -> int:
    """Input channels of a timm patch embedding: its projection's, or for a hybrid embedding (a CNN stem such as
    the ResNet of ``vit_*_r*`` or ViTamin's conv stages, then the projection) the stem's first convolution's. The
    stem is part of the embedding: everything before the first block is."""
    convs = [m for m in patch_embed.modules() if isinstance(m, nn.Conv2d)]
    if not convs:
        raise UnsupportedModelError(f"{type(patch_embed).__name__} has no convolution to read the input channels from")
    return int(convs[0].in_channels)


class TimmViTAdapter(Adapter):
    """timm ``VisionTransformer`` and subclasses whose blocks are pre-norm ``Block``s with standard ``Attention``.

    Readout: ``global_pool='token'`` reads the CLS token; the distilled DeiT reads CLS and DIST; every other pooling
    (``avg``, ``max``, ``avgmax``, ``map``) is treated as a pooled readout over tokens.
    """

    #: the wrapped model; typed ``Any`` because the family's submodules and config are reached by attribute
    #: (``nn.Module.__getattr__`` types them loosely), after :meth:`matches` and ``__init__`` checked the layout
    model: Any
    patch_size: tuple[int, int]  # set in __init__ from the patch embedding: never None for this family

    family = "timm-vit"
    capabilities = frozenset({CLASS_LOGITS, ATTENTION, BLOCK_IO, TOKEN_SEQUENCE, LRP_LINEARS, LRP_VARIANT_LINEARS,
                              LINEAR_HEAD, STREAM_HEAD, TOKENS, ATTENTION_MASK, FEATURES, FEATURE_MAPS, TOKEN_GRID})

    @staticmethod
    def matches(model: nn.Module) -> bool:
        return _is_timm_vit(model)

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self._check_blocks()
        self.num_prefix_tokens = int(getattr(model, "num_prefix_tokens", 1))
        self.num_classes = int(self.model.num_classes)
        if getattr(model, "head_dist", None) is not None:  # VisionTransformerDistilled
            self.readout_tokens = (0, 1)
        elif getattr(model, "global_pool", "token") == "token" and getattr(model, "cls_token", None) is not None:
            self.readout_tokens = (0,)
        else:
            self.readout_tokens = None
        pe = self.model.patch_embed
        self.patch_size = tuple(pe.patch_size)
        self.dynamic = bool(getattr(pe, "dynamic_img_size", False) or getattr(model, "dynamic_img_size", False))
        self.default_size = tuple(pe.img_size) if pe.img_size is not None else None
        self.in_chans = stem_channels(pe)
        grid = getattr(pe, "grid_size", None)
        if self.default_size is not None and grid is not None and all(int(g) > 0 for g in grid):
            # pixels per token (a hybrid stem's stride times its projection's patch size)
            self.patch_size = (self.default_size[0] // int(grid[0]), self.default_size[1] // int(grid[1]))
        self.any_size = self.dynamic or self.default_size is None
        self._declare_lrp()
        pool = getattr(model, "global_pool", "token")
        if pool not in ("token", "avg") or isinstance(getattr(model, "attn_pool", None), nn.Module):
            self.capabilities = self.capabilities - {ATTENTION_MASK}
            self.capability_notes = {**self.capability_notes, ATTENTION_MASK: f"the readout global_pool={pool!r} is "
                                     "not restricted to the visible tokens here (only 'token' and 'avg' are)"}
        if isinstance(getattr(model, "attn_pool", None), nn.Module):  # global_pool='map' (SigLIP, so150m)
            self._declare_attention_pool()

    def _declare_attention_pool(self) -> None:
        """An attention-pool head (``global_pool='map'``: a learned query attends over the tokens, then an MLP) is
        read by the model's forward like any other layer, but it is no linear map on the final readout tokens, and no
        LRP rule here goes through its attention and MLP: the LRP capabilities and the linear head are not claimed
        (what the gradient methods and the attention of the blocks give still holds)."""
        why = ("the attention-pool head (global_pool='map') reads the tokens through its own attention and MLP, which "
               "no LRP rule here propagates through")
        self.capabilities = self.capabilities - {LRP_LINEARS, LRP_VARIANT_LINEARS, LINEAR_HEAD}
        self.capability_notes = {**self.capability_notes, LRP_LINEARS: why, LRP_VARIANT_LINEARS: why,
                                 LINEAR_HEAD: "the classifier reads an attention pool's output (global_pool='map'), "
                                              "not the final readout tokens"}

    def _check_blocks(self) -> None:
        """Raise :class:`UnsupportedModelError` unless every block is one this adapter reads."""
        from timm.layers import Attention
        from timm.models.vision_transformer import Block

        for i, blk in enumerate(self.model.blocks):
            if not isinstance(blk, Block) or type(blk.attn) is not Attention:
                raise UnsupportedModelError(
                    f"timm model block {i} is {type(blk).__name__} with {type(getattr(blk, 'attn', None)).__name__}; "
                    "vitlens supports pre-norm timm Blocks with the standard Attention module, ParallelScalingBlock "
                    "and (without attention) DiffAttention and ParallelThingsBlock blocks "
                    "(see docs/architecture.md to add a block family)"
                )

    def _declare_lrp(self) -> None:
        """Which LRP capability the blocks allow: the plain ViT block both; q/k norms, scale norms and gated MLPs
        only the variant one (the gradient × input rules); anything else neither, with the reason."""
        try:
            declared = self.lrp_linears()
        except UnsupportedModelError as e:
            why = (f"{e}; LRP rules are written for pre-norm blocks with qkv, proj and a two-layer (or gated) MLP as "
                   "nn.Linear calls")
            self.capabilities = self.capabilities - {LRP_LINEARS, LRP_VARIANT_LINEARS}
            self.capability_notes = {**self.capability_notes, LRP_LINEARS: why, LRP_VARIANT_LINEARS: why}
            return
        variants = [v for v in (variant_of(lin, i) for i, lin in enumerate(declared)) if v is not None]
        if variants:
            self.capabilities = self.capabilities - {LRP_LINEARS}
            self.capability_notes = {**self.capability_notes, LRP_LINEARS: (
                f"{variants[0]}: not the plain ViT block (declared as 'lrp_variant_linears', the LRP rules for q/k "
                "norms, scale norms and gated MLPs)")}

    def blocks(self) -> Sequence[nn.Module]:
        return list(self.model.blocks)

    def stream_logits(self, tokens: Tensor) -> Tensor:
        """``forward_head(norm(tokens))``: the model's final norm, then its own readout (CLS, CLS + DIST averaged,
        token mean, attention pool) with ``fc_norm`` and head, as ``forward_features`` ends and ``forward`` goes on."""
        return self.model.forward_head(self.model.norm(tokens))

    def layernorms(self) -> list[nn.Module]:
        """The normalisations after the embedding (a hybrid stem's own norms, e.g. channel-first ``LayerNorm2d``,
        run before the first block's leaf: no relevance passes through them)."""
        stem = set(self.model.patch_embed.modules())
        return [m for m in normalisation_layers(self.model) if m not in stem]

    def lrp_linears(self) -> list[LRPLinears]:
        return [block_linears(blk, i) for i, blk in enumerate(self.blocks())]

    def grid(self, input_hw: tuple[int, int]) -> tuple[int, int]:
        pe = self.model.patch_embed
        if self.dynamic:
            return int_pair(pe.dynamic_feat_size(tuple(input_hw)))
        return int_pair(pe.grid_size)

    def check_input(self, x: Tensor) -> None:
        if x.shape[1] != self.in_chans:
            raise InputError(f"model expects {self.in_chans} input channels; got a batch with {x.shape[1]}")
        hw = tuple(x.shape[-2:])
        if not self.dynamic and self.default_size is not None and hw != self.default_size:
            raise InputError(
                f"model expects {self.default_size[0]}x{self.default_size[1]} inputs; got {hw[0]}x{hw[1]} "
                "(create it with dynamic_img_size=True to explain other sizes)"
            )
        ph, pw = self.patch_size
        if self.dynamic and not getattr(self.model.patch_embed, "dynamic_img_pad", False):
            if hw[0] % ph or hw[1] % pw:
                raise InputError(f"input size {hw[0]}x{hw[1]} is not a multiple of the patch size {ph}x{pw}")

    @contextlib.contextmanager
    def readout_only(self, all_queries: bool = True) -> Iterator[bool]:
        with readout_only(self, all_queries=all_queries) as active:
            yield active

    def _embedding_module(self) -> nn.Module:
        return self.model.patch_drop  # applied right after the position embeddings

    @contextlib.contextmanager
    def _explicit_attention(self) -> Iterator[None]:
        with switched([blk.attn for blk in self.model.blocks], "fused_attn", False):
            yield

    def recomputes_attention(self) -> bool:
        """Every block runs timm's fused ``scaled_dot_product_attention`` (``fused_attn``, the default)."""
        return all(bool(blk.attn.fused_attn) for blk in self.model.blocks)

    def _install_capture(self, rec: Recording, hooks: list) -> None:
        blocks = list(self.model.blocks)
        rec.blocks.extend(BlockRecord() for _ in blocks)
        for i, blk in enumerate(blocks):
            hooks.append(blk.register_forward_pre_hook(self._leaf_first_block_hook(rec, i), with_kwargs=True))
            hooks.append(blk.norm2.register_forward_pre_hook(self._record_h_hook(rec, i)))
            if rec.recompute:
                _install_fused_capture(rec, i, blk.attn, hooks)
                continue

            def attn_hook(module, args, output, i=i):
                rec.blocks[i].attn = output

            def qkv_hook(module, args, output, i=i, attn=blk.attn):
                b, n, _ = output.shape
                v = output.detach().reshape(b, n, 3, attn.num_heads, attn.head_dim)[:, :, 2]
                rec.blocks[i].value = v.permute(0, 2, 1, 3)

            hooks.append(blk.attn.attn_drop.register_forward_hook(attn_hook))
            hooks.append(blk.attn.qkv.register_forward_hook(qkv_hook))

        def final_hook(module, args, output):
            rec.final = output

        hooks.append(blocks[-1].register_forward_hook(final_hook))


def _plain_qk(attn: Any) -> bool:
    """Queries and keys enter the attention as the ``qkv`` projection gives them (no ``q_norm``/``k_norm``)."""
    return isinstance(attn.q_norm, nn.Identity) and isinstance(attn.k_norm, nn.Identity)


def _install_fused_capture(rec: Recording, i: int, attn: Any, hooks: list) -> None:
    """Record block ``i``'s queries and keys (after ``q_norm``/``k_norm``, as they enter the fused attention),
    values, the softmax scale and the attention output (the input of ``attn.norm``, before the output projection).

    The queries, keys and values are detached views of the ``qkv`` output, which the fused attention saves for its
    backward anyway: holding them until the block's backward costs no memory.
    """
    rec.blocks[i].scale = float(attn.scale)

    def query_hook(module, args, output):
        rec.blocks[i].query = output.detach()

    def key_hook(module, args, output):
        rec.blocks[i].key = output.detach()

    live: dict[str, Any] = {}

    def masked_hook(module, args, kwargs):  # an attention mask: the probabilities are not recomputed in backward
        live["masked"] = kwargs.get("attn_mask") is not None or bool(kwargs.get("is_causal", False)) or len(args) > 1

    def value_hook(module, args, output):
        b, n, _ = output.shape
        v = output.detach().reshape(b, n, 3, attn.num_heads, attn.head_dim)[:, :, 2]
        rec.blocks[i].value = v.permute(0, 2, 1, 3)
        if rec.on_probabilities is not None and not module.training:
            live["qkv"] = output

    def out_hook(module, args):
        o, qkv, masked = args[0], live.pop("qkv", None), live.pop("masked", False)
        sink = rec.on_probabilities
        if sink is not None and qkv is not None and not masked and _plain_qk(attn) and o.dim() == 3 \
                and o.shape[0] == qkv.shape[0] and o.shape[1] <= qkv.shape[1] and 3 * o.shape[2] == qkv.shape[2]:
            o = ProbabilitiesInBackward.apply(o.detach(), qkv, int(attn.num_heads), float(attn.scale), i, sink)
            rec.blocks[i].probabilities_in_backward = True
            rec.blocks[i].out = o
            return (o, *args[1:])
        rec.blocks[i].out = o
        return None

    hooks.append(attn.register_forward_pre_hook(masked_hook, with_kwargs=True))
    hooks.append(attn.q_norm.register_forward_hook(query_hook))
    hooks.append(attn.k_norm.register_forward_hook(key_hook))
    hooks.append(attn.qkv.register_forward_hook(value_hook))
    hooks.append(attn.norm.register_forward_pre_hook(out_hook))
