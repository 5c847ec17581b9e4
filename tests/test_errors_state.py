"""Output locations, damaged state, failed runs that must not poison their folder, and data loss.

Benchmarks run in-process on a tiny random ViT (seconds); train-aha on the tiny target of test_aha.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from vitlens import atomic
from vitlens.bench import BenchConfig, run_benchmark
from vitlens.cli import main
from vitlens.errors import DamagedFileError, InputError

from conftest import result_rows, tiny_vit
from test_aha import FAST, tiny_data, tiny_target


def model():
    m = tiny_vit(num_classes=6)
    m.vitlens_data_config = {"input_size": (3, 32, 32), "mean": (0.5,) * 3, "std": (0.25,) * 3}
    return m


def config(**kw) -> BenchConfig:
    base = dict(model="tiny", data="scenes:seed=5", methods=[("inputxgradient", {}), ("random", {})],
                metrics=[("pointing_game", {"tolerance": 2})], n=6, batch_size=3, show=2)
    base.update(kw)
    return BenchConfig(**base)


def bench(out: Path, **kw) -> Path:
    return run_benchmark(config(**kw), out, model=model(), progress=False)


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def no_partials(folder: Path) -> None:
    """No temporary, and no empty file, anywhere under ``folder``."""
    for p in folder.rglob("*"):
        if p.is_file():
            assert ".tmp" not in p.name, p
            assert p.stat().st_size > 0, p


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "run"
    bench(out)
    return out


def run_cli(argv: list[str]) -> int:
    """``vitlens ARGV`` in-process; argparse's usage errors (SystemExit 2) become the return code."""
    try:
        return main(argv)
    except SystemExit as e:
        return int(e.code)


def one_line(msg: str) -> str:
    assert "\n" not in msg.strip() and "Traceback" not in msg, msg
    return msg


# --- output locations ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["bench", "train-aha", "explain"])
def test_out_that_is_a_file(tmp_path, capsys, command):
    f = tmp_path / "taken"
    f.write_text("keep me")
    argv = {"bench": ["bench", "--model", "shapes-vit", "--n", "2", "--quiet"],
            "train-aha": ["train-aha", "--model", "shapes-vit", "--steps", "1", "--no-progress"],
            "explain": ["explain", str(tmp_path / "missing.png"), "--model", "shapes-vit"]}[command]
    rc = main([*argv, "--out", str(f)])
    err = one_line(capsys.readouterr().err)
    assert rc == 2 and str(f) in err and ("is a file" in err or "not a directory" in err), err
    assert f.read_text() == "keep me"


def test_read_only_location_is_refused_before_work(tmp_path, monkeypatch):
    # the check asks the OS whether the folder is writable; as root every folder is, so ask it to answer "no"
    real = os.access
    ro = tmp_path / "ro"
    ro.mkdir()
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == ro else real(p, mode))
    with pytest.raises(InputError, match=r"cannot write to .*ro .*read-only.*choose another --out"):
        bench(ro / "run")
    assert list(ro.iterdir()) == []


@pytest.mark.parametrize("fail_at", ["example map", "summary", "config"])
def test_full_disk_leaves_no_partial_file_and_rerun_completes(tmp_path, monkeypatch, capsys, reference, fail_at):
    """A write that hits ENOSPC half-way: one line, exit code 1, no 0-byte or half file; the rerun completes."""
    out = tmp_path / "run"
    real_save, real_write = np.save, Path.write_text

    def disk_full(path):
        with open(path, "wb") as f:
            f.write(b"\x93NUMPY half")
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    if fail_at == "example map":
        monkeypatch.setattr(np, "save", lambda path, arr, *a, **k: disk_full(path))
    else:
        name = {"summary": "summary.md", "config": "config.json"}[fail_at]

        def write_text(self, *a, **k):
            if self.name.startswith(f".{Path(name).stem}.tmp"):
                disk_full(self)
            return real_write(self, *a, **k)

        monkeypatch.setattr(Path, "write_text", write_text)
    cfg = config()
    with pytest.raises(OSError, match="No space left"):
        run_benchmark(cfg, out, model=model(), progress=False)
    if out.exists():
        no_partials(out)
    monkeypatch.setattr(np, "save", real_save)
    monkeypatch.setattr(Path, "write_text", real_write)
    run_benchmark(cfg, out, model=model(), progress=False)
    no_partials(out)
    assert result_rows(out) == result_rows(reference)


def test_atomic_write_keeps_the_previous_file_on_failure(tmp_path):
    target = tmp_path / "w.bin"
    target.write_bytes(b"old")

    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        with atomic.atomic_path(target) as tmp:
            tmp.write_bytes(b"half")
            raise Boom
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.bin"]
    atomic.write_bytes(target, b"new")
    assert target.read_bytes() == b"new" and sorted(p.name for p in tmp_path.iterdir()) == ["w.bin"]


def test_cli_full_disk_is_exit_code_1_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(np, "save", lambda path, *a, **k: (_ for _ in ()).throw(
        OSError(errno.ENOSPC, "No space left on device", str(path))))
    rc = main(["bench", "--model", "timm:vit_tiny_patch16_224", "--model-option", "pretrained=False",
               "--model-option", "img_size=32", "--model-option", "patch_size=8", "--methods", "random",
               "--n", "2", "--quiet", "--out", str(tmp_path / "run")])
    err = one_line(capsys.readouterr().err)
    assert rc == 1 and "No space left on device" in err and "examples/random__0.npy" in err, err
    no_partials(tmp_path / "run")


# --- damaged state ---------------------------------------------------------------------------------------------

DAMAGE = {
    "garbage": b"this is not what was written" * 40,
    "truncated-header": b"SQLite format 3\x00" + b"\x00" * 20,
    "zeros": b"\x00" * 4096,
}


@pytest.mark.parametrize("how", sorted(DAMAGE))
def test_damaged_shard_names_the_file(tmp_path, reference, how, capsys):
    out = tmp_path / "run"
    bench(out)
    shard = out / "shards" / "rank-0.sqlite"
    shard.write_bytes(DAMAGE[how])
    with pytest.raises(DamagedFileError) as err:
        bench(out)
    msg = one_line(str(err.value))
    assert str(shard) in msg and "move it aside and rerun" in msg
    shard.rename(out / "rank-0.sqlite.bad")
    bench(out)  # the units are recomputed from scratch, identically
    assert result_rows(out) == result_rows(reference)


@pytest.mark.parametrize("how", sorted(DAMAGE))
def test_damaged_merged_store_is_rebuilt_from_the_shards(tmp_path, reference, how):
    out = tmp_path / "run"
    bench(out)
    (out / "results.sqlite").write_bytes(DAMAGE[how])
    with pytest.warns(RuntimeWarning, match=r"results.sqlite was damaged .* rebuilt from the shards"):
        bench(out)
    assert result_rows(out) == result_rows(reference)
    assert (out / "results.sqlite.damaged").read_bytes() == DAMAGE[how]  # nothing thrown away


@pytest.mark.parametrize("content", ["{\"model\": \"tiny\", ", "", "[1, 2]", "\xff\xfe"])
def test_damaged_config_names_the_file_and_the_way_out(tmp_path, capsys, content, reference):
    out = tmp_path / "run"
    bench(out)
    (out / "config.json").write_bytes(content.encode("latin-1"))
    with pytest.raises(DamagedFileError) as err:
        bench(out)
    msg = one_line(str(err.value))
    assert str(out / "config.json") in msg and "--overwrite" in msg
    run_benchmark(config(), out, model=model(), progress=False, overwrite=True)
    assert result_rows(out) == result_rows(reference)


def _trained(out: Path, **kw):
    from vitlens.aha.train import train_aha

    return train_aha(tiny_target(), tiny_data(), out, progress=False, **{"steps": 2, **FAST, **kw})


CKPT_DAMAGE = {
    "truncated": lambda b: b[: len(b) // 3],
    "garbage": lambda b: b"\x80\x04garbage" * 10,
    "empty": lambda b: b"",
    "foreign": None,  # a valid torch file that is not a checkpoint
}


@pytest.mark.parametrize("how", sorted(CKPT_DAMAGE))
def test_damaged_checkpoint_names_the_file(tmp_path, how):
    from vitlens.aha.train import train_aha

    out = tmp_path / "aha"
    _trained(out, ckpt_every=1, stop_after=1)
    ck = out / "checkpoint.pt"
    if CKPT_DAMAGE[how] is None:
        torch.save({"weights": torch.zeros(3)}, ck)
    else:
        ck.write_bytes(CKPT_DAMAGE[how](ck.read_bytes()))
    with pytest.raises(DamagedFileError) as err:
        train_aha(tiny_target(), tiny_data(), out, steps=2, resume=True, progress=False, **FAST)
    msg = one_line(str(err.value))
    assert f"checkpoint {ck} is damaged" in msg and "--overwrite" in msg


def test_damaged_checkpoint_cli_exit_code_1(tmp_path, capsys):
    out = tmp_path / "aha"
    out.mkdir()
    (out / "checkpoint.pt").write_bytes(b"PK\x03\x04 not a zip")
    rc = main(["train-aha", "--model", "timm:vit_tiny_patch16_224", "--model-option", "pretrained=False",
               "--model-option", "img_size=32", "--model-option", "patch_size=8", "--steps", "1",
               "--batch-size", "2", "--n-val", "0", "--width", "8", "--no-progress", "--resume", "--out", str(out)])
    err = one_line(capsys.readouterr().err)
    assert rc == 1 and "checkpoint.pt is damaged" in err


# --- a failed run does not poison its folder -------------------------------------------------------------------

BAD_CONFIGS = {
    "method typo": dict(methods=[("inputxgradient", {}), ("gradskipp", {})]),
    "bad method option": dict(methods=[("gradskip", {"alpha": "x"})]),
    "unknown metric setting": dict(metrics=[("pointing_game", {"tol": 2})]),
    "bad metric value": dict(metrics=[("pointing_game", {"tolerance": -4})]),
    "no metric": dict(metrics=[]),
    "bad source": dict(data="scenes:foo=1"),
    "zero images": dict(n=0),
    "zero batch": dict(batch_size=0),
}


@pytest.mark.parametrize("bad", sorted(BAD_CONFIGS))
def test_failed_validation_leaves_a_new_folder_absent(tmp_path, reference, bad):
    out = tmp_path / "run"
    with pytest.raises(InputError):
        bench(out, **BAD_CONFIGS[bad])
    assert not out.exists()
    bench(out)  # the corrected rerun is not refused
    assert result_rows(out) == result_rows(reference)


@pytest.mark.parametrize("bad", sorted(BAD_CONFIGS))
def test_failed_validation_leaves_an_existing_run_as_it_was(tmp_path, bad):
    out = tmp_path / "run"
    bench(out)
    before = snapshot(out)
    with pytest.raises(InputError):
        bench(out, **BAD_CONFIGS[bad])
    assert snapshot(out) == before


def test_failed_train_aha_leaves_folder_as_it_was(tmp_path, capsys):
    out = tmp_path / "aha"
    _trained(out)
    before = snapshot(out)
    for argv in (["--lr", "-1"], ["--name", "../escape"], ["--device", "tpu"]):
        rc = run_cli(["train-aha", "--model", "shapes-vit", "--out", str(out), "--resume", *argv])
        assert rc == 2
    assert snapshot(out) == before
    assert not (tmp_path / "escape.safetensors").exists()


# --- no command destroys earlier results -----------------------------------------------------------------------

def test_bench_other_configuration_refused_then_overwrite(tmp_path, reference, capsys):
    out = tmp_path / "run"
    bench(out, n=3)
    (out / "notes.txt").write_text("mine")
    before = snapshot(out)
    with pytest.raises(InputError, match=r"another configuration \(differs in: n\).*--overwrite") as err:
        bench(out)
    one_line(str(err.value))
    assert snapshot(out) == before
    run_benchmark(config(), out, model=model(), progress=False, overwrite=True)
    assert result_rows(out) == result_rows(reference)
    assert (out / "notes.txt").read_text() == "mine"  # --overwrite removes only what a benchmark writes


def test_bench_results_without_config_are_not_adopted(tmp_path):
    out = tmp_path / "run"
    bench(out)
    (out / "config.json").unlink()
    before = snapshot(out)
    with pytest.raises(InputError, match=r"holds benchmark files \(results.sqlite, .*shards.*\) but no config.json"):
        bench(out)
    assert snapshot(out) == before


def test_bench_same_configuration_is_reused(tmp_path, reference):
    out = tmp_path / "run"
    bench(out)
    bench(out)
    assert result_rows(out) == result_rows(reference)


@pytest.mark.parametrize("existing", ["checkpoint.pt", "aha.safetensors", "aha.json", "aha.md"])
def test_train_aha_never_replaces_a_run(tmp_path, existing):
    from vitlens.aha.train import train_aha

    out = tmp_path / "aha"
    _trained(out)
    for p in out.iterdir():
        if p.name != existing:
            p.unlink()
    before = snapshot(out)
    with pytest.raises(InputError) as err:
        _trained(out)
    msg = one_line(str(err.value))
    assert f"{out} already holds a run ({existing})" in msg and "--resume" in msg and "--overwrite" in msg
    assert snapshot(out) == before
    res = train_aha(tiny_target(), tiny_data(), out, steps=2, progress=False, overwrite=True, **FAST)
    assert res.finished and res.weights.is_file()


def test_train_aha_resume_without_checkpoint_keeps_the_weights(tmp_path):
    from vitlens.aha.train import train_aha

    out = tmp_path / "aha"
    _trained(out)
    (out / "checkpoint.pt").unlink()
    before = snapshot(out)
    with pytest.raises(InputError, match=r"--resume: .* has no checkpoint.pt to continue .*--overwrite") as err:
        train_aha(tiny_target(), tiny_data(), out, steps=2, resume=True, progress=False, **FAST)
    one_line(str(err.value))
    assert snapshot(out) == before


def test_train_aha_cli_refusal_and_name(tmp_path, capsys):
    out = tmp_path / "aha"
    _trained(out, ckpt_every=1)
    before = snapshot(out)
    rc = main(["train-aha", "--model", "shapes-vit", "--name", "aha", "--out", str(out), "--no-progress"])
    err = one_line(capsys.readouterr().err)
    assert rc == 2 and "already holds a run" in err and "--resume" in err and "--overwrite" in err
    assert snapshot(out) == before
    rc = main(["train-aha", "--model", "shapes-vit", "--name", "aha", "--out", str(out), "--resume", "--overwrite"])
    assert rc == 2 and "pass one of them" in one_line(capsys.readouterr().err)
    assert snapshot(out) == before
    with pytest.raises(InputError, match="--name must be a plain file name"):
        _trained(tmp_path / "other", name="../x")
    assert not (tmp_path / "x.safetensors").exists() and not (tmp_path / "other").exists()


def test_full_disk_during_a_checkpoint_keeps_the_previous_one(tmp_path, monkeypatch):
    """ENOSPC half-way through a checkpoint save: the error propagates, the previous checkpoint is intact, no
    temporary is left, and --resume continues from that checkpoint to the uninterrupted result."""
    from vitlens.aha.train import train_aha

    full = _trained(tmp_path / "full", steps=4)
    out = tmp_path / "aha"
    _trained(out, steps=4, stop_after=2)
    before = (out / "checkpoint.pt").read_bytes()
    real_save = torch.save

    def disk_full(obj, path, *a, **k):
        Path(path).write_bytes(b"PK\x03\x04half")
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError, match="No space left") as err:
        train_aha(tiny_target(), tiny_data(), out, steps=4, resume=True, progress=False, **FAST)
    assert err.value.filename == str(out / "checkpoint.pt")  # the file meant, not the temporary
    assert (out / "checkpoint.pt").read_bytes() == before
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint.pt"]
    monkeypatch.setattr(torch, "save", real_save)
    rest = train_aha(tiny_target(), tiny_data(), out, steps=4, resume=True, progress=False, **FAST)
    for (k, a), b in zip(full.net.state_dict().items(), rest.net.state_dict().values()):
        assert torch.equal(a, b), k
