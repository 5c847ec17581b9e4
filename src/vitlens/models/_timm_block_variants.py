"""What the LRP rules need to know about the variants of timm's pre-norm ``Block``: q/k norms (``qk_norm=True``), the
scale norms of BEiT3 (``scale_attn_norm`` / ``scale_mlp_norm``) and gated MLPs (``SwiGLU``, ``SwiGLUPacked`` =
``GluMlp``). Package-internal (used by :mod:`.timm_vit`).

:func:`block_linears` declares a block's linear maps and variant modules (:class:`~.base.LRPLinears`) or raises
:class:`UnsupportedModelError` with the reason the rules do not cover it; :func:`variant_of` names what a declared
block adds to the plain ViT block (``None``: nothing). The rules themselves check the declaration numerically.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from torch import nn

from ..errors import UnsupportedModelError
from .base import LRPLinears, linears_at, normalisation_layers

__all__ = ["block_linears", "variant_of"]


def _norm(module: nn.Module | None, index: int, what: str) -> nn.Module | None:
    """``module`` if it is a normalisation the conservative mode linearises, ``None`` if it is the identity."""
    if module is None or isinstance(module, nn.Identity):
        return None
    if normalisation_layers(module) != [module]:
        raise UnsupportedModelError(
            f"block {index} normalises {what} with {type(module).__name__}, which vitlens cannot treat as linear in "
            "the backward pass (LayerNorm and RMSNorm only)")
    return module


def block_linears(blk: Any, index: int) -> LRPLinears:
    """The declared maps of timm ``Block`` ``blk`` (number ``index``), its variants included (ViTamin's ``GeGluMlp``,
    which normalises the MLP input itself, too)."""
    from timm.layers import GluMlp, Mlp, SwiGLU

    attn, mlp = blk.attn, blk.mlp
    if getattr(attn, "gate", None) is not None:
        raise UnsupportedModelError(f"block {index} gates the attention output with sigmoid(gate(x)) (gated=True); "
                                    "the LRP rules do not cover an attention gate")
    q_norm = _norm(getattr(attn, "q_norm", None), index, "queries (q_norm)")
    k_norm = _norm(getattr(attn, "k_norm", None), index, "keys (k_norm)")
    ctx_norm = _norm(getattr(attn, "norm", None), index, "the attention output (scale_attn_norm)")
    mlp_norm = None if type(mlp).__name__ == "GeGluMlp" else _norm(getattr(mlp, "norm", None), index,
                                                                      "the MLP hidden features (scale_mlp_norm)")
    qkv = [("attn.qkv",), ("attn.q_proj", "attn.k_proj", "attn.v_proj")]

    def declared(fc1: str, fc2: str, **variant: Any) -> LRPLinears:
        base = linears_at(blk, index, qkv=qkv, proj=("attn.proj",), fc1=(fc1,), fc2=(fc2,))
        return replace(base, act=mlp.act, after_act=mlp.drop1, q_norm=q_norm, k_norm=k_norm, ctx_norm=ctx_norm,
                       **variant)

    def gate_map(name: str) -> nn.Linear:
        g = getattr(mlp, name)
        if not isinstance(g, nn.Linear):
            raise UnsupportedModelError(f"block {index} ({type(blk).__name__}): no nn.Linear MLP gate map at mlp.{name}")
        return g

    if type(mlp) is SwiGLU:
        return declared("mlp.fc1_x", "mlp.fc2", gate=gate_map("fc1_g"), mlp_norm=mlp_norm)
    if type(mlp).__name__ == "GeGluMlp" and type(mlp).__module__.startswith("timm."):  # ViTamin: norm, then
        # act(w0(x)) · w1(x), then w2 (the norm on the MLP input is linearised like every LayerNorm)
        return declared("mlp.w1", "mlp.w2", gate=gate_map("w0"))
    if type(mlp) not in (Mlp, GluMlp):
        raise UnsupportedModelError(f"block {index}'s MLP is {type(mlp).__name__}; the LRP rules cover timm's Mlp, "
                                    "GluMlp (SwiGLUPacked) and SwiGLU")
    packed = None
    if type(mlp) is GluMlp:
        if getattr(mlp, "chunk_dim", -1) != -1:
            raise UnsupportedModelError(f"block {index}'s gated MLP is convolutional (use_conv=True)")
        packed = "last" if mlp.gate_last else "first"
    return declared("mlp.fc1", "mlp.fc2", packed_gate=packed, mlp_norm=mlp_norm)


def variant_of(lin: LRPLinears, index: int) -> str | None:
    """What block ``index`` adds to the plain ViT block, in words (``None``: it is the plain block)."""
    parts = []
    if lin.q_norm is not None or lin.k_norm is not None:
        parts.append(f"normalises queries/keys ({type(lin.q_norm or lin.k_norm).__name__}) before the softmax")
    if lin.ctx_norm is not None or lin.mlp_norm is not None:
        parts.append("normalises the attention output / MLP hidden features (scale norms)")
    if lin.gated:
        parts.append("has a gated MLP (act(gate) · value)")
    return f"block {index} " + " and ".join(parts) if parts else None
