"""``vitlens.TextProbability(texts, among)``: the zero-shot probability of a prompt among a prompt set (softmax over the
model's own image–text scores), on the bundled ``shapes-clip``; its figure wording; ``vitlens explain --text …
--probability``."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import vitlens
from conftest import scene_png  # noqa: E402
from vitlens import cli_explain, viz
from vitlens.cli import main
from vitlens.errors import TargetError
from vitlens.models.zoo import SHAPES_MEAN, SHAPES_STD

AMONG = ["a ring", "a disk", "a star"]


@pytest.fixture(scope="module")
def clip_and_images():
    clip = vitlens.VisionLanguageModel(vitlens.load_model("shapes-clip"))  # its output: image embeddings (B, D)
    scenes = vitlens.data.multiscenes.make_multi_scenes(4, seed=3)
    mean = torch.tensor(SHAPES_MEAN)[:, None, None]
    std = torch.tensor(SHAPES_STD)[:, None, None]
    return clip, (scenes.images - mean) / std


def test_score_is_the_zero_shot_probability(clip_and_images):
    clip, x = clip_and_images
    t = vitlens.TextProbability("a disk", among=AMONG).bind(clip)
    with torch.no_grad():
        emb = clip(x)
        got = t(emb)
        zs = vitlens.ZeroShotClassifier(clip, AMONG)
        want = vitlens.ClassProbability(1)(zs(x))
        # by hand: the model's own score of each prompt (what TextPrompt explains), then a softmax over among
        scores = torch.stack([vitlens.TextPrompt(p).bind(clip)(emb) for p in AMONG], dim=1)
    assert got.shape == (4,)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(got, scores.softmax(dim=1)[:, 1], rtol=0, atol=1e-6)
    assert bool(((got > 0) & (got < 1)).all())
    assert float(scores.min()) < 0  # the raw scores this target replaces are not all positive


def test_gradskip_is_complete_and_agrees_with_the_zero_shot_classifier(clip_and_images):
    clip, x = clip_and_images
    exp = vitlens.explain(clip, x, "gradskip", target=vitlens.TextProbability("a ring", AMONG))
    total = exp.token_maps.sum((1, 2)) + exp.remainder
    torch.testing.assert_close(total, exp.scores, rtol=1e-4, atol=1e-5)
    assert exp.targets.tolist() == [0] * 4
    zs = vitlens.explain(vitlens.ZeroShotClassifier(clip, AMONG), x, "gradskip", target=vitlens.ClassProbability(0))
    torch.testing.assert_close(exp.scores, zs.scores, rtol=0, atol=1e-6)
    torch.testing.assert_close(exp.token_maps, zs.token_maps, rtol=1e-4, atol=1e-6)


def test_per_image_prompts_chunking_and_select(clip_and_images):
    clip, x = clip_and_images
    texts = ["a star", "a ring", "a disk", "a star"]
    t = vitlens.TextProbability(texts, among=AMONG)
    whole = vitlens.explain(clip, x, "gradskip", target=t)
    assert whole.targets.tolist() == [2, 0, 1, 2]  # indices in among
    with torch.no_grad():
        probs = vitlens.ZeroShotClassifier(clip, AMONG)(x).softmax(dim=1)
    torch.testing.assert_close(whole.scores, probs[torch.arange(4), torch.tensor([2, 0, 1, 2])], rtol=0, atol=1e-6)
    chunked = vitlens.explain(clip, x, "gradskip", target=t, batch_size=1)
    torch.testing.assert_close(chunked.scores, whole.scores, rtol=0, atol=1e-6)
    torch.testing.assert_close(chunked.maps, whole.maps, rtol=1e-4, atol=1e-6)
    assert chunked.targets.tolist() == whole.targets.tolist()
    with torch.no_grad():
        emb = clip(x)
    resolved = t.bind(clip).resolve(emb)
    part = resolved.select(torch.tensor([1, 3]))
    torch.testing.assert_close(part(emb[[1, 3]]), whole.scores[[1, 3]], rtol=0, atol=1e-6)
    assert part.resolved_classes().tolist() == [0, 2]
    with pytest.raises(TargetError, match="3 prompts given for a batch of 4"):
        vitlens.explain(clip, x, "gradskip", target=vitlens.TextProbability(texts[:3], AMONG))


@pytest.mark.parametrize("texts,among,match", [
    ("a cross", AMONG, r"'a cross' is not one of among"),
    (["a ring", "a cross"], AMONG, r"'a cross' is not one of among"),
    ("a ring", ["a ring"], "at least 2 prompts in among"),
    ("a ring", [], "at least 2 prompts in among"),
    ("a ring", ["a ring", "a disk", "a ring"], "'a ring' is given 2 times"),
    ("a ring", "a ring", "takes a list of prompts"),
    ("a ring", ["a ring", 3], "takes a list of prompts"),
    ([], AMONG, "non-empty list"),
])
def test_bad_prompt_sets_one_line(texts, among, match):
    with pytest.raises(TargetError, match=match) as err:
        vitlens.TextProbability(texts, among)
    assert "\n" not in str(err.value)


def test_describe_and_figure_wording(clip_and_images):
    clip, x = clip_and_images
    t = vitlens.TextProbability("a ring", AMONG)
    assert t.describe() == {"kind": "TextProbability", "prompts": AMONG, "texts": "a ring", "among": AMONG}
    per_image = vitlens.TextProbability(["a ring", "a star"], AMONG).describe()
    assert per_image["texts"] == ["a ring", "a star"] and per_image["among"] == AMONG
    exp = vitlens.explain(clip, x[:2], "gradskip", target=vitlens.TextProbability(["a ring", "a star"], AMONG))
    assert exp.target["kind"] == "TextProbability" and exp.target["among"] == AMONG
    assert exp.target["scale"] == pytest.approx(float(clip.scale))
    words = ["P(\u201ca ring\u201d) among 3 prompts", "P(\u201ca star\u201d) among 3 prompts"]
    assert [cli_explain._target_words(exp, j) for j in range(2)] == words
    assert cli_explain._text_caption(exp, 1) == f"{words[1]} = {float(exp.scores[1]):.3g}"
    assert cli_explain._text_caption(exp, 1, name_only=True) == "a star"
    assert viz.colorbar_label("signed", target=words[0]) == (
        "relevance: blue against P(\u201ca ring\u201d) among 3 prompts, red for it, white = 0")


def test_explain_probability_one_figure_per_prompt(tmp_path, monkeypatch, capsys):
    calls = []
    real = viz.save_figure

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(viz, "save_figure", spy)
    img = scene_png(tmp_path)
    out = tmp_path / "out"
    args = ["explain", str(img), "--model", "shapes-clip", "--methods", "gradskip", "--dpi", "40", "--out", str(out)]
    for p in AMONG:
        args += ["--text", p]
    assert main(args + ["--probability"]) == 0
    line_out = capsys.readouterr().out
    total = 0.0
    for p in AMONG:
        stem = f"scene_png.{p.replace(' ', '_')}.gradskip"
        info = json.loads((out / f"{stem}.json").read_text())
        assert info["target"]["kind"] == "TextProbability" and info["target"]["among"] == AMONG
        assert info["target"]["texts"] == p and info["target_name"] == p
        assert 0 < info["score"] < 1
        total += info["score"]
        assert abs(info["score"] - (float(np.load(out / f"{stem}.npz")["token_map"].sum()) + info["remainder"])) < 1e-4
        assert (out / f"{stem}.png").stat().st_size > 0 and (out / f"{stem}.view.png").stat().st_size > 0
        assert f"P(\u201c{p}\u201d) among 3 prompts = " in line_out
    assert total == pytest.approx(1.0, abs=1e-4)  # one image's probabilities over its prompt set
    targets = [kw["target"] for kw in calls]
    assert targets == [f"P(\u201c{p}\u201d) among 3 prompts" for p in AMONG for _ in range(2)]
    assert all("class" not in kw["caption"] for kw in calls)


@pytest.mark.parametrize("extra,match", [
    (["--text", "a ring", "--probability"], "--probability needs at least two --text prompts (got 1, 'a ring')"),
    (["--probability"], "--probability needs at least two --text prompts"),
    (["--text", "a ring", "--text", "a disk", "--probability", "--versus", "a picture"],
     "--probability and --versus both given"),
])
def test_explain_probability_errors_one_line(tmp_path, capsys, extra, match):
    img = scene_png(tmp_path)
    out = tmp_path / "o"
    assert main(["explain", str(img), "--model", "shapes-clip", "--out", str(out)] + extra) == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not out.exists()
