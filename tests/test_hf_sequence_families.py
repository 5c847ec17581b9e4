"""HF single-sequence families added as one declaration each (``models/hf_families.py``): ViTMSN (CLS readout),
I-JEPA (no CLS token, token-mean readout) and Data2VecVision (transformers 4.x layer layout, SDPA attention class
chosen when the model is built, relative position bias and layer scale). The shared family tests
(``tests/test_families.py``) and the support sweep run them too; here: what is particular to each."""

from __future__ import annotations

import logging

import pytest
import torch

import vitlens
from vitlens.explainers.support import why_not, working_methods
from vitlens.models.families import build

logging.disable(logging.WARNING)


def _x(n=2, seed=0):
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def test_layouts_are_read_from_the_declarations():
    msn, ijepa, d2v = (vitlens.get_adapter(build(n)) for n in ("HF ViTMSN", "HF I-JEPA", "HF Data2VecVision"))
    assert (msn.family, msn.num_prefix_tokens, msn.readout_tokens) == ("hf-vit-msn", 1, (0,))
    assert (ijepa.family, ijepa.num_prefix_tokens, ijepa.readout_tokens) == ("hf-ijepa", 0, None)
    assert (d2v.family, d2v.num_prefix_tokens, d2v.readout_tokens) == ("hf-data2vec-vision", 1, None)  # mean pool
    for a in (msn, ijepa, d2v):
        assert a.fallback_reason is None and len(a.blocks()) == 2 and a.grid((32, 32)) == (4, 4)


def test_data2vec_attention_runs_eager_only_during_the_session_and_gets_its_class_back():
    model = build("HF Data2VecVision")
    classes = [type(m) for m in model.modules()]
    assert any("Sdpa" in c.__name__ for c in classes)  # built with the SDPA path, which returns no probabilities
    adapter = vitlens.get_adapter(model)
    with pytest.raises(KeyError):
        with adapter.session(capture=True) as rec:
            assert not any("Sdpa" in type(m).__name__ for m in model.modules())
            adapter.forward(_x(1))
            assert rec.blocks[0].attn.shape == (1, 4, 17, 17)
            raise KeyError("inside")
    assert [type(m) for m in model.modules()] == classes


def test_data2vec_capture_matches_the_models_own_forward_with_trained_like_parameters():
    model = build("HF Data2VecVision", trained=True)
    adapter = vitlens.get_adapter(model)
    x = _x()
    with torch.no_grad():
        ref = model(pixel_values=x).logits
    with adapter.session(capture=True) as rec:
        logits = adapter.forward(x)
    torch.testing.assert_close(logits.detach(), ref, rtol=1e-5, atol=1e-6)
    for blk in rec.blocks:
        torch.testing.assert_close(blk.attn.detach().sum(-1), torch.ones(blk.attn.shape[:-1]))


@pytest.mark.parametrize("cls, cfg, kw", [
    ("Data2VecVisionForImageClassification", "Data2VecVisionConfig", {"use_relative_position_bias": False}),
    ("BeitForImageClassification", "BeitConfig", {"use_relative_position_bias": False}),
])
def test_without_relative_position_bias_the_blocks_are_plain_for_lrp(cls, cfg, kw):
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, cfg)(image_size=32, patch_size=8, hidden_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, intermediate_size=96, num_labels=5, **kw)
    model = getattr(transformers, cls)(config).eval()
    assert {"cplrp", "attnlrp"} <= set(working_methods(model))
    exp = vitlens.explain(model, _x(3), method="cplrp")  # biases at zero as initialised: complete (bias terms 0)
    total = exp.token_maps.sum((1, 2)).double() + exp.remainder.double()
    torch.testing.assert_close(total, exp.scores.double(), rtol=1e-4, atol=1e-5)


def test_relative_position_bias_refuses_lrp_with_the_reason():
    for name in ("HF Data2VecVision", "HF BEiT"):
        reason = why_not(build(name), "cplrp")
        assert reason is not None and "relative position bias enters the softmax" in reason, name


@pytest.mark.parametrize("family", ["HF ViTMSN", "HF I-JEPA", "HF Data2VecVision"])
def test_gradskip_complete_and_conserved_with_trained_like_parameters(family):
    exp = vitlens.explain(build(family, trained=True), _x(3), method="gradskip")
    y = exp.scores.double()
    torch.testing.assert_close(exp.token_maps.sum((1, 2)).double() + exp.remainder.double(), y, rtol=1e-5, atol=1e-6)
    totals = exp.extras["layer_totals"].double()
    torch.testing.assert_close(totals, y[:, None].expand_as(totals), rtol=1e-5, atol=1e-6)


def test_ijepa_has_no_prefix_token_so_nothing_is_left_in_the_remainder():
    exp = vitlens.explain(build("HF I-JEPA", trained=True), _x(2), method="gradskip")
    assert exp.remainder.abs().max() == 0
