"""Pointing game and energy-inside on hand-made maps and masks."""

from __future__ import annotations

import pytest
import torch

from vitlens.errors import InputError
from vitlens.metrics.localisation import boxes_to_masks, energy_inside, pointing_game


def test_pointing_game_by_hand():
    maps = torch.zeros(3, 8, 8)
    masks = torch.zeros(3, 8, 8, dtype=torch.bool)
    masks[:, 2:4, 2:4] = True
    maps[0, 3, 3] = 1.0  # inside
    maps[1, 7, 7] = 1.0  # far outside
    maps[2, 5, 3] = 1.0  # 2 px below the region
    assert pointing_game(maps, masks).tolist() == [1.0, 0.0, 0.0]
    assert pointing_game(maps, masks, tolerance=2).tolist() == [1.0, 0.0, 1.0]


def test_pointing_game_ties_and_constant_maps():
    masks = torch.zeros(2, 4, 4, dtype=torch.bool)
    masks[:, 0, 0] = True
    maps = torch.zeros(2, 4, 4)
    maps[0, 0, 0] = maps[0, 3, 3] = 1.0  # two maxima, one inside → hit
    assert pointing_game(maps, masks).tolist() == [1.0, 0.0]  # second map is constant → miss


def test_energy_inside_by_hand():
    maps = torch.tensor([[[1.0, 3.0], [-5.0, 0.0]]])
    masks = torch.tensor([[[True, False], [True, False]]])
    assert energy_inside(maps, masks).tolist() == [0.25]
    assert energy_inside(-maps.abs(), masks).tolist() == [0.0]


def test_boxes_to_masks():
    m = boxes_to_masks(torch.tensor([[1, 2, 3, 4]]), (5, 5))
    assert m.sum() == 4 and m[0, 2, 1] and m[0, 3, 2] and not m[0, 4, 1]


def test_bad_shapes():
    with pytest.raises(InputError, match="masks must have"):
        pointing_game(torch.zeros(1, 4, 4), torch.zeros(1, 5, 5, dtype=torch.bool))
    with pytest.raises(InputError, match="NaN"):
        energy_inside(torch.full((1, 2, 2), float("nan")), torch.ones(1, 2, 2, dtype=torch.bool))
