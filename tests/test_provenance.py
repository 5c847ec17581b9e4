"""Provenance: seeded random weights are reproducible and recorded; explain's JSON names the model (spec, options,
seed, weights digest, preprocessing) and the image (digest); the five lines of docs/cli.md that reload an ``.npz``
and redraw it run against a real explain output and rebuild the same weights."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
import torch

import vitlens
from vitlens.api import model_provenance, weights_sha256
from vitlens.cli import main
from vitlens.errors import InputError

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(pretrained=False, img_size=32, patch_size=8, depth=2, embed_dim=48, num_heads=2, num_classes=5)


def test_seeded_random_weights_are_the_same_and_the_global_state_is_left_alone() -> None:
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    a = vitlens.load_model("timm:vit_tiny_patch16_224", seed=7, **TINY)
    assert torch.equal(torch.rand(3), expected_next)  # loading drew from its own generator
    b = vitlens.load_model("timm:vit_tiny_patch16_224", seed=7, **TINY)
    c = vitlens.load_model("timm:vit_tiny_patch16_224", seed=8, **TINY)
    assert weights_sha256(a) == weights_sha256(b) != weights_sha256(c)
    record = model_provenance(a)
    assert record["spec"] == "timm:vit_tiny_patch16_224" and record["seed"] == 7 and record["pretrained"] is False
    assert record["options"]["depth"] == 2 and record["preprocessing"]["input_size"] == [3, 32, 32]
    assert re.fullmatch(r"[0-9a-f]{64}", record["weights_sha256"])


def test_a_seed_where_nothing_is_random_is_refused() -> None:
    with pytest.raises(InputError, match="takes no seed"):
        vitlens.load_model("shapes-vit", seed=0)
    with pytest.raises(InputError, match="seed must be an integer"):
        vitlens.load_model("timm:vit_tiny_patch16_224", seed=-1, **TINY)


def test_weights_digest_sees_one_changed_value() -> None:
    model = vitlens.load_model("shapes-vit")
    before = weights_sha256(model)
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] += 1e-6
    assert weights_sha256(model) != before


def _five_lines() -> str:
    text = (ROOT / "docs" / "cli.md").read_text()
    block = text.split("- **Redraw a saved map**")[1].split("```python")[1].split("```")[0]
    lines = [line.strip() for line in block.strip().splitlines()]
    assert sum(1 for line in lines if not line.startswith("style=")) == 5  # five statements, one wrapped
    return "\n".join(line if not line.startswith("style=") else "    " + line for line in lines)


@pytest.mark.slow
def test_explain_records_provenance_and_the_docs_five_lines_redraw(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    image = tmp_path / "cat.jpg"
    image.write_bytes((ROOT / "docs" / "images" / "astronaut.jpg").read_bytes())
    monkeypatch.chdir(tmp_path)
    assert main(["explain", "cat.jpg", "--model", "timm:vit_small_patch16_224", "--model-option", "pretrained=False",
                 "--methods", "inputxgradient", "--out", "runs/x", "--quiet"]) == 0  # the docs' command
    info = json.loads(Path("runs/x/cat_jpg.inputxgradient.json").read_text())
    assert info["image_sha256"] == hashlib.sha256(image.read_bytes()).hexdigest()
    m = info["model_provenance"]
    assert (m["spec"], m["options"], m["seed"]) == ("timm:vit_small_patch16_224", {"pretrained": False}, 0)
    assert m["preprocessing"]["mean"] and m["preprocessing"]["crop_pct"] > 0 and info["colour"]["style"]
    namespace: dict = {}
    exec(compile(_five_lines(), "docs/cli.md", "exec"), namespace)  # the docs' code, as written
    assert Path("redrawn.png").stat().st_size > 0
    assert weights_sha256(namespace["model"]) == m["weights_sha256"]  # the same weights, rebuilt from the record
    colour = info["colour"]
    saved = namespace["np"].load("runs/x/cat_jpg.inputxgradient.npz")["map"]
    drawn = vitlens.viz.map_scale(saved, vitlens.viz.style_normalize(colour["style"], colour["normalize"]),
                                  colour["clip"])  # the range the redraw uses is the one recorded
    assert (drawn.vmin, drawn.vmax) == pytest.approx((colour["scale"]["vmin"], colour["scale"]["vmax"]))


def test_bench_run_writes_provenance_and_counts_progress_in_images(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture) -> None:
    from vitlens.bench import BenchConfig, run_benchmark

    model = vitlens.load_model("shapes-vit")
    config = BenchConfig(model="shapes-vit", data="scenes:seed=3", methods=[("random", {}), ("rollout", {})],
                         metrics=[("pointing_game", {"tolerance": 4})], n=4, batch_size=2, show=0)
    run = run_benchmark(config, tmp_path / "run", model=model, progress=True, device="cpu")
    err = capsys.readouterr().err
    # 8 maps (4 images x 2 methods): the bar moves after each method on a batch, naming what runs
    assert "8/8" in err and "map" in err and "rollout on images 3-4" in err and "unit" not in err
    prov = json.loads((run / "provenance.json").read_text())
    assert prov["device"] == "cpu" and prov["model"]["spec"] == "shapes-vit"
    assert prov["model"]["weights_sha256"] == weights_sha256(model) and prov["torch"] == torch.__version__
