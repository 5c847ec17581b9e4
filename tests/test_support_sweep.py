"""The support table is true: for every adapter family in ``vitlens.models.families`` and every registered method,
a method the support query lists runs (its default options, with the cheaper sample counts of ``fast_options``
where it has them; a ``SegmentationTarget`` on per-pixel models; as initialised and with trained-like parameters),
GradSkip, where listed, is complete and conserved per layer on both; and every other method is refused
by the one refusal path (``vitlens.explainers.support.check``), naming the capability it needs and the methods that
work."""

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


#: what a ✓ promises beyond a finite map, checked on every cell that has it: method → tolerance of
#: ``token_maps.sum() + remainder == score`` and per layer (``layer_totals``). CP-LRP is complete only up to the
#: biases' contributions (docs/methods/attention_methods.md), so with trained-like biases it promises no equality.
COMPLETE = {"gradskip": 1e-5}


def _check_promise(name, exp):
    total = exp.token_maps.sum((1, 2)).double() + exp.remainder.double()
    y = exp.scores.double()
    torch.testing.assert_close(total, y, rtol=COMPLETE[name], atol=COMPLETE[name], msg=f"{name}: not complete")
    totals = exp.extras.get("layer_totals")
    if totals is not None and "stage_totals" not in exp.extras:  # SegFormer's decode head reads every stage: its
        # blocks carry their stage's share (docs/methods/gradskip_segformer.md), the map still sums to the score
        torch.testing.assert_close(totals.double(), y[:, None].expand_as(totals), rtol=COMPLETE[name],
                                   atol=COMPLETE[name], msg=f"{name}: not conserved per layer")


@pytest.mark.parametrize("trained_like", [False, True], ids=["init", "trained-like"])
@pytest.mark.parametrize("family", [f.name for f in FAMILIES])
def test_every_cell_of_the_support_table(family, trained_like):
    logging.disable(logging.WARNING)
    model = build(family, trained=trained_like)  # trained-like: vitlens.models.families.trained_like
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
            if name in COMPLETE:
                _check_promise(name, exp)
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
    assert "adapter: TimmViTAdapter (timm-vit)" in out and "provides: attention, attention_mask, block_io" in out
    assert "methods that run: aha, attn_gradcam, attnlrp" in out and "  windows: " in out
