"""Benchmark harness: storage, summary, config checks, resume after kill -9, and torchrun sharding."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from vitlens.bench.runner import split_specs
from vitlens.errors import InputError

from conftest import result_rows

#: real command-line processes, training or a sweep over every family: left out of `pytest -m "not slow"`
pytestmark = pytest.mark.slow

MODEL = ["--model", "timm:vit_tiny_patch16_224", "--model-option", "pretrained=False",
         "--model-option", "img_size=32", "--model-option", "num_classes=6", "--model-option", "patch_size=8"]


def bench_cmd(out: Path, n: int = 24, batch: int = 4, extra: list[str] | None = None) -> list[str]:
    return [sys.executable, "-m", "vitlens.cli", "bench", *MODEL, "--data", "scenes:seed=5",
            "--methods", "gradskip,random,gradskip:skip='fixed'", "--metrics", "pointing_game:tolerance=2",
            "--num-images", str(n), "--batch", str(batch), "--quiet", "--out", str(out), *(extra or [])]


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["OMP_NUM_THREADS"] = "1"
    e["PYTHONUNBUFFERED"] = "1"
    return e


def test_split_specs():
    assert split_specs(["gradskip,rise:n_masks=10", "gradskip:head_subset=('top', 0.25);skip='none'"]) == [
        ("gradskip", {}), ("rise", {"n_masks": 10}),
        ("gradskip", {"head_subset": ("top", 0.25), "skip": "none"}),
    ]
    with pytest.raises(InputError, match="not KEY=VALUE"):
        split_specs("gradskip:alpha")


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "ref"
    subprocess.run(bench_cmd(out), check=True, env=env(), capture_output=True, timeout=600)
    return out


def test_run_writes_tables_plots_and_report(reference_run):
    r = result_rows(reference_run)
    assert len(r) == 24 * 3 * 2  # images x methods x outputs
    assert len({x[:4] for x in r}) == len(r)
    for name in ["summary.md", "summary.csv", "summary.json", "report.html", "examples.png", "config.json"]:
        assert (reference_run / name).exists(), name
    summary = json.loads((reference_run / "summary.json").read_text())
    assert {s["method"] for s in summary} == {"gradskip", "random", "gradskip[skip=fixed]"}
    assert all(s["pointing_game[tolerance=2]/pointing_game"]["n"] == 24 for s in summary)
    assert "<table class='ranking'" in (reference_run / "report.html").read_text()


def test_resume_after_kill_9(tmp_path, reference_run):
    out = tmp_path / "killed"
    from test_errors_interrupts import interrupt_at

    res = interrupt_at(bench_cmd(out)[3:], "bench.unit.4", signal.SIGKILL)  # a few units stored: kill mid-way
    assert res.returncode == -signal.SIGKILL
    con = sqlite3.connect(out / "shards" / "rank-0.sqlite")
    try:
        assert con.execute("SELECT COUNT(DISTINCT method || ':' || image) FROM costs").fetchone()[0] == 4 * 4  # 4 units of 4 images
    finally:
        con.close()
    assert not (out / "results.sqlite").exists()
    subprocess.run(bench_cmd(out), check=True, env=env(), capture_output=True, timeout=600)
    resumed = result_rows(out)
    assert len(resumed) == len({x[:4] for x in resumed}) == 24 * 3 * 2  # nothing missing, nothing twice
    ref = result_rows(reference_run)
    assert [x[:4] for x in resumed] == [x[:4] for x in ref]
    for a, b in zip(resumed, ref):
        assert a[4] == pytest.approx(b[4], abs=1e-6)


def test_other_configuration_is_refused(reference_run):
    proc = subprocess.run(bench_cmd(reference_run, n=12), env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "written by another configuration (differs in: n)" in proc.stderr


def test_torchrun_two_processes_match_single_process(tmp_path, reference_run):
    out = tmp_path / "ddp"
    cmd = bench_cmd(out)
    ddp = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
           "-m", "vitlens.cli", *cmd[3:]]
    proc = subprocess.run(ddp, env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(p.name for p in (out / "shards").iterdir()) == ["rank-0.sqlite", "rank-1.sqlite"]
    got, ref = result_rows(out), result_rows(reference_run)
    assert [x[:4] for x in got] == [x[:4] for x in ref]
    for a, b in zip(got, ref):
        assert a[4] == pytest.approx(b[4], abs=1e-6)


def test_folder_source_through_the_harness(tmp_path):
    """A plain image folder (written here) runs through the same harness and report."""
    import numpy as np
    import torch
    from PIL import Image

    from conftest import tiny_vit
    from vitlens.bench import BenchConfig, run_benchmark

    root = tmp_path / "imgs" / "cat"
    root.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(5):
        Image.fromarray(rng.integers(0, 255, (40, 50, 3), dtype=np.uint8)).save(root / f"{i}.png")
    model = tiny_vit()
    model.vitlens_data_config = {"input_size": (3, 32, 32), "mean": (0.5,) * 3, "std": (0.25,) * 3}
    cfg = BenchConfig(model="tiny", data=f"folder:root='{tmp_path / 'imgs'}'", methods=[("gradskip", {})],
                      metrics=[("pointing_game", {})], n=None, batch_size=2)
    with pytest.raises(InputError, match="needs masks or boxes"):
        run_benchmark(cfg, tmp_path / "run", model=model, progress=False)
    cfg.metrics = [("faithfulness_violation", {})] if "faithfulness_violation" in _metrics() else []
    if cfg.metrics:
        run_benchmark(cfg, tmp_path / "run2", model=model, progress=False)
        assert (tmp_path / "run2" / "report.html").exists()
    torch.manual_seed(0)


def _metrics():
    from vitlens.metrics import metric_names

    return metric_names()


def test_examples_grid_with_many_methods_is_drawn(tmp_path):
    """A run with ~30 methods (every registered method and the ablations, as benchmarks/planted_evidence.py runs)
    asked save_grid for 44.5-pt text, which it refuses: the report's examples figure failed at the end of the run."""
    import numpy as np

    from vitlens.bench.report_figures import MAX_TEXT_PT, grid_text_size
    from vitlens.viz import save_grid

    sizes = [grid_text_size(c, 100) for c in (2, 10, 30, 60)]
    assert sizes == sorted(sizes) and all(7.5 <= s <= MAX_TEXT_PT for s in sizes) and sizes[-1] == MAX_TEXT_PT
    rng = np.random.default_rng(0)
    maps = {f"method{i}": [rng.random((16, 16))] for i in range(40)}
    save_grid(str(tmp_path / "examples.png"), [rng.random((16, 16, 3))], maps, text_size=grid_text_size(41, 100),
              dpi=100)
    assert (tmp_path / "examples.png").stat().st_size > 0


def test_summary_csv_never_holds_a_formula(tmp_path):
    import csv

    from vitlens.bench.report import _write_csv, csv_cell

    assert csv_cell("=HYPERLINK(\"x\")") == "'=HYPERLINK(\"x\")" and csv_cell("@SUM(A1)") == "'@SUM(A1)"
    assert csv_cell("gradskip") == "gradskip" and csv_cell(-0.25) == -0.25 and csv_cell(None) is None
    table = [{"method": "=1+1", "insertion": {"mean": -0.5, "n": 3}}, {"method": "gradskip", "insertion": {"mean": 0.4}}]
    _write_csv(table, tmp_path / "s.csv")
    rows = list(csv.reader((tmp_path / "s.csv").open()))
    assert rows[1][0] == "'=1+1" and rows[1][1] == "-0.5" and rows[2][0] == "gradskip"
