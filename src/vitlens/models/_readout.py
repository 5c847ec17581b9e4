"""Readout fast path: run the last transformer block on the readout token(s) only.

In a ViT whose classifier reads single tokens (CLS, or CLS + DIST) the last block's outputs at every other token
cannot reach the logits: after the last attention, MLP and final norm act token by token. Within
:func:`readout_only` the last block of a timm ``VisionTransformer`` computes its keys and values for all tokens as
before, but its attention output, output projection, residual adds, MLP, and (through the model's own final norm
and head) the readout on the ``r`` readout tokens only, and returns ``(B, r, D)``. The logits are the same
computation on the same rows, so they agree with the full model up to float rounding (a matrix product over fewer
rows may be blocked differently); gradients to every earlier tensor are the same, because the rows dropped had zero
gradient.

``all_queries=True`` keeps the queries and the attention probabilities ``(B, H, T, T)`` of every token (the
capture hooks see the full matrix, and methods that read every row, e.g. GradSkip's head sparsity, are unchanged);
``False`` also projects queries and computes attention rows for the readout tokens only.

Only the instance attribute ``forward`` of the last block is set, for the duration of the context, and removed in
``finally`` (also after an exception); the class and every other module are untouched. Models the path does not
apply to (pooled readouts, readout tokens that are not the first tokens, other block types, training mode, attention
masks) run unchanged.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch.nn.functional as F
from torch import Tensor

# The timm ``Block`` / ``Attention`` internals are reached by attribute (timm types ``Block.attn`` and its parts as
# plain ``nn.Module``), so they are typed ``Any`` here; :func:`_last_block` checks the exact classes first.

__all__ = ["readout_only", "readout_path_applies"]


def _last_block(adapter: Any) -> Any:
    """The timm ``Block`` the fast path would replace, or ``None`` when it does not apply."""
    try:
        from timm.models.vision_transformer import VisionTransformer
    except ImportError:  # pragma: no cover - timm is an optional extra
        return None
    if not isinstance(getattr(adapter, "model", None), VisionTransformer) or adapter.family != "timm-vit":
        return None
    readout = adapter.readout_tokens
    if not readout or tuple(readout) != tuple(range(len(readout))):
        return None
    model = adapter.model
    if getattr(model, "attn_pool", None) is not None or model.training:
        return None
    if getattr(model, "head_dist", None) is None and getattr(model, "global_pool", "token") != "token":
        return None
    from timm.layers import Attention
    from timm.models.vision_transformer import Block

    blk = model.blocks[-1]
    if type(blk) is not Block or type(blk.attn) is not Attention or "forward" in vars(blk):
        return None
    return blk


def readout_path_applies(adapter) -> bool:
    """Whether :func:`readout_only` would change how ``adapter``'s model runs."""
    return _last_block(adapter) is not None


def _attend(attn_mod: Any, q: Tensor, k: Tensor, v: Tensor, rows: int) -> Tensor:
    """Attention output ``(B, H, rows, d_head)`` for the first ``rows`` queries (``q`` may hold all tokens)."""
    if attn_mod.fused_attn:
        return F.scaled_dot_product_attention(q[:, :, :rows], k, v)
    a = (q * attn_mod.scale) @ k.transpose(-2, -1)
    a = attn_mod.attn_drop(a.softmax(dim=-1))  # capture hooks on attn_drop see every computed row
    return a[:, :, :rows] @ v


def _readout_forward(blk: Any, r: int, all_queries: bool) -> Any:
    attn_mod = blk.attn
    full = type(blk).forward

    def forward(x: Tensor, attn_mask: Tensor | None = None, is_causal: bool = False) -> Tensor:
        if attn_mask is not None or is_causal or blk.training:
            return full(blk, x, attn_mask=attn_mask, is_causal=is_causal)
        b, t, _ = x.shape
        heads, hd = attn_mod.num_heads, attn_mod.head_dim
        y = blk.norm1(x)
        if all_queries:
            qkv = attn_mod.qkv(y).reshape(b, t, 3, heads, hd).permute(2, 0, 3, 1, 4)
            q, k, v = qkv.unbind(0)
        else:  # queries for the readout rows only; keys and values for all tokens
            w, bias = attn_mod.qkv.weight, attn_mod.qkv.bias
            d = heads * hd
            q = F.linear(y[:, :r], w[:d], None if bias is None else bias[:d])
            q = q.reshape(b, r, heads, hd).transpose(1, 2)
            kv = F.linear(y, w[d:], None if bias is None else bias[d:]).reshape(b, t, 2, heads, hd)
            k, v = kv.permute(2, 0, 3, 1, 4).unbind(0)
        q, k = attn_mod.q_norm(q), attn_mod.k_norm(k)
        o = _attend(attn_mod, q, k, v, r).transpose(1, 2).reshape(b, r, heads * hd)
        o = attn_mod.norm(o)
        if getattr(attn_mod, "gate", None) is not None:
            o = o * attn_mod.gate(y[:, :r]).sigmoid()
        o = attn_mod.proj_drop(attn_mod.proj(o))
        h = x[:, :r] + blk.drop_path1(blk.ls1(o))
        return h + blk.drop_path2(blk.ls2(blk.mlp(blk.norm2(h))))

    return forward


@contextlib.contextmanager
def readout_only(adapter, all_queries: bool = True) -> Iterator[bool]:
    """Within the context the model's last block runs on the readout tokens only (see the module docstring).

    Yields whether the path is active; where it does not apply the model runs unchanged and ``False`` is yielded.
    While active, the last block's output (and ``Recording.final``) is ``(B, r, D)`` for ``r`` readout tokens, and
    the residual stream after its attention add (``BlockRecord.h`` of the last block) is ``(B, r, D)`` too.
    """
    blk = _last_block(adapter)
    if blk is None:
        yield False
        return
    blk.forward = _readout_forward(blk, len(adapter.readout_tokens), all_queries)
    try:
        yield True
    finally:
        del blk.forward
