"""The named capabilities an adapter provides and a method needs (a leaf module: it imports nothing of vitlens).

An adapter lists what it provides in :attr:`~vitlens.models.base.Adapter.capabilities` and, for a capability it
lacks, may say why in :attr:`~vitlens.models.base.Adapter.capability_notes`. A method lists what it needs in
``Explainer.needs`` (an entry that is a tuple of names needs any one of them). Whether a method runs on a model is
computed from the two in one place, :mod:`vitlens.explainers.support`; no method name appears under ``models/``.
"""

from __future__ import annotations

__all__ = ["ATTENTION", "BLOCK_IO", "TOKEN_SEQUENCE", "WINDOWS", "CLASS_ATTENTION", "STAGES", "LRP_LINEARS",
           "LRP_VARIANT_LINEARS", "MASK_UNITS", "POOLING_ATTENTION", "PARTITION_ATTENTION", "STREAM_HEAD",
           "LINEAR_HEAD", "TOKENS", "ATTENTION_MASK", "FEATURES", "FEATURE_MAPS", "TOKEN_GRID", "CLASS_LOGITS",
           "PIXEL_LOGITS", "DESCRIPTIONS", "describe_need"]

#: per-block attention probabilities, part of the autograd graph (explicit attention; ``Recording.blocks[i].attn``)
ATTENTION = "attention"
#: per-block residual stream: block input ``u``, after the attention residual ``h``, and ``final``
BLOCK_IO = "block_io"
#: every block works on one token sequence (prefix tokens, then the patch tokens) with attention over all of it
TOKEN_SEQUENCE = "token_sequence"
#: attention inside (shifted) windows of the token grid, with patch merging between stages (Swin)
WINDOWS = "windows"
#: self-attention blocks on the patch tokens, then class-attention blocks on the CLS token only (CaiT)
CLASS_ATTENTION = "class_attention"
#: hierarchical stages with their own token grids, reduced keys and patch merging (SegFormer; Swin's stages)
STAGES = "stages"
#: attention within mask units of an unrolled token order, with query max-pooling and pooled, projected skips at
#: stage transitions (Hiera: ``vitlens.models.hiera.HieraRecording``)
MASK_UNITS = "mask_units"
#: multiscale pooling attention (MViTv2): per block, the pooled queries, keys and values with their pooling
#: convolutions, the residual-pooling term and the (max-pooled) skip, in a ``PooledRecording``
POOLING_ATTENTION = "pooling_attention"
#: convolution (MBConv) blocks, then attention within windows and within a dilated grid of a 2-d feature map, with
#: the partitions and the convolutions recorded (MaxViT; ``session(partitions=True)`` of its adapter)
PARTITION_ATTENTION = "partition_attention"
#: per block, the declared q/k/v, output-projection and MLP linear maps of a plain pre-norm block (``lrp_linears()``)
LRP_LINEARS = "lrp_linears"
#: as :data:`LRP_LINEARS`, for pre-norm blocks that may also normalise queries/keys (``qk_norm``) or the attention
#: output / MLP hidden features (scale norms), and whose MLP may be gated (SwiGLU): ``lrp_linears()`` declares them
LRP_VARIANT_LINEARS = "lrp_variant_linears"
#: the classifier heads (``classifier_modules()``) read the final-normed readout tokens (or their mean) directly
LINEAR_HEAD = "linear_head"
#: the model's own final norm, readout (token, pooled or attention-pooled) and head can be applied to the residual
#: stream after any block (``Adapter.stream_logits()``: the logits that block's tokens would give; LeGrad)
STREAM_HEAD = "stream_head"
#: running on a subset of patch tokens after the position embeddings (``keep_tokens()``)
TOKENS = "tokens"
#: an additive attention mask accepted by every block (timm ``forward_features(x, attn_mask=...)``) and a class-token
#: or mean-pooled readout, so patches can be held out of the whole forward (ViT-Shapley's surrogate)
ATTENTION_MASK = "attention_mask"
#: feature layers in token layout ``(B, T, D)`` (``feature_layers()``; Grad-CAM's target layers)
FEATURES = "features"
#: multi-depth features readable as ``(B, C, h, w)`` maps or token blocks (the AHA decoder's input)
FEATURE_MAPS = "feature_maps"
#: a patch-token grid for an input size (``grid()``)
TOKEN_GRID = "token_grid"
#: the model outputs class logits ``(B, K)`` (so a softmax probability of a class is defined)
CLASS_LOGITS = "class_logits"
#: the model outputs per-pixel logits ``(B, K, h, w)`` (segmentation)
PIXEL_LOGITS = "pixel_logits"

#: capability → what it means, in words (used in refusals and the conformance listing)
DESCRIPTIONS = {
    ATTENTION: "per-block attention probabilities",
    BLOCK_IO: "per-block residual stream (block inputs/outputs)",
    TOKEN_SEQUENCE: "one token sequence through every block, with full attention",
    WINDOWS: "shifted-window attention with patch merging",
    CLASS_ATTENTION: "class-attention blocks after self-attention on the patch tokens",
    STAGES: "hierarchical stages",
    MASK_UNITS: "mask-unit attention in an unrolled token order, with query max-pooling",
    POOLING_ATTENTION: "pooling attention with pooled queries, keys and values and a pooled skip (MViTv2)",
    PARTITION_ATTENTION: "MBConv blocks, then block (window) and grid attention over a 2-d feature map",
    LRP_LINEARS: "declared linear maps of plain pre-norm blocks (for LRP rules)",
    LRP_VARIANT_LINEARS: "declared linear maps of pre-norm blocks, also with q/k norms, scale norms or a gated MLP "
                         "(for the gradient x input LRP rules)",
    LINEAR_HEAD: "a classifier head reading the final readout tokens directly",
    STREAM_HEAD: "the model's final norm, readout and head applied to the residual stream after any block",
    TOKENS: "running on a subset of the patch tokens",
    ATTENTION_MASK: "an attention mask through every block and a class-token or mean-pooled readout",
    FEATURES: "feature layers in token layout",
    FEATURE_MAPS: "multi-depth feature maps",
    TOKEN_GRID: "a patch-token grid",
    CLASS_LOGITS: "class logits (B, K)",
    PIXEL_LOGITS: "per-pixel logits (B, K, h, w)",
}

def describe_need(need: str | tuple[str, ...]) -> str:
    """``'attention'`` → ``"'attention' (per-block attention probabilities)"``; a tuple → ``"one of 'a', 'b'"``."""
    if isinstance(need, tuple):
        return "one of " + ", ".join(f"'{n}'" for n in need)
    return f"'{need}' ({DESCRIPTIONS.get(need, 'a capability no adapter declares')})"
