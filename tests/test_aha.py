"""AHA: the soft sorter, the soft curves and loss, training (frozen target, resume, DDP) and the method's refinement.

Everything runs on a tiny random ViT (32 px, 4×4 tokens) in seconds; the 2-process run uses ``torch.distributed.run``
with gloo on CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import vitlens
from vitlens.aha.evaluation import deletion_insertion
from vitlens.aha.network import AHANet, load_explainer, save_explainer
from vitlens.aha.soft_metrics import (RegionGrid, aha_loss, curve_fractions, reference, soft_curves,
                                      soft_membership)
from vitlens.aha.sorter import gumbel_noise, hard_sort, sinkhorn, sinkhorn_error, soft_sort
from vitlens.aha.train import AHATrainConfig, add_train_aha_parser, train_aha, training_loss
from vitlens.errors import UnsupportedModelError

from conftest import model_fingerprint, tiny_vit

SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: one intra-op thread is much faster than two on a shared CPU (restored after each test)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_target(seed: int = 0):
    """A 6-class tiny ViT with a data config (32 px, the scenes' normalisation)."""
    m = tiny_vit(seed=seed, num_classes=6)
    m.vitlens_data_config = {"input_size": (3, 32, 32), "mean": (0.5, 0.5, 0.5), "std": (0.25, 0.25, 0.25),
                             "crop_pct": 1.0}
    return m


def tiny_data(n_train: int = 8, n_val: int = 4):
    """Normalised 32-px scenes as tensors: (train_x, train_y, val_x, val_y)."""
    from vitlens.images import normalize

    tr = vitlens.data.make_scenes(n_train, seed=11, size=32)
    va = vitlens.data.make_scenes(n_val, seed=12, size=32)
    cfg = {"input_size": (3, 32, 32), "mean": (0.5,) * 3, "std": (0.25,) * 3}
    return normalize(tr.images, cfg), tr.labels, normalize(va.images, cfg), va.labels


#: a fast configuration: small grids, 4 curve points, a narrow decoder
FAST = dict(batch_size=4, m=4, grid_range=(2, 4), width=8, n_val=4, ckpt_every=2, chunk=64)


def distinct_scores(b: int, d: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(d, generator=g).double() + 0.5 * torch.rand(d, generator=g, dtype=torch.float64)
                        for _ in range(b)])


# --------------------------------------------------------------------------------------------------------------------
# Sorter
# --------------------------------------------------------------------------------------------------------------------


def test_sorter_tends_to_the_hard_sort():
    s = distinct_scores(6, 10)
    hard = hard_sort(s)
    # hard_sort is the permutation matrix of torch.argsort (rank j holds region order[j])
    order = torch.argsort(s, dim=-1, descending=True)
    assert torch.equal(hard.argmax(dim=2), order)
    errors = []
    for tau in (0.1, 0.01, 1e-3, 1e-4):
        p = soft_sort(s, tau, n_iters=3000)
        errors.append(float((p - hard).abs().max()))
    assert all(a > b for a, b in zip(errors, errors[1:])), errors
    assert errors[-1] < 1e-3, errors
    assert torch.equal(soft_sort(s, 1e-4, 3000).argmax(dim=2), order)
    # ascending = the sorter applied to −s
    asc = soft_sort(s, 1e-4, 3000, descending=False)
    assert torch.equal(asc.argmax(dim=2), torch.argsort(s, dim=-1, descending=False))


def test_sorter_is_doubly_stochastic_and_scale_invariant():
    s = torch.rand(4, 25, generator=torch.Generator().manual_seed(1))
    p = soft_sort(s, 0.3, 30)
    err = sinkhorn_error(p)
    assert float(err["row"].max()) < 1e-5 and float(err["col"].max()) < 1e-3
    torch.testing.assert_close(soft_sort(3.0 * s - 7.0, 0.3, 30), p, atol=1e-5, rtol=1e-5)
    # the scaling form and the log form are the same iteration
    noise = gumbel_noise((4, 25, 25), generator=torch.Generator().manual_seed(2))
    for tau in (1.0, 0.3):
        torch.testing.assert_close(soft_sort(s, tau, 30, noise=noise, method="scaling"),
                                   soft_sort(s, tau, 30, noise=noise, method="log"), atol=1e-5, rtol=1e-4)
    u = gumbel_noise((1000,), generator=torch.Generator().manual_seed(3))
    assert torch.isfinite(u).all() and abs(float(u.mean()) - 0.5772) < 0.1


def test_scaling_sinkhorn_backward_is_autograd_through_the_loop():
    """The scaling form (row vectors times contiguous matrices, a hand-written backward with one product for the 2n
    rank-one parts of ∂K) gives the plain loop's ``P`` and autograd's gradient through it: to rounding in float64
    (and ``gradcheck``), at float32 rounding in float32."""
    def loop(log_alpha, n):  # the iteration as written before the hand-written backward
        k = (log_alpha - log_alpha.flatten(1).amax(1)[:, None, None]).exp()
        r = torch.ones(k.shape[0], k.shape[1], 1, dtype=k.dtype)
        c = r
        for _ in range(n):
            c = 1.0 / torch.bmm(k.transpose(1, 2), r)
            r = 1.0 / torch.bmm(k, c)
        return r * k * c.transpose(1, 2)

    g = torch.Generator().manual_seed(4)
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 5e-5)):
        s = torch.rand(3, 1, 20, generator=g, dtype=torch.float64)
        la = (-(s - torch.linspace(0, 1, 20, dtype=torch.float64)[None, :, None]) ** 2 / 0.03).to(dtype)
        la.requires_grad_(True)
        w = torch.randn(3, 20, 20, generator=g, dtype=torch.float64).to(dtype)
        p = sinkhorn(la, 30, method="scaling")
        (got,) = torch.autograd.grad((p * w).sum(), la)
        (want,) = torch.autograd.grad((loop(la, 30) * w).sum(), la)
        torch.testing.assert_close(p.detach(), loop(la, 30).detach(), rtol=0, atol=tol)  # the same forward
        torch.testing.assert_close(got, want, rtol=0, atol=tol * float(want.abs().max()))
    small = torch.randn(2, 5, 5, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a: sinkhorn(a, 7, method="scaling"), (small,))


# --------------------------------------------------------------------------------------------------------------------
# Regions and soft curves
# --------------------------------------------------------------------------------------------------------------------


def test_region_grid_matches_pooling_and_nearest_upsampling():
    maps = torch.randn(2, 32, 32)
    grid = RegionGrid((32, 32), 4)
    torch.testing.assert_close(grid.pool(maps), F.avg_pool2d(maps[:, None], 8).reshape(2, -1))
    vals = torch.rand(2, 3, 16)
    up = F.interpolate(vals.reshape(6, 1, 4, 4), size=(32, 32), mode="nearest").reshape(2, 3, 32, 32)
    torch.testing.assert_close(grid.to_pixels(vals, blur_sigma=0), up)
    shifted = RegionGrid((32, 32), 4, offset=(3, 5))
    assert shifted.d == 25 and int(shifted.counts.sum()) == 32 * 32
    torch.testing.assert_close(shifted.pool(torch.ones(1, 32, 32)), torch.ones(1, 25))


def test_soft_membership_counts_and_interpolates():
    p = soft_sort(torch.rand(3, 9), 0.5, 30)
    fr = torch.tensor([0.0, 0.1, 0.5, 1.0])
    c = soft_membership(p, fr)
    torch.testing.assert_close(c.sum(-1), (fr * 9).expand(3, -1), atol=1e-4, rtol=0)  # rows of P sum to one
    h = soft_membership(hard_sort(torch.arange(9.0)[None]), torch.tensor([2.5 / 9]))
    torch.testing.assert_close(h[0, 0], torch.tensor([1, 1, 0.5, 0, 0, 0, 0, 0, 0.0]).flip(0))


def _curve_case():
    """A tiny target's adapter, two images, two random maps, a 4×4 grid, 9 fractions, the mean reference."""
    adapter = vitlens.get_adapter(tiny_target())
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    maps = torch.randn(2, 32, 32, generator=torch.Generator().manual_seed(1))
    return adapter, x, maps, RegionGrid((32, 32), 4), curve_fractions(9), reference(x, "mean", (0.5,) * 3, (0.25,) * 3)


def test_soft_aucs_approach_hard_aucs():
    adapter, x, maps, grid, fr, ref = _curve_case()
    with adapter.session(capture=False), torch.no_grad():
        cls = adapter.forward(x).argmax(-1)

        def prob(im, c):
            return adapter.forward(im).softmax(-1).gather(1, c[:, None])[:, 0]

        hard = soft_curves(prob, x, ref, maps, cls, grid, fr, tau=1.0, hard=True)
        gaps = []
        for tau in (0.3, 0.03, 3e-3, 3e-4):
            soft = soft_curves(prob, x, ref, maps, cls, grid, fr, tau=tau, n_iters=2000)
            gaps.append(float(torch.cat([(soft.del_auc - hard.del_auc).abs(), (soft.ins_auc - hard.ins_auc).abs()])
                              .max()))
    assert gaps[-1] < 1e-3 and gaps[-1] < gaps[0], gaps
    # the hard curves start at prob(x) and end at prob(ref)
    with torch.no_grad(), adapter.session(capture=False):
        torch.testing.assert_close(hard.deletion[:, 0], prob(x, cls))
        torch.testing.assert_close(hard.deletion[:, -1], prob(ref, cls), atol=1e-5, rtol=1e-4)


def test_straight_through_curves_are_the_hard_ones_with_the_sorters_gradient():
    adapter, x, maps, grid, fr, ref = _curve_case()
    with adapter.session(capture=False):
        cls = adapter.forward(x).argmax(-1)

        def prob(im, c):
            return adapter.forward(im).softmax(-1).gather(1, c[:, None])[:, 0]

        with torch.no_grad():
            hard = soft_curves(prob, x, ref, maps, cls, grid, fr, tau=1.0, hard=True)
            soft = soft_curves(prob, x, ref, maps, cls, grid, fr, tau=0.1)
        m = maps.clone().requires_grad_(True)
        st = soft_curves(prob, x, ref, m, cls, grid, fr, tau=0.1, straight_through=True)
        (st.del_auc - st.ins_auc).sum().backward()
    torch.testing.assert_close(st.del_auc.detach(), hard.del_auc)  # the values are the hard ranking's
    torch.testing.assert_close(st.ins_auc.detach(), hard.ins_auc)
    g = m.grad
    assert g is not None and bool(torch.isfinite(g).all()) and float(g.abs().max()) > 0  # the sorter's gradient
    assert float((soft.del_auc - hard.del_auc).abs().max()) > 1e-4  # ... which the relaxation's values are not


# --------------------------------------------------------------------------------------------------------------------
# Loss, training, resume, DDP
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe,maps_per_image,overrides", [("tracked", 1, {}), ("authors", 1, {}),
                                                               ("authors", 2, {"classes": "maps"})])
def test_loss_trains_the_decoder_only(recipe, maps_per_image, overrides):
    model = tiny_target()
    for p in model.parameters():
        p.requires_grad_(True)
    net = AHANet(model, width=8, seed=0)
    x, y, _, _ = tiny_data(4, 1)
    cfg = AHATrainConfig.preset(recipe, **{k: v for k, v in FAST.items() if k in AHATrainConfig.__dataclass_fields__},
                                **overrides)
    with net.target_adapter.session(capture=False):
        loss, parts, plan = training_loss(net, net.decoder, x, y, list(range(4)), 0, cfg, 1.0,
                                          ((0.5,) * 3, (0.25,) * 3), mean_img=x.mean(0))
        loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for p in net.decoder.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert sum(float(g.abs().sum()) for g in grads) > 0
    assert net.decoder.head3.weight.grad.abs().sum() > 0 and net.decoder.class_embed.weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in model.parameters())
    assert all(p.requires_grad for p in model.parameters())  # restored after the session
    assert parts["del_auc"].shape == (4 * maps_per_image,)  # 4 images x (1 or 2) maps (authors: 1 map, 2 classes)


def test_training_leaves_the_target_unchanged(tmp_path):
    model = tiny_target()
    before = model_fingerprint(model)
    res = train_aha(model, tiny_data(), tmp_path, steps=2, progress=False, **FAST)
    assert res.finished and res.weights.is_file()
    assert model_fingerprint(model) == before
    meta = json.loads(res.weights.with_suffix(".json").read_text())
    assert meta["validation"]["n"] == 4 and len(meta["loss_history"]) == 2
    assert (tmp_path / "aha.md").is_file() and (tmp_path / "checkpoint.pt").is_file()


def test_resume_matches_an_uninterrupted_run(tmp_path):
    data = tiny_data()
    full = train_aha(tiny_target(), data, tmp_path / "full", steps=4, progress=False, **FAST)
    part = train_aha(tiny_target(), data, tmp_path / "split", steps=4, stop_after=2, progress=False, **FAST)
    assert not part.finished and part.step == 2 and part.weights is None
    rest = train_aha(tiny_target(), data, tmp_path / "split", steps=4, resume=True, progress=False, **FAST)
    assert rest.finished and rest.step == 4 and len(rest.history) == 4
    for (k, a), b in zip(full.net.state_dict().items(), rest.net.state_dict().values()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=k)
    assert [h["loss"] for h in full.history] == pytest.approx([h["loss"] for h in rest.history], rel=1e-6)
    with pytest.raises(vitlens.InputError, match="config differs"):
        train_aha(tiny_target(), data, tmp_path / "split", steps=4, resume=True, progress=False,
                  **{**FAST, "m": 5})


_DDP_SCRIPT = """
import json, sys, torch
sys.path.insert(0, {tests!r})
from test_aha import tiny_target, tiny_data, FAST
from vitlens.aha.train import train_aha
torch.set_num_threads(1)
res = train_aha(tiny_target(), tiny_data(), {out!r}, steps=3, progress=False, **FAST)
"""


@pytest.mark.slow
def test_two_process_ddp_matches_one_process(tmp_path):
    script = tmp_path / "ddp_train.py"
    script.write_text(textwrap.dedent(_DDP_SCRIPT.format(tests=str(Path(__file__).parent), out=str(tmp_path / "ddp"))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    single = train_aha(tiny_target(), tiny_data(), tmp_path / "single", steps=3, progress=False, **FAST)
    ddp_meta = json.loads((tmp_path / "ddp" / "aha.json").read_text())
    assert ddp_meta["processes"] == 2
    assert ddp_meta["loss_history"] == pytest.approx([h["loss"] for h in single.history], rel=1e-4, abs=1e-5)
    ddp_net = load_explainer(tmp_path / "ddp" / "aha.safetensors", tiny_target())
    # Adam turns the all-reduce's float rounding (~1e-7 relative) into whole steps for parameters whose gradient is
    # near zero: its update lr·m̂/sqrt(v̂) is ±lr whatever the gradient's size, and rounding can decide the sign. So no
    # bound on single weights follows from the computation (up to 2·lr per step); what does: such parameters are few
    # (their gradients are at rounding level), while a wrong shard or a missed all-reduce moves most weights. Hence:
    # fewer than 1 % of the weights differ by more than a tenth of a step, and the mean difference is below a
    # hundredth of a step; the loss history above (which every weight feeds) agrees to 1e-4.
    lr = AHATrainConfig().lr
    diffs = torch.cat([(a - b).abs().flatten() for a, b in zip(single.net.state_dict().values(),
                                                                ddp_net.state_dict().values())])
    assert float((diffs > lr / 10).float().mean()) < 0.01, float((diffs > lr / 10).float().mean())
    assert float(diffs.mean()) < lr / 100, float(diffs.mean())


def test_cli_parser():
    import argparse

    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="command")
    add_train_aha_parser(sub)
    args = p.parse_args(["train-aha", "--model", "shapes-vit", "--out", "x", "--steps", "5", "--grid-range", "4",
                         "8", "--step-sampling", "random"])
    assert args.steps == 5 and args.grid_range == [4, 8] and args.func.__name__ == "cmd_train_aha"


# --------------------------------------------------------------------------------------------------------------------
# The method
# --------------------------------------------------------------------------------------------------------------------


def test_refine_steps_zero_is_the_network_map_and_refinement_lowers_the_soft_loss(tmp_path):
    model = tiny_target()
    net = AHANet(model, width=8, seed=3)
    x = tiny_data(3, 1)[0]
    exp = vitlens.explain(model, x, method="aha", explainer=net, refine_steps=0)
    with torch.no_grad():
        direct = net(x, exp.targets)
    assert torch.equal(exp.maps, direct)
    assert exp.cost.forward_passes == 1 and exp.cost.backward_passes == 0

    # saved and loaded: the same map
    path, _ = save_explainer(net, tmp_path / "e.safetensors", {"target": {}})
    again = vitlens.explain(model, x, method="aha", explainer=str(path), refine_steps=0)
    torch.testing.assert_close(again.maps, exp.maps)

    # one fixed reference (the mean: zeros here), so the loss it lowers is the one measured below
    refined = vitlens.explain(model, x, method="aha", explainer=net, refine_steps=3, m=6, reference="mean")
    assert not torch.equal(refined.maps, exp.maps)
    assert refined.cost.forward_passes == 1 + 1 + 3 * 2 * 4 and refined.cost.backward_passes == 3 * 2 * 4
    adapter = vitlens.get_adapter(model)
    grid = RegionGrid((32, 32), adapter.grid((32, 32)))
    fr = curve_fractions(6)
    ref = torch.zeros_like(x)
    with adapter.session(capture=False), torch.no_grad():
        def prob(im, c):
            return adapter.forward(im).softmax(-1).gather(1, c[:, None])[:, 0]

        def soft_loss(maps):
            return aha_loss(soft_curves(prob, x, ref, maps, exp.targets, grid, fr, 0.3), maps)[0]

        assert float(soft_loss(refined.maps).mean()) < float(soft_loss(exp.maps).mean())


def test_mixed_reference_refinement_takes_the_references_in_turn():
    from vitlens.aha.refine import refine_maps

    model = tiny_target()
    net = AHANet(model, width=8, seed=3)
    x = tiny_data(3, 1)[0]
    mixed = vitlens.explain(model, x, method="aha", explainer=net, refine_steps=3, m=6, reference="mixed")
    # one forward per reference (mean, black, blur), declared = counted
    assert mixed.cost.forward_passes == 1 + 3 + 3 * 2 * 4 and mixed.cost.backward_passes == 3 * 2 * 4
    assert torch.isfinite(mixed.maps).all()
    # the default refinement reference is mixed; one fixed reference gives another map
    assert torch.equal(mixed.maps, vitlens.explain(model, x, method="aha", explainer=net, refine_steps=3, m=6).maps)
    assert not torch.equal(mixed.maps, vitlens.explain(model, x, method="aha", explainer=net, refine_steps=3, m=6,
                                                       reference="mean").maps)
    # one step with a list of references is the step with its first reference alone
    adapter = vitlens.get_adapter(model)
    with adapter.session(capture=False):
        def prob(im, c):
            return adapter.forward(im).softmax(-1).gather(1, c[:, None])[:, 0]

        cls = torch.tensor([0, 1, 2])
        maps0 = torch.rand(3, 32, 32, generator=torch.Generator().manual_seed(0))
        r1, r2 = torch.zeros_like(x), torch.ones_like(x)
        with torch.no_grad():
            e1, e2 = (prob(x, cls), prob(r1, cls)), (prob(x, cls), prob(r2, cls))
        one = refine_maps(prob, x, maps0, cls, r1, e1, steps=1, grid=4, m=6)
        listed = refine_maps(prob, x, maps0, cls, [r1, r2], [e1, e2], steps=1, grid=4, m=6)
        torch.testing.assert_close(one, listed)
        with pytest.raises(ValueError, match="as many endpoint pairs"):
            refine_maps(prob, x, maps0, cls, [r1, r2], [e1], steps=1, grid=4, m=6)
    with pytest.raises(vitlens.InputError, match="'mixed'"):
        vitlens.explain(model, x, method="aha", explainer=net, reference="grey")


def test_default_explainer_needs_a_shipped_one():
    with pytest.raises(UnsupportedModelError, match="no shipped AHA explainer"):
        vitlens.explain(tiny_target(), torch.randn(1, 3, 32, 32), method="aha")


def test_hard_evaluation_protocol():
    model = tiny_target()
    x = tiny_data(2, 1)[0]
    maps = torch.randn(2, 32, 32, generator=torch.Generator().manual_seed(0))
    r = deletion_insertion(model, x, maps)
    assert r["deletion_curve"].shape == (2, 21)
    adapter = vitlens.get_adapter(model)
    with torch.no_grad():
        p = adapter.forward(x).softmax(-1).gather(1, r["classes"][:, None])[:, 0]
        p_ref = adapter.forward(torch.zeros_like(x)).softmax(-1).gather(1, r["classes"][:, None])[:, 0]
    torch.testing.assert_close(r["deletion_curve"][:, 0], p)
    torch.testing.assert_close(r["insertion_curve"][:, -1], p)
    torch.testing.assert_close(r["deletion_curve"][:, -1], p_ref)
    torch.testing.assert_close(r["insertion_curve"][:, 0], p_ref)
    torch.testing.assert_close(r["difference"], r["insertion"] - r["deletion"])


def test_accelerator_options_run_on_cpu_and_are_restored(tmp_path):
    """The CUDA defaults (bf16 autocast, per-block gradient checkpointing of the target) forced on the CPU."""
    model = tiny_target()
    before = model_fingerprint(model)
    res = train_aha(model, tiny_data(), None, steps=2, progress=False, amp="bf16", grad_checkpointing="on",
                    **{k: v for k, v in FAST.items() if k != "ckpt_every"})
    assert res.finished and all(torch.isfinite(torch.tensor(h["loss"])) for h in res.history)
    assert not getattr(model, "grad_checkpointing", False)
    assert model_fingerprint(model) == before
