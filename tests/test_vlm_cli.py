"""The command line with vision–language models (issue #52, item 5): ``vitlens explain --text`` (one figure per prompt,
the caption naming the prompt and its score) and ``vitlens bench --prompts`` (prompts as classes, shown in the
report)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from vitlens.cli import main

from tiny_vlms import hf_model, tokenizer

CLASSES = "a disk,a square,a triangle,a cross,a ring,a star"  # the scenes' classes in their order


@pytest.fixture()
def clip_dir(tmp_path):
    folder = tmp_path / "clip"
    hf_model("clip").save_pretrained(folder)
    tokenizer().save_pretrained(folder)
    return folder


def test_explain_one_figure_per_prompt(clip_dir, tmp_path, capsys):
    img = tmp_path / "cat.png"
    Image.fromarray((np.random.RandomState(0).rand(40, 56, 3) * 255).astype("uint8")).save(img)
    out = tmp_path / "out"
    assert main(["explain", str(img), "--model", f"hf:{clip_dir}", "--text", "a photo of a cat", "--text",
                 "a photo of a dog", "--methods", "gradskip", "--json", "--dpi", "60", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    records = [json.loads(line) for line in captured.out.splitlines() if line.startswith("{")]
    assert [r["methods"]["gradskip"]["name"] for r in records] == ["a photo of a cat", "a photo of a dog"]
    # progress counts each prompt's explanation of the image (it said "[1/2] images explained" twice, never "done")
    lines = [ln for ln in captured.err.splitlines() if ln.startswith("[")]
    assert [ln.split(",")[0] for ln in lines] == ["[1/2] explanations (1 image(s) × 2 prompts)",
                                                  "[2/2] explanations (1 image(s) × 2 prompts)"]
    assert lines[-1].endswith("done")
    for stem in ("a_photo_of_a_cat", "a_photo_of_a_dog"):
        info = json.loads((out / f"cat_png.{stem}.gradskip.json").read_text())
        assert info["target"]["kind"] == "TextPrompt" and info["target_name"] == stem.replace("_", " ")
        assert info["probability"] is None  # an image embedding has no class probability
        assert abs(info["score"] - (sum(np.load(out / f"cat_png.{stem}.gradskip.npz")["token_map"].ravel())
                                    + info["remainder"])) < 1e-4 * max(1.0, abs(info["score"]))
        assert (out / f"cat_png.{stem}.gradskip.png").stat().st_size > 0


def test_explain_text_needs_a_vision_language_model(tmp_path, capsys):
    img = tmp_path / "x.png"
    Image.fromarray(np.zeros((32, 32, 3), dtype="uint8")).save(img)
    code = main(["explain", str(img), "--model", "shapes-vit", "--text", "a ring", "--dpi", "60",
                 "--out", str(tmp_path / "o")])
    assert code != 0
    err = capsys.readouterr().err
    assert "vision–language model" in err and "Traceback" not in err
    assert main(["explain", str(img), "--model", "shapes-vit", "--text", "a ring", "--target", "1",
                 "--out", str(tmp_path / "p")]) != 0


def test_bench_with_prompts_as_classes(clip_dir, tmp_path):
    out = tmp_path / "run"
    assert main(["bench", "--model", f"hf:{clip_dir}", "--prompts", CLASSES, "--data", "scenes", "--n", "3",
                 "--batch", "3", "--methods", "gradskip", "--out", str(out), "--quiet"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["prompts"] == CLASSES.split(",")
    page = (out / "report.html").read_text()
    assert "Prompts (the classes)" in page and "\u201ca triangle\u201d" in page
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("# one per class\n" + "\n".join(CLASSES.split(",")) + "\n")
    assert main(["bench", "--model", f"hf:{clip_dir}", "--prompts", f"@{prompts_file}", "--data", "scenes", "--n",
                 "3", "--batch", "3", "--methods", "gradskip", "--out", str(out), "--quiet"]) == 0  # the same run
    assert main(["bench", "--model", f"hf:{clip_dir}", "--prompts", "a ring,a ring", "--data", "scenes", "--n", "3",
                 "--methods", "gradskip", "--out", str(tmp_path / "bad"), "--quiet"]) != 0


def test_explain_text_versus_explains_the_contrast(tmp_path, capsys):
    """--versus: each --text prompt against one prompt (TextContrast), e.g. a prompt naming no object; one-line errors
    without --text or when it repeats a --text prompt."""
    from vitlens.data.scenes import make_scenes

    img = tmp_path / "scene.png"
    Image.fromarray((make_scenes(1, seed=5).images[0].permute(1, 2, 0).numpy() * 255).astype("uint8")).save(img)
    out = tmp_path / "out"
    assert main(["explain", str(img), "--model", "shapes-clip", "--text", "a ring", "--versus", "a picture",
                 "--methods", "gradskip", "--dpi", "60", "--out", str(out)]) == 0
    info = json.loads((out / "scene_png.a_ring.gradskip.json").read_text())
    assert info["target"]["kind"] == "TextContrast" and info["target"]["prompts"] == ["a ring", "a picture"]
    assert abs(info["score"] - (sum(np.load(out / "scene_png.a_ring.gradskip.npz")["token_map"].ravel())
                                + info["remainder"])) < 1e-4 * max(1.0, abs(info["score"]))
    capsys.readouterr()
    assert main(["explain", str(img), "--model", "shapes-clip", "--versus", "a picture", "--out",
                 str(tmp_path / "o2")]) == 2
    assert "--versus needs --text" in capsys.readouterr().err
    assert main(["explain", str(img), "--model", "shapes-clip", "--text", "a ring", "--versus", "a ring", "--out",
                 str(tmp_path / "o3")]) == 2
    assert "--versus 'a ring'" in capsys.readouterr().err
