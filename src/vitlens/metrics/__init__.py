"""Metrics that judge explanations. Each takes maps from any explainer as a ``(B, H, W)`` tensor."""

from .localisation import energy_inside, pointing_game

__all__ = ["pointing_game", "energy_inside"]
