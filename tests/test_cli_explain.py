"""`vitlens explain` on one's own model with several methods, `vitlens models`, `vitlens methods`, `--help`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import vitlens
from vitlens.cli import build_parser, main
from vitlens.cli_explain import output_bases

TINY = ["--model", "timm:vit_tiny_patch16_224", "--model-option", "pretrained=False", "--model-option", "img_size=32",
        "--model-option", "patch_size=8", "--model-option", "num_classes=6"]


@pytest.fixture
def photos(tmp_path: Path) -> list[Path]:
    """Two different pictures with the same file name in two folders, one wide (its sides are cropped away)."""
    rng = np.random.default_rng(0)
    paths = []
    for folder, size in (("a", (40, 90)), ("b", (48, 48))):
        (tmp_path / folder).mkdir()
        path = tmp_path / folder / "img.png"
        Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8)).save(path)
        paths.append(path)
    return paths


def test_several_methods_own_model_unique_outputs(tmp_path: Path, photos: list[Path], capsys) -> None:
    out = tmp_path / "out"
    assert main(["explain", *map(str, photos), *TINY, "--methods", "gradskip,inputxgradient", "--device", "cpu",
                 "--out", str(out)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2  # one summary line per image
    assert all("class " in ln and "p = " in ln and "gradskip 1 fwd + 1 bwd" in ln for ln in lines)
    for folder in ("a", "b"):  # same file name, two folders: nothing overwritten
        for method in ("gradskip", "inputxgradient"):
            for suffix in (".png", ".view.png", ".npz", ".json"):
                assert (out / folder / f"img_png.{method}{suffix}").is_file()
        assert (out / folder / "img_png.grid.png").is_file()
    record = json.loads((out / "a" / "img_png.gradskip.json").read_text())
    assert record["method"] == "gradskip" and 0.0 < record["probability"] <= 1.0
    with Image.open(out / "a" / "img_png.gradskip.png") as fig:  # on the original: enlarged, its aspect kept
        assert fig.size[0] > 2 * 320 and fig.size[0] > fig.size[1]
    with np.load(out / "a" / "img_png.gradskip.npz") as maps:
        assert maps["map"].shape == (32, 32) and maps["token_map"].shape == (4, 4)


def test_json_and_quiet(tmp_path: Path, photos: list[Path], capsys) -> None:
    assert main(["explain", str(photos[0]), *TINY, "--json", "--out", str(tmp_path / "j")]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["methods"]["gradskip"]["forward_passes"] == 1.0
    assert main(["explain", str(photos[0]), *TINY, "--quiet", "--out", str(tmp_path / "q")]) == 0
    assert capsys.readouterr().out == ""


def test_bad_device_and_duplicate_method_are_one_line_errors(tmp_path: Path, photos: list[Path], capsys) -> None:
    assert main(["explain", str(photos[0]), *TINY, "--device", "nonsense", "--out", str(tmp_path)]) != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("vitlens: error:") and "--device" in err and "\n" not in err
    assert main(["explain", str(photos[0]), *TINY, "--methods", "gradskip,gradskip", "--out", str(tmp_path)]) != 0
    assert "twice" in capsys.readouterr().err


def test_output_bases_follow_relative_paths(tmp_path: Path) -> None:
    a, b = tmp_path / "x" / "cat.jpg", tmp_path / "y" / "cat.jpg"
    assert output_bases([a, b]) == ["x/cat_jpg", "y/cat_jpg"]
    assert output_bases([a, a]) == ["cat_jpg", "cat_jpg-2"]
    assert output_bases([tmp_path / "cat.jpg", tmp_path / "cat.png"]) == ["cat_jpg", "cat_png"]


def test_models_and_methods_commands(capsys) -> None:
    assert main(["models"]) == 0
    text = capsys.readouterr().out
    for name in ("shapes-vit", "digits-vit", "timm:<arch>", "hf:<dir>", "efficientnet_lite0"):
        assert name in text
    assert main(["methods"]) == 0
    text = capsys.readouterr().out
    assert "rise" in text and "4001 forward" in text and "gradskip" in text
    assert main(["methods", "--names"]) == 0
    assert capsys.readouterr().out.split() == vitlens.methods()
    names = [m.name for m in vitlens.list_models()]
    assert "shapes-vit" in names and names.index("shapes-vit") < names.index("timm:<arch>")


def test_every_help_shows_defaults() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name, child in sub.choices.items():
        text = child.format_help()
        if any(a.default not in (None, False, []) and a.option_strings and a.dest != "help" for a in child._actions):
            assert "(default:" in text, name
    assert "(default: gradskip)" in " ".join(sub.choices["explain"].format_help().split())


def test_import_vitlens_gives_viz_and_metrics_and_a_compact_repr() -> None:
    import torch

    assert callable(vitlens.viz.save_grid) and callable(vitlens.metrics.get_metric)
    model = vitlens.load_model("timm:vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8,
                               num_classes=6)
    exp = vitlens.explain(model, torch.rand(9, 3, 32, 32), method="gradskip", alpha=0.0)
    text = repr(exp)
    assert "\n" not in text and len(text) < 240
    assert "method='gradskip'" in text and "alpha=0.0" in text and "maps=(9, 32, 32)" in text and "…" in text


def test_explain_without_model_is_a_usage_error(tmp_path: Path, photos: list[Path], capsys) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["explain", str(photos[0]), "--out", str(tmp_path / "o")])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("error: the following arguments are required: --model")
    assert not (tmp_path / "o").exists()  # nothing was explained with a model the user did not choose


def test_unsupported_model_error_is_one_short_line(tmp_path: Path, photos: list[Path], capsys) -> None:
    assert main(["explain", str(photos[0]), "--model", "timm:resnet18", "--model-option", "pretrained=False",
                 "--methods", "gradskip", "--out", str(tmp_path / "o")]) != 0
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and len(err) < 400, err  # one line (it was 1,550 characters of cut docstrings)
    assert "vitlens models" in err and "gradcam" in err  # where to look, and what works on this model


def test_progress_per_image_on_stderr(tmp_path: Path, photos: list[Path], capsys) -> None:
    assert main(["explain", *map(str, photos[:2]), *TINY, "--methods", "rollout", "--json",
                 "--out", str(tmp_path / "p")]) == 0
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.startswith("[")]
    assert lines[0].startswith("[1/2] images explained") and "ETA" in lines[0]
    assert lines[-1].startswith("[2/2]") and lines[-1].endswith("done")
    assert all(line.startswith("{") for line in captured.out.splitlines())  # stdout: only the JSON records
