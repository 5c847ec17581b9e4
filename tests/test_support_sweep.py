"""The support table is true: for every adapter family in ``vitlens.models.families`` and every registered method,
a method the support query lists runs (its default options, with the cheaper sample counts of ``fast_options``
where it has them; a ``SegmentationTarget`` on per-pixel models; as initialised and with trained-like parameters),
and every other method is refused by the one refusal path (``vitlens.explainers.support.check``), naming the capability it needs and the methods that work."""

from __future__ import annotations

import logging

import pytest
import torch

import vitlens
from vitlens.errors import UnsupportedModelError
from vitlens.explainers import get_method
from vitlens.explainers.registry import method_classes
from vitlens.explainers.support import conformance, missing, working_methods
from vitlens.models.capabilities import DESCRIPTIONS, PIXEL_LOGITS
from vitlens.models.families import FAMILIES, build
from vitlens.targets import SegmentationTarget

#: real command-line processes, training or a sweep over every family: left out of `pytest -m "not slow"`
pytestmark = pytest.mark.slow

METHODS = sorted(method_classes())


def _options(name: str) -> dict:
    if name == "aha":  # a useful AHA map needs an explainer trained for the model; the untrained one runs the path
        return {"explainer": "untrained", "refine_steps": 0}
    return dict(type(get_method(name)).fast_options)


def _trained_like(model: torch.nn.Module) -> torch.nn.Module:
    """Parameters as a trained model has them, not as initialised: non-zero biases and position tables, layer
    scales near 0.1 (random init leaves biases, position and relative-bias tables at zero)."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("gamma", "gamma_1", "gamma_2", "lambda1", "lambda2", "lambda_1", "lambda_2") or \
                    "layer_scale" in name or ".ls" in name:
                p.copy_(0.1 + 0.02 * torch.randn(p.shape, generator=gen))
            elif leaf == "bias" or "pos" in name or "position" in name or "bias_table" in name:
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model


@pytest.mark.parametrize("trained_like", [False, True], ids=["init", "trained-like"])
@pytest.mark.parametrize("family", [f.name for f in FAMILIES])
def test_every_cell_of_the_support_table(family, trained_like):
    logging.disable(logging.WARNING)
    model = _trained_like(build(family)) if trained_like else build(family)
    adapter = vitlens.get_adapter(model)
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    target = SegmentationTarget(0) if adapter.provides(PIXEL_LOGITS) else None
    working = working_methods(model)
    ran = refused = 0
    for name in METHODS:
        method = get_method(name, **_options(name))
        if name in working:
            exp = method.explain(model, x, target=target)
            assert exp.maps.shape == (1, 32, 32) and torch.isfinite(exp.maps).all(), name
            ran += 1
            continue
        with pytest.raises(UnsupportedModelError) as err:
            method.explain(model, x, target=target)
        msg = str(err.value)
        need = missing(adapter, method)[0]
        first = need[0] if isinstance(need, tuple) else need
        assert msg.startswith(f"method '{name}' needs ") and f"'{first}'" in msg and "\n" not in msg, msg
        listed = msg.split("methods that work on this model: ")[1].split(", ")
        assert listed == working, name
        refused += 1
    assert ran + refused == len(METHODS) and ran == len(working)
    assert {"gradient", "inputxgradient", "integrated_gradients", "random", "smoothgrad"} <= set(working)


def test_conformance_lists_what_an_adapter_provides_and_lacks():
    report = conformance(build("timm Swin"))
    assert report["family"] == "timm-swin" and "windows" in report["provides"]
    assert set(report["provides"]) | set(report["lacks"]) == set(DESCRIPTIONS)
    assert "windowed" in report["lacks"]["token_sequence"]
    assert "gradskip" in report["methods"] and "attnlrp" in report["refused"]
    assert set(report["methods"]) | set(report["refused"]) == set(METHODS)


def test_conformance_cli_lists_capabilities_and_methods(capsys):
    from vitlens.cli import main

    assert main(["conformance", "timm:vit_tiny_patch16_224", "--model-option", "pretrained=False",
                 "--model-option", "img_size=32", "--model-option", "patch_size=8"]) == 0
    out = capsys.readouterr().out
    assert "adapter: TimmViTAdapter (timm-vit)" in out and "provides: attention, block_io" in out
    assert "methods that run: aha, attn_gradcam, attnlrp" in out and "  windows: " in out
