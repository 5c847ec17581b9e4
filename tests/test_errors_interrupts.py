"""Interrupts and fault injection: ``bench`` and ``train-aha`` killed (SIGKILL) and interrupted (SIGINT, as Ctrl-C)
at several points, then resumed, give exactly the rows / weights of an uninterrupted run.

Ctrl-C: exit code 130, one line on stderr (no traceback) with the command that resumes; finished work is kept.
Each run is a real ``python -m vitlens.cli`` process on a tiny random timm ViT (seconds).

No test races the clock: the run itself stops at a named pause point (:mod:`vitlens.pause`, ``VITLENS_PAUSE_AT``)
and says so in a marker file, and only then is the signal sent; a run cannot finish before it arrives, however fast
the machine.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

#: real command-line processes, training or a sweep over every family: left out of `pytest -m "not slow"`
pytestmark = pytest.mark.slow

MODEL = ["--model", "timm:vit_tiny_patch16_224", "--model-option", "pretrained=False",
         "--model-option", "img_size=32", "--model-option", "num_classes=6", "--model-option", "patch_size=8"]
CLI = [sys.executable, "-m", "vitlens.cli"]


def env() -> dict[str, str]:
    e = dict(os.environ)
    src = str(Path(__file__).resolve().parents[1] / "src")
    e["PYTHONPATH"] = os.pathsep.join([src, e.get("PYTHONPATH", "")])
    e["OMP_NUM_THREADS"] = "1"
    e["PYTHONUNBUFFERED"] = "1"
    return e


def bench_args(out: Path) -> list[str]:
    return ["bench", *MODEL, "--data", "scenes:seed=5", "--methods", "gradskip,random,inputxgradient",
            "--metrics", "pointing_game:tolerance=2,insertion_deletion:steps=4", "--num-images", "24",
            "--batch", "2", "--quiet", "--out", str(out)]


def train_args(out: Path) -> list[str]:
    return ["train-aha", *MODEL, "--steps", "12", "--batch-size", "2", "--curve-points", "4", "--grid-range", "2",
            "4", "--width", "8", "--n-val", "4", "--ckpt-every", "1", "--chunk", "64", "--threads", "1",
            "--no-progress", "--name", "aha", "--out", str(out)]


def run(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + args, env=env(), capture_output=True, text=True, timeout=300)


def bench_tables(run_dir: Path) -> dict[str, list[tuple]]:
    con = sqlite3.connect(run_dir / "results.sqlite")
    try:
        return {
            "results": sorted(con.execute("SELECT image, image_id, method, metric, output, value, protocol "
                                          "FROM results")),
            "curves": sorted(con.execute("SELECT image, method, metric, output, x, y FROM curves")),
            "costs": sorted(con.execute("SELECT image, method, forward_passes, backward_passes FROM costs")),
        }
    finally:
        con.close()


def stored_units(run_dir: Path) -> int:
    shard = run_dir / "shards" / "rank-0.sqlite"
    if not shard.exists():
        return -1 if (run_dir / "config.json").exists() else -2
    try:
        con = sqlite3.connect(shard, timeout=1)
        try:
            return con.execute("SELECT COUNT(DISTINCT method || ':' || image) FROM costs").fetchone()[0] // 2
        finally:
            con.close()
    except sqlite3.Error:
        return -1


def checkpoint_step(out: Path) -> int:
    ck = out / "checkpoint.pt"
    if not ck.exists():
        return -1
    try:
        return int(torch.load(ck, map_location="cpu", weights_only=False)["step"])
    except Exception:  # noqa: BLE001 - a file being replaced on a slow disk: look again
        return -1


def _default_signals() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def interrupt_at(args: list[str], point: str, sig: int, cli: list[str] = CLI) -> subprocess.CompletedProcess:
    """Start ``vitlens ARGS`` held at pause point ``point``; once it is there, send ``sig``."""
    marker = Path(tempfile.mkdtemp(prefix="vitlens-pause-")) / "reached"
    e = {**env(), "VITLENS_PAUSE_AT": point, "VITLENS_PAUSE_FILE": str(marker), "VITLENS_PAUSE_SECONDS": "300"}
    # SIGINT and SIGTERM at their defaults in the child: a suite started in the background by a non-interactive
    # shell inherits SIGINT ignored, and an ignored signal stays ignored across exec (the run would then never see
    # the Ctrl-C this test sends)
    proc = subprocess.Popen(cli + args, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_default_signals)
    try:
        deadline = time.monotonic() + 300  # only a bound for a broken run, never what the test waits for
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert marker.exists() and proc.poll() is None, \
            f"the run never reached pause point {point!r}: {proc.communicate(timeout=60)[1][-2000:]}"
        assert marker.read_text() == point
        os.kill(proc.pid, sig)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def check_ctrl_c(res: subprocess.CompletedProcess, out: Path, resume_flag: bool) -> None:
    assert res.returncode == 130, res.stderr[-2000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert lines[0].startswith(f"vitlens: interrupted; finished results are kept in {out}; resume with: ")
    assert ("--resume" in lines[0]) == resume_flag


@pytest.fixture(scope="module")
def bench_reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "bench"
    res = run(bench_args(out))
    assert res.returncode == 0, res.stderr[-2000:]
    return bench_tables(out)


@pytest.fixture(scope="module")
def train_reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "aha"
    res = run(train_args(out))
    assert res.returncode == 0, res.stderr[-2000:]
    return out


def test_bench_killed_at_several_points_equals_uninterrupted(tmp_path, bench_reference):
    """SIGKILL once the model is loaded (nothing written yet), after 3 and after 15 units; SIGINT after 27 of 36
    units."""
    out = tmp_path / "bench"
    points = [("model-loaded", signal.SIGKILL), ("bench.unit.3", signal.SIGKILL), ("bench.unit.15", signal.SIGKILL),
              ("bench.unit.27", signal.SIGINT)]
    seen = []
    for point, sig in points:
        res = interrupt_at(bench_args(out), point, sig)
        seen.append(stored_units(out))
        if sig == signal.SIGINT:
            check_ctrl_c(res, out, resume_flag=False)
            assert res.stderr.strip().endswith(" ".join(bench_args(out)[-2:]))  # the same command resumes
        else:
            assert res.returncode == -signal.SIGKILL
        assert not (out / "results.sqlite").exists()
        assert not [p for p in out.rglob("*") if ".tmp" in p.name]
    assert seen == [-2, 3, 15, 27]  # progress was kept across every interruption, exactly to the unit
    res = run(bench_args(out))
    assert res.returncode == 0, res.stderr[-2000:]
    got = bench_tables(out)
    for table in ("results", "curves", "costs"):
        assert len(got[table]) == len(bench_reference[table]), table
        assert got[table] == bench_reference[table], table  # row for row, value for value


def test_train_aha_killed_at_several_points_equals_uninterrupted(tmp_path, train_reference):
    """SIGKILL after steps 2 and 6, SIGINT (Ctrl-C) after step 9 of 12; each restart with --resume."""
    from safetensors.torch import load_file

    out = tmp_path / "aha"
    args = train_args(out)
    points = [(2, signal.SIGKILL), (6, signal.SIGKILL), (9, signal.SIGINT)]
    for k, (step, sig) in enumerate(points):
        res = interrupt_at(args + (["--resume"] if k else []), f"train.step.{step}", sig)
        if sig == signal.SIGINT:
            check_ctrl_c(res, out, resume_flag=True)
        else:
            assert res.returncode == -signal.SIGKILL
        assert checkpoint_step(out) == step and not (out / "aha.safetensors").exists()
        assert not [p for p in out.iterdir() if ".tmp" in p.name]
    refused = run(args)  # without --resume the interrupted run is not replaced
    assert refused.returncode == 2 and "already holds a run (checkpoint.pt)" in refused.stderr
    res = run(args + ["--resume"])
    assert res.returncode == 0, res.stderr[-2000:]
    want, got = load_file(train_reference / "aha.safetensors"), load_file(out / "aha.safetensors")
    assert sorted(want) == sorted(got)
    for key in want:
        assert torch.equal(want[key], got[key]), key
    m_want = json.loads((train_reference / "aha.json").read_text())
    m_got = json.loads((out / "aha.json").read_text())
    assert m_got["loss_history"] == m_want["loss_history"] and len(m_got["loss_history"]) == 12
    wall = "seconds"  # the validation record's wall time differs between any two runs
    assert {k: v for k, v in m_got["validation"].items() if k != wall} == \
        {k: v for k, v in m_want["validation"].items() if k != wall}


@pytest.mark.parametrize("command,argv,expect", [
    ("bench", ["bench", "--out", "runs/b", "--overwrite", "--n", "5"],
     "vitlens: interrupted; finished results are kept in runs/b; resume with: "),
    ("train-aha", ["train-aha", "--model", "m", "--out", "runs/a", "--overwrite"],
     "vitlens: interrupted; finished results are kept in runs/a; resume with: "),
    ("explain", ["explain", "x.png", "--model", "shapes-vit", "--out", "o"], "vitlens: interrupted; the files written so far are in o"),
    ("methods", ["methods"], "vitlens: interrupted"),
])
def test_ctrl_c_message_and_resume_command(monkeypatch, capsys, command, argv, expect):
    """In-process: the command raises KeyboardInterrupt; the resume command drops --overwrite (that would start
    over) and adds --resume for train-aha."""
    import vitlens.cli as cli

    parser = cli.build_parser()

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", lambda: _with_func(parser, interrupted))
    assert cli.main(argv) == 130
    err = capsys.readouterr().err.strip()
    assert err.startswith(expect) and len(err.splitlines()) == 1, err
    assert "--overwrite" not in err
    assert ("--resume" in err) == (command == "train-aha")
    if command == "bench":
        assert err.endswith("bench --out runs/b --n 5")


def _with_func(parser, func):
    for action in parser._subparsers._group_actions:
        for sub in action.choices.values():
            sub.set_defaults(func=func)
    return parser


# Ctrl-C at every phase of a run: start-up, model loading, a unit of work, writing a result, shutdown

_PHASES = {
    "bench": ["start", "model-loaded", "bench.unit.1", "write.summary.md", "shutdown"],
    "train-aha": ["start", "model-loaded", "train.step.1", "write.aha.safetensors", "shutdown"],
}


@pytest.mark.slow
@pytest.mark.parametrize("command,point", [(c, p) for c, ps in _PHASES.items() for p in ps])
def test_ctrl_c_at_every_phase_is_one_line_and_130(tmp_path, command, point):
    out = tmp_path / "run"
    args = bench_args(out) if command == "bench" else train_args(out)
    res = interrupt_at(args, point, signal.SIGINT)
    check_ctrl_c(res, out, resume_flag=command == "train-aha")
    assert not [p for p in out.rglob("*") if ".tmp" in p.name]  # no half-written file, whatever the phase
    if point == "write.summary.md":
        assert not (out / "summary.md").exists()  # the interrupted write left nothing, the rows are in place
        assert (out / "results.sqlite").exists()
    if point == "shutdown":  # the run had finished: everything is there and a rerun only confirms it
        assert (out / ("report.html" if command == "bench" else "aha.safetensors")).exists()


@pytest.mark.slow
def test_sigterm_gives_the_resume_line_and_143(tmp_path):
    out = tmp_path / "aha"
    res = interrupt_at(train_args(out), "train.step.2", signal.SIGTERM)
    assert res.returncode == 143, res.stderr[-2000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert lines[0].startswith(f"vitlens: terminated (SIGTERM); finished results are kept in {out}; resume with: ")
    assert "--resume" in lines[0] and checkpoint_step(out) == 2


@pytest.mark.slow
def test_ctrl_c_during_start_up_of_the_installed_program(tmp_path):
    """``python -m vitlens`` (the program's own entry) held before the arguments are read: still one line."""
    out = tmp_path / "b"
    res = interrupt_at(bench_args(out), "start", signal.SIGINT, cli=[sys.executable, "-m", "vitlens"])
    check_ctrl_c(res, out, resume_flag=False)
