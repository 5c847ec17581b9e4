"""Progress on everything over a few seconds, per-image cost in per-image files, usage mistakes refused before any
model loads, and random weights said as such."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vitlens.cli import main

TINY = ["--model", "timm:vit_tiny_patch16_224", "--model-option", "pretrained=False", "--model-option", "img_size=32",
        "--model-option", "patch_size=8", "--model-option", "num_classes=6"]


@pytest.fixture
def photos(tmp_path: Path) -> list[Path]:
    rng = np.random.default_rng(0)
    paths = []
    for name in ("a.png", "b.png"):
        Image.fromarray(rng.integers(0, 255, (40, 48, 3), dtype=np.uint8)).save(tmp_path / name)
        paths.append(tmp_path / name)
    return paths


def test_explain_progress_cost_per_image_and_random_weights(tmp_path: Path, photos: list[Path], capsys) -> None:
    out = tmp_path / "out"
    assert main(["explain", *map(str, photos), *TINY, "--methods", "gradskip,rollout", "--json", "--out",
                 str(out)]) == 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("[")]
    assert lines[0].startswith("[1/2] images explained") and "ETA" in lines[0] and lines[-1].endswith("done")
    a = json.loads((out / "a_png.gradskip.json").read_text())
    b = json.loads((out / "b_png.gradskip.json").read_text())
    # on the CPU each image has its own call: its JSON states its own time, never the batch's
    assert a["cost"]["seconds_are"] == "this image's own call" and a["cost"]["seconds"] == a["seconds_per_image"]
    assert a["cost"]["seconds"] != b["cost"]["seconds"]
    run = json.loads((out / "explain-run.json").read_text())
    assert len(run["calls"]) == 4 and all(len(c["images"]) == 1 for c in run["calls"])
    assert run["seconds"] == pytest.approx(sum(c["seconds"] for c in run["calls"]))
    # random weights: said, and no class names passed off as a prediction
    assert a["random_weights"] is True and a["target_name"] is None and a["model_provenance"]["random_weights"]
    with Image.open(out / "a_png.gradskip.png") as fig:
        assert fig.info["random_weights"] == "True"


@pytest.mark.parametrize("case", ["missing image", "unknown method", "existing out", "bench method",
                                  "bench metric", "bench option"])
def test_usage_mistakes_are_refused_before_the_model_loads(tmp_path: Path, photos: list[Path], capsys,
                                                           monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the usage mistake was found")

    monkeypatch.setattr("vitlens.cli_explain.load_model_with_options", no_model)
    monkeypatch.setattr("vitlens.options.load_model_with_options", no_model)
    (tmp_path / "done").mkdir()
    (tmp_path / "done" / "a_png.gradskip.png").write_bytes(b"an earlier run's figure")
    argv, expect = {
        "missing image": (["explain", str(tmp_path / "nope.png"), *TINY, "--out", str(tmp_path / "o")],
                          "image file not found"),
        "unknown method": (["explain", str(photos[0]), *TINY, "--methods", "gradskipp", "--out", str(tmp_path / "o")],
                           "did you mean 'gradskip'"),
        "existing out": (["explain", str(photos[0]), *TINY, "--out", str(tmp_path / "done")], "--overwrite"),
        "bench method": (["bench", *TINY, "--methods", "rolout", "--n", "2", "--out", str(tmp_path / "b")],
                         "did you mean 'rollout'"),
        "bench metric": (["bench", *TINY, "--metrics", "pointing_gme", "--n", "2", "--out", str(tmp_path / "b")],
                         "did you mean 'pointing_game'"),
        "bench option": (["bench", *TINY, "--methods", "rise:n_masks=0", "--n", "2", "--out", str(tmp_path / "b")],
                         "n_masks"),
    }[case]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("vitlens: error:") and expect in err and "\n" not in err, err
    assert not (tmp_path / "o").exists() and not (tmp_path / "b").exists()


def test_bench_progress_moves_inside_a_batch(tmp_path: Path, capsys) -> None:
    import torch

    from vitlens.bench import BenchConfig, run_benchmark

    from conftest import tiny_vit

    model = tiny_vit(num_classes=6)
    model.vitlens_data_config = {"input_size": (3, 32, 32), "mean": (0.5,) * 3, "std": (0.25,) * 3, "crop_pct": 1.0}
    config = BenchConfig(model="tiny", data="scenes:seed=5", methods=[("gradskip", {}), ("random", {})],
                         metrics=[("pointing_game", {"tolerance": 2})], n=4, batch_size=4, show=0)
    torch.manual_seed(0)
    run_benchmark(config, tmp_path / "run", model=model, progress=True, device="cpu")
    err = capsys.readouterr().err
    # one batch of 4 images and 2 methods: the bar moves after each method (4 maps, then 8), not once at the end
    assert "4/8" in err and "8/8" in err and "random on images 1-4" in err


def test_train_aha_validation_has_its_own_progress(tmp_path: Path, capsys) -> None:
    from vitlens.aha.train import train_aha

    from test_aha import FAST, tiny_data, tiny_target

    res = train_aha(tiny_target(), tiny_data(), tmp_path, steps=2, progress=True, **FAST)
    err = capsys.readouterr().err
    assert "validation" in err and res.validation is not None


def test_report_captions_of_a_random_model_are_no_prediction(tmp_path: Path) -> None:
    from vitlens.bench.report_figures import _caption, random_weights

    (tmp_path / "provenance.json").write_text(json.dumps({"model": {"pretrained": False, "weights_file": None}}))
    assert random_weights(tmp_path)
    text = _caption((0, 3, 0.0029, None), "predicted", None, random_weights=True)
    assert "random weights" in text and "not a prediction" in text and "predicted:" not in text
    (tmp_path / "provenance.json").write_text(json.dumps({"model": {"pretrained": None, "weights_file": "w.pt"}}))
    assert not random_weights(tmp_path)


def test_a_batch_call_gives_each_image_its_share(tmp_path: Path, photos: list[Path], capsys,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """On an accelerator a batch is one call per method: each image's JSON says its seconds are a share, and the
    run's record holds the call (simulated on the CPU)."""
    monkeypatch.setattr("vitlens.cli_explain._one_call_per_image", lambda device: False)
    out = tmp_path / "out"
    assert main(["explain", *map(str, photos), *TINY, "--methods", "gradskip", "--quiet", "--out", str(out)]) == 0
    a = json.loads((out / "a_png.gradskip.json").read_text())
    b = json.loads((out / "b_png.gradskip.json").read_text())
    assert "share of one call on 2 image(s)" in a["cost"]["seconds_are"]
    assert a["cost"]["seconds"] == b["cost"]["seconds"]  # the call's time split evenly, never the whole on each
    run = json.loads((out / "explain-run.json").read_text())
    assert len(run["calls"]) == 1 and len(run["calls"][0]["images"]) == 2
    assert a["cost"]["seconds"] == pytest.approx(run["calls"][0]["seconds"] / 2)
