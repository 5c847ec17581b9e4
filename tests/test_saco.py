"""SaCo (Wu et al., CVPR 2024): the coefficient on models where the answer is known, its range, determinism,
batching, and its registration (``vitlens bench --metrics saco``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vitlens.errors import InputError
from vitlens.metrics import SaCo, get_metric, metric_names, saco_coefficient

from conftest import tiny_vit

DC = {"mean": (0.5, 0.5, 0.5), "std": (0.25, 0.25, 0.25)}


def _linear_model(seed: int = 0) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """Logit 0 = Σ w·x over the pixels, logit 1 = 0: replacing a group by the image's channel mean changes logit 0
    by exactly the group's sum of ``w·(x − mean)``, the perfect map."""
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(3 * 8 * 8, 2)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(2, 3 * 8 * 8, generator=g))
        lin.weight[1] = 0.0
        lin.bias.zero_()
    model = nn.Sequential(nn.Flatten(), lin).eval()
    x = torch.randn(3, 3, 8, 8, generator=g)
    contrib = (lin.weight[0].detach().view(3, 8, 8) * (x - x.mean(dim=(2, 3), keepdim=True))).sum(dim=1)
    return model, x, contrib


@pytest.mark.parametrize("score", ["logit", "probability"])
def test_perfect_order_scores_one_and_reversed_minus_one(score):
    model, x, contrib = _linear_model()
    metric = SaCo(groups=8, score=score, data_config=DC)
    perfect = metric(contrib, model=model, x=x, targets=[0, 0, 0]).values["saco"]
    reversed_ = metric(-contrib, model=model, x=x, targets=[0, 0, 0]).values["saco"]
    torch.testing.assert_close(perfect, torch.ones(3))
    torch.testing.assert_close(reversed_, -torch.ones(3))
    random = metric(torch.rand(3, 8, 8, generator=torch.Generator().manual_seed(2)), model=model, x=x,
                    targets=[0, 0, 0]).values["saco"]
    assert bool((random < perfect).all()) and bool((random > reversed_).all())


def test_coefficient_by_hand():
    s = torch.tensor([[3.0, 2.0, 0.0]])
    # pairs (1,2) w=1 ok, (1,3) w=3 ok, (2,3) w=2 violated -> (1 + 3 - 2) / 6
    assert float(saco_coefficient(s, torch.tensor([[5.0, 1.0, 2.0]]))) == pytest.approx(2 / 6)
    assert torch.isnan(saco_coefficient(torch.ones(1, 4), torch.rand(1, 4))).all()


def test_range_determinism_and_batching_on_a_vit():
    model = tiny_vit()
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    maps = torch.randn(4, 32, 32, generator=torch.Generator().manual_seed(1))
    metric = get_metric("saco", data_config=DC, batch_size=5)
    targets = model(x).argmax(-1)  # the predicted class, as the paper explains it
    a = metric(maps, model=model, x=x, targets=targets)
    b = metric(maps, model=model, x=x, targets=targets)
    assert torch.equal(a.values["saco"], b.values["saco"])
    assert bool(((a.values["saco"] >= -1) & (a.values["saco"] <= 1)).all())
    one = torch.cat([metric(maps[i:i + 1], model=model, x=x[i:i + 1], targets=targets[i:i + 1]).values["saco"]
                     for i in range(4)])
    torch.testing.assert_close(one, a.values["saco"])
    assert a.curves["delta"].shape == (4, 10) and a.higher_is_better == {"saco": True}
    assert a.protocol["metric"] == "saco" and a.protocol["groups"] == 10 and a.protocol["baseline"] == "sample_mean"
    patch = get_metric("saco", granularity="patch", groups=4, baseline="black", data_config=DC)(
        maps, model=model, x=x, targets=targets)
    assert patch.protocol["num_features"] == 16 and bool(torch.isfinite(patch.values["saco"]).all())


def test_settings_are_checked_and_registered():
    assert "saco" in metric_names()
    with pytest.raises(InputError, match="groups"):
        SaCo(groups=1)
    with pytest.raises(InputError, match="baseline"):
        SaCo(baseline="zeros")
    with pytest.raises(InputError):
        get_metric("saco", steps=3)
