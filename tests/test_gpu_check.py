"""The GPU check script runs end to end at tiny size on the CPU (``--smoke``) and reports every figure it promises.

On a lent GPU the same script runs at full size (ViT-B/16, batch 64); wall times are never asserted on.
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip("timm")

from conftest import load_benchmark, torch_threads  # noqa: E402


def test_smoke_run_reports_ratios_training_and_bench_throughput(tmp_path):
    check = load_benchmark("gpu_check")
    with torch_threads(1):
        res = check.main(["--smoke", "--device", "cpu", "--out", str(tmp_path / "gpu.md")])
    assert set(res["gradskip"]) == {"fp32", "bf16"}
    for r in res["gradskip"].values():
        for key in ("gradskip_x_floor", "gradskip_x_forward", "floor_x_forward", "gradskip_x_explicit_floor",
                    "explicit_floor_x_floor"):
            assert math.isfinite(r[key]) and r[key] > 0
        assert math.isnan(r["mem_x_floor"])  # CUDA memory only
    assert res["aha"]["finished"] and res["aha"]["timed_steps"] == 2 and res["aha"]["images_per_s"] > 0
    assert res["bench"]["n"] == 4 and res["bench"]["images_per_s"] > 0
    md = (tmp_path / "gpu.md").read_text()
    assert md == res["markdown"]
    for text in ("| fp32 |", "| bf16 |", "AHA training", "images/s", "bench", "GradSkip ÷ default floor",
                 "explicit ÷ default floor"):
        assert text in md
    assert check.FULL["model"] == "vit_base_patch16_224" and check.FULL["batch"] == 64
