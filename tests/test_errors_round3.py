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
