"""ViT-Shapley: the surrogate's masking, the subset samplers, KernelSHAP and exact Shapley values, the training loop
(steps, resume, torchrun), the explainer's efficiency, the method and the shipped explainers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import vitlens
from vitlens.errors import DamagedFileError
from vitlens.explainers import get_method
from vitlens.shapley import (SHIPPED, WEIGHTS_DIR, ShapleyExplainer, load_shapley, masked_logits, patch_layout,
                             shipped_shapley, train_shapley)
from vitlens.shapley.kernelshap import exact_shapley, kernelshap, surrogate_game
from vitlens.shapley.sampling import generator, shapley_kernel_sizes, shapley_subsets, uniform_subsets

from conftest import VARIANTS, tiny_vit

SRC = Path(__file__).resolve().parents[1] / "src"
FAST = dict(surrogate_steps=3, steps=3, batch_size=4, masks=4, n_val=4, ckpt_every=1)


def tiny_data(n_train: int = 16, n_val: int = 4):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(n_train, 3, 32, 32, generator=g), None, torch.randn(n_val, 3, 32, 32, generator=g), None)


def x_batch(n=3, size=32, seed=0):
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------------------------------------------------
# The surrogate's masking
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_all_patches_visible_is_the_model(variant):
    model = VARIANTS[variant]()
    x = x_batch(2)
    with torch.no_grad():
        torch.testing.assert_close(masked_logits(model, x, torch.ones(2, 16)), model(x), rtol=0, atol=0)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_held_out_patches_do_not_reach_the_output(variant):
    model = VARIANTS[variant]()
    x = x_batch(1)
    keep = torch.ones(1, 16)
    keep[0, [0, 5, 6, 15]] = 0
    y = x.clone()
    y[..., 0:8, 0:8] = 10.0  # patch 0 (row-major)
    y[..., 8:16, 8:24] = -7.0  # patches 5 and 6
    with torch.no_grad():
        a, b = masked_logits(model, x, keep), masked_logits(model, y, keep)
        c = masked_logits(model, y, torch.ones(1, 16))
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(a, c, atol=1e-4)  # the patches matter when visible


def test_masking_equals_dropping_the_tokens():
    model = tiny_vit()
    x = x_batch(1)
    keep = torch.zeros(1, 16)
    vis = [1, 2, 7, 8, 9, 12]
    keep[0, vis] = 1
    with torch.no_grad():
        t = model._pos_embed(model.patch_embed(x * 1.0))
        t = torch.cat([t[:, :1], t[:, 1:][:, vis]], 1)
        for blk in model.blocks:
            t = blk(t)
        dropped = model.forward_head(model.norm(t))
        torch.testing.assert_close(masked_logits(model, x, keep), dropped, rtol=1e-5, atol=1e-5)


def test_null_coalition_does_not_depend_on_the_image():
    model = tiny_vit()
    with torch.no_grad():
        a = masked_logits(model, x_batch(1, seed=1), torch.zeros(1, 16))
        b = masked_logits(model, x_batch(1, seed=2), torch.zeros(1, 16))
    torch.testing.assert_close(a, b)
    gap = VARIANTS["gap"]()  # no prefix token: no token visible at all, still finite
    with torch.no_grad():
        assert torch.isfinite(masked_logits(gap, x_batch(2), torch.zeros(2, 16))).all()


def test_unsupported_models_and_sizes_are_one_line_errors():
    from vitlens.models.families import FAMILIES  # noqa: F401  (import check only)

    with pytest.raises(vitlens.UnsupportedModelError, match="timm VisionTransformer"):
        patch_layout(torch.nn.Linear(3, 3))
    with pytest.raises(vitlens.InputError, match="input size 32×32"):
        masked_logits(tiny_vit(), x_batch(1, size=48), torch.ones(1, 36))
    with pytest.raises(vitlens.InputError, match=r"keep must be \(batch, 16\)"):
        masked_logits(tiny_vit(), x_batch(1), torch.ones(1, 15))


# --------------------------------------------------------------------------------------------------------------------
# Subsets, KernelSHAP, exact values
# --------------------------------------------------------------------------------------------------------------------


def test_samplers_are_keyed_and_paired():
    a = shapley_subsets(10, 6, generator(0, "explainer", 3, 7))
    b = shapley_subsets(10, 6, generator(0, "explainer", 3, 7))
    c = shapley_subsets(10, 6, generator(0, "explainer", 4, 7))
    assert torch.equal(a, b) and not torch.equal(a, c)
    torch.testing.assert_close(a[3:], 1 - a[:3])
    sizes = a[:3].sum(1)
    assert ((sizes >= 1) & (sizes <= 9)).all()
    u = uniform_subsets(10, 2000, generator(1, "surrogate", 0, 0)).sum(1)
    assert u.min() == 0 and u.max() == 10  # every size, the empty and full subsets included
    p = shapley_kernel_sizes(10)
    assert float(p.sum()) == pytest.approx(1.0) and p[0] == p[-1] and p[0] > p[4]


def _toy_game(n=6):
    """v(S) = Σ_{i∈S} w_i + 0.6·[0, 1, 2 ∈ S] for two classes: Shapley values w_i (+ 0.2 for players 0, 1, 2).
    (A three-way interaction: paired KernelSHAP is exact for games of order two.)"""
    w = torch.linspace(-0.5, 1.0, n, dtype=torch.float64)

    def game(masks):
        m = masks.double()
        first = m @ w + 0.6 * m[:, 0] * m[:, 1] * m[:, 2]
        return torch.stack([first, -2 * first], 1)

    truth = torch.stack([w, -2 * w], 1)
    truth[:3] += torch.tensor([[0.2, -0.4]], dtype=torch.float64)
    return game, truth


def test_exact_shapley_and_kernelshap_on_a_known_game():
    game, truth = _toy_game()
    torch.testing.assert_close(exact_shapley(game, 6), truth)
    est, at = kernelshap(game, 6, 4096, seed=0, checkpoints=(256,))
    torch.testing.assert_close(est.sum(0), truth.sum(0))  # efficiency holds exactly at every sample count
    assert float((est - truth).norm() / truth.norm()) < 0.03
    assert float((at[256] - truth).norm()) > float((est - truth).norm())


def test_kernelshap_converges_to_the_exact_values_of_a_surrogate_game():
    model = tiny_vit(img_size=24)  # 3×3 patches: 512 subsets
    game = surrogate_game(model, x_batch(1, size=24))
    exact = exact_shapley(game, 9)
    est, _ = kernelshap(game, 9, 4096, seed=0)
    assert float((est - exact).norm() / exact.norm()) < 0.05


# --------------------------------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------------------------------


def test_training_steps_write_an_explainer_that_loads(tmp_path):
    res = train_shapley(tiny_vit(), tiny_data(), tmp_path, progress=False, name="tiny", **FAST)
    assert res.finished and res.step == 6 and [h["phase"] for h in res.history] == ["surrogate"] * 3 + ["explainer"] * 3
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in res.history)
    v = res.validation
    assert v["surrogate"]["n"] == 4 and v["explainer"]["efficiency_gap"] < 1e-5
    meta = json.loads((tmp_path / "tiny.json").read_text())
    assert meta["format"] == "vitlens-vit-shapley-1" and meta["steps"] == 6
    assert "ViT-Shapley explainer" in (tmp_path / "tiny.md").read_text()
    net = load_shapley(tmp_path / "tiny.safetensors", tiny_vit())
    x = x_batch(2)
    with torch.no_grad():
        out, ref = net(x), res.net(x)
    torch.testing.assert_close(out.values, ref.values, atol=2e-3, rtol=2e-2)  # float16 file
    with pytest.raises(vitlens.InputError, match="already holds a run"):
        train_shapley(tiny_vit(), tiny_data(), tmp_path, progress=False, name="tiny", **FAST)


def test_the_original_model_is_unchanged_by_training():
    model = tiny_vit()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    train_shapley(model, tiny_data(), None, progress=False, **{**FAST, "ckpt_every": 0})
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not model.training and all(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("stop", [2, 3, 4])  # inside the surrogate phase, at its end, inside the explainer phase
def test_resume_continues_bit_for_bit(tmp_path, stop):
    data = tiny_data()
    full = train_shapley(tiny_vit(), data, tmp_path / "full", progress=False, **FAST)
    part = train_shapley(tiny_vit(), data, tmp_path / "split", stop_after=stop, progress=False, **FAST)
    assert not part.finished and part.step == stop and part.weights is None
    rest = train_shapley(tiny_vit(), data, tmp_path / "split", resume=True, progress=False, **FAST)
    assert rest.finished and rest.step == 6
    assert [h["loss"] for h in rest.history] == [h["loss"] for h in full.history]
    for (k, a), b in zip(full.net.state_dict().items(), rest.net.state_dict().values()):
        assert torch.equal(a, b), k
    with pytest.raises(vitlens.InputError, match="config differs in masks"):
        train_shapley(tiny_vit(), data, tmp_path / "split", resume=True, progress=False, **{**FAST, "masks": 6})


def test_a_phase_not_yet_started_may_change_its_settings_on_resume(tmp_path):
    data = tiny_data()
    train_shapley(tiny_vit(), data, tmp_path, stop_after=2, progress=False, **FAST)
    with pytest.raises(vitlens.InputError, match="config differs in batch_size"):
        train_shapley(tiny_vit(), data, tmp_path, resume=True, progress=False, **{**FAST, "batch_size": 2})
    res = train_shapley(tiny_vit(), data, tmp_path, resume=True, progress=False,
                        **{**FAST, "surrogate_steps": 4, "steps": 2, "masks": 2})
    assert res.finished and [h["phase"] for h in res.history] == ["surrogate"] * 4 + ["explainer"] * 2
    train_shapley(tiny_vit(), data, tmp_path / "b", stop_after=5, progress=False, **FAST)  # inside the explainer phase
    with pytest.raises(vitlens.InputError, match="config differs in masks"):
        train_shapley(tiny_vit(), data, tmp_path / "b", resume=True, progress=False, **{**FAST, "masks": 2})
    res = train_shapley(tiny_vit(), data, tmp_path / "b", resume=True, progress=False, **{**FAST, "steps": 4})
    assert res.finished and res.step == 7


def test_checkpoint_is_read_without_unpickling(tmp_path):
    train_shapley(tiny_vit(), tiny_data(), tmp_path, stop_after=2, progress=False, **FAST)
    ck = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert ck["step"] == 2
    (tmp_path / "checkpoint.pt").write_bytes(b"garbage")
    with pytest.raises(DamagedFileError, match="checkpoint.*is damaged"):
        train_shapley(tiny_vit(), tiny_data(), tmp_path, resume=True, progress=False, **FAST)


_DDP_SCRIPT = """
import sys, torch
sys.path.insert(0, {tests!r})
from test_vit_shapley import tiny_vit, tiny_data, FAST
from vitlens.shapley import train_shapley
torch.set_num_threads(1)
train_shapley(tiny_vit(), tiny_data(), {out!r}, progress=False, **{{**FAST, "n_val": 0}})
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
    single = train_shapley(tiny_vit(), tiny_data(), tmp_path / "single", progress=False, **{**FAST, "n_val": 0})
    meta = json.loads((tmp_path / "ddp" / "vit-shapley.json").read_text())
    assert meta["processes"] == 2
    assert [v for _, v in meta["loss_history"]] == pytest.approx([h["loss"] for h in single.history], rel=1e-4,
                                                                  abs=1e-6)


# --------------------------------------------------------------------------------------------------------------------
# The explainer and the method
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_values_sum_to_grand_minus_null(variant):
    model = VARIANTS[variant]()
    net = ShapleyExplainer(model, tune_blocks=2, seed=0).eval()
    x = x_batch(3)
    with torch.no_grad():
        net.set_null(x[:1])
        out = net(x)
        grand = model(x).softmax(-1)  # the untrained surrogate is the model: v(1) is the model's probability
        null = masked_logits(model, x, torch.zeros(3, 16)).softmax(-1)
    assert out.values.shape == (3, 16, 5)
    torch.testing.assert_close(out.grand, grand, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.null[None].expand(3, -1), null, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.values.sum(1), grand - null, rtol=1e-4, atol=1e-6)


def test_method_efficiency_determinism_and_batches():
    model = tiny_vit()
    x = x_batch(3)
    m = get_method("vit_shapley", explainer="untrained")
    a = m.explain(model, x)
    b = get_method("vit_shapley", explainer="untrained").explain(model, x)
    torch.testing.assert_close(a.token_maps, b.token_maps, rtol=0, atol=0)
    assert a.token_maps.shape == (3, 4, 4) and (a.token_maps < 0).any()  # signed values
    torch.testing.assert_close(a.token_maps.sum((1, 2)), a.extras["grand"] - a.extras["null"], rtol=1e-4, atol=1e-6)
    one = m.explain(model, x[1:2], target=2)
    many = m.explain(model, x, target=2)
    torch.testing.assert_close(one.token_maps[0], many.token_maps[1], rtol=1e-5, atol=1e-7)
    assert m.explain(model, x[:1], batch_size=1).cost.backward_passes == 0


def test_method_refuses_a_model_without_an_explainer_in_one_line(tmp_path):
    with pytest.raises(vitlens.UnsupportedModelError, match="no shipped ViT-Shapley explainer") as e:
        get_method("vit_shapley").explain(tiny_vit(), x_batch(1))
    assert "\n" not in str(e.value)
    with pytest.raises(vitlens.WeightsUnavailableError, match="not found"):
        get_method("vit_shapley", explainer=str(tmp_path / "none.safetensors")).explain(tiny_vit(), x_batch(1))
    with pytest.raises(vitlens.InputError, match=".safetensors"):
        get_method("vit_shapley", explainer=str(tmp_path / "x.pt"))


def test_method_reads_a_trained_explainer_file(tmp_path):
    res = train_shapley(tiny_vit(), tiny_data(), tmp_path, progress=False, name="tiny", **FAST)
    model = tiny_vit()
    exp = get_method("vit_shapley", explainer=str(res.weights)).explain(model, x_batch(2))
    with torch.no_grad():
        out = res.net(x_batch(2))
    pick = exp.targets
    want = out.values[torch.arange(2), :, pick].reshape(2, 4, 4)
    torch.testing.assert_close(exp.token_maps, want, atol=2e-3, rtol=2e-2)
@pytest.mark.parametrize("model_name", ["shapes-vit", "digits-vit"])
def test_shipped_explainers_load_and_sum_to_grand_minus_null(model_name):
    model = vitlens.load_model(model_name)
    name, path, _ = shipped_shapley(model)
    assert path.is_file() and path.parent == WEIGHTS_DIR and (WEIGHTS_DIR / f"{name}.md").is_file()
    meta = json.loads(path.with_suffix(".json").read_text())
    assert meta["steps"] == meta["train"]["surrogate_steps"] + meta["train"]["steps"]  # a finished run
    size = patch_layout(model).size
    x = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(0))
    exp = vitlens.explain(model, x, method="vit_shapley")
    torch.testing.assert_close(exp.token_maps.sum((1, 2)), exp.extras["grand"] - exp.extras["null"], rtol=1e-3,
                               atol=1e-5)
    assert sorted(n for n, _ in SHIPPED.values()) == ["digits-vit-shapley", "shapes-vit-shapley"]
