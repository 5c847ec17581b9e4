"""The teacher term of AHA training (vitlens.aha.teacher): its maps, its loss, its schedule and its flags."""

from __future__ import annotations

import pytest
import torch

import vitlens
from vitlens.aha.data import TensorData
from vitlens.aha.teacher import teacher_grid, teacher_loss, teacher_maps, teacher_weight
from vitlens.aha.train import AHATrainConfig, train_aha
from vitlens.errors import InputError

from test_aha import FAST, tiny_data, tiny_target
from test_aha_recipe import _parse


def test_teacher_grid_is_the_token_grid_or_eight_by_eight():
    assert teacher_grid((64, 64), 8) == (8, 8)
    assert teacher_grid((64, 32), (16, 8)) == (4, 4)
    assert teacher_grid((64, 64), None) == (8, 8)
    assert teacher_grid((4, 6), None) == (4, 6)


def test_teacher_loss_is_one_minus_the_correlation_on_the_grid():
    g = torch.Generator().manual_seed(0)
    teacher = torch.rand(3, 16, generator=g, dtype=torch.float64)
    same = teacher.reshape(3, 1, 4, 4).repeat_interleave(2, 2).repeat_interleave(2, 3).squeeze(1)  # (3, 8, 8)
    loss = teacher_loss(2.5 * same + 1.0, teacher, (4, 4))  # scale and shift do not matter
    assert loss.shape == (3,) and torch.allclose(loss, torch.zeros(3, dtype=torch.float64), atol=1e-6)
    assert torch.allclose(teacher_loss(-same, teacher, (4, 4)), torch.full((3,), 2.0, dtype=torch.float64))
    other = torch.rand(3, 8, 8, generator=g, dtype=torch.float64)
    a = torch.nn.functional.avg_pool2d(other.unsqueeze(1), 2).flatten(1)
    r = torch.stack([torch.corrcoef(torch.stack([a[i], teacher[i]]))[0, 1] for i in range(3)])
    assert torch.allclose(teacher_loss(other, teacher, (4, 4)), 1 - r, atol=1e-6)
    const = torch.ones(1, 8, 8, dtype=torch.float64, requires_grad=True)  # a flat map: finite loss and gradient
    out = teacher_loss(const, teacher[:1], (4, 4))
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(const.grad).all()


def test_teacher_weight_fades_linearly_to_zero():
    assert teacher_weight(0, 100, 2.0, 0.5) == 2.0
    assert teacher_weight(25, 100, 2.0, 0.5) == pytest.approx(1.0)
    assert teacher_weight(50, 100, 2.0, 0.5) == 0.0 and teacher_weight(99, 100, 2.0, 0.5) == 0.0
    assert teacher_weight(0, 100, 0.0, 0.5) == 0.0


def test_teacher_maps_are_the_methods_maps_pooled_to_the_grid():
    model = tiny_target()
    x, y = tiny_data(n_train=5)[:2]
    maps = teacher_maps(model, TensorData(x, y), "gradskip", (4, 4), batch=2)
    ref = vitlens.explain(model, x, method="gradskip").maps
    expect = torch.nn.functional.adaptive_avg_pool2d(ref.unsqueeze(1), (4, 4)).flatten(1)
    assert maps.shape == (5, 16) and torch.allclose(maps, expect, atol=1e-5)
    with pytest.raises(InputError, match="unknown AHA teacher 'rise'"):
        teacher_maps(model, TensorData(x, y), "rise", (4, 4))


def test_a_teacher_pulls_the_first_steps_towards_its_maps():
    """With the AUC terms off, the teacher term alone must raise the correlation with the teacher's maps."""
    model, data = tiny_target(), tiny_data()
    run = dict(steps=6, progress=False, w_del=0.0, w_ins=0.0, w_peak=0.0, lr=1e-2, **FAST)
    res = train_aha(model, data, None, teacher="gradskip", teacher_frac=1.0, **run)
    losses = [h["teacher"] for h in res.history]
    first, last = sum(losses[:2]) / 2, sum(losses[4:]) / 2  # each pair: one epoch (all 8 images)
    assert len(losses) == 6 and last < first - 0.1
    assert all("teacher" not in h for h in train_aha(tiny_target(), data, None, **run).history)
    faded = train_aha(tiny_target(), data, None, teacher="gradskip", teacher_frac=0.5, **run).history
    assert ["teacher" in h for h in faded] == [True, True, True, False, False, False]


def test_teacher_settings_are_checked():
    with pytest.raises(InputError, match="w_del and w_ins"):
        AHATrainConfig(w_del=-1.0).check()
    with pytest.raises(InputError, match="unknown AHA teacher"):
        AHATrainConfig(teacher="rise").check()
    with pytest.raises(InputError, match="classes_per_image = 1"):
        AHATrainConfig(teacher="gradskip", classes_per_image=2).check()
    with pytest.raises(InputError, match="teacher_frac"):
        AHATrainConfig(teacher="gradskip", teacher_frac=1.5).check()
    assert _parse().teacher is None  # the flags themselves: test_aha_recipe.test_cli_recipe_defaults_and_explicit_flags


def test_the_card_names_the_teacher():
    """An explainer trained with a teacher says so in its card's loss line; one trained without says nothing."""
    import json

    from vitlens.aha import load_explainer, shipped_explainer
    from vitlens.aha.card import model_card

    model = vitlens.load_model("digits-vit")
    _, path, _ = shipped_explainer(model)
    meta = json.loads(path.with_suffix(".json").read_text())
    net = load_explainer(path, model)
    plain = next(ln for ln in model_card(meta, net).splitlines() if ln.startswith("- Loss:"))
    assert "teacher" not in plain
    meta["train"].update(teacher="gradskip", w_teacher=0.5, teacher_frac=1.0)
    line = next(ln for ln in model_card(meta, net).splitlines() if ln.startswith("- Loss:"))
    assert line.endswith("per image; teacher `gradskip` (weight 0.5, fading to 0 at 100% of the steps).")
    meta["notes"] = ["Kept elsewhere: the teacher."]  # a maintainer's note in the JSON: the card's last bullet
    notes = model_card(meta, net).split("## Notes", 1)[1]
    assert notes.splitlines()[-3] == "- Kept elsewhere: the teacher."


def test_the_shipped_shapes_deit_explainer_names_a_teacher_file_the_repository_holds():
    """Its card's command names an untracked teacher file; the note names the kept copy, with the same contents."""
    import hashlib
    import json
    import re
    from pathlib import Path

    from vitlens.aha import shipped_explainer

    _, path, _ = shipped_explainer(vitlens.load_model("shapes-deit"))
    meta = json.loads(path.with_suffix(".json").read_text())
    assert meta["train"]["teacher"] == "aha"
    kept = re.search(r"`(benchmarks/results/aha-teachers/[^`]+)`", " ".join(meta["notes"]))
    assert kept is not None
    file = Path(__file__).resolve().parents[1] / kept.group(1)
    assert hashlib.sha256(file.read_bytes()).hexdigest() == meta["teacher_file"]["sha256"]


def test_the_card_names_a_mask_blur_other_than_the_default():
    """``--mask-sigma`` other than the default 1 px shows in the card's loss line; the default adds nothing."""
    import json

    from vitlens.aha import load_explainer, shipped_explainer
    from vitlens.aha.card import model_card

    model = vitlens.load_model("digits-vit")
    _, path, _ = shipped_explainer(model)
    meta = json.loads(path.with_suffix(".json").read_text())
    net = load_explainer(path, model)
    assert "mask blur" not in next(ln for ln in model_card(meta, net).splitlines() if ln.startswith("- Loss:"))
    meta["train"]["mask_sigma"] = 0.0
    line = next(ln for ln in model_card(meta, net).splitlines() if ln.startswith("- Loss:"))
    assert "Sinkhorn iterations; mask blur σ 0.0 px;" in line


def test_images_without_a_teacher_map_add_no_loss_and_no_gradient():
    """A NaN teacher row (an image beyond ``teacher_images``) gives 0 and no gradient; the other rows are unchanged."""
    g = torch.Generator().manual_seed(1)
    teacher = torch.rand(3, 16, generator=g, dtype=torch.float64)
    maps = torch.rand(3, 8, 8, generator=g, dtype=torch.float64, requires_grad=True)
    full = teacher_loss(maps, teacher, (4, 4))
    partial = teacher.clone()
    partial[1] = float("nan")
    loss = teacher_loss(maps, partial, (4, 4))
    assert loss[1] == 0 and torch.equal(loss[[0, 2]], full[[0, 2]].detach())
    loss.sum().backward()
    assert torch.isfinite(maps.grad).all() and bool((maps.grad[1] == 0).all()) and bool((maps.grad[0] != 0).any())


def _tiny_explainer(model, path):
    from vitlens.aha.network import build_explainer, save_explainer

    torch.manual_seed(0)
    save_explainer(build_explainer(model, width=8), path)
    return path


def test_refined_aha_teacher_covers_the_first_images_and_is_cached(tmp_path, monkeypatch):
    """``teacher="aha"``: the AHA method's refined maps of a given explainer for the first ``count`` images (NaN rows
    after them), written to the cache after every batch; a second call reads the cache instead of refining again,
    goes on from where it stopped, and does not reuse rows of another identity."""
    import vitlens.api

    model = tiny_target()
    x, y = tiny_data(n_train=5)[:2]
    data = TensorData(x, y)
    path = _tiny_explainer(model, tmp_path / "e.safetensors")
    opts = {"explainer": str(path), "refine_steps": 1, "m": 4}
    cache = tmp_path / "teacher-maps.pt"
    maps = teacher_maps(model, data, "aha", (4, 4), batch=2, count=3, options=opts, cache=cache, identity={"r": 1})
    ref = vitlens.explain(model, x[:3], method="aha", **opts).maps
    expect = torch.nn.functional.adaptive_avg_pool2d(ref.unsqueeze(1), (4, 4)).flatten(1)
    assert maps.shape == (5, 16) and torch.allclose(maps[:3], expect, atol=1e-5)
    assert bool(torch.isnan(maps[3:]).all()) and cache.is_file()
    calls: list[int] = []
    explain = vitlens.api.explain

    def counted(model, x, **kw):
        calls.append(len(x))
        return explain(model, x, **kw)

    monkeypatch.setattr(vitlens.api, "explain", counted)
    again = teacher_maps(model, data, "aha", (4, 4), batch=2, count=3, options=opts, cache=cache, identity={"r": 1})
    assert calls == [] and torch.equal(again[:3], maps[:3])
    more = teacher_maps(model, data, "aha", (4, 4), batch=2, count=4, options=opts, cache=cache, identity={"r": 1})
    assert calls == [1] and torch.equal(more[:3], maps[:3]) and bool(torch.isfinite(more[3]).all())
    teacher_maps(model, data, "aha", (4, 4), batch=2, count=2, options=opts, cache=cache, identity={"r": 2})
    assert calls == [1, 2]  # another run's rows are not reused


def test_a_training_with_the_refined_aha_teacher_caches_its_maps(tmp_path):
    import json

    model, data = tiny_target(), tiny_data()
    path = _tiny_explainer(model, tmp_path / "teacher.safetensors")
    res = train_aha(model, data, tmp_path / "run", steps=2, progress=False, teacher="aha", teacher_frac=1.0,
                    teacher_explainer=str(path), teacher_images=3, **FAST)
    saved = torch.load(tmp_path / "run" / "teacher-maps.pt", weights_only=True)
    assert saved["done"] == 3 and saved["maps"].shape[0] == 3
    assert any("teacher" in h for h in res.history)  # logged on the steps whose images have a teacher map
    meta = json.loads((tmp_path / "run" / "aha.json").read_text())
    assert (meta["train"]["teacher"], meta["train"]["teacher_images"]) == ("aha", 3)
    import hashlib

    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    assert meta["teacher_file"] == {"path": str(path), "sha256": sha}  # the card names the file's contents
    assert f"SHA-256 `{sha[:16]}…`" in (tmp_path / "run" / "aha.md").read_text()


def test_refined_teacher_settings_are_checked():
    with pytest.raises(InputError, match="teacher_explainer"):
        AHATrainConfig(teacher="gradskip", teacher_explainer="x.safetensors").check()
    with pytest.raises(InputError, match="teacher_images"):
        AHATrainConfig(teacher="aha", teacher_images=0).check()
    with pytest.raises(InputError, match="needs a teacher"):
        AHATrainConfig(teacher_images=5).check()
    args = _parse("--teacher", "aha", "--teacher-explainer", "e.safetensors", "--teacher-images", "960")
    assert (args.teacher, args.teacher_explainer, args.teacher_images) == ("aha", "e.safetensors", 960)


def test_a_teacher_that_gives_non_finite_maps_is_a_clear_error(monkeypatch):
    import vitlens.api

    model = tiny_target()
    x, y = tiny_data(n_train=5)[:2]
    explain = vitlens.api.explain

    calls: list[int] = []

    def broken(model, x, **kw):  # the second batch's first map gets a NaN
        exp = explain(model, x, **kw)
        calls.append(len(x))
        if len(calls) == 2:
            exp.maps[0, 0, 0] = float("nan")
        return exp

    monkeypatch.setattr(vitlens.api, "explain", broken)
    with pytest.raises(InputError, match="non-finite maps on training images 2–3"):
        teacher_maps(model, TensorData(x, y), "gradskip", (4, 4), batch=2, count=4, progress=False)


_SHARDED_SCRIPT = """
import json, os, sys, torch
sys.path.insert(0, {tests!r})
import vitlens.api
from test_aha import tiny_target, tiny_data
from vitlens.aha.data import TensorData
from vitlens.aha.teacher import teacher_maps
from vitlens.runtime import init_distributed
torch.set_num_threads(1)
info = init_distributed()
calls = []
explain = vitlens.api.explain
def counted(model, x, **kw):
    calls.append(len(x))
    return explain(model, x, **kw)
vitlens.api.explain = counted
x, y = tiny_data(n_train=7)[:2]
maps = teacher_maps(tiny_target(), TensorData(x, y), "gradskip", (4, 4), batch=2, count={count},
                    cache={cache!r}, identity={{"r": 1}}, dist_info=info)
with open(os.path.join({out!r}, f"rank{{info.rank}}.json"), "w") as f:
    json.dump({{"calls": calls, "maps": maps.tolist()}}, f)
torch.distributed.barrier()
torch.distributed.destroy_process_group()  # gloo's threads torn down before exit (left to the interpreter: abort)
"""


@pytest.mark.slow
def test_teacher_maps_under_torchrun_share_the_batches(tmp_path):
    """Two processes: each computes only its batches, both return every map (the single process's maps), the first
    writes the cache, and a resumed run with more images reads it and computes only the new rows."""
    import json
    import os
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    tests = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests.parent / "src"), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    cache = tmp_path / "teacher-maps.pt"

    def run(count: int) -> list[dict]:
        script = tmp_path / f"sharded{count}.py"
        script.write_text(textwrap.dedent(_SHARDED_SCRIPT.format(tests=str(tests), count=count, cache=str(cache),
                                                                 out=str(tmp_path))))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]

    first = run(5)  # rounds of 2 batches of 2: rank 0 images 0–1 and 4, rank 1 images 2–3
    assert [r["calls"] for r in first] == [[2, 1], [2]]
    x, y = tiny_data(n_train=7)[:2]
    single = teacher_maps(tiny_target(), TensorData(x, y), "gradskip", (4, 4), batch=2, count=5)
    for r in first:
        got = torch.tensor(r["maps"])
        assert torch.allclose(got[:5], single[:5], atol=1e-6) and bool(torch.isnan(got[5:]).all())
    saved = torch.load(cache, weights_only=True)
    assert saved["done"] == 5 and torch.allclose(saved["maps"], single[:5], atol=1e-6)
    again = run(7)  # resumed: images 5–6 only, on rank 0
    assert [r["calls"] for r in again] == [[2], []]
    assert torch.allclose(torch.tensor(again[1]["maps"])[:5], single[:5], atol=1e-6)
    assert bool(torch.isfinite(torch.tensor(again[1]["maps"])).all())


def test_the_default_aha_teacher_is_recorded_as_the_bundled_file_by_its_contents():
    import hashlib

    from vitlens.aha import shipped_explainer
    from vitlens.aha.teacher import teacher_file

    model = vitlens.load_model("shapes-deit")
    found = shipped_explainer(model)
    assert found is not None
    rec = teacher_file(model, None)
    assert rec == {"path": f"weights/{found[1].name} (bundled)",
                   "sha256": hashlib.sha256(found[1].read_bytes()).hexdigest()}
    assert teacher_file(tiny_target(), None) is None  # no bundled explainer: nothing to record
