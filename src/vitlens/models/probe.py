"""A backbone with a linear head, the way self-supervised backbones are used for classification (linear probing).

HuggingFace ships DINOv3 (``DINOv3ViTModel``) as a backbone without a classifier; users add their own linear head.
:class:`LinearProbe` is that model as one ``nn.Module`` vitlens can explain: it states where the head reads, so the
adapter knows the readout without guessing from a user's ``forward``::

    from transformers import DINOv3ViTModel
    from vitlens.models import LinearProbe

    backbone = DINOv3ViTModel.from_pretrained(path)            # a local folder: no model hub at run time
    model = LinearProbe(backbone, torch.nn.Linear(backbone.config.hidden_size, 1000), readout="cls").eval()
    vitlens.explain(model, x, method="gradskip")

Readouts: ``"cls"`` (the normalised CLS token, the backbone's ``pooler_output``), ``"mean"`` (the mean of the
normalised patch tokens) or ``"cls+mean"`` (both concatenated, DINOv2/v3's linear-evaluation head; the head then
takes ``2 × hidden_size`` features). Register tokens are never read.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..errors import InputError

__all__ = ["LinearProbe", "PROBE_READOUTS"]

PROBE_READOUTS = ("cls", "mean", "cls+mean")


class LinearProbe(nn.Module):
    """``head(readout(backbone(pixel_values).last_hidden_state))`` for a HF ViT-style backbone.

    Args:
        backbone: a transformers vision backbone returning ``last_hidden_state`` (B, T, D) whose first token is
            CLS, followed by ``config.num_register_tokens`` registers (if any), then the patch tokens.
        head: the classifier, e.g. ``nn.Linear(D, num_classes)`` (``2·D`` inputs for ``"cls+mean"``).
        readout: one of :data:`PROBE_READOUTS`.
    """

    def __init__(self, backbone: nn.Module, head: nn.Module, readout: str = "cls") -> None:
        super().__init__()
        if readout not in PROBE_READOUTS:
            raise InputError(f"readout must be one of {', '.join(PROBE_READOUTS)}; got {readout!r}")
        if not hasattr(backbone, "config"):
            raise InputError(f"LinearProbe needs a transformers backbone with a config; got {type(backbone).__name__}")
        self.backbone, self.head, self.readout = backbone, head, readout
        self.num_prefix_tokens = 1 + int(getattr(backbone.config, "num_register_tokens", 0) or 0)

    @property
    def config(self):  # the backbone's config: image size, patch size, processor defaults
        return self.backbone.config

    def forward(self, pixel_values: Tensor) -> Tensor:
        seq = self.backbone(pixel_values=pixel_values).last_hidden_state
        cls, patches = seq[:, 0], seq[:, self.num_prefix_tokens:]
        if self.readout == "cls":
            feat = cls
        elif self.readout == "mean":
            feat = patches.mean(1)
        else:
            feat = torch.cat([cls, patches.mean(1)], dim=-1)
        return self.head(feat)
