"""The shared properties, parametrised over every model family in ``vitlens.models.families`` (tiny random configs
of the real timm / HF classes): shapes, determinism, batch = one-by-one, completeness and per-layer conservation where
promised, the model restored after success and after an exception, the capture matching the model's own forward,
and clear refusals that name the methods that work.
"""

from __future__ import annotations

import copy

import pytest
import torch

import vitlens
from vitlens.errors import UnsupportedModelError
from vitlens.explainers import get_method
from vitlens.explainers.registry import requirements
from vitlens.explainers.support import why_not, working_methods
from vitlens.models.families import FAMILIES, build

from conftest import model_fingerprint

SUPPORTED = [f.name for f in FAMILIES if f.note == ""]  # the transformer classifiers
#: hierarchical classifiers (PVTv2: spatial-reduction attention; MViTv2: pooling attention): no single token
#: sequence, so no rollout/GAE
STAGED = [f.name for f in FAMILIES if f.note == "stages"]
REFUSED = [f.name for f in FAMILIES if f.note == "refused"]
NEW = [n for n in SUPPORTED if n not in ("timm ViT", "timm DeiT distilled", "HF ViT")]
METHODS = sorted(n for n in requirements() if n != "aha")  # AHA needs a trained explainer network
BATCH_METHODS = ["gradskip", "rollout", "gae", "gradcam", "attn_gradcam", "gradient"]


def _x(n=3, seed=0):
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def _method(name):
    return get_method(name, **type(get_method(name)).fast_options)


def _fingerprint(model):
    state = model_fingerprint(model)
    state["configs"] = [(n, m.config._attn_implementation) for n, m in model.named_modules()
                        if hasattr(getattr(m, "config", None), "_attn_implementation")]
    return state


_MODELS: dict[str, torch.nn.Module] = {}


def _model(name):
    if name not in _MODELS:
        _MODELS[name] = build(name)
    return _MODELS[name]


def _working(name):
    return working_methods(_model(name))


@pytest.mark.parametrize("family", SUPPORTED + STAGED)
def test_every_working_method_gives_finite_maps_of_the_right_shape(family):
    model = _model(family)
    before = _fingerprint(model)
    working = [m for m in _working(family) if m != "aha"]
    assert {"gradskip", "gradcam", "gradient", "rise"} <= set(working)
    assert {"rollout", "gae"} <= set(working) or family in STAGED
    for name in working:
        exp = _method(name).explain(model, _x(2))
        assert exp.maps.shape == (2, 32, 32) and exp.maps.dtype == torch.float32, name
        adapter = vitlens.get_adapter(model)
        grid = adapter.feature_grid((32, 32)) if name in ("gradcam", "finercam") else adapter.grid((32, 32))
        assert exp.token_maps.shape == (2, *grid), name  # (4, 4) for the patch-8 ViTs; Swin: 8x8, features 4x4
        assert torch.isfinite(exp.maps).all(), name
    assert _fingerprint(model) == before


@pytest.mark.parametrize("family", SUPPORTED + STAGED)
def test_refused_methods_name_the_methods_that_work(family):
    model = _model(family)
    working = _working(family)
    for name in sorted(set(METHODS) - set(working)):
        with pytest.raises(UnsupportedModelError) as err:
            get_method(name).explain(model, _x(1))
        msg = str(err.value)
        assert "methods that work on this model: " in msg and "\n" not in msg, name
        listed = msg.split("methods that work on this model: ")[1].split(".")[0].split(", ")
        assert "gradient" in listed and "rise" in listed, name


@pytest.mark.parametrize("trained", [False, True], ids=["init", "trained-like"])
@pytest.mark.parametrize("family", SUPPORTED + STAGED)
def test_gradskip_completeness_and_per_layer_conservation(family, trained):
    """As initialised and with trained-like parameters (``families.trained_like``: non-zero biases, position and
    relative-bias tables, tokens, layer scales ≈ 0.1, norm weights ≠ 1)."""
    model = build(family, trained=True) if trained else _model(family)
    exp = vitlens.explain(model, _x(), method="gradskip")
    y = exp.scores.double()
    total = exp.token_maps.sum((1, 2)).double() + exp.remainder.double()
    torch.testing.assert_close(total, y, rtol=1e-5, atol=1e-6)
    totals = exp.extras["layer_totals"].double()  # (B, L+1): input of block 0 ... readout
    torch.testing.assert_close(totals, y[:, None].expand_as(totals), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", [n for n in SUPPORTED if "cplrp" in working_methods(build(n))])
def test_cplrp_completeness_where_it_applies(family):
    exp = vitlens.explain(_model(family), _x(), method="cplrp")
    total = exp.token_maps.sum((1, 2)).double() + exp.remainder.double()
    torch.testing.assert_close(total, exp.scores.double(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", SUPPORTED + STAGED)
def test_deterministic_and_batch_equals_one_by_one(family):
    model = _model(family)
    x = _x(3)
    working = set(_working(family))
    for name in [m for m in BATCH_METHODS if m in working]:
        full = _method(name).explain(model, x)
        again = _method(name).explain(model, x)
        torch.testing.assert_close(full.maps, again.maps, rtol=0, atol=0, msg=f"{name} not deterministic")
        for i in range(3):
            one = _method(name).explain(model, x[i:i + 1])
            torch.testing.assert_close(one.maps, full.maps[i:i + 1], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("family", SUPPORTED)
def test_capture_session_leaves_the_forward_unchanged(family):
    """The explicit-attention path the adapter switches on computes the same logits as the model's own forward,
    and the captured attention rows are probabilities (what relevance propagation needs)."""
    model = _model(family)
    adapter = vitlens.get_adapter(model)
    x = _x(2)
    with torch.no_grad():
        ref = adapter.forward(x)
    with adapter.session(capture=True) as rec:
        logits = adapter.forward(x)
    torch.testing.assert_close(logits.detach(), ref, rtol=1e-4, atol=1e-5)
    assert len(rec.blocks) == len(adapter.blocks())
    t = x.shape[0]
    for i, blk in enumerate(rec.blocks):
        if adapter.class_attention:  # CaiT: SA blocks on the N patch tokens, then CA blocks with one CLS row
            n = rec.final.shape[1] - 1
            if i < rec.self_attention:  # the talking-heads mixing tensor (not row-stochastic: tests/test_cait.py)
                assert blk.attn.shape[0] == t and blk.attn.shape[2:] == (n, n) and blk.u.shape[1] == n
            else:
                assert blk.attn.shape[0] == t and blk.attn.shape[2:] == (1, n + 1) and blk.u.shape[1] == 1
                torch.testing.assert_close(blk.attn.detach().sum(-1), torch.ones(blk.attn.shape[:-1]))
            assert blk.value.shape[:3] == blk.attn.shape[:2] + blk.attn.shape[-1:]
            continue
        torch.testing.assert_close(blk.attn.detach().sum(-1), torch.ones(blk.attn.shape[:-1]), rtol=1e-5, atol=1e-5)
        if adapter.windowed:  # Swin: one attention per window, B·nW rows of N = window-area tokens
            n = blk.window[0] * blk.window[1]
            nw = -(-blk.grid[0] // blk.window[0]) * -(-blk.grid[1] // blk.window[1])
            assert blk.attn.shape == (t * nw, blk.attn.shape[1], n, n) and blk.u.shape[1] == blk.grid[0] * blk.grid[1]
            assert blk.vnorm.shape == blk.attn.shape[:3]
            continue
        assert blk.attn.shape[0] == t and blk.attn.shape[-1] == blk.attn.shape[-2] == blk.u.shape[1]
        assert blk.value.shape[:3] == blk.attn.shape[:2] + blk.attn.shape[-1:]


@pytest.mark.parametrize("family", [n for n in SUPPORTED if "tokens" in vitlens.get_adapter(build(n)).capabilities])
def test_keeping_every_token_reproduces_the_logits(family):
    model = _model(family)
    adapter = vitlens.get_adapter(model)
    x = _x(2)
    gh, gw = adapter.grid((32, 32))
    keep = torch.arange(gh * gw).expand(2, -1).contiguous()
    with torch.no_grad():
        ref = adapter.forward(x)
        with adapter.keep_tokens(keep):
            kept = adapter.forward(x)
        with adapter.keep_tokens(keep[:, : gh * gw // 2]):
            half = adapter.forward(x)
    torch.testing.assert_close(kept, ref, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(half, ref)


@pytest.mark.parametrize("family", NEW + STAGED)
def test_model_restored_after_an_exception(family):
    model = copy.deepcopy(_model(family))
    adapter = vitlens.get_adapter(model)

    class Boom(RuntimeError):
        pass

    def bad(module, args, output):
        raise Boom("inside the forward")

    handle = adapter.blocks()[-1].register_forward_hook(bad)
    before = _fingerprint(model)
    for name in ("gradskip", "gradcam", "gradient"):
        with pytest.raises(Boom):
            vitlens.explain(model, _x(1), method=name)
        assert _fingerprint(model) == before, name
    handle.remove()


#: least correlation with the float32 map, measured on these tiny random models (docs/supported_models.md): float16
#: >= 0.998 everywhere; bfloat16 >= 0.997 except SigLIP (0.954: no prefix token, a mean readout and near-flat maps,
#: so bfloat16's 3 significant digits in the readout gradient show).
MIN_CORR = {torch.float16: 0.99, torch.bfloat16: 0.95}
#: HF Swinv2 in bfloat16: 0.941 measured (timm SwinV2, the same block: 0.9999). The model's own bfloat16 logits are
#: 5.0e-3 from float32 (timm SwinV2: 3.9e-4, HF Swin: 5.3e-4): the spread is in transformers' forward, not GradSkip's
MIN_CORR_FAMILY = {("HF Swinv2", torch.bfloat16): 0.93}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("family", SUPPORTED + STAGED)
def test_gradskip_in_half_precision_matches_float32_and_conserves(family, dtype):
    model = _model(family)
    x = _x(4)
    ref = vitlens.explain(model, x, method="gradskip", target=1)
    exp = vitlens.explain(copy.deepcopy(model).to(dtype), x, method="gradskip", target=1)
    a, b = exp.token_maps.flatten(1).double(), ref.token_maps.flatten(1).double()
    a, b = a - a.mean(1, keepdim=True), b - b.mean(1, keepdim=True)
    corr = (a * b).sum(1) / (a.norm(dim=1) * b.norm(dim=1))
    assert corr.min() >= MIN_CORR_FAMILY.get((family, dtype), MIN_CORR[dtype]), corr
    total = exp.token_maps.sum((1, 2)).double() + exp.remainder.double()
    torch.testing.assert_close(total, exp.scores.double(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", REFUSED)
def test_refused_families_say_why_and_keep_model_agnostic_methods(family):
    model = _model(family)
    with pytest.raises(UnsupportedModelError) as err:
        vitlens.explain(model, _x(1), method="gradskip")
    msg = str(err.value)
    assert type(model).__name__ in msg and "methods that work on this model: " in msg and "\n" not in msg
    listed = msg.split("methods that work on this model: ")[1].split(", ")
    assert {"gradient", "integrated_gradients", "rise"} <= set(listed)
    for name in listed:
        if name == "aha":
            continue
        exp = _method(name).explain(model, _x(2))
        assert exp.maps.shape == (2, 32, 32) and torch.isfinite(exp.maps).all(), name


def test_non_standard_timm_blocks_get_model_agnostic_methods():
    # post-norm blocks (ResPostBlock): no adapter reads them (ParallelScalingBlock, DiffAttention and ParallelThings
    # blocks are read since issue #25: tests/test_parallel_blocks.py)
    from timm.models.vision_transformer import ResPostBlock, VisionTransformer

    torch.manual_seed(0)
    m = VisionTransformer(img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=4, num_classes=3,
                          block_fn=ResPostBlock).eval()
    for name in ("gradient", "integrated_gradients", "rise", "inputxgradient"):
        exp = _method(name).explain(m, _x(2))
        assert exp.maps.shape == (2, 32, 32) and torch.isfinite(exp.maps).all()
        assert exp.token_maps.shape == (2, 4, 4)  # pooled on the model's patch grid
        torch.testing.assert_close(exp.token_maps.sum((1, 2)), exp.maps.sum((1, 2)), rtol=1e-4, atol=1e-6)
    with pytest.raises(UnsupportedModelError, match="ResPostBlock.*methods that work on this model: .*rise"):
        vitlens.explain(m, _x(1), method="gradskip")


@pytest.mark.parametrize("family", [n for n in SUPPORTED + STAGED if vitlens.get_adapter(build(n)).any_size])
def test_other_input_sizes_where_the_family_allows_them(family):
    model = _model(family)
    x = torch.randn(2, 3, 48, 40, generator=torch.Generator().manual_seed(1))
    exp = vitlens.explain(model, x, method="gradskip")
    grid = vitlens.get_adapter(model).grid((48, 40))  # (6, 5) for the patch-8 ViTs; HF Swin (patch 4): (12, 10)
    assert exp.token_maps.shape == (2, *grid) and exp.maps.shape == (2, 48, 40)
    total = exp.token_maps.sum((1, 2)).double() + exp.remainder.double()
    torch.testing.assert_close(total, exp.scores.double(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", [n for n in SUPPORTED if not vitlens.get_adapter(build(n)).any_size])
def test_fixed_size_families_refuse_other_sizes_clearly(family):
    with pytest.raises(vitlens.InputError, match="expects 32x32 inputs; got 48x48"):
        vitlens.explain(_model(family), torch.randn(1, 3, 48, 48), method="gradskip")


@pytest.mark.parametrize("family", NEW + STAGED)
def test_randomisation_check_walks_the_blocks(family):
    from vitlens.metrics.sanity import randomisation_check

    out = randomisation_check(_model(family), _x(2), method="gradskip")
    n = len(vitlens.get_adapter(_model(family)).blocks())
    assert out["stages"] == ["head"] + [f"blocks.{i}" for i in reversed(range(n))]
    assert out["spearman"].shape == (n + 1, 2)


@pytest.mark.parametrize("family, mean", [
    ("HF DINOv2", (0.485, 0.456, 0.406)), ("HF DINOv2 + registers", (0.485, 0.456, 0.406)),
    ("HF CLIP", (0.48145466, 0.4578275, 0.40821073)), ("HF SigLIP", (0.5, 0.5, 0.5)), ("HF BEiT", (0.5, 0.5, 0.5)),
])
def test_hf_families_get_their_processor_preprocessing(family, mean):
    model = _model(family)
    cfg = vitlens.get_adapter(model).data_config()
    assert cfg.input_size == (3, 32, 32) and cfg.interpolation == "bicubic"
    assert cfg.mean == pytest.approx(mean)
    from PIL import Image

    batch = vitlens.load_images([Image.new("RGB", (40, 50), (200, 30, 30))], model)
    assert batch.shape == (1, 3, 32, 32)


@pytest.mark.parametrize("family", NEW + STAGED)
def test_explicit_attention_context_is_restored(family):
    model = _model(family)
    adapter = vitlens.get_adapter(model)
    for m in model.modules():  # timm's Swin ships with the fused path off (experimental): switch it on first
        if getattr(m, "fused_attn", None) is False:
            m.fused_attn = True
    before = _fingerprint(model)
    # SwinV2's window attention has no fused path: nothing to switch there, only to leave as it was
    switchable = any(impl != "eager" for _, impl in before["configs"]) or any(
        hasattr(m, "fused_attn") for m in model.modules())  # HF Swinv2 is eager already (it only asks for attentions)
    with pytest.raises(KeyError):
        with adapter.explicit_attention():
            assert _fingerprint(model) != before or not switchable  # something was switched
            raise KeyError("inside")
    assert _fingerprint(model) == before


@pytest.mark.parametrize("family", [f.name for f in FAMILIES if why_not(build(f.name), "aha") is None])
def test_aha_runs_where_the_table_says_it_does(family):
    """The supported-models table probes AHA's feature reader; where it says ✓ an (untrained) explainer runs."""
    exp = get_method("aha", explainer="untrained", refine_steps=0).explain(_model(family), _x(2))
    assert exp.maps.shape == (2, 32, 32) and torch.isfinite(exp.maps).all()
