"""Issue #24, round two: nothing lost (unique output names, no replacing without --overwrite, one run per folder),
no traceback (each bad value is one line naming it) and nothing silently accepted or ignored."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import vitlens
from vitlens import viz
from vitlens.cli import main
from vitlens.errors import InputError, TargetError
from vitlens.run_folders import LOCK_NAME, folder_lock
from vitlens.targets import Contrast

from conftest import tiny_vit
from test_aha import FAST, tiny_data, tiny_target

TINY = ["--model", "timm:vit_tiny_patch16_224", "--model-option", "pretrained=False", "--model-option", "img_size=32",
        "--model-option", "patch_size=8"]
SIX = [*TINY, "--model-option", "num_classes=6"]


def one_line(text: str) -> str:
    text = text.strip()
    assert text and "\n" not in text and "Traceback" not in text and len(text) < 500, text
    return text


def explain(capsys, *argv: str) -> tuple[int, str]:
    rc = main(["explain", "--quiet", *argv])
    err = capsys.readouterr().err
    return rc, (one_line(err) if rc else err)


@pytest.fixture
def pictures(tmp_path: Path) -> dict[str, Path]:
    """``dup/a/x.png`` and ``dup/b/x.png`` (two pictures, one name), and a file that is not an image."""
    rng = np.random.default_rng(0)
    out = {}
    for key in ("a", "b"):
        (tmp_path / "dup" / key).mkdir(parents=True)
        out[key] = tmp_path / "dup" / key / "x.png"
        Image.fromarray(rng.integers(0, 255, (40, 40, 3), dtype=np.uint8)).save(out[key])
    out["bad"] = tmp_path / "bad.png"
    out["bad"].write_text("not an image")
    return out


def files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# --- lost: two settings or paths, one file name; a second run into the same folder; two runs at once ------------

@pytest.mark.parametrize("methods", [
    "gradskip:head_subset=('top', 0.5),gradskip:head_subset=['top', 0.5]",
    "aha:explainer='runs/x',aha:explainer='runs_x'",
    "gradskip:skip='fixed',gradskip:skip='FIXED'",
], ids=["tuple-vs-list", "slash-vs-underscore", "case"])
def test_two_method_settings_one_file_name_refused_before_writing(tmp_path, pictures, capsys, methods):
    out = tmp_path / "o"
    rc, err = explain(capsys, str(pictures["a"]), "--out", str(out), *SIX, "--methods", methods)
    assert rc == 2 and "would write the same files" in err
    assert not out.exists()


def test_second_explain_into_the_same_out_keeps_the_first_runs_files(tmp_path, pictures, capsys):
    out = tmp_path / "o"
    assert explain(capsys, str(pictures["a"]), "--out", str(out), *SIX)[0] == 0
    first = files(out)
    assert first and LOCK_NAME not in first
    rc, err = explain(capsys, str(pictures["b"]), "--out", str(out), *SIX)
    assert rc == 2 and "already holds" in err and "--overwrite" in err and "x_png.gradskip.png" in err
    assert files(out) == first
    assert explain(capsys, str(pictures["b"]), "--out", str(out), *SIX, "--overwrite")[0] == 0
    assert set(files(out)) == set(first) and files(out) != first


def test_inputs_differing_in_case_get_distinct_outputs():
    from vitlens.cli_explain import output_bases

    bases = output_bases([Path("/p/A.png"), Path("/p/a.png")])
    assert len({b.casefold() for b in bases}) == 2


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_explain_into_a_folder_in_use_is_refused_and_a_stale_lock_taken_over(tmp_path, pictures, capsys):
    out = tmp_path / "o"
    out.mkdir()
    (out / LOCK_NAME).write_text(f"{os.getpid()} explain\n")  # a live process holds it
    rc, err = explain(capsys, str(pictures["a"]), "--out", str(out), *SIX)
    assert rc == 2 and "in use by another explain run" in err and str(os.getpid()) in err
    assert files(out) == {LOCK_NAME: f"{os.getpid()} explain\n".encode()}
    (out / LOCK_NAME).write_text(f"{_dead_pid()} explain\n")  # its process is gone (killed)
    assert explain(capsys, str(pictures["a"]), "--out", str(out), *SIX)[0] == 0
    assert not (out / LOCK_NAME).exists() and (out / "x_png.gradskip.png").is_file()


def test_folder_lock_removes_only_what_it_created(tmp_path):
    with pytest.raises(RuntimeError):
        with folder_lock(tmp_path / "new", "explain"):
            raise RuntimeError("refused before writing")
    assert not (tmp_path / "new").exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(InputError, match="is a file"):
        with folder_lock(tmp_path / "file", "explain"):
            pass


# --- tracebacks become one line ---------------------------------------------------------------------------------

EXPLAIN_ONE_LINE = {
    "empty methods": (["--methods", ""], r"--methods is empty"),
    "blank methods": (["--methods", "  "], r"--methods is empty"),
    "device meta": (["--device", "meta"], r"--device: device 'meta' is not supported"),
    "device xla": (["--device", "xla"], r"--device: device 'xla' is not supported"),
    "device tpu": (["--device", "tpu"], r"--device: unknown device 'tpu'"),
    "device mps": (["--device", "mps"], r"--device: device 'mps'"),
    "target 10**30": (["--target", str(10 ** 30)], r"class 10{30} is out of range for a model with 6 classes"),
    "target 6": (["--target", "6"], r"class 6 is out of range for a model with 6 classes \(valid: 0\.\.5\)"),
}


@pytest.mark.parametrize("case", sorted(EXPLAIN_ONE_LINE))
def test_explain_bad_value_is_one_line(tmp_path, pictures, capsys, case):
    import re

    argv, pattern = EXPLAIN_ONE_LINE[case]
    if case == "device mps" and torch.backends.mps.is_available():
        pytest.skip("mps exists here")
    rc, err = explain(capsys, str(pictures["a"]), "--out", str(tmp_path / "o"), *SIX, *argv)
    assert rc == 2 and re.search(pattern, err), err
    assert not (tmp_path / "o").exists()


def test_model_option_the_model_cannot_take_is_one_line(tmp_path, pictures, capsys):
    rc, err = explain(capsys, str(pictures["a"]), "--out", str(tmp_path / "o"), *TINY,
                      "--model-option", "img_size='big'")
    assert rc == 2 and "--model-option" in err and "img_size='big'" in err and "TypeError" in err


def test_bad_image_is_counted_in_the_input_list_not_the_batch(tmp_path, pictures, capsys):
    rc, err = explain(capsys, str(pictures["a"]), str(pictures["b"]), str(pictures["bad"]), "--batch", "2",
                      "--out", str(tmp_path / "o"), *SIX)
    assert rc == 2 and err.startswith("vitlens: error: image 3 of 3") and "bad.png" in err


def test_save_figure_unknown_suffix_names_the_path(tmp_path):
    target = tmp_path / "figure.unknownfmt"
    with pytest.raises(InputError, match=r"figure\.unknownfmt: its name must end in one of .*\.png") as err:
        viz.save_figure(target, np.zeros((8, 8, 3)), np.zeros((8, 8)))
    assert ".tmp" not in str(err.value) and not list(tmp_path.iterdir())
    with pytest.raises(InputError, match="its name must end"):
        viz.save_grid(tmp_path / "grid", [np.zeros((8, 8, 3))], {"m": [np.zeros((8, 8))]})


@pytest.mark.parametrize("hw", [(0, 0), (0, 5), (5, 0)])
def test_map_to_original_zero_size(hw):
    with pytest.raises(InputError, match=r"at least 1 x 1 pixels"):
        viz.map_to_original(np.zeros((32, 32)), hw, tiny_vit())


def test_load_model_unknown_device_before_loading():
    with pytest.raises(InputError, match=r"unknown device 'tpu'"):
        vitlens.load_model("shapes-vit", device="tpu")
    with pytest.raises(InputError, match=r"device 'meta' is not supported"):
        vitlens.load_model(tiny_vit(), device="meta")


# --- silent acceptance: refused (or honoured), never ignored ----------------------------------------------------

@pytest.mark.parametrize("kwargs,pattern", [
    ({"pretrained": False}, r"pretrained=False\): a bundled model is its trained weights"),
    ({"num_classes": 10}, r"takes no num_classes"),
    ({"weights": "w.safetensors"}, r"takes no weights"),
    ({"pretrained": "no"}, r"pretrained must be True or False"),
])
def test_load_model_bundled_refuses_arguments_it_would_ignore(kwargs, pattern):
    with pytest.raises(InputError, match=pattern):
        vitlens.load_model("shapes-vit", **kwargs)


def test_load_model_module_refuses_options():
    with pytest.raises(InputError, match=r"an nn.Module\) takes no num_classes"):
        vitlens.load_model(tiny_vit(), num_classes=3)


def test_headless_model_is_not_explained_as_a_class(tmp_path, pictures, capsys):
    rc, err = explain(capsys, str(pictures["a"]), "--out", str(tmp_path / "o"), *TINY,
                      "--model-option", "num_classes=0")
    assert rc == 2 and "no classifier head (num_classes=0)" in err
    assert not (tmp_path / "o").exists()


def test_target_shapes_and_contrast_with_itself():
    model, x = tiny_vit(), torch.rand(4, 3, 32, 32)
    with pytest.raises(TargetError, match=r"one per image, shape \(4,\); got shape \(2, 2\)"):
        vitlens.explain(model, x, method="gradskip", target=torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(TargetError, match=r"class 10{30} is out of range"):
        vitlens.explain(model, x, method="gradskip", target=10 ** 30)
    with pytest.raises(TargetError, match=r"image 0 contrasts class 0 with itself"):
        vitlens.explain(model, x, method="gradskip", target=Contrast(classes=0, versus=0))
    for bad in (2.5, 0, True, "2"):
        with pytest.raises(InputError, match=r"batch_size must be a positive integer"):
            vitlens.explain(model, x, method="gradskip", batch_size=bad)
    exp = vitlens.explain(model, x, method="gradskip", target=Contrast(classes=0, versus=1))  # still works
    assert exp.maps.shape[0] == 4


# --- train-aha ---------------------------------------------------------------------------------------------------

TRAIN = ["train-aha", *SIX, "--steps", "2", "--batch-size", "2", "--n-val", "0", "--width", "8", "--no-progress"]


def train_cli(capsys, out: Path, *argv: str) -> tuple[int, str, str]:
    rc = main([*TRAIN, "--out", str(out), *argv])
    got = capsys.readouterr()
    return rc, got.out, (one_line(got.err) if rc else got.err)


@pytest.mark.parametrize("argv,pattern", [
    (["--grid-range", "5", "2"], r"needs 1 <= MIN <= MAX; got 5 2"),
    (["--references", ""], r"--references is empty"),
    (["--references", " , "], r"--references is empty"),
    (["--data", "planted:foo=1"], r"unknown setting foo for --data planted; settings: size"),
    (["--data", "scenes:seed=7"], r"unknown setting seed for --data scenes"),
    (["--data", "scenes:size=big"], r"size must be an integer >= 1; got 'big'"),
    (["--resume"], r"--resume: .* has no checkpoint.pt to continue; drop --resume"),
    (["--device", "meta"], r"device 'meta' is not supported"),
], ids=["grid-range", "references-empty", "references-blank", "planted-foo", "scenes-seed", "size", "resume-none",
        "device"])
def test_train_aha_refuses_before_writing(tmp_path, capsys, argv, pattern):
    import re

    out = tmp_path / "aha"
    rc, _, err = train_cli(capsys, out, *argv)
    assert rc == 2 and re.search(pattern, err), err
    assert not out.exists()


def test_train_aha_without_validation_prints_no_measurement(tmp_path, capsys):
    rc, printed, err = train_cli(capsys, tmp_path / "aha")
    assert rc == 0, err
    assert "no validation (--n-val 0)" in printed and "validation deletion" not in printed
    assert not (tmp_path / "aha" / LOCK_NAME).exists()


def test_train_aha_into_a_folder_in_use_is_refused(tmp_path, capsys):
    out = tmp_path / "aha"
    out.mkdir()
    (out / LOCK_NAME).write_text(f"{os.getpid()} train-aha\n")
    rc, _, err = train_cli(capsys, out)
    assert rc == 2 and "in use by another train-aha run" in err
    assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]


def _partial(out: Path, **kw):
    from vitlens.aha.train import train_aha

    return train_aha(tiny_target(), tiny_data(), out, steps=4, stop_after=2, progress=False, **{**FAST, **kw})


def test_resume_with_another_model_refused(tmp_path):
    from vitlens.aha.train import train_aha

    out = tmp_path / "aha"
    _partial(out)
    with pytest.raises(InputError, match=r"trained for another target model"):
        train_aha(tiny_target(seed=1), tiny_data(), out, steps=4, resume=True, progress=False, **FAST)
    res = train_aha(tiny_target(), tiny_data(), out, steps=4, resume=True, progress=False, **FAST)  # its own: fine
    assert res.finished and res.step == 4


def test_resume_with_other_data_refused(tmp_path):
    from vitlens.aha.train import train_aha

    out = tmp_path / "aha"
    _partial(out)
    with pytest.raises(InputError, match=r"trained on other data \(differs in kind"):
        train_aha(tiny_target(), "scenes:size=32", out, steps=4, resume=True, progress=False, **FAST)


def test_resume_checkpoint_of_the_wrong_shape_is_one_line(tmp_path):
    from vitlens.aha.train import train_aha

    out = tmp_path / "aha"
    _partial(out)
    ck = torch.load(out / "checkpoint.pt", weights_only=False)
    del ck["target"]  # as an older checkpoint: the decoder's shapes are what tells
    torch.save(ck, out / "checkpoint.pt")
    other = tiny_vit(num_classes=4)
    other.vitlens_data_config = tiny_target().vitlens_data_config
    with pytest.raises(InputError, match=r"its decoder does not fit this model \(size mismatch") as err:
        train_aha(other, tiny_data(), out, steps=4, resume=True, progress=False, **FAST)
    one_line(str(err.value))


def test_sigterm_gives_the_resume_hint(monkeypatch, capsys):
    """In-process: SIGTERM during a command is reported like Ctrl-C, with the command that resumes (exit 143), and
    the previous SIGTERM handler is restored afterwards."""
    import signal

    import vitlens.cli as cli
    from test_errors_interrupts import _with_func

    parser = cli.build_parser()
    before = signal.getsignal(signal.SIGTERM)

    def terminated(args):
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("SIGTERM did not stop the command")

    monkeypatch.setattr(cli, "build_parser", lambda: _with_func(parser, terminated))
    assert cli.main(["train-aha", "--model", "shapes-vit", "--out", "runs/a"]) == 143
    err = one_line(capsys.readouterr().err)
    assert err.startswith("vitlens: terminated (SIGTERM); finished results are kept in runs/a; resume with: ")
    assert err.endswith("--resume")
    assert signal.getsignal(signal.SIGTERM) == before


def test_closed_pil_image_is_one_line():
    from vitlens.errors import ImageLoadError

    img = Image.fromarray(np.zeros((40, 40, 3), dtype=np.uint8))
    img.close()
    with pytest.raises(ImageLoadError, match=r"inputs\[0\]: cannot read this PIL image \(.*closed image"):
        vitlens.load_images([img], {"input_size": (3, 32, 32)})


@pytest.mark.parametrize("preset", [["aha"], ("aha",), 3, {"aha": 1}])
def test_insertion_deletion_preset_of_another_type(preset):
    from vitlens.metrics import get_metric

    with pytest.raises(InputError, match=r"unknown preset .*available: aha, aha_authors, mutex, rise"):
        get_metric("insertion_deletion", preset=preset)


@pytest.mark.parametrize("field,specs,pattern", [
    ("methods", [("random", {}), ("random", {})], r"--methods lists random twice"),
    ("metrics", [("pointing_game", {}), ("pointing_game", {})], r"--metrics lists pointing_game twice"),
    ("methods", [("gradskip", {"skip": "fixed"}), ("gradskip", {"skip": "FIXED"})], r"would share one name"),
])
def test_bench_same_method_twice_refused(field, specs, pattern):
    from vitlens.bench import BenchConfig

    base = dict(model="shapes-vit", data="scenes", methods=[("random", {})], metrics=[("pointing_game", {})])
    with pytest.raises(InputError, match=pattern):
        BenchConfig(**{**base, field: specs}).check()


def test_torch_save_failure_names_the_file_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    """A full disk inside torch.save (a RuntimeError from its stream writer) is an OSError naming the checkpoint;
    the temporary is removed and the CLI prints one line."""
    from vitlens import atomic
    from vitlens.cli import main as cli_main

    def full(obj, f, *a, **k):
        Path(f).write_bytes(b"partial")
        raise RuntimeError("[enforce fail at inline_container.cc:595] . PytorchStreamWriter failed writing file "
                           "data/0: file write failed")

    monkeypatch.setattr(torch, "save", full)
    target = tmp_path / "checkpoint.pt"
    with pytest.raises(OSError) as err:
        atomic.save_torch({"x": 1}, target)
    assert err.value.filename == str(target) and "disk full" in str(err.value)
    assert not list(tmp_path.iterdir())
    rc = cli_main([*TRAIN, "--out", str(tmp_path / "aha")])
    msg = one_line(capsys.readouterr().err)
    assert rc == 1 and "checkpoint.pt" in msg and "disk full" in msg and ".tmp" not in msg
