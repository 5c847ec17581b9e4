"""Attention rollout (Abnar & Zuidema, ACL 2020): multiply the layers' head-fused attention, with the residual.

One forward pass, no gradients. The equations implemented here are written out in
``docs/methods/attention_methods.md``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..errors import UnsupportedModelError
from ..models import Adapter
from ..models.base import recorded
from ..models.capabilities import ATTENTION, CLASS_ATTENTION, TOKEN_SEQUENCE, WINDOWS
from ..targets import Target
from ._attention import DISCARD_PER, FUSIONS, discard_lowest, fuse_heads, readout_row, token_map
from ..options import choice, number
from .base import Attribution, Explainer, image_size
from .registry import register

__all__ = ["AttentionRollout", "fuse_heads", "discard_lowest", "readout_row", "token_map"]  # helpers re-exported



@register
class AttentionRollout(Explainer):
    """Attention rollout: ``Â_l = rownorm(½·(fuse_h A_l) + ½·I)``, ``J = Â_L ⋯ Â_1``, readout row of ``J``.

    Options:
        head_fusion: ``mean`` (the paper) | ``max`` | ``min`` — how the heads of a layer are fused.
        discard_ratio: fraction in [0, 1) of the lowest fused-attention entries zeroed per layer and image before the
            identity is added (0 = the paper; 0.9 is the common implementation's default). See :func:`discard_lowest`.
        discard_per: ``matrix`` (the lowest entries of the whole matrix, as the common implementation) | ``row``.

    The map is the readout row over the patch tokens; every row of ``J`` sums to 1, so the map plus ``remainder``
    (the mass on prefix tokens) is 1 per image.
    """

    name = "rollout"
    value_kind = "nonnegative"
    description = "attention rollout: attention maps multiplied through the blocks"
    needs = (ATTENTION, (TOKEN_SEQUENCE, WINDOWS, CLASS_ATTENTION))
    display_name = "Attention Rollout"
    level = "token"
    defaults: dict[str, Any] = {"head_fusion": "mean", "discard_ratio": 0.0, "discard_per": "matrix"}
    option_specs = {"head_fusion": choice(*FUSIONS), "discard_ratio": number(0, 1, high_open=True),
                    "discard_per": choice(*DISCARD_PER)}

    def check_options(self) -> None:
        self.options["discard_ratio"] = float(self.options["discard_ratio"])

    def declared_cost(self) -> dict[str, float]:
        return {"forward": 1.0, "backward": 0.0}

    def attribute(self, adapter: Adapter, x: Tensor, target: Target) -> tuple[Attribution, Tensor, Target]:
        o = self.options
        with adapter.session(capture=True) as rec, torch.no_grad():
            logits = adapter.forward(x)
            tgt = self.resolve_target(target, logits)
            tgt(logits)  # validates the target against the batch (the map itself does not depend on it)
            attns = [recorded(blk.attn, "attention") for blk in rec.blocks]
        protect = adapter.readout_tokens or ()
        if adapter.provides(WINDOWS):  # Swin: the row through shifted windows and merges (docs/methods/gradskip_swin.md)
            from ._windows import windowed_row

            mats = []
            for attn in attns:
                fused = discard_lowest(fuse_heads(attn.detach().float(), o["head_fusion"]), o["discard_ratio"], (),
                                       o["discard_per"])  # per window
                a = 0.5 * fused + 0.5 * torch.eye(fused.shape[-1], device=fused.device, dtype=fused.dtype)
                mats.append(a / a.sum(dim=-1, keepdim=True))
            row = windowed_row(rec, mats, x.shape[0], lambda r, mixed: mixed)
            return Attribution(values=self.on_grid(adapter, row, image_size(x))), logits.detach(), tgt
        if adapter.provides(CLASS_ATTENTION):  # CaiT: docs/methods/gradskip_cait.md
            return self._class_attention(adapter, rec, attns, x), logits.detach(), tgt
        joint = None
        for attn in attns:
            fused = discard_lowest(fuse_heads(attn.detach().float(), o["head_fusion"]), o["discard_ratio"], protect,
                                   o["discard_per"])
            eye = torch.eye(fused.shape[-1], device=fused.device, dtype=fused.dtype)
            a = 0.5 * fused + 0.5 * eye
            a = a / a.sum(dim=-1, keepdim=True)
            joint = a if joint is None else a.bmm(joint)
        if joint is None:
            raise UnsupportedModelError("the model has no transformer blocks: there is no attention to roll out")
        row = readout_row(joint, adapter.readout_tokens, adapter.num_prefix_tokens)
        values, remainder = token_map(adapter, row, x)
        return Attribution(values=values, remainder=remainder), logits.detach(), tgt

    def _class_attention(self, adapter: Adapter, rec: Any, attns: list, x: Tensor) -> Attribution:
        """CaiT: the readout row through the class-attention rows (``½·fuse_h A + ½·e_CLS``, normalised), then the
        self-attention blocks with ``fuse_h rownorm(|A'|)`` of the talking-heads mixing tensor in place of ``A``."""
        from ._class_attention import class_attention_row, magnitude_rows, readout_start

        o = self.options
        n_sa = int(rec.self_attention)
        sa, ca = [], []
        for i, attn in enumerate(attns):
            a = attn.detach().float()
            if i < n_sa:
                fused = discard_lowest(fuse_heads(magnitude_rows(a), o["head_fusion"]), o["discard_ratio"], (),
                                       o["discard_per"])
                m = 0.5 * fused + 0.5 * torch.eye(fused.shape[-1], device=fused.device, dtype=fused.dtype)
                sa.append(m / m.sum(dim=-1, keepdim=True))
            else:
                fused = discard_lowest(fuse_heads(a, o["head_fusion"]), o["discard_ratio"], (0,), o["discard_per"])
                row = 0.5 * fused[:, 0]
                row[:, 0] += 0.5
                ca.append(row / row.sum(dim=-1, keepdim=True))
        start = readout_start(adapter.readout_tokens, attns[-1].shape[-1], x.shape[0], sa[0])
        patches, cls_left = class_attention_row(start, ca, sa, add=False)
        return Attribution(values=self.on_grid(adapter, patches, image_size(x)), remainder=cls_left)
