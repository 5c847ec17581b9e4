"""Figures of a text target name the prompt, not "the class": the colour bars' labels (single figures and grids), the
captions and the summary line of ``vitlens explain --text``; class targets keep their wording."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import vitlens
from conftest import scene_png  # noqa: E402
from vitlens import cli_explain, viz
from vitlens.cli import main
from vitlens.viz.colorbars import bar_label
from vitlens.viz.pixels import Scale

CLASS_SIGNED = "relevance: blue against the class, red for it, white = 0"


def _scale(mode: str = "signed") -> Scale:
    return Scale(mode=mode, vmin=-1.0, vmax=1.0, clip=None, data_min=-1.0, data_max=1.0)


# -- the words, from targets' descriptions -----------------------------------------------------------------------------
@pytest.mark.parametrize("described", [None, {}, {"kind": "ClassTarget", "classes": "predicted"},
                                       {"kind": "Contrast", "classes": 1, "versus": 2},
                                       {"kind": "SegmentationTarget", "classes": 0, "region": None}])
def test_class_targets_keep_class_wording(described):
    assert viz.target_phrase(described) == "the class"
    words = viz.target_phrase(described)
    assert viz.colorbar_label("signed", target=words) == CLASS_SIGNED
    assert viz.colorbar_label("signed") == CLASS_SIGNED  # the default is unchanged


def test_prompt_wording():
    described = {"kind": "TextPrompt", "prompts": ["a ring", "a disk"]}
    assert viz.target_phrase(described, 0) == "\u201ca ring\u201d"
    assert viz.target_phrase(described, 1) == "\u201ca disk\u201d"
    label = viz.colorbar_label("signed", target=viz.target_phrase(described, 0))
    assert label == "relevance: blue against \u201ca ring\u201d, red for it, white = 0"
    assert "class" not in label


def test_contrast_wording():
    described = {"kind": "TextContrast", "prompts": ["a ring", "a disk"], "versus": "a disk", "gamma": 1.0}
    words = viz.target_phrase(described, 0)
    assert words == "\u201ca ring\u201d over \u201ca disk\u201d"
    assert viz.colorbar_label("signed", target=words) == (
        "relevance: blue against \u201ca ring\u201d over \u201ca disk\u201d, red for it, white = 0")
    scaled = dict(described, gamma=0.5)
    assert viz.target_phrase(scaled, 0) == "\u201ca ring\u201d over 0.5·\u201ca disk\u201d"
    per_image = {"kind": "TextContrast", "prompts": ["a ring", "a star", "a disk", "a cross"],
                 "versus": ["a disk", "a cross"], "gamma": 1.0}
    assert viz.target_phrase(per_image, 1, row=1) == "\u201ca star\u201d over \u201ca cross\u201d"


def test_embedding_wording():
    described = {"kind": "TextEmbedding", "embeddings": [2, 8]}
    assert viz.target_phrase(described, 1, 1) == "the text embedding"
    assert "class" not in viz.colorbar_label("signed", target=viz.target_phrase(described))


def test_bar_label_carries_the_target_and_other_modes_are_unchanged():
    words = "\u201ca ring\u201d"
    label, _ = bar_label(_scale(), "relevance", True, "signed", (False, False), wrap=200, target=words)
    assert label == f"relevance: blue against {words}, red for it, white = 0; each map on its own scale"
    label, _ = bar_label(_scale(), "relevance", True, "signed", (False, False), wrap=200)
    assert label == CLASS_SIGNED + "; each map on its own scale"
    for mode in ("positive", "abs", "minmax"):  # no class in these: the same for both kinds of target
        assert viz.colorbar_label(mode, target=words) == viz.colorbar_label(mode)


# -- the words of real explanations ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def clip_and_image():
    clip = vitlens.load_model("shapes-clip")
    scenes = vitlens.data.make_multi_scenes(n=2, seed=0)
    return clip, vitlens.load_images(scenes.images, clip)


def test_explanations_of_text_targets_name_their_prompt(clip_and_image):
    clip, x = clip_and_image
    exp = vitlens.explain(clip, x, "gradskip", target=vitlens.TextPrompt("a ring"))
    assert [viz.target_phrase(exp.target, int(exp.targets[j]), j) for j in range(2)] == ["\u201ca ring\u201d"] * 2
    assert cli_explain._text_caption(exp, 0) == f"\u201ca ring\u201d, score = {float(exp.scores[0]):.3g}"
    assert cli_explain._text_caption(exp, 0, name_only=True) == "a ring"
    versus = vitlens.explain(clip, x, "gradskip", target=vitlens.TextContrast(["a ring", "a star"], "a disk"))
    assert cli_explain._target_words(versus, 1) == "\u201ca star\u201d over \u201ca disk\u201d"
    assert cli_explain._text_caption(versus, 1).startswith("\u201ca star\u201d over \u201ca disk\u201d, score = ")
    emb = clip.encode_text(["a ring"])[0]
    direct = vitlens.explain(clip, x, "gradskip", target=vitlens.TextEmbedding(emb))
    assert cli_explain._target_words(direct, 0) == "the text embedding"


def test_explanations_of_classes_keep_class_wording():
    model = vitlens.load_model("shapes-vit")
    x = vitlens.load_images(vitlens.data.make_scenes(n=2, seed=0).images, model)
    for target in (None, 1, vitlens.Contrast(classes=1, versus=2)):
        exp = vitlens.explain(model, x, "gradskip", target=target)
        assert cli_explain._target_words(exp, 0) == "the class"
        assert cli_explain._text_caption(exp, 0) is None


# -- the command line --------------------------------------------------------------------------------------------------
def _record_calls(monkeypatch):
    calls = []
    for name in ("save_figure", "save_grid"):
        real = getattr(viz, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls.append((_name, kwargs))
            return _real(*args, **kwargs)

        monkeypatch.setattr(viz, name, spy)
    return calls


def test_explain_text_figures_and_summary_name_the_prompt(tmp_path, monkeypatch, capsys):
    calls = _record_calls(monkeypatch)
    img = scene_png(tmp_path)
    assert main(["explain", str(img), "--model", "shapes-clip", "--text", "a ring", "--text", "a disk",
                 "--methods", "gradskip,rollout", "--dpi", "40", "--quiet", "--out", str(tmp_path / "out")]) == 0
    figures = [kw for name, kw in calls if name == "save_figure"]
    grids = [kw for name, kw in calls if name == "save_grid"]
    assert len(figures) == 8 and len(grids) == 2
    assert {kw["target"] for kw in figures[:4]} == {"\u201ca ring\u201d"}
    assert {kw["target"] for kw in figures[4:]} == {"\u201ca disk\u201d"}
    assert [kw["target"] for kw in grids] == ["\u201ca ring\u201d", "\u201ca disk\u201d"]
    assert all("class" not in kw["caption"] for kw in figures)
    assert all("class" not in c for kw in grids for c in kw["captions"])
    assert main(["explain", str(img), "--model", "shapes-clip", "--text", "a ring", "--methods", "gradskip",
                 "--dpi", "40", "--out", str(tmp_path / "line")]) == 0
    line = capsys.readouterr().out.strip()
    assert ": \u201ca ring\u201d, score = " in line and "class" not in line


def test_explain_class_figures_and_summary_unchanged(tmp_path, monkeypatch, capsys):
    calls = _record_calls(monkeypatch)
    img = scene_png(tmp_path)
    assert main(["explain", str(img), "--model", "shapes-vit", "--target", "3", "--methods", "gradskip,rollout",
                 "--dpi", "40", "--out", str(tmp_path / "out")]) == 0
    assert {kw["target"] for _, kw in calls} == {"the class"}
    line = capsys.readouterr().out.strip()
    assert "(class 3), p = " in line


def test_text_target_drawn(tmp_path):
    """The label reaches the drawn figure: save_figure and save_grid accept it for a signed map."""
    heat = torch.linspace(-1, 1, 64).reshape(8, 8)
    image = np.full((8, 8, 3), 0.5)
    words = "\u201ca ring\u201d over \u201ca disk\u201d"
    assert viz.save_figure(tmp_path / "f.png", image, heat, normalize="signed", target=words, dpi=40).exists()
    assert viz.save_grid(tmp_path / "g.png", [image], {"gradskip": [heat]}, target=words, dpi=40,
                         shared_scale=True).exists()
