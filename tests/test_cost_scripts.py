"""The every-method cost table and the LXT side-by-side script run end to end (times are never asserted on)."""

from __future__ import annotations

import math
import os

import pytest
import torch

pytest.importorskip("timm")

from conftest import BENCHMARKS as BENCH, load_benchmark  # noqa: E402

TINY = "timm:vit_tiny_patch16_224:img_size=32,patch_size=8,depth=2,num_classes=5"


def test_method_cost_table_lists_declared_and_counted_passes(tmp_path):
    script = load_benchmark("method_cost")
    threads = torch.get_num_threads()
    out = tmp_path / "cost.md"
    res = script.main(["--models", TINY, "--methods", "gradskip,rise,gradient", "--batch", "2", "--repeats", "1",
                       "--budget", "0.01", "--out", str(out)])
    assert torch.get_num_threads() == threads
    rows = {r["method"]: r for r in res["rows"]}
    assert set(rows) == {"gradskip", "rise", "gradient"}
    assert (rows["gradskip"]["declared_fwd"], rows["gradskip"]["declared_bwd"]) == (1.0, 1.0)
    assert (rows["gradskip"]["counted_fwd"], rows["gradskip"]["counted_bwd"]) == (1.0, 1.0)
    # RISE's 4000 masks do not fit the budget: measured at its fast_options, and what it declares then is counted
    assert rows["rise"]["which"] == "fast_options" and rows["rise"]["options"]["n_masks"] == 24
    assert rows["rise"]["counted_fwd"] == rows["rise"]["declared_fwd"] == 25.0
    for r in rows.values():
        assert math.isfinite(r["x_forward"]) and r["x_forward"] > 0 and r["ms_per_map"] > 0
    md = out.read_text()
    assert md == res["markdown"] and "| gradskip | defaults | 1 / 1 | 1 / 1 |" in md
    assert "fast: n_masks=24" in md


def test_method_cost_floor_and_memory_columns(tmp_path):
    """--floor times the forward + backward floor in every repeat, --memory runs each row in a fresh subprocess."""
    script = load_benchmark("method_cost")
    res = script.main(["--models", TINY, "--methods", "legrad,libragrad_inputxgradient", "--batch", "2",
                       "--repeats", "1", "--floor", "--memory", "--out", str(tmp_path / "cost.md")])
    for r in res["rows"]:
        assert math.isfinite(r["x_floor"]) and r["x_floor"] > 0 and r["floor_ms"] > 0
        assert r["peak_mib"] >= 0 and r["floor_peak_mib"] > 0
    assert "× floor | peak MiB | mem × floor |" in res["markdown"] and "forward + backward floor" in res["markdown"]


LXT = os.environ.get("VITLENS_LXT_PYTHON") or (
    str(BENCH.parent / ".venv-lxt" / "bin" / "python") if (BENCH.parent / ".venv-lxt").exists() else None)


@pytest.mark.skipif(not LXT, reason="set VITLENS_LXT_PYTHON to a python with lxt and transformers<5")
@pytest.mark.slow
def test_lxt_side_by_side_agrees_with_lxt(tmp_path, monkeypatch):
    monkeypatch.setenv("VITLENS_LXT_PYTHON", LXT)
    script = load_benchmark("lxt_side_by_side")
    res = script.main(["--model", "vit_tiny_patch16_224:img_size=32,patch_size=8,depth=2", "--batch", "2",
                       "--repeats", "1", "--out", str(tmp_path / "lxt.md")])
    assert set(res["times"]) == {r for rows in script.SIDES.values() for r in rows}
    assert res["agreement"]["LXT AttnLRP"]["rel_max_diff"] < 1e-5
    assert res["agreement"]["LXT CP-LRP"]["rel_max_diff"] < 1e-5
    assert "vitlens attnlrp ÷ LXT AttnLRP" in (tmp_path / "lxt.md").read_text()


def test_gradskip_components_times_the_steps_of_eva_and_swin_and_restores_them():
    from vitlens.explainers import gradskip, gradskip_swin

    script = load_benchmark("gradskip_components")
    originals = (gradskip._BlockSteps._attn_step, gradskip_swin._WindowSteps.attn_step)
    threads = torch.get_num_threads()
    res = script.main(["--models", "eva02_tiny_patch14_224:img_size=28,depth=2,num_classes=5",
                       "swin_tiny_patch4_window7_224:img_size=56,embed_dim=24,num_classes=5", "--batch", "2",
                       "--repeats", "1"])
    assert torch.get_num_threads() == threads
    assert (gradskip._BlockSteps._attn_step, gradskip_swin._WindowSteps.attn_step) == originals
    for r in res:
        assert [row["row"] for row in r["rows"]] == ["(b′) floor, default attention", "(b) floor, explicit attention",
                                                     "(c′) GradSkip"]
        parts = {p["part"]: p["ms"] for p in r["parts"]}
        assert {"attention step (all)", "skip-gate step", "  of which Gini sort"} <= set(parts), r["model"]
        assert parts["attention step (all)"] >= parts["  of which Gini sort"] > 0
