"""Option values, counts and runtime arguments: every bad value is one vitlens error naming the option, the value and
what is allowed — for the Python API (methods, metrics, data sources) and for every command's arguments."""

from __future__ import annotations

import argparse

import pytest
import torch

import vitlens
from vitlens.bench.sources import open_source
from vitlens.cli import main
from vitlens.errors import InputError
from vitlens.metrics import get_metric
from vitlens.options import (check_device, check_file_name, check_int, check_number, load_model_with_options,
                             positive_float, positive_int)

from conftest import tiny_vit


@pytest.fixture(scope="module")
def model():
    return tiny_vit()


def one_line(err: pytest.ExceptionInfo) -> str:
    msg = str(err.value)
    assert "\n" not in msg and 0 < len(msg) < 400, msg
    return msg


# --- method options: the type of each option's default is enforced before the method's own range checks ----------

METHOD_CASES = [
    ("gradskip", {"alpha": "x"}, r"option alpha of method 'gradskip' must be a finite number in \[0, 1\]; got 'x'"),
    ("gradskip", {"alpha": None}, r"option alpha of method 'gradskip' must be a finite number in \[0, 1\]; got None"),
    ("gradskip", {"alpha": True}, r"alpha .* must be a finite number in \[0, 1\]; got True"),
    ("gradskip", {"alpha": float("nan")}, r"alpha .* finite number in \[0, 1\]; got nan"),
    ("gradskip", {"grad_threshold": None}, r"grad_threshold .* finite number"),
    ("gradskip", {"conservative": "yes"}, r"conservative of method 'gradskip' must be True or False; got 'yes'"),
    ("gradskip", {"eps": "tiny"}, r"eps .* finite number"),
    ("rise", {"p_keep": "x"}, r"p_keep .* finite number in \(0, 1\]; got 'x'"),
    ("rise", {"n_masks": 2.5}, r"n_masks of method 'rise' must be an integer in \[1, 1000000\] \(one forward pass per image each.*\); got 2.5"),
    ("rise", {"seed": None}, r"seed of method 'rise' must be an integer in \[0, 2\*\*63 - 1\] \(a random seed\); got None"),
    ("tis", {"token_ratio": None}, r"token_ratio .* finite number"),
    ("mutex", {"quantile": "half"}, r"quantile .* finite number"),
    ("mda", {"cutoff": None}, r"cutoff .* finite number"),
    ("vitcx", {"noise_std": "x"}, r"noise_std .* finite number"),
    ("aha", {"lr": None}, r"lr of method 'aha' must be a finite number > 0; got None"),
    ("aha", {"n_iters": "many"}, r"n_iters of method 'aha' must be an integer"),
    ("random", {"seed": None}, r"seed of method 'random' must be an integer"),
    ("gradskip", {"alhpa": 0.3}, r"unknown option.*alhpa.*options are"),
]


@pytest.mark.parametrize("method,opts,msg", METHOD_CASES, ids=[f"{m}-{next(iter(o))}" for m, o, _ in METHOD_CASES])
def test_method_option_values(model, method, opts, msg):
    with pytest.raises(InputError, match=msg) as err:
        vitlens.explain(model, torch.randn(1, 3, 32, 32), method=method, **opts)
    one_line(err)


def test_documented_none_still_accepted():
    assert vitlens.explainers.get_method("integrated_gradients", internal_batch_size=None).options[
        "internal_batch_size"] is None


@pytest.mark.parametrize("method", ["rise", "tis", "vitcx", "mutex", "mda"])
def test_method_batch_size_option_is_not_shadowed(model, method):
    """``explain(batch_size=)`` sets the method's own batch_size (images per forward) when it has one."""
    fast = dict(vitlens.explainers.registry._METHODS[method].fast_options)
    fast.pop("batch_size", None)
    exp = vitlens.explain(model, torch.randn(2, 3, 32, 32), method=method, batch_size=3, **fast)
    assert exp.options["batch_size"] == 3


# --- metric settings -------------------------------------------------------------------------------------------

METRIC_CASES = [
    ("insertion_deletion", {"foo": 1}, r"unknown setting foo for metric 'insertion_deletion'; settings: .*steps"),
    ("pointing_game", {"tolerance": -4}, r"tolerance of metric 'pointing_game' must be a number >= 0; got -4"),
    ("pointing_game", {"tolerance": "wide"}, r"tolerance .* must be a number >= 0; got 'wide'"),
    ("pointing_game", {"skip_large": 2.0}, r"skip_large .* <= 1; got 2.0"),
    ("pointing_game", {"skip_large": 0}, r"skip_large .* > 0"),
    ("pointing_game", {"tol": 4}, r"unknown setting tol for metric 'pointing_game'; settings: skip_large, tolerance"),
    ("segmentation", {"bins": 3}, r"unknown setting bins"),
    ("faithfulness_violation", {"kk": 1}, r"unknown setting kk"),
    ("pos_neg_perturbation", {"steps": 5}, r"unknown setting steps"),
    ("no_such_metric", {}, r"unknown metric 'no_such_metric'; available: "),
]


@pytest.mark.parametrize("metric,opts,msg", METRIC_CASES, ids=[f"{m}-{list(o)}" for m, o, _ in METRIC_CASES])
def test_metric_settings(metric, opts, msg):
    with pytest.raises(InputError, match=msg) as err:
        get_metric(metric, **opts)
    one_line(err)


# --- data source settings --------------------------------------------------------------------------------------

SOURCE_CASES = [
    ("scenes:foo=1", r"unknown setting foo for data source 'scenes'; settings: seed, size"),
    ("scenes:seed='x'", r"option seed of data source 'scenes' must be an integer; got 'x'"),
    ("scenes:size=0", r"size of data source 'scenes' must be an integer >= 8"),
    ("imagenet", r"data source 'imagenet' needs the setting root, e.g. imagenet:root=DIR"),
    ("folder", r"'folder' needs the setting root"),
    ("bloodmnist", r"'bloodmnist' needs the setting path"),
    ("imagenet:rot=/x", r"has no setting rot; settings: root, boxes"),
    ("mnist5k:foo=1", r"has no setting foo"),
    ("photos:n=3", r"takes no settings"),
    ("nosuch", r"unknown data source 'nosuch'"),
]


@pytest.mark.parametrize("spec,msg", SOURCE_CASES, ids=[s for s, _ in SOURCE_CASES])
def test_source_settings(model, spec, msg):
    with pytest.raises(InputError, match=msg) as err:
        open_source(spec, model, n=2)
    one_line(err)


# --- model options ---------------------------------------------------------------------------------------------

MODEL_OPTION_CASES = [
    ("shapes-vit", {"foo": 1}, r"--model-option foo: model 'shapes-vit' takes no options"),
    ("timm:vit_tiny_patch16_224", {"pretrained": False, "img_size": 32, "foo": 1}, r"does not take 'foo'"),
]


@pytest.mark.parametrize("name,opts,msg", MODEL_OPTION_CASES, ids=[n for n, _, _ in MODEL_OPTION_CASES])
def test_model_options_never_ignored(name, opts, msg):
    with pytest.raises(InputError, match=msg) as err:
        load_model_with_options(name, opts)
    one_line(err)


# --- the checkers themselves -----------------------------------------------------------------------------------

@pytest.mark.parametrize("call,msg", [
    (lambda: check_number("lr", float("inf"), low=0, low_open=True), r"lr must be a number > 0; got inf"),
    (lambda: check_number("p", 1.5, low=0, high=1), r"p must be a number >= 0 and <= 1; got 1.5"),
    (lambda: check_int("n", 0, low=1), r"n must be an integer >= 1; got 0"),
    (lambda: check_int("n", True, low=1), r"n must be an integer >= 1; got True"),
    (lambda: check_device("tpu"), r"device 'tpu'"),
    (lambda: check_device("cuda:99"), r"cuda:99"),
    (lambda: check_file_name("--name", "../x"), r"--name must be a plain file name"),
    (lambda: check_file_name("--name", "a/b"), r"plain file name"),
    (lambda: check_file_name("--name", ".."), r"plain file name"),
    (lambda: check_file_name("--name", ""), r"plain file name"),
])
def test_checkers(call, msg):
    with pytest.raises(InputError, match=msg) as err:
        call()
    one_line(err)


@pytest.mark.parametrize("conv,text", [(positive_int, "0"), (positive_int, "-3"), (positive_int, "2.5"),
                                       (positive_float, "nan"), (positive_float, "-1"), (positive_float, "inf"),
                                       (positive_float, "x")])
def test_converters_refuse(conv, text):
    with pytest.raises(argparse.ArgumentTypeError, match=f"got '{text}'"):
        conv(text)


# --- command-line values: usage errors, exit code 2, one line naming the argument, nothing written ---------------

TINY = ["--model", "timm:vit_tiny_patch16_224", "--model-option", "pretrained=False", "--model-option", "img_size=32",
        "--model-option", "num_classes=6", "--model-option", "patch_size=8"]

CLI_CASES = [
    # counts
    (["explain", "x.png", "--batch", "0"], r"argument --batch: expected an integer >= 1, got '0'"),
    (["explain", "x.png", "--batch", "-3"], r"argument --batch: expected an integer >= 1, got '-3'"),
    (["explain", "x.png", "--target", "-1"], r"argument --target: expected an integer >= 0"),
    (["bench", "--n", "0", "--out", "OUT"], r"--num-images/--n: expected an integer >= 1, got '0'"),
    (["bench", "--num-images", "-5", "--out", "OUT"], r"expected an integer >= 1, got '-5'"),
    (["bench", "--batch", "0", "--out", "OUT"], r"argument --batch: expected an integer >= 1"),
    (["bench", "--show", "-1", "--out", "OUT"], r"argument --show: expected an integer >= 0"),
    (["demo", "--n", "0"], r"argument --n: expected an integer >= 1"),
    (["train-aha", "--model", "shapes-vit", "--out", "OUT", "--n-train", "0"], r"--n-train: expected an integer >= 1"),
    (["train-aha", "--model", "shapes-vit", "--out", "OUT", "--steps", "0"], r"--steps: expected an integer >= 1"),
    (["train-aha", "--model", "shapes-vit", "--out", "OUT", "--batch-size", "-2"], r"--batch-size: expected"),
    # runtime arguments
    (["train-aha", "--model", "shapes-vit", "--out", "OUT", "--lr", "nan"], r"--lr: expected a finite number > 0"),
    (["train-aha", "--model", "shapes-vit", "--out", "OUT", "--lr", "-1"], r"--lr: expected a finite number > 0"),
    (["train-aha", "--model", "shapes-vit", "--out", "OUT", "--tau", "0", "0"], r"--tau: expected a finite number > 0"),
    (["train-aha", "--model", "shapes-vit", "--out", "OUT", "--width", "0"], r"--width: expected an integer >= 1"),
    (["train-aha", "--model", "shapes-vit", "--out", "OUT", "--w-peak", "-0.1"], r"--w-peak: expected"),
    (["train-aha", "--model", "shapes-vit", "--out", "OUT", "--w-del", "-1"], r"--w-del: expected"),
    (["train-aha", "--model", "shapes-vit", "--out", "OUT", "--curve-points", "0"], r"--curve-points: expected"),
]


def _case_id(argv: list[str]) -> str:
    return " ".join(a for a in argv if a not in ("--out", "OUT", "--model", "shapes-vit"))


@pytest.mark.parametrize("argv,msg", CLI_CASES, ids=[_case_id(a) for a, _ in CLI_CASES])
def test_cli_values_are_usage_errors(tmp_path, capsys, argv, msg):
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in argv]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    import re

    assert re.search(msg, err), err
    assert not (tmp_path / "out").exists()


RUNTIME_CASES = [
    (["train-aha", "--model", "shapes-vit", "--device", "tpu"], r"unknown device 'tpu'; use cpu, cuda or cuda:N"),
    (["train-aha", "--model", "shapes-vit", "--name", "../x"], r"--name must be a plain file name"),
    (["train-aha", "--model", "shapes-vit", "--name", "sub/x"], r"--name must be a plain file name"),
    (["train-aha", "--model", "shapes-vit", "--model-option", "foo=1"], r"takes no options"),
    (["train-aha", "--model", "shapes-vit", "--model-option", "novalue"], r"--model-option expects KEY=VALUE"),
    (["bench", *TINY, "--methods", "gradskipp", "--n", "2"], r"unknown method 'gradskipp'"),
    (["bench", *TINY, "--methods", ",,", "--n", "2"], r"no method given"),
    (["bench", *TINY, "--metrics", ",,,", "--n", "2"], r"no metric given: --metrics needs at least one"),
    (["bench", *TINY, "--metrics", "insertion_deletion:foo=1", "--n", "2"], r"unknown setting foo"),
    (["bench", *TINY, "--metrics", "pointing_game:tolerance=-4", "--n", "2"], r"tolerance .* >= 0; got -4"),
    (["bench", *TINY, "--data", "scenes:foo=1", "--n", "2"], r"unknown setting foo for data source 'scenes'"),
    (["bench", *TINY, "--data", "imagenet", "--n", "2"], r"'imagenet' needs the setting root"),
    (["bench", *TINY, "--model-option", "foo=1", "--n", "2"], r"does not take 'foo'"),
    (["bench", *TINY, "--methods", "gradskip:alpha='x'", "--n", "2"], r"alpha of method 'gradskip' must be a finite"),
    # a folder has no masks: the default metric is then insertion/deletion; the pointing game asked for is refused
    (["bench", *TINY, "--data", "FOLDER", "--n", "2", "--metrics", "pointing_game:tolerance=4"],
     r"metric 'pointing_game\[tolerance=4\]' needs masks or boxes"),
]


@pytest.mark.parametrize("argv,msg", RUNTIME_CASES, ids=[" ".join(a[-4:]) for a, _ in RUNTIME_CASES])
def test_cli_invalid_runs_write_nothing(tmp_path, capsys, argv, msg):
    import re

    out = tmp_path / "run"
    if "FOLDER" in argv:
        import numpy as np
        from PIL import Image

        (tmp_path / "imgs" / "a").mkdir(parents=True)
        for i in range(2):
            Image.fromarray(np.full((40, 40, 3), 60 * i, dtype=np.uint8)).save(tmp_path / "imgs" / "a" / f"{i}.png")
        argv = [f"folder:root='{tmp_path / 'imgs'}'" if a == "FOLDER" else a for a in argv]
    rc = main([*argv, "--out", str(out)] + (["--quiet"] if argv[0] == "bench" else ["--no-progress"]))
    assert rc == 2
    err = capsys.readouterr().err
    # one error line; informational notes (e.g. how class folders were labelled) may precede it
    errors = [line for line in err.strip().splitlines() if not line.startswith("vitlens: note:")]
    assert "Traceback" not in err and len(errors) == 1, err
    assert re.search(msg, err), err
    assert not out.exists(), "a refused run must leave nothing behind"


def test_cuda_device_without_gpu_is_one_line(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a machine without a GPU
    rc = main(["train-aha", "--model", "shapes-vit", "--device", "cuda", "--out", str(tmp_path / "o")])
    assert rc == 2
    assert "no CUDA GPU is available here; use --device cpu" in capsys.readouterr().err

