"""Issue #24, round three: half precision for AHA, platform faults (full disk in bench's SQLite store and in
train-aha), data labelled in other classes than the model's, stretched maps, ``torch.inference_mode()``, bounded
memory for huge photos, and the new bad inputs of this round's hunt — each one line naming the problem, or honoured."""

from __future__ import annotations

import copy
import errno
import re
import sqlite3
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import vitlens
from vitlens import viz
from vitlens.cli import main
from vitlens.errors import InputError
from vitlens.explainers import get_method
from vitlens.explainers.registry import requirements

from conftest import model_fingerprint, tiny_vit
from test_errors_round2 import SIX, TRAIN, one_line, train_cli

pytestmark = pytest.mark.usefixtures("one_thread_per_module")


def _x(n: int = 2, size: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


def _corr(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, b = a.flatten(1).double(), b.flatten(1).double()
    a, b = a - a.mean(1, keepdim=True), b - b.mean(1, keepdim=True)
    return (a * b).sum(1) / (a.norm(dim=1) * b.norm(dim=1))


# --- half precision: AHA (the other methods: tests/test_precision.py) -----------------------------------------------

AHA_FAST = {"explainer": "untrained", "refine_steps": 2, "m": 4}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64, "autocast"],
                         ids=["fp16", "bf16", "fp64", "autocast-bf16"])
def test_aha_refinement_runs_on_half_and_double_models(dtype):
    """Refinement blends float32 masks with the images; the model must get them in its own dtype (it crashed with
    'Input type (float) and bias type (c10::BFloat16) should be the same')."""
    model = tiny_vit(num_classes=6)
    ref = get_method("aha", **AHA_FAST).explain(model, _x())
    half = copy.deepcopy(model)
    if dtype == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            exp = get_method("aha", **AHA_FAST).explain(half, _x())
    else:
        half = half.to(dtype)
        before = model_fingerprint(half)
        exp = get_method("aha", **AHA_FAST).explain(half, _x())
        assert model_fingerprint(half) == before
    assert exp.maps.dtype == torch.float32 and torch.isfinite(exp.maps).all()
    assert torch.equal(exp.targets, ref.targets)
    assert _corr(exp.maps, ref.maps).min() > 0.95


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_shipped_aha_on_a_half_precision_shapes_vit_matches_float32(dtype):
    from vitlens.data import make_scenes
    from vitlens.images import data_config, normalize

    model = vitlens.load_model("shapes-vit")
    x = normalize(make_scenes(2, seed=5).images, data_config(model))
    ref = vitlens.explain(model, x, method="aha")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bf16 rounds the weights: the explainer warns that they differ
        exp = vitlens.explain(copy.deepcopy(model).to(dtype), x, method="aha")
    assert torch.equal(exp.targets, ref.targets)
    assert _corr(exp.maps, ref.maps).min() > 0.99  # measured 0.9995 (bf16), 0.997 (fp16)


# --- platform faults: a full disk ------------------------------------------------------------------------------

BENCH = ["bench", *SIX, "--data", "scenes:seed=5", "--methods", "random", "--metrics", "insertion_deletion:steps=4",
         "--n", "4", "--batch", "2", "--quiet"]


def _small_sqlite(monkeypatch, pages: int = 1):
    """SQLite's own size limit (``max_page_count``) makes every new store full after ``pages`` more pages: the same
    SQLITE_FULL a full disk gives."""
    from vitlens.bench import store

    original = store._connect

    def small(path):
        con = original(path)
        n = con.execute("PRAGMA page_count").fetchone()[0]
        con.execute(f"PRAGMA max_page_count = {n + pages}")
        return con

    monkeypatch.setattr(store, "_connect", small)


def test_bench_full_disk_in_the_sqlite_store_is_one_line_naming_it_and_resumes(tmp_path, monkeypatch, capsys):
    out = tmp_path / "b"
    _small_sqlite(monkeypatch)
    rc = main([*BENCH, "--out", str(out)])
    err = one_line(capsys.readouterr().err)
    assert rc == 1 and "shards/rank-0.sqlite" in err and "disk is full" in err and "OperationalError" not in err
    monkeypatch.undo()  # space freed: the same command resumes and finishes
    assert main([*BENCH, "--out", str(out)]) == 0
    from vitlens.bench.store import read_rows

    assert read_rows(out / "results.sqlite", "SELECT COUNT(DISTINCT image) FROM costs")[0][0] == 4


def test_store_write_fault_kinds(tmp_path):
    """A read-only store is an OSError naming it; a fault of another kind (a constraint) is not turned into one."""
    from vitlens.bench.store import ResultStore

    store = ResultStore(tmp_path / "run")
    store.write_unit([], [(0, "m", 1.0, 1.0, 0.1)])
    store.close()
    ro = sqlite3.connect(f"file:{store.path}?mode=ro", uri=True)
    store.con = ro
    with pytest.raises(OSError) as err:
        store.write_unit([], [(1, "m", 1.0, 1.0, 0.1)])
    assert err.value.filename == str(store.path) and "read-only" in str(err.value)
    ro.close()
    store.con = sqlite3.connect(str(store.path))
    with pytest.raises(sqlite3.IntegrityError):
        store.write_unit([], [(1, "m", None, 1.0, 0.1)])  # NOT NULL: a bug, not the platform
    store.close()


def test_train_aha_full_disk_oserror_without_a_file_name_names_the_checkpoint(tmp_path, monkeypatch, capsys):
    def full(obj, f, *a, **k):
        Path(f).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")  # no file name, as from a C writer

    monkeypatch.setattr(torch, "save", full)
    rc, _, err = train_cli(capsys, tmp_path / "aha")
    assert rc == 1 and "checkpoint.pt" in err and "No space left" in err and ".tmp" not in err
    assert not [p for p in (tmp_path / "aha").rglob("*") if ".tmp" in p.name]


# --- data labelled in other classes than the model's -----------------------------------------------------------

@pytest.mark.parametrize("model_name,spec,pattern", [
    ("shapes-vit", "mnist5k", r"'mnist5k' is labelled in 10 classes \(0, 1, .*model's 6 classes are disk, square"),
    ("digits-vit", "scenes", r"'scenes' is labelled in 6 classes \(disk, .*model's 10 classes are 0, 1"),
    ("shapes-vit", "cues", r"'cues' is labelled in 8 classes \(star, cross, stripes"),
], ids=["mnist5k-on-shapes", "scenes-on-digits", "cues-on-shapes"])
def test_bench_data_in_other_classes_than_the_models_is_refused(tmp_path, capsys, model_name, spec, pattern):
    out = tmp_path / "b"
    rc = main(["bench", "--model", model_name, "--data", spec, "--methods", "random", "--n", "2", "--quiet",
               "--out", str(out)])
    err = one_line(capsys.readouterr().err)
    assert rc == 2 and re.search(pattern, err), err
    assert not out.exists()


def test_label_space_by_count_when_the_model_has_no_names():
    from vitlens.bench.sources import check_label_space

    with pytest.raises(InputError, match=r"labelled in 6 classes .* but the model has 5 classes"):
        check_label_space("scenes", vitlens.data.CLASS_NAMES, tiny_vit(num_classes=5))
    check_label_space("scenes", vitlens.data.CLASS_NAMES, tiny_vit(num_classes=6))  # cannot tell: accepted
    check_label_space("scenes", vitlens.data.CLASS_NAMES, tiny_vit(num_classes=1000))  # ImageNet names are guessed
    check_label_space("mnist5k", vitlens.data.DIGIT_CLASS_NAMES, vitlens.load_model("digits-vit"))


# --- a map of another aspect ratio than the image --------------------------------------------------------------

@pytest.mark.parametrize("map_hw,image_hw,warns", [
    ((10, 20), (64, 64), True), ((32, 32), (64, 128), True),
    ((14, 14), (224, 224), False), ((7, 10), (28, 40), False), ((6, 8), (480, 640), False),
])
def test_stretched_map_warns(map_hw, image_hw, warns):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = viz.overlay(np.zeros((*image_hw, 3)), np.random.default_rng(0).random(map_hw))
    assert out.shape == (*image_hw, 3)
    stretched = [w for w in caught if "stretched" in str(w.message)]
    assert bool(stretched) == warns
    if warns:
        assert f"{map_hw[0]}x{map_hw[1]} map is stretched onto a {image_hw[0]}x{image_hw[1]} image" in str(
            stretched[0].message)


# --- torch.inference_mode() ------------------------------------------------------------------------------------

FAST_OPTIONS = {name: dict(type(get_method(name)).fast_options) for name in requirements()}


@pytest.mark.parametrize("name", sorted(FAST_OPTIONS))
def test_every_method_works_inside_inference_mode(name):
    model = tiny_vit(num_classes=6)
    x = _x()
    ref = get_method(name, **FAST_OPTIONS[name]).explain(model, x)
    with torch.inference_mode():
        xi = x.clone()  # made inside: an inference tensor
        exp = get_method(name, **FAST_OPTIONS[name]).explain(model, xi)
        assert torch.is_inference_mode_enabled()  # the caller's mode is back
    torch.testing.assert_close(exp.maps, ref.maps)


def test_model_made_inside_inference_mode_is_one_line():
    with torch.inference_mode():
        model = tiny_vit()
    with pytest.raises(InputError, match=r"parameter cls_token was made inside torch.inference_mode\(\)") as err:
        vitlens.explain(model, _x(), method="gradskip")
    one_line(str(err.value))


# --- bounded work: a large photo is displayed downsampled -------------------------------------------------------

def test_large_photo_is_displayed_bounded(tmp_path, monkeypatch, capsys):
    """A 3000x900 photo (and its EXIF rotation): every array drawn is at most 2048 px on its longer side, the map on
    the original has the displayed image's shape, and the figure files stay bounded."""
    from vitlens.images import display_pixels

    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 255, (900, 3000, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(tmp_path / "wide.jpg", quality=80)
    img = Image.fromarray(pixels)
    exif = img.getexif()
    exif[0x0112] = 6  # rotated by 90 degrees on display
    img.save(tmp_path / "tall.jpg", exif=exif, quality=80)
    assert display_pixels(tmp_path / "wide.jpg", "x", 2048).shape == (614, 2048, 3)
    assert display_pixels(tmp_path / "tall.jpg", "x", 2048).shape == (2048, 614, 3)
    drawn = []
    original = viz.save_figure

    def spy(path, image, heatmap, **kw):
        drawn.append((viz.to_uint8(image).shape, np.asarray(heatmap).shape))
        return original(path, image, heatmap, **kw)

    monkeypatch.setattr(viz, "save_figure", spy)
    rc = main(["explain", "--quiet", str(tmp_path / "wide.jpg"), str(tmp_path / "tall.jpg"), *SIX,
               "--out", str(tmp_path / "o")])
    assert rc == 0, capsys.readouterr().err
    assert sorted(s for s, _ in drawn) == [(32, 32, 3), (32, 32, 3), (614, 2048, 3), (2048, 614, 3)]
    for image_shape, map_shape in drawn:
        assert image_shape[:2] == map_shape
    for fig in (tmp_path / "o").glob("*.png"):
        with Image.open(fig) as f:
            assert max(f.size) <= 2600  # the 2048-px image plus colour bar and caption


def test_to_uint8_keeps_uint8_pixels_without_a_float_copy():
    from vitlens.viz.pixels import to_uint8

    a = np.random.default_rng(0).integers(0, 255, (5, 7, 3), dtype=np.uint8)
    assert np.array_equal(to_uint8(a), a) and to_uint8(a).dtype == np.uint8
    g = a[..., :1]
    assert np.array_equal(to_uint8(g), np.repeat(g, 3, axis=-1))


# --- the hunt: new bad inputs across the commands ------------------------------------------------------------------

@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """A picture, odd pictures and files that are no pictures."""
    d = tmp_path_factory.mktemp("pics")
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (40, 40, 3), dtype=np.uint8)).save(d / "ok.png")
    Image.fromarray(rng.integers(0, 255, (1, 1, 3), dtype=np.uint8)).save(d / "one.png")
    Image.fromarray(rng.integers(0, 255, (3, 600, 3), dtype=np.uint8)).save(d / "strip.png")
    Image.fromarray(rng.integers(0, 65535, (40, 40), dtype=np.uint16)).save(d / "deep.png")
    Image.fromarray(rng.integers(0, 255, (40, 40, 3), dtype=np.uint8)).convert("CMYK").save(d / "cmyk.jpg")
    frames = [Image.fromarray(rng.integers(0, 255, (40, 40, 3), dtype=np.uint8)) for _ in range(3)]
    frames[0].save(d / "anim.gif", save_all=True, append_images=frames[1:])
    (d / "x.svg").write_text('<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"></svg>')
    (d / "map.txt").write_text("a: disk\n")
    (d / "empty.png").write_bytes(b"")
    return d


EX = ["explain", "OK", *SIX, "--quiet"]
BE = ["bench", *SIX, "--methods", "random", "--n", "2", "--quiet"]
ONE_LINE = {  # argv (OK: the picture, FILES: its folder), exit code, what the line says
    "explain --dpi 100000": ([*EX, "--dpi", "100000"], 2, r"--dpi 100000 is more than 1200"),
    "explain --smooth 1e9": ([*EX, "--smooth", "1e9"], 2, r"--smooth 1e\+09 is more than the model's view \(32x32"),
    "explain --out ''": ([*EX, "--out", ""], 2, r"--out is empty"),
    "explain patch_size=0": ([*EX, "--model-option", "patch_size=0"], 2,
                             r"--model-option: timm:vit_tiny_patch16_224 cannot be built with .*patch_size=0 "
                             r"\(ZeroDivisionError"),
    "explain num_classes=-1": ([*EX, "--model-option", "num_classes=-1"], 2, r"num_classes must be an integer >= 0"),
    "explain img_size=0": ([*EX, "--model-option", "img_size=0"], 2, r"cannot be built with img_size=0"),
    "explain alpha=nan": ([*EX, "--methods", "gradskip:alpha=nan"], 2, r"alpha of method 'gradskip' must be a finite"),
    "explain alpha=1e400": ([*EX, "--methods", "gradskip:alpha=1e400"], 2, r"must be a finite number in \[0, 1\]; got inf"),
    "explain --option list": ([*EX, "--option", "alpha=[1,2]"], 2, r"must be a finite number in \[0, 1\]; got \[1, 2\]"),
    "explain --option for two methods": ([*EX, "--methods", "gradskip,rollout", "--option", "alpha=0.5"], 2,
                                         r"unknown option\(s\) alpha for method 'rollout'"),
    "explain setting without value": ([*EX, "--methods", "gradskip:alpha"], 2, r"'alpha' is not KEY=VALUE"),
    "explain method without name": ([*EX, "--methods", ":alpha=1"], 2, r"empty name in ':alpha=1'"),
    "explain head_subset k=2": ([*EX, "--methods", "gradskip:head_subset=('top', 2.0)"], 2,
                                r"head_subset of method 'gradskip' must be None or \('top' \| 'bottom', k\) with 0 < k <= 1"),
    "explain --device CPU": ([*EX, "--device", "CPU"], 2, r"unknown device 'CPU'"),
    "explain --device cuda:abc": ([*EX, "--device", "cuda:abc"], 2, r"unknown device 'cuda:abc'"),
    "explain model timm:": (["explain", "OK", "--model", "timm:", "--quiet"], 2, r"timm has no architecture named ''"),
    "explain segformer, class target": (["explain", "OK", "--model", "shapes-segformer", "--quiet"], 2,
                                        r"per-pixel logits: use vitlens.targets.SegmentationTarget"),
    "explain aha, no explainer": ([*EX, "--methods", "aha"], 2, r"no shipped AHA explainer for VisionTransformer"),
    "explain aha, missing file": ([*EX, "--methods", "aha:explainer='/nonexistent/x.safetensors'"], 1,
                                  r"AHA explainer /nonexistent/x.safetensors .* not found"),
    "explain svg": (["explain", "FILES/x.svg", *SIX, "--quiet"], 2, r"x.svg': not an image file"),
    "explain ~ path": (["explain", "~/nonexistent-vitlens.png", *SIX, "--quiet"], 2, r"image file not found"),
    "bench --seed 10**30": ([*BE, "--seed", str(10 ** 30)], 2, r"--seed: expected an integer in \[0, 2\*\*63 - 1\]"),
    "bench --seed -1": ([*BE, "--seed", "-1"], 2, r"--seed: expected an integer in \[0"),
    "bench --target label on photos": ([*BE, "--data", "photos", "--target", "label", "--metrics",
                                        "insertion_deletion:steps=2"], 2, r"--target label needs labels"),
    "bench aha without explainer": (["bench", *SIX, "--methods", "aha", "--n", "2", "--quiet"], 2,
                                    r"no shipped AHA explainer"),
    "bench --class-map missing": ([*BE, "--data", "folder:root='FILES'", "--class-map", "/nonexistent-map.txt"], 2,
                                  r"--class-map /nonexistent-map.txt: no such file"),
    "bench --class-map, no class folders": ([*BE, "--data", "folder:root='FILES'", "--class-map", "FILES/map.txt"], 2,
                                            r"maps class folders, but '.*' has none"),
    "bench scenes:size=31": ([*BE, "--data", "scenes:size=31"], 2, r"size must be in \[32, 224\], got 31"),
    "bench planted:cue_frac=2": ([*BE, "--data", "planted:cue_frac=2"], 2, r"cue_frac .* must be a number >= 0"),
    "bench --out a file": ([*BE, "--out", "FILES/ok.png"], 2, r"is a file, not a directory"),
    "train-aha --curve-points 2": ([*TRAIN, "--curve-points", "2"], 2, r"must be >= 3, got 2: with only the two"),
    "train-aha --seed 10**30": ([*TRAIN, "--seed", str(10 ** 30)], 2, r"--seed: expected an integer in \[0"),
    "train-aha --name ../x": ([*TRAIN, "--name", "../escape"], 2, r"--name must be a plain file name"),
    "train-aha folder with a non-image": ([*TRAIN, "--data", "FILES"], 2, r"empty.png': not an image file"),
    "train-aha --resume --overwrite": ([*TRAIN, "--resume", "--overwrite"], 2, r"pass one of them"),
    "train-aha --out a file": ([*TRAIN, "--out", "FILES/ok.png"], 2, r"is a file, not a folder"),
    "demo --model digits-vit": (["demo", "--model", "digits-vit", "--n", "2", "--quiet", "--methods", "random"], 2,
                                r"'scenes' is labelled in 6 classes .* model's 10 classes"),
    "demo --seed -5": (["demo", "--seed", "-5", "--n", "2", "--quiet", "--methods", "random"], 2, r"--seed"),
    "conformance hf: folder without config": (["conformance", "hf:FILES"], 1, r"not available offline"),
    "conformance option for a bundled model": (["conformance", "shapes-vit", "--model-option", "foo=1"], 2,
                                               r"model 'shapes-vit' takes no options"),
}


@pytest.mark.parametrize("case", sorted(ONE_LINE))
def test_hunt_bad_input_is_one_line_and_writes_nothing(tmp_path, files, capsys, case):
    argv, code, pattern = ONE_LINE[case]
    argv = [a.replace("FILES", str(files)) if a != "OK" else str(files / "ok.png") for a in argv]
    out = tmp_path / "out"
    if argv[0] != "conformance" and "--out" not in argv:
        argv = [*argv, "--out", str(out)]
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's own refusal: usage and one error line, exit 2
        rc = int(e.code or 0)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == code and err and "Traceback" not in "\n".join(err), err
    one_line(err[-1])
    assert re.search(pattern, err[-1]), err[-1]
    assert not out.exists()


@pytest.mark.parametrize("name", ["one.png", "strip.png", "deep.png", "cmyk.jpg", "anim.gif"])
def test_hunt_odd_pictures_are_explained(tmp_path, files, capsys, name):
    """A 1x1 pixel, a 3x600 strip, 16-bit grey, CMYK and an animated GIF (first frame) are explained, not refused."""
    rc = main(["explain", "--quiet", str(files / name), *SIX, "--out", str(tmp_path / "o")])
    assert rc == 0, capsys.readouterr().err
    assert len(list((tmp_path / "o").glob("*.png"))) == 2


API_ONE_LINE = {
    "meta batch": (lambda m: vitlens.explain(m, torch.zeros(2, 3, 32, 32, device="meta"), method="gradskip"),
                   r"on the 'meta' device"),
    "complex batch": (lambda m: vitlens.explain(m, torch.zeros(2, 3, 32, 32, dtype=torch.cfloat), method="gradskip"),
                      r"expected a floating-point batch, got dtype torch.complex64"),
    "target 2.5": (lambda m: vitlens.explain(m, _x(), method="gradskip", target=2.5), r"must be an int, got the float"),
    "target True": (lambda m: vitlens.explain(m, _x(), method="gradskip", target=True), r"got a bool"),
    "target 3 for 2 images": (lambda m: vitlens.explain(m, _x(), method="gradskip", target=[1, 2, 3]),
                              r"3 class indices given for a batch of 2 images"),
    "method None": (lambda m: vitlens.explain(m, _x(), method=None), r"unknown method None"),
    "load_model patch_size=0": (lambda m: vitlens.load_model("timm:vit_tiny_patch16_224", pretrained=False,
                                                             patch_size=0),
                                r"cannot be built with patch_size=0 \(ZeroDivisionError"),
    "load_model num_classes=2.5": (lambda m: vitlens.load_model("timm:vit_tiny_patch16_224", pretrained=False,
                                                                num_classes=2.5),
                                   r"num_classes must be an integer >= 0 .*got 2.5"),
    "load_model num_classes=-1": (lambda m: vitlens.load_model("timm:vit_tiny_patch16_224", pretrained=False,
                                                               num_classes=-1), r"got -1"),
    "load_model foo=1": (lambda m: vitlens.load_model("timm:vit_tiny_patch16_224", pretrained=False, foo=1),
                         r"timm:vit_tiny_patch16_224 does not take 'foo'"),
    "load_model dtype for a bundled model": (lambda m: vitlens.load_model("shapes-vit", dtype=torch.float16),
                                             r"takes no dtype"),
    "save_figure dpi 0": (lambda m: viz.save_figure("f.png", np.zeros((8, 8, 3)), np.zeros((8, 8)), dpi=0),
                          r"dpi must be a number in \[1, 1200\], got 0"),
    "save_grid dpi 10**6": (lambda m: viz.save_grid("g.png", [np.zeros((8, 8, 3))], {"m": [np.zeros((8, 8))]},
                                                    dpi=10 ** 6), r"dpi must be a number in \[1, 1200\]"),
    "overlay alpha nan": (lambda m: viz.overlay(np.zeros((8, 8, 3)), np.zeros((8, 8)), alpha=float("nan")),
                          r"alpha must lie in \[0, 1\], got nan"),
    "data config std 0": (lambda m: vitlens.load_images(torch.rand(3, 32, 32), {"input_size": (3, 32, 32),
                                                        "mean": (0.5,) * 3, "std": (0, 1, 1)}),
                          r"'std' must be > 0"),
}


@pytest.mark.parametrize("case", sorted(API_ONE_LINE))
def test_hunt_api_bad_input_is_one_line(tmp_path, monkeypatch, case):
    from vitlens.errors import VitlensError

    monkeypatch.chdir(tmp_path)
    fn, pattern = API_ONE_LINE[case]
    with pytest.raises(VitlensError, match=pattern) as err:
        fn(tiny_vit(num_classes=6))
    one_line(str(err.value))
    assert not list(tmp_path.iterdir())  # no figure, no temporary


def test_rise_with_a_runaway_mask_count_is_refused_before_any_work():
    """Bounded work: 10**12 masks would be 10**12 forwards per image; refused in one line, the bound named."""
    with pytest.raises(InputError, match=r"at most 1,000,000"):
        get_method("rise", n_masks=10**12)
    get_method("rise", n_masks=1_000_000)  # the bound itself is accepted


@pytest.mark.parametrize("device", ["cpu:1", "cpu:7"])
def test_a_cpu_device_index_other_than_zero_is_refused(device):
    from vitlens.devices import check_device

    with pytest.raises(InputError, match="the CPU is one device"):
        check_device(device)
    assert check_device("cpu:0") == "cpu:0"
