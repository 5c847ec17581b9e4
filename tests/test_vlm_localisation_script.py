"""``benchmarks/vlm_localisation.py`` (issue 52, item 4): every target kind gives a row per method, the tolerant
pointing column never scores below the strict one, and the zero-shot target is the prompt's probability."""

from __future__ import annotations

import csv

import pytest
import torch

from conftest import load_benchmark  # noqa: E402

import vitlens
from vitlens.data import CLASS_NAMES
from vitlens.data.multiscenes import make_multi_scenes
from vitlens.models.zoo import SHAPES_MEAN, SHAPES_STD


def test_table_rows_for_every_target_and_a_tolerant_pointing_column(tmp_path):
    script = load_benchmark("vlm_localisation")
    out, table = tmp_path / "loc.md", tmp_path / "loc.csv"
    assert script.main(["--n", "3", "--seed", "31000", "--methods", "gradskip", "random", "--versus", "a picture",
                        "--zero-shot", "--rise-masks", "8", "--out", str(out), "--csv", str(table)]) == 0
    rows = list(csv.DictReader(table.open(encoding="utf-8")))
    targets = {"prompt", 'prompt − "a picture"', script.ZERO_SHOT}
    expect = {(m, t) for m in ("gradskip", "random") for t in targets} | {("rise", script.ZERO_SHOT)}  # black box
    assert {(r["method"], r["target"]) for r in rows} == expect
    for r in rows:
        assert float(r["pointing_near"]) >= float(r["pointing"])
        assert 0.0 <= float(r["inside"]) <= 1.0
    text = out.read_text(encoding="utf-8")
    assert "pointing ±4.3 px" in text and "--zero-shot" in text and "TextProbability" in text
    section = text.split("**Object level.**")[1].split("Targets of issue 52")[0]  # object level + removal ceiling
    ceiling = [line.split(" | ") for line in section.splitlines() if line.startswith("| model (removal)")]
    assert {c[1] for c in ceiling} == targets and all(c[4] != "—" for c in ceiling)  # with its prompt sensitivity
    for r in rows:
        assert 0.0 <= float(r["object_pointing"]) <= 1.0
    depth = text.split("**GradSkip by depth.**")[1].split("Targets of issue 52")[0]
    assert "| block 0 | block 1 |" in depth and sum(line.startswith(("| prompt", "| zero")) for line in
                                                    depth.splitlines()) == 3
    strict = {r["target"]: float(r["pointing"]) for r in rows if r["method"] == "gradskip"}
    block0 = {line.split(" | ")[0][2:]: float(line.split(" | ")[1]) for line in depth.splitlines()
              if line.startswith(("| prompt", "| zero"))}
    assert block0 == pytest.approx(strict, abs=1e-3)  # block 0's input is the map itself
    assert out.with_suffix(".png").is_file() and (tmp_path / "loc_depth.png").is_file()
    assert "loc_depth.png" in text


def test_zero_shot_pairs_explain_the_prompt_probability():
    script = load_benchmark("vlm_localisation")
    model = vitlens.load_model("shapes-clip").eval()
    scenes = make_multi_scenes(2, seed=31000, min_objects=2, max_objects=3)
    x = (scenes.images - torch.tensor(SHAPES_MEAN).view(1, 3, 1, 1)) / torch.tensor(SHAPES_STD).view(1, 3, 1, 1)
    scene, cls = script.pairs_of(scenes.present)
    maps, scores, _ = script.explain_pairs(model, x, scene, cls, "gradskip", chunk=2, versus=script.ZERO_SHOT)
    zs = vitlens.ZeroShotClassifier(model, [f"a {c}" for c in CLASS_NAMES])
    with torch.no_grad():
        expect = zs(x[scene]).softmax(-1).gather(1, cls[:, None])[:, 0]
    assert maps.shape == (len(scene), 64, 64)
    torch.testing.assert_close(scores, expect, atol=1e-5, rtol=0)
    # a black-box method reads the same probability through the prompts as classes, on this target only
    rise, rise_scores, _ = script.explain_pairs(model, x, scene, cls, "rise", chunk=2, versus=script.ZERO_SHOT,
                                                n_masks=8, grid_size=8)
    assert rise.shape == maps.shape
    torch.testing.assert_close(rise_scores, expect, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="zero-shot probability target only"):
        script.explain_pairs(model, x, scene, cls, "rise", chunk=2, versus="a picture")


def test_removal_grounding_counts_the_pairs_whose_object_matters_most():
    import argparse

    script = load_benchmark("vlm_localisation")
    model = vitlens.load_model("shapes-clip").eval()
    args = argparse.Namespace(n=12, seed=31000)
    scenes = make_multi_scenes(12, seed=31000, min_objects=2, max_objects=4)
    scene, cls = script.pairs_of(scenes.present)
    got = script.removal_grounding(model, args, scenes, scene, cls, [None, "a picture", script.ZERO_SHOT])
    assert set(got) == {"prompt", "a picture", script.ZERO_SHOT}
    assert all(hits.shape == scene.shape and hits.dtype == torch.bool for hits in got.values())
    assert float(got[script.ZERO_SHOT].float().mean()) >= 0.75  # object-grounded (0.924 on 60 validation scenes)
    row = script.object_row(got[script.ZERO_SHOT], scene)  # the ceiling's row: pointing and prompt sensitivity
    assert row["object"] == pytest.approx(float(got[script.ZERO_SHOT].float().mean()))
    assert 0.0 <= row["object_sensitivity"] <= 1.0


def test_object_pointing_picks_the_object_with_the_densest_relevance():
    script = load_benchmark("vlm_localisation")
    lab = torch.zeros(1, 4, 4, dtype=torch.long)
    lab[0, :2, :2] = 1  # class 0: 4 pixels
    lab[0, 2:, :] = 3  # class 2: 8 pixels
    present = torch.tensor([[True, False, True]])
    m = torch.zeros(1, 4, 4)
    m[0, 0, 0] = 2.0  # density 0.5 in class 0
    m[0, 2:, :] = 0.3  # density 0.3 in class 2, but the larger total
    got = script.object_pointing(torch.cat([m, m]), torch.cat([lab, lab]), torch.cat([present, present]),
                                 torch.tensor([0, 2]))
    assert got.tolist() == [True, False]
