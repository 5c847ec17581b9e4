"""CP-LRP (Ali et al., ICML 2022) in gradient × input form: one forward and one (activation-only) backward pass.

The driver it shares with AttnLRP (:mod:`.attnlrp`) is in :mod:`._gradient_input_lrp`. Equations and cross-check
results: ``docs/methods/attention_methods.md``.
"""

from __future__ import annotations

from ._gradient_input_lrp import GradientInputLRP
from .registry import register

__all__ = ["CPLRP"]


@register
class CPLRP(GradientInputLRP):
    """CP-LRP (Ali et al., ICML 2022) as gradient × input: attention probabilities and LayerNorm's standard deviation
    are constants in the backward pass; plain gradient elsewhere, with the identity rule for the MLP activation by
    default (as LXT's CP-LRP map for vision transformers does). With the identity rule the relevance is exactly
    conservative: ``token_maps.sum() + remainder = y − (bias contributions)``.

    Options:
        activation_rule: ``identity`` (default) | ``gradient`` (plain gradient through the activation).
    """

    name = "cplrp"
    value_kind = "signed"
    description = "CP-LRP relevance as gradient x input"
    display_name = "CP-LRP"
    mode = "cplrp"
