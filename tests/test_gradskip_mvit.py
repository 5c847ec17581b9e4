"""GradSkip on timm MViTv2 (``explainers/gradskip_mvit.py``, ``models/timm_mvit.py``): the capture matches the
model's own attention (``o − q = A·v``), the pooling hand-backs are exact first-order splits and conserve, the map
is complete (``map.sum() + remainder == y``) and every block conserves the total, with and without a CLS token, as
initialised and with trained-like parameters; on an MViTv2 that is a ViT (nothing pooled) it gives the plain ViT
path's maps; one forward and one backward per batch, batch = one by one, deterministic, the ablation switches act,
and the model is restored after success and after an exception."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import vitlens
from vitlens.explainers.gradskip_mvit import depthwise_contributions, maxpool_contributions, pooled_handback
from vitlens.models.families import trained_like
from vitlens.models.timm_mvit import attention_probabilities
from vitlens.targets import ClassLogit

from conftest import GRADSKIP_ABLATIONS, assert_restored, options_id, sharpen

pytest.importorskip("timm")
from timm.models.mvitv2 import MultiScaleVit, MultiScaleVitCfg  # noqa: E402

#: name → (MultiScaleVitCfg arguments, global_pool); three stages, so two stage transitions (pooled q, pooled skip)
VARIANTS = {
    "avg": (dict(), None),
    "cls": (dict(use_cls_token=True), None),
    "cls-avg": (dict(use_cls_token=True), "avg"),  # a CLS token the head does not read
    "no-expand": (dict(expand_attn=False), None),  # the width changes in the MLP's skip projection
    "no-residual-pooling": (dict(residual_pooling=False, use_cls_token=True), None),
    "no-rel-pos": (dict(rel_pos_type="none", use_abs_pos=True), None),
    "no-pooling": (dict(kernel_qkv=(1, 1), stride_q=((1, 1),) * 3, stride_kv_adaptive=(1, 1)), None),
}


def _mvit(kind: str = "cls", trained: bool = True, seed: int = 0) -> nn.Module:
    extra, pool = VARIANTS[kind]
    args = dict(depths=(1, 2, 1), embed_dim=16, num_heads=2, stride_q=((1, 1), (2, 2), (2, 2)))
    torch.manual_seed(seed)
    model = MultiScaleVit(MultiScaleVitCfg(**{**args, **extra}), img_size=32, num_classes=5, global_pool=pool)
    model = sharpen(model.eval())
    return trained_like(model) if trained else model


def _x(n: int = 3, size: int = 32, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> None:
    torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol * float(b.abs().max()))


# -- capture ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["avg", "cls", "no-rel-pos", "no-pooling"])
def test_capture_matches_the_models_own_attention_and_logits(kind):
    model = _mvit(kind)
    adapter = vitlens.get_adapter(model)
    x = _x(2)
    with torch.no_grad():
        ref = model(x)
    with adapter.session(capture=True) as rec:
        logits = adapter.forward(x)
    torch.testing.assert_close(logits.detach(), ref, rtol=1e-5, atol=1e-6)
    assert len(rec.blocks) == 4 and rec.final is not None
    p = adapter.num_prefix_tokens
    for i, blk in enumerate(rec.blocks):
        attn = attention_probabilities(blk)
        b, tq = blk.o.shape[:2]
        heads = blk.attn.num_heads
        assert attn.shape == (b, heads, tq, blk.k.shape[2]) and blk.v.shape[2] == blk.k.shape[2]
        torch.testing.assert_close(attn.sum(-1), torch.ones(attn.shape[:-1]))
        o = blk.o.detach().reshape(b, tq, heads, -1).transpose(1, 2)
        av = o - blk.q if blk.attn.residual_pooling else o
        torch.testing.assert_close(av, attn @ blk.v, rtol=1e-5, atol=1e-6)  # A recomputed as the model computed it
        assert tq == p + blk.q_size[0] * blk.q_size[1] and blk.u.shape[1] == p + blk.grid_in[0] * blk.grid_in[1]
        pooled_skip = kind != "no-pooling" and i in (1, 3)  # each stage's first block after the first stage
        assert (blk.skip_pool is not None) == pooled_skip and (blk.q_size != blk.grid_in) == pooled_skip


# -- hand-backs -------------------------------------------------------------------------------------------------------

def _grad_at(module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The output of ``module`` on ``x`` and the gradient of a random linear score at it."""
    out = module(x)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    return out.detach(), w


@pytest.mark.parametrize("stride", [1, 2, 4])
def test_depthwise_contributions_are_the_exact_first_order_split(stride):
    conv = nn.Conv2d(4, 4, 3, stride=stride, padding=1, groups=4, bias=False)
    x = torch.randn(2, 4, 9, 7)
    out, g = _grad_at(conv, x)
    c = depthwise_contributions(x, g, conv)  # (N, K, 9)
    assert c.shape == (2, out.shape[-2] * out.shape[-1], 9)
    _close(c.sum(-1), (out * g).sum(1).flatten(1))
    # one input position: its contributions over all windows = ⟨x_j, ∂y/∂x_j⟩ (the conv is linear, bias-free)
    xg = x.clone().requires_grad_(True)
    (conv(xg) * g).sum().backward()
    per_input = torch.nn.functional.fold(c.transpose(1, 2), (9, 7), kernel_size=3, padding=1, stride=stride)
    _close(per_input[:, 0], (xg.grad * x).sum(1))


def test_maxpool_contributions_sit_on_the_arg_max():
    pool = nn.MaxPool2d(3, 2, 1)
    x = torch.randn(2, 5, 8, 8)
    out, g = _grad_at(pool, x)
    c = maxpool_contributions(x, g, pool)
    _close(c.sum(-1), (out * g).sum(1).flatten(1))
    xg = x.clone().requires_grad_(True)
    (pool(xg) * g).sum().backward()  # the gradient of max: the same arg-max positions
    per_input = torch.nn.functional.fold(c.transpose(1, 2), (8, 8), kernel_size=3, padding=1, stride=2)
    _close(per_input[:, 0], (xg.grad * x).sum(1))


@pytest.mark.parametrize("prefix", [0, 1])
def test_pooled_handback_conserves_and_falls_back_to_uniform(prefix):
    pool = nn.MaxPool2d(3, 2, 1)
    r = torch.rand(2, prefix + 9)
    c = torch.rand(2, 9, 9) - 0.3
    back = pooled_handback(r, c, (6, 6), pool, prefix)
    assert back.shape == (2, prefix + 36) and float(back.min()) >= 0
    _close(back.sum(-1), r.sum(-1))
    assert torch.equal(back[:, :prefix], r[:, :prefix])  # CLS passes the pooling unchanged
    one = torch.zeros(1, prefix + 9)
    one[0, prefix] = 1.0  # the corner window covers rows/cols {-1, 0, 1}: 4 in-image positions
    flat = pooled_handback(one, -torch.ones(1, 9, 9), (6, 6), pool, prefix)[0, prefix:].reshape(6, 6)
    assert torch.allclose(flat[:2, :2], torch.full((2, 2), 0.25)) and float(flat.sum()) == pytest.approx(1.0)


# -- the method -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("trained", [False, True], ids=["init", "trained-like"])
@pytest.mark.parametrize("kind", list(VARIANTS))
def test_complete_and_conserved_block_by_block(kind, trained):
    model = _mvit(kind, trained)
    adapter = vitlens.get_adapter(model)
    exp = vitlens.explain(model, _x(), method="gradskip")
    assert exp.token_maps.shape == (3, 8, 8) and exp.maps.shape == (3, 32, 32)
    y = exp.scores
    _close(exp.token_maps.sum((1, 2)) + exp.remainder, y)  # complete
    totals = exp.extras["layer_totals"]  # (B, 4): the total on each block's input
    assert totals.shape == (3, 4)
    _close(totals, y[:, None].expand_as(totals))  # every block conserves (skip, A·v, pooled q, all hand-backs)
    if adapter.num_prefix_tokens == 0:
        assert torch.equal(exp.remainder, torch.zeros(3))
    else:
        assert bool((exp.remainder != 0).all())  # what ends on CLS is reported, not dropped
    assert exp.extras["head_weights"].shape == (3, 4, 8)
    _close(exp.extras["head_weights"].sum(-1), torch.ones(3, 4))
    for li, tq in enumerate([64] * 4 if kind == "no-pooling" else [64, 16, 16, 4]):
        for key in ("beta_main", "gamma_attention"):
            gate = exp.extras[f"{key}_block{li}"]
            assert gate.shape == (3, adapter.num_prefix_tokens + tq) and 0 <= float(gate.min()) <= float(gate.max()) <= 1
    if kind == "no-residual-pooling":
        assert all(bool((exp.extras[f"gamma_attention_block{li}"] > 1 - 1e-6).all()) for li in range(4))


def _mvit_and_its_vit(cls_token: bool) -> tuple[nn.Module, nn.Module]:
    """An MViTv2 with nothing pooled (1×1 kernels, stride 1), no residual pooling, no relative positions and a 4×4
    patchifying embedding — its blocks are then plain pre-norm ViT blocks — and a timm ViT with the same weights."""
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    cfg = MultiScaleVitCfg(depths=(3,), embed_dim=16, num_heads=2, stride_q=((1, 1),), kernel_qkv=(1, 1),
                           stride_kv_adaptive=(1, 1), residual_pooling=False, rel_pos_type="none", use_abs_pos=True,
                           use_cls_token=cls_token, patch_kernel=(4, 4), patch_stride=(4, 4), patch_padding=(0, 0))
    mvit = trained_like(sharpen(MultiScaleVit(cfg, img_size=32, num_classes=5).eval()))
    vit = VisionTransformer(img_size=32, patch_size=4, embed_dim=16, depth=3, num_heads=2, num_classes=5,
                            class_token=cls_token, global_pool="token" if cls_token else "avg", fc_norm=False).eval()
    vit.load_state_dict({k.replace("stages.0.blocks.", "blocks.").replace("head.fc.", "head."): v
                         for k, v in mvit.state_dict().items()})
    return mvit, vit


@pytest.mark.parametrize("opts", [{}, {"skip": "fixed"}, {"head_weighting": "uniform"}], ids=options_id)
@pytest.mark.parametrize("cls_token", [False, True], ids=["avg", "cls"])
def test_without_pooling_it_is_the_plain_vit_path(cls_token, opts):
    """The pooled path reduces to the plain ViT path (``explainers/gradskip.py``, another implementation) where
    the model reduces to a ViT: the same maps and remainder, from the same weights."""
    mvit, vit = _mvit_and_its_vit(cls_token)
    x = _x(2)
    torch.testing.assert_close(mvit(x), vit(x), rtol=1e-5, atol=1e-6)
    a = vitlens.explain(mvit, x, method="gradskip", **opts)
    b = vitlens.explain(vit, x, method="gradskip", **opts)
    assert vitlens.get_adapter(vit).family == "timm-vit"
    torch.testing.assert_close(a.token_maps, b.token_maps, rtol=1e-4, atol=1e-6 * float(b.token_maps.abs().max()))
    torch.testing.assert_close(a.remainder, b.remainder, rtol=1e-4, atol=1e-7)


def test_other_targets_and_smaller_inputs_stay_complete():
    model = _mvit("cls")
    x = _x(2, 24)  # a 6x6 grid (the tables are built for 8x8): the relative positions index the smaller grid
    for target in (ClassLogit(1), ClassLogit([0, 4])):
        exp = vitlens.explain(model, x, method="gradskip", target=target)
        assert exp.token_maps.shape == (2, 6, 6)
        _close(exp.token_maps.sum((1, 2)) + exp.remainder, exp.scores)


def test_exactly_one_forward_and_one_backward_per_batch():
    model = _mvit("cls")
    calls = {"fwd": 0, "bwd": 0}

    def fwd(module, args, out):
        calls["fwd"] += 1
        out.register_hook(lambda g: calls.__setitem__("bwd", calls["bwd"] + 1))

    seen = []
    hooks = [model.register_forward_hook(fwd),
             model.patch_embed.proj.register_full_backward_hook(lambda *a: seen.append(1))]
    try:
        exp = vitlens.explain(model, _x(4), method="gradskip")
    finally:
        for h in hooks:
            h.remove()
    assert calls == {"fwd": 1, "bwd": 1}
    assert seen == []  # the backward stops at the first block's input
    assert exp.cost.model_calls == 1 and exp.cost.backward_calls == 1


@pytest.mark.parametrize("kind", ["avg", "cls"])
def test_batch_equals_one_by_one_and_chunks_and_is_deterministic(kind):
    model = _mvit(kind)
    x = _x(3)
    full = vitlens.explain(model, x, method="gradskip")
    scale = float(full.token_maps.abs().max())
    for i in range(3):
        one = vitlens.explain(model, x[i:i + 1], method="gradskip")
        torch.testing.assert_close(one.token_maps[0], full.token_maps[i], rtol=1e-4, atol=1e-5 * scale)
    chunked = vitlens.explain(model, x, method="gradskip", batch_size=2)
    assert chunked.cost.model_calls == 2
    torch.testing.assert_close(chunked.token_maps, full.token_maps, rtol=1e-4, atol=1e-5 * scale)
    assert torch.equal(vitlens.explain(model, x, method="gradskip").maps, full.maps)


@pytest.fixture(scope="module")
def ablation_setup():
    model = _mvit("cls", seed=3)
    x = _x(2, seed=5)
    return model, x, vitlens.explain(model, x, method="gradskip")


@pytest.mark.parametrize("opts", GRADSKIP_ABLATIONS, ids=options_id)
def test_each_ablation_switch_changes_the_map_and_stays_complete(opts, ablation_setup):
    model, x, base = ablation_setup
    exp = vitlens.explain(model, x, method="gradskip", **opts)
    assert not torch.allclose(exp.token_maps, base.token_maps, rtol=1e-4, atol=1e-7), opts
    _close(exp.token_maps.sum((1, 2)) + exp.remainder, exp.scores)


class Boom(RuntimeError):
    pass


class ExplodingTarget(ClassLogit):
    def score(self, logits):
        raise Boom("fails after the forward pass, with every hook installed")


@pytest.mark.parametrize("train_mode", [False, True])
def test_model_restored_after_success_and_exception(train_mode):
    model = _mvit("cls").train(train_mode)
    for p in list(model.parameters())[:3]:
        p.requires_grad_(False)
    assert_restored(model, lambda m: vitlens.explain(m, _x(1), method="gradskip"), model.stages[1].blocks[0].attn)
    from conftest import model_fingerprint

    before = model_fingerprint(model)
    with pytest.raises(Boom):
        vitlens.explain(model, _x(1), method="gradskip", target=ExplodingTarget(1))
    assert model_fingerprint(model) == before and model.training == train_mode


def test_cost_script_runs_and_reports_complete_maps():
    """``benchmarks/gradskip_mvit_cost.py`` end to end on the tiny models (times are never asserted on)."""
    from conftest import load_benchmark

    threads = torch.get_num_threads()
    rows = load_benchmark("gradskip_mvit_cost").main(["--pairs", "1"])
    assert torch.get_num_threads() == threads and len(rows) == 2
    for r in rows:
        assert r["completeness"] <= 1e-5 and r["conservation"] <= 1e-5 and r["ratio_median"] > 0
