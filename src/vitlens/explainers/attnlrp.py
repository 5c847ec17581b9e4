"""AttnLRP (Achtibat et al., ICML 2024) in gradient × input form: one forward and one (activation-only) backward pass.

The LRP rules it imposes on the backward (and what it shares with CP-LRP, :mod:`.cplrp`) are in
:mod:`._gradient_input_lrp`. Equations and cross-check results: ``docs/methods/attention_methods.md``.
"""

from __future__ import annotations

from ._gradient_input_lrp import GradientInputLRP, attention_rule, identity_rule, scale_grad
from .registry import register

__all__ = ["AttnLRP", "scale_grad", "identity_rule", "attention_rule"]


@register
class AttnLRP(GradientInputLRP):
    """AttnLRP (Achtibat et al., ICML 2024) as gradient × input: ε-rule (plain gradient) for linear maps and
    residual additions, identity rule for the MLP activation and LayerNorm's scaling, softmax rule (plain softmax
    gradient), uniform rule for the bilinear ``q·kᵀ`` and ``A·v`` products. Relevance at the first block's input,
    summed over channels; what lands on prefix tokens is the ``remainder``.

    Options:
        activation_rule: ``identity`` (the paper) | ``gradient`` (plain gradient through the activation; ablation).
    """

    name = "attnlrp"
    value_kind = "signed"
    description = "AttnLRP relevance as gradient x input"
    display_name = "AttnLRP"
    mode = "attnlrp"
