"""The GPU check script runs end to end at tiny size on the CPU (``--smoke``) and reports every figure it promises.

On a lent GPU the same script runs at full size (ViT-B/16, batch 64); wall times are never asserted on.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("timm")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_smoke_run_reports_ratios_training_and_bench_throughput(tmp_path):
    check = load_script()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        res = check.main(["--smoke", "--device", "cpu", "--out", str(tmp_path / "gpu.md")])
    finally:
        torch.set_num_threads(threads)
    assert set(res["gradskip"]) == {"fp32", "bf16"}
    for r in res["gradskip"].values():
        for key in ("gradskip_x_floor", "gradskip_x_forward", "floor_x_forward"):
            assert math.isfinite(r[key]) and r[key] > 0
        assert math.isnan(r["mem_x_floor"])  # CUDA memory only
    assert res["aha"]["finished"] and res["aha"]["timed_steps"] == 2 and res["aha"]["images_per_s"] > 0
    assert res["bench"]["n"] == 4 and res["bench"]["images_per_s"] > 0
    md = (tmp_path / "gpu.md").read_text()
    assert md == res["markdown"]
    for text in ("| fp32 |", "| bf16 |", "AHA training", "images/s", "bench"):
        assert text in md
    assert check.FULL["model"] == "vit_base_patch16_224" and check.FULL["batch"] == 64
