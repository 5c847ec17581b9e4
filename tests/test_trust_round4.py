"""Issue #51, items 1-3: no code runs from a data file, nothing a run wrote is replaced, only regular files are read
and every image mode is converted by its real range. Each planted pickle here would create a marker file if any of
it ran; every test checks the marker is absent."""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from test_errors_round2 import SIX, TRAIN, one_line
from test_report_stats import _fake_run

import vitlens
from vitlens.cli import main
from vitlens.errors import (
    DamagedFileError,
    ImageLoadError,
    InputError,
    WeightsUnavailableError,
)

pytestmark = pytest.mark.usefixtures("one_thread_per_module")


class _Planted:
    """Pickles as ``os.system("touch MARKER")``: unpickling it would run a shell command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch '{self.marker}'",))


class _Thing:
    """A plain object of a class: not a tensor or a plain value."""


def _plant(path: Path, marker: Path, wrap: bool = True) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"decoder": _Planted(marker)} if wrap else _Planted(marker), path)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _run(capsys, argv: list[str]) -> tuple[int, str]:
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = int(e.code or 0)
    got = capsys.readouterr()
    return rc, got.err.strip()


def _within(seconds: float, fn):
    """``fn()``'s result, or a failure if it does not return in ``seconds`` (a read that blocks on a FIFO)."""
    box: dict = {}

    def target() -> None:
        try:
            box["r"] = fn()
        except BaseException as e:  # re-raised in the test's thread
            box["e"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "blocked (a FIFO was opened)"
    if "e" in box:
        raise box["e"]
    return box["r"]


# --- 1. no code from data ---------------------------------------------------------------------------------------

def test_a_planted_checkpoint_is_refused_and_never_runs(tmp_path, capsys):
    out, marker = tmp_path / "aha", tmp_path / "PWNED"
    _plant(out / "checkpoint.pt", marker)
    rc, err = _run(capsys, [*TRAIN, "--out", str(out), "--resume"])
    assert rc == 1, err
    line = one_line(err)
    assert "checkpoint.pt" in line and "refused" in line and "system" in line and "nothing of it was run" in line
    assert not marker.exists()


@pytest.mark.slow  # two short trainings (10-40 s on a loaded 2-core machine)
def test_checkpoints_load_without_pickle_and_old_ones_resume(tmp_path, capsys):
    """A new checkpoint is tensors and plain values (plain ``weights_only=True`` reads it); one written before the
    NumPy random state was a tensor (an ndarray inside) still resumes."""
    out = tmp_path / "aha"
    rc, err = _run(capsys, [*TRAIN, "--out", str(out)])
    assert rc == 0, err
    ck = torch.load(out / "checkpoint.pt", weights_only=True)  # no allow-list needed
    assert isinstance(ck["rng"]["numpy"][1], torch.Tensor)
    legacy = dict(ck, rng=dict(ck["rng"], numpy=np.random.get_state()))  # as written by the earlier version
    torch.save(legacy, out / "checkpoint.pt")
    with pytest.raises(__import__("pickle").UnpicklingError):
        torch.load(out / "checkpoint.pt", weights_only=True)  # the ndarray needs NumPy's (code-free) rebuilder
    from vitlens.run_folders import load_checkpoint

    back = load_checkpoint(out / "checkpoint.pt", ("decoder", "rng"))
    assert isinstance(back["rng"]["numpy"][1], np.ndarray)
    rc, err = _run(capsys, [*TRAIN, "--out", str(out), "--resume"])
    assert rc == 0, err


def test_rng_state_round_trip_is_plain():
    from vitlens.runtime import rng_state, set_rng_state

    state = rng_state()
    a = (torch.rand(2), np.random.rand(2))
    set_rng_state(state)
    b = (torch.rand(2), np.random.rand(2))
    assert torch.equal(a[0], b[0]) and np.array_equal(a[1], b[1])


def test_planted_teacher_map_cache_is_refused(tmp_path):
    from conftest import tiny_vit

    from vitlens.aha.teacher import teacher_maps

    marker, cache = tmp_path / "PWNED", tmp_path / "teacher-maps.pt"
    _plant(cache, marker, wrap=False)
    data = [(torch.randn(3, 32, 32), 0) for _ in range(2)]
    with pytest.raises(DamagedFileError, match=r"teacher-map cache .* was refused: it asks to build .*system"):
        teacher_maps(tiny_vit(), data, "gradskip", (4, 4), batch=2, cache=cache)
    assert not marker.exists()
    cache.write_bytes(b"garbage")
    with pytest.raises(DamagedFileError, match=r"teacher-map cache .* is damaged"):
        teacher_maps(tiny_vit(), data, "gradskip", (4, 4), batch=2, cache=cache)
    cache.unlink()
    maps = teacher_maps(tiny_vit(), data, "gradskip", (4, 4), batch=2, cache=cache)  # written, then reused
    assert torch.equal(teacher_maps(tiny_vit(), data, "gradskip", (4, 4), batch=2, cache=cache), maps)


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory) -> Path:
    """A real HuggingFace ViT folder, one whose pytorch_model.bin is a planted pickle, one that needs its own code."""
    from transformers import ViTConfig, ViTForImageClassification

    root = tmp_path_factory.mktemp("hf")
    cfg = ViTConfig(image_size=32, patch_size=8, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                    intermediate_size=32, num_labels=3)
    model = ViTForImageClassification(cfg)
    model.save_pretrained(root / "ok")
    model.config.save_pretrained(root / "planted")
    _plant(root / "planted" / "pytorch_model.bin", root / "PWNED", wrap=False)
    model.save_pretrained(root / "remote")
    c = json.loads((root / "remote" / "config.json").read_text())
    c.update(model_type="vitlens-custom", auto_map={"AutoConfig": "custom.Config",
                                                     "AutoModelForImageClassification": "custom.Model"})
    (root / "remote" / "config.json").write_text(json.dumps(c))
    (root / "remote" / "custom.py").write_text(f"open({str(root / 'PWNED-remote')!r}, 'w').write('ran')\n")
    from transformers import CLIPConfig

    clip = CLIPConfig(text_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                                   "num_attention_heads": 2, "vocab_size": 50},
                      vision_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                                     "num_attention_heads": 2, "image_size": 32, "patch_size": 8},
                      projection_dim=8)
    clip.save_pretrained(root / "clip")
    _plant(root / "clip" / "pytorch_model.bin", root / "PWNED-clip", wrap=False)
    return root


def test_hf_folders_run_no_code(hf_folders, capsys):
    assert type(vitlens.load_model(f"hf:{hf_folders / 'ok'}")).__name__ == "ViTForImageClassification"
    with pytest.raises(WeightsUnavailableError, match=r"weights file was refused: it asks to build .*system"):
        vitlens.load_model(f"hf:{hf_folders / 'planted'}")
    with pytest.raises(WeightsUnavailableError, match=r"needs code from its folder .* trust_remote_code=True"):
        vitlens.load_model(f"hf:{hf_folders / 'remote'}")
    rc, err = _run(capsys, ["conformance", f"hf:{hf_folders / 'planted'}"])
    assert rc == 1 and "refused" in one_line(err.splitlines()[-1])  # (above it: transformers' own progress bar)
    with pytest.raises(WeightsUnavailableError, match=r"weights file was refused: it asks to build .*system"):
        vitlens.load_model(f"hf:{hf_folders / 'clip'}")  # an image-text folder (vitlens.models.vlm)
    assert not [p.name for p in hf_folders.iterdir() if p.name.startswith("PWNED")]


def test_timm_and_efficientnet_weight_files_run_no_code(tmp_path):
    marker = tmp_path / "PWNED"
    _plant(tmp_path / "w.pth", marker, wrap=False)
    with pytest.raises(WeightsUnavailableError, match=r"w.pth was refused: it asks to build"):
        vitlens.load_model("timm:vit_tiny_patch16_224", weights=tmp_path / "w.pth", img_size=32, patch_size=8)
    with pytest.raises(WeightsUnavailableError, match=r"w.pth was refused: it asks to build"):
        vitlens.load_model("efficientnet_lite0", weights=tmp_path / "w.pth")
    assert not marker.exists()


def test_load_torch_plain_names_what_was_asked(tmp_path):
    from vitlens.files import load_torch_plain

    torch.save({"a": torch.ones(2), "b": [1, "x", None, (2.0,)]}, tmp_path / "ok.pt")
    assert load_torch_plain(tmp_path / "ok.pt", "f")["b"] == [1, "x", None, (2.0,)]
    torch.save({"c": _Thing()}, tmp_path / "obj.pt")
    with pytest.raises(DamagedFileError, match=r"f was refused: it asks to build test_trust_round4._Thing"):
        load_torch_plain(tmp_path / "obj.pt", "f")


# --- a benchmark run to report on -----------------------------------------------------------------------------

BENCH = ["bench", "--model", "shapes-vit", "--data", "scenes:seed=3", "--methods", "random", "--metrics",
         "pointing_game:tolerance=4", "--n", "2", "--batch", "2", "--show", "1", "--quiet"]


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bench") / "run"
    assert main([*BENCH, "--out", str(out)]) == 0
    return out


@pytest.fixture
def run(bench_run, tmp_path) -> Path:
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(bench_run, copy)
    return copy


def _snapshot(run: Path) -> dict[str, str]:
    return {p.relative_to(run).as_posix(): _digest(p) for p in sorted(run.rglob("*")) if p.is_file()}


def test_damaged_or_pickled_example_arrays_are_one_line(run, capsys):
    ex = sorted((run / "examples").glob("image__*.npy"))[0]
    np.save(ex, np.array([{"a": 1}], dtype=object), allow_pickle=True)  # an object array: a pickle inside
    before = _digest(run / "report.html")
    rc, err = _run(capsys, ["report", str(run)])
    assert rc == 1 and "is damaged" in one_line(err) and ex.name in err
    assert _digest(run / "report.html") == before
    ex.write_bytes(b"\x93NUMPY garbage")
    rc, err = _run(capsys, ["report", str(run)])
    assert rc == 1 and "is damaged" in one_line(err)


def test_markdown_escapes_user_strings(tmp_path, capsys):
    run = _fake_run(tmp_path / "run", n=4)
    con = sqlite3.connect(run / "results.sqlite")
    with con:
        for table in ("results", "costs"):
            con.execute(f"UPDATE {table} SET method = 'random[note=<b>x</b>]' WHERE method = 'random'")
    con.close()
    assert main(["report", str(run), "--format", "markdown"]) == 0
    printed = capsys.readouterr().out
    assert main(["report", str(run)]) == 0
    for text in (printed, (run / "summary.md").read_text()):
        assert "<b>x</b>" not in text and "&lt;b&gt;x&lt;/b&gt;" in text
    page = (run / "report.html").read_text()
    assert "<b>x</b>" not in page and "&lt;b&gt;x&lt;/b&gt;" in page
    assert "\\textless{}b\\textgreater{}x\\textless{}/b\\textgreater{}" in (run / "summary.tex").read_text()


def test_markdown_escape():
    from vitlens.bench.report_tables import markdown_escape

    assert markdown_escape("a <b>x</b> | *y* _z_ [l](u) `c`") == \
        "a &lt;b&gt;x&lt;/b&gt; \\| \\*y\\* \\_z\\_ \\[l\\](u) \\`c\\`"
    assert "\n" not in markdown_escape("two\nlines")


# --- 2. nothing a run wrote is replaced -------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["results.sqlite", "config.json", "provenance.json", "shards/rank-0.sqlite",
                                  "new.md"])
def test_report_out_never_writes_into_the_run(run, capsys, name):
    before = _snapshot(run)
    for flag in ([], ["--overwrite"]):
        rc, err = _run(capsys, ["report", str(run), "--format", "markdown", "--out", str(run / name), *flag])
        assert rc == 2 and "never writes the run's own files" in one_line(err)
    assert _snapshot(run) == before


def test_report_out_through_a_link_to_a_run_file_is_refused(run, tmp_path, capsys):
    before = _snapshot(run)
    os.link(run / "results.sqlite", tmp_path / "hard.sqlite")
    (tmp_path / "soft.md").symlink_to(run / "config.json")
    for name in ("hard.sqlite", "soft.md"):
        rc, err = _run(capsys, ["report", str(run), "--format", "latex", "--out", str(tmp_path / name),
                                "--overwrite"])
        assert rc == 2 and "never writes" in one_line(err), name
    assert _snapshot(run) == before


def test_report_out_replaces_a_file_only_with_overwrite(run, tmp_path, capsys):
    target = tmp_path / "table.md"
    target.write_text("mine")
    rc, err = _run(capsys, ["report", str(run), "--format", "markdown", "--out", str(target)])
    assert rc == 2 and "--overwrite" in one_line(err) and target.read_text() == "mine"
    rc, err = _run(capsys, ["report", str(run), "--format", "markdown", "--out", str(target), "--overwrite"])
    assert rc == 0 and target.read_text().startswith("| rank | method |")


def test_report_html_out_is_honoured_and_the_run_is_only_read(run, tmp_path, capsys):
    before = _snapshot(run)
    page = tmp_path / "X.html"
    rc, err = _run(capsys, ["report", str(run), "--out", str(page)])
    assert rc == 0, err
    text = page.read_text()
    assert text.startswith("<!doctype html>") and "data:image/png;base64," in text
    assert _snapshot(run) == before  # nothing written into the run (not even its figures), the store untouched
    rc, err = _run(capsys, ["report", str(run)])  # the run's own report files are the report's to rewrite
    assert rc == 0 and _digest(run / "results.sqlite") == before["results.sqlite"]
    assert {k: v for k, v in _snapshot(run).items() if not k.endswith((".png", ".html"))} == \
        {k: v for k, v in before.items() if not k.endswith((".png", ".html"))}


def _foreign(path: Path) -> None:
    path.unlink()
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE people (name TEXT)")
    con.commit()
    con.close()


def _empty_tables(path: Path) -> None:
    con = sqlite3.connect(path)
    with con:
        for t in ("results", "costs", "curves", "predictions"):
            con.execute(f"DELETE FROM {t}")
    con.close()


def _text_value(path: Path) -> None:
    con = sqlite3.connect(path)
    with con:
        con.execute("UPDATE results SET value = 'abc' WHERE rowid = (SELECT MIN(rowid) FROM results)")
    con.close()


BAD_STORES = {
    "zero bytes": (lambda p: p.write_bytes(b""), r"is empty \(0 bytes\)"),
    "garbage": (lambda p: p.write_bytes(b"not a database at all" * 100), r"is damaged"),
    "foreign schema": (_foreign, r"is not a vitlens results store \(it has no 'results' table; tables: people\)"),
    "empty tables": (_empty_tables, r"holds no results"),
    "text in value": (_text_value, r"results.value holds text 'abc' where real or integer or null belongs"),
}


@pytest.mark.parametrize("case", sorted(BAD_STORES))
def test_bad_stores_are_one_line_and_replace_nothing(run, capsys, case):
    spoil, pattern = BAD_STORES[case]
    spoil(run / "results.sqlite")
    before = _snapshot(run)
    for argv in (["report", str(run)], ["report", str(run), "--format", "markdown"],
                 ["report", str(run), "--format", "latex"]):
        rc, err = _run(capsys, argv)
        assert rc == 1, (argv, err)
        import re

        assert re.search(pattern, one_line(err)), err
    assert _snapshot(run) == before  # report.html, the tables and the store itself as they were


@pytest.mark.parametrize("text,pattern", [("{not json", r"config.json is not JSON"),
                                          ("[1, 2]", r"config.json is not a JSON object \(it is a list\)"),
                                          (b"\xff\xfe\x00\x01", r"config.json is a binary file")])
def test_damaged_config_is_one_line(run, capsys, text, pattern):
    import re

    p = run / "config.json"
    p.write_bytes(text) if isinstance(text, bytes) else p.write_text(text)
    before = _snapshot(run)
    rc, err = _run(capsys, ["report", str(run)])
    assert rc == 1 and re.search(pattern, one_line(err)), err
    assert _snapshot(run) == before


def test_a_resumed_store_is_matched_by_weights_not_by_name(run, capsys):
    """A store written by shapes-vit whose config.json names shapes-deit is not resumed as shapes-deit's."""
    cfg = json.loads((run / "config.json").read_text())
    cfg["model"] = "shapes-deit"
    (run / "config.json").write_text(json.dumps(cfg, indent=2))
    before = _snapshot(run)
    argv = [*BENCH, "--out", str(run)]
    argv[argv.index("shapes-vit")] = "shapes-deit"
    rc, err = _run(capsys, argv)
    assert rc == 2 and "holds results computed with other weights than shapes-deit's" in one_line(err)
    assert _snapshot(run) == before
    from vitlens.api import weights_sha256
    from vitlens.bench.store import stored_weights

    assert set(stored_weights(run).values()) == {weights_sha256(vitlens.load_model("shapes-vit"))}
    rc, err = _run(capsys, [*BENCH, "--out", str(run)])  # the real model: (config differs only in its name)
    assert rc == 2 and "another configuration" in err


def test_a_store_written_before_the_digest_is_matched_by_its_provenance(run, capsys):
    for db in [run / "results.sqlite", *(run / "shards").glob("*.sqlite")]:
        con = sqlite3.connect(db)
        con.execute("DROP TABLE meta")
        con.commit()
        con.close()
    cfg = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps(dict(cfg, model="shapes-deit")))
    argv = [*BENCH, "--out", str(run)]
    argv[argv.index("shapes-vit")] = "shapes-deit"
    rc, err = _run(capsys, argv)
    assert rc == 2 and "in provenance.json" in one_line(err)
    (run / "config.json").write_text(json.dumps(cfg))
    assert main([*BENCH, "--out", str(run)]) == 0  # the same model resumes (and now records its digest)


# --- 3. only regular files; every image mode ----------------------------------------------------------------------

@pytest.fixture
def fifo(tmp_path) -> Path:
    p = tmp_path / "pipe.png"
    os.mkfifo(p)
    return p


def test_a_fifo_is_never_opened(fifo, tmp_path, capsys):
    with pytest.raises(ImageLoadError, match=r"is a FIFO \(named pipe\), not a regular file"):
        _within(20, lambda: vitlens.load_images(str(fifo), vitlens.images.DataConfig()))
    rc, err = _within(60, lambda: _run(capsys, ["explain", str(fifo), *SIX, "--quiet", "--out",
                                                 str(tmp_path / "o")]))
    assert rc == 2 and "FIFO" in one_line(err) and not (tmp_path / "o").exists()


def test_a_fifo_inside_an_input_folder_is_skipped_with_a_note(fifo, tmp_path, capsys):
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 40, 3), dtype=np.uint8)).save(
        tmp_path / "ok.png")
    rc, err = _within(120, lambda: _run(capsys, ["explain", str(tmp_path), *SIX, "--quiet", "--methods", "random",
                                                  "--out", str(tmp_path / "o")]))
    assert rc == 0, err
    assert "skipped 1 entry" in err and "pipe.png" in err and "not a regular file" in err
    assert (tmp_path / "o" / "ok_png.random.png").exists()


def test_folder_data_source_skips_a_fifo(fifo, tmp_path):
    from vitlens.data.loaders import ImageFolder

    d = tmp_path / "cls" / "a"
    d.mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(d / "x.png")
    os.mkfifo(d / "y.png")
    with pytest.warns(RuntimeWarning, match=r"skipped 1 entry .* not a regular file"):
        ds = _within(20, lambda: ImageFolder(tmp_path / "cls"))
    assert len(ds) == 1


@pytest.mark.parametrize("content,pattern", [(b"\x89PNG\r\n\x1a\n\x00\x00binary", r"is a binary file"),
                                             (b"a: \xff\xfe", r"is not UTF-8 text"), ("fifo", r"FIFO")])
def test_class_map_of_bytes_or_a_fifo_is_one_line(tmp_path, capsys, content, pattern):
    d = tmp_path / "data" / "disk"
    d.mkdir(parents=True)
    Image.new("RGB", (64, 64)).save(d / "x.png")
    cm = tmp_path / "map.txt"
    if content == "fifo":
        os.mkfifo(cm)
    else:
        cm.write_bytes(content)
    import re

    rc, err = _within(60, lambda: _run(capsys, ["bench", "--model", "shapes-vit", "--data",
                                                 f"folder:root={tmp_path / 'data'}", "--class-map", str(cm),
                                                 "--methods", "random", "--n", "1", "--quiet", "--out",
                                                 str(tmp_path / "o")]))
    assert rc == 2 and re.search(pattern, one_line(err)), err


def test_float_and_int32_images_are_scaled_by_their_range(tmp_path):
    from vitlens.images import to_rgb

    ramp = np.linspace(0.0, 1.0, 64 * 64, dtype=np.float32).reshape(64, 64)
    cases = {"f.tif": ramp * 0.25 + 0.5, "i.tif": (ramp * 70000 - 1000).astype(np.int32)}
    for name, arr in cases.items():
        Image.fromarray(arr).save(tmp_path / name)
        img = Image.open(tmp_path / name)
        assert img.mode in ("F", "I")
        rgb = np.asarray(to_rgb(img))
        assert rgb.min() == 0 and rgb.max() == 255, name  # its own min to 0, max to 255
        expect = np.rint((arr - arr.min()) / (arr.max() - arr.min()) * 255)
        assert np.abs(rgb[..., 0].astype(float) - expect).max() <= 1, name
        x = vitlens.load_images(str(tmp_path / name), vitlens.images.DataConfig(input_size=(3, 32, 32)))
        assert float(x.std()) > 0.3  # not black, not white
    assert np.asarray(to_rgb(Image.fromarray(np.full((4, 4), 0.5, np.float32))))[0, 0, 0] == 128  # constant
    with pytest.raises(ImageLoadError, match=r"NaN or infinite"):
        to_rgb(Image.fromarray(np.full((4, 4), np.nan, np.float32)))
    deep = Image.fromarray((ramp * 65535).astype(np.uint16))  # 16-bit keeps its format's range
    assert deep.mode.startswith("I;16") and np.asarray(to_rgb(deep)).max() == 255


def test_premultiplied_alpha_grey_converts():
    from vitlens.images import to_rgb

    assert np.asarray(to_rgb(Image.new("La", (2, 2), (100, 255)))).tolist() == [[[100] * 3] * 2] * 2


def test_damaged_aha_explainer_metadata_is_one_line(tmp_path):
    from conftest import tiny_vit

    from vitlens.aha.network import load_explainer

    (tmp_path / "e.safetensors").write_bytes(b"x")
    (tmp_path / "e.json").write_text("{not json")
    with pytest.raises(WeightsUnavailableError, match=r"e.json is damaged"):
        load_explainer(tmp_path / "e.safetensors", tiny_vit())
    (tmp_path / "e.json").write_text('{"arch": {}}')
    with pytest.raises((WeightsUnavailableError, InputError)):
        load_explainer(tmp_path / "e.safetensors", tiny_vit())
    for arch, said in [('{"nonsense": 1, "width": 8}', r"unknown architecture keys: 'nonsense'"),
                       ('{"width": "wide"}', r"e.json is damaged \(architecture"),
                       ('{"depths": 3}', r"e.json is damaged \(architecture")]:
        (tmp_path / "e.json").write_text('{"arch": %s}' % arch)
        with pytest.raises(WeightsUnavailableError, match=said) as info:
            load_explainer(tmp_path / "e.safetensors", tiny_vit())
        assert "\n" not in str(info.value)


def test_a_fifo_in_a_run_folder_is_one_line(run, capsys):
    shard = run / "shards" / "rank-0.sqlite"
    shard.unlink()
    os.mkfifo(shard)
    rc, err = _within(120, lambda: _run(capsys, [*BENCH, "--out", str(run)]))
    assert rc == 1 and "rank-0.sqlite is a FIFO (named pipe)" in one_line(err)
    (run / "results.sqlite").unlink()
    os.mkfifo(run / "results.sqlite")
    rc, err = _within(60, lambda: _run(capsys, ["report", str(run)]))
    assert rc == 1 and "results.sqlite is a FIFO (named pipe)" in one_line(err)
