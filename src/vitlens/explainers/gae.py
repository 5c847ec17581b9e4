"""Generic Attention-model Explainability, GAE (Chefer et al., ICCV 2021): gradient-weighted attention rollout.

One forward and one (activation-only) backward pass. The equations implemented here are written out in
``docs/methods/attention_methods.md``.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ..models import Adapter
from ..models.base import recorded
from ..models.capabilities import ATTENTION, CLASS_ATTENTION, TOKEN_SEQUENCE, WINDOWS
from ..targets import Target
from ._attention import relevance_rollout, rollout_row, token_map
from .base import Attribution, Explainer, image_size
from .registry import register

__all__ = ["GAE", "relevance_rollout"]


@register
class GAE(Explainer):
    """GAE: per block ``Ā = mean_h((∇A ⊙ A)⁺)``, ``R = Π_l (I + Ā_l)`` (last block leftmost), readout row of ``R``.

    ``∇A`` is the plain gradient of the target score (by default the class logit) with respect to the attention
    probabilities of every block. No options: the paper has none for ViTs.
    """

    name = "gae"
    value_kind = "nonnegative"
    description = "gradient-weighted attention rollout (Chefer et al. 2021b)"
    needs = (ATTENTION, (TOKEN_SEQUENCE, WINDOWS, CLASS_ATTENTION))
    display_name = "GAE"
    level = "token"
    defaults: dict[str, Any] = {}

    def attribute(self, adapter: Adapter, x: Tensor, target: Target) -> tuple[Attribution, Tensor, Target]:
        with adapter.session(capture=True, conservative=False) as rec:
            logits = adapter.forward(x)
            tgt = self.resolve_target(target, logits)
            attns = [recorded(blk.attn, "attention") for blk in rec.blocks]
            grads = self.gradients(tgt(logits), attns)
        maps = [(grad * attn.detach()).clamp_min(0).mean(dim=1) for attn, grad in zip(attns, grads)]
        if adapter.provides(WINDOWS):  # Swin: R ← R + Ā·R inside each block's windows, merges split evenly
            from ._windows import windowed_row

            row = windowed_row(rec, [m.float() for m in maps], x.shape[0], lambda r, mixed: r + mixed)
            return Attribution(values=self.on_grid(adapter, row, image_size(x))), logits.detach(), tgt
        if adapter.provides(CLASS_ATTENTION):  # CaiT: R ← R + Ā·R through the class-attention rows, then the SA blocks
            from ._class_attention import class_attention_row, readout_start

            n_sa = int(getattr(rec, "self_attention"))
            start = readout_start(adapter.readout_tokens, maps[-1].shape[-1], x.shape[0], maps[0].float())
            patches, _ = class_attention_row(start, [m.float()[:, 0] for m in maps[n_sa:]],
                                             [m.float() for m in maps[:n_sa]], add=True)
            return Attribution(values=self.on_grid(adapter, patches, image_size(x))), logits.detach(), tgt
        row = rollout_row(maps, adapter.readout_tokens, adapter.num_prefix_tokens)
        values, _ = token_map(adapter, row, x)
        return Attribution(values=values), logits.detach(), tgt
