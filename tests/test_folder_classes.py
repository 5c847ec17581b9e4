"""One's own labelled folders: folder names become the model's class indices (or a clear one-line error)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import tiny_vit
from vitlens.bench.sources import open_source
from vitlens.data.classes import match_folders, model_class_names, read_class_map
from vitlens.data.loaders import ImageFolder
from vitlens.errors import InputError


@pytest.fixture(scope="module")
def imagenet_model():
    """A tiny random timm ViT with the 1000 ImageNet outputs (class names come from timm's bundled metadata)."""
    model = tiny_vit(num_classes=1000)
    model.vitlens_data_config = {"input_size": (3, 32, 32), "mean": (0.5,) * 3, "std": (0.25,) * 3}
    return model


def _folder(root: Path, layout: dict[str, int]) -> Path:
    rng = np.random.default_rng(0)
    for folder, count in layout.items():
        (root / folder).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            Image.fromarray(rng.integers(0, 255, (36, 40, 3), dtype=np.uint8)).save(root / folder / f"{i}.png")
    return root


def test_imagenet_names_synonyms_and_wnids(imagenet_model) -> None:
    names = model_class_names(imagenet_model)
    assert names is not None and len(names) == 1000 and names[967] == "espresso"
    got = match_folders(["espresso", "tiger_cat", "Tabby-Cat", "n01440764"], imagenet_model)
    assert got == {"espresso": 967, "tiger_cat": 282, "Tabby-Cat": 281, "n01440764": 0}


def test_unmatched_and_ambiguous_folders_are_one_line_errors(imagenet_model) -> None:
    with pytest.raises(InputError, match=r"folder 'my_cats' matches none of the model's 1000 class names") as e:
        match_folders(["my_cats"], imagenet_model)
    assert "\n" not in str(e.value) and "--class-map" in str(e.value)
    with pytest.raises(InputError, match="names 2 of the model's classes"):
        match_folders(["crane"], imagenet_model)  # the bird (134) and the machine (517)


def test_class_map_file(tmp_path: Path, imagenet_model) -> None:
    path = tmp_path / "map.txt"
    path.write_text("# folder: class\nmy_cats: tabby cat\ncrane = 517\n")
    assert read_class_map(path) == {"my_cats": "tabby cat", "crane": 517}
    assert match_folders(["my_cats", "crane", "espresso"], imagenet_model, path) == {
        "my_cats": 281, "crane": 517, "espresso": 967}
    (tmp_path / "bad.json").write_text('{"my_cats": 5000}')
    with pytest.raises(InputError, match="class 5000, but the model has 1000 classes"):
        match_folders(["my_cats"], imagenet_model, tmp_path / "bad.json")


def test_folder_source_labels_are_the_models_classes(tmp_path: Path, imagenet_model, capsys) -> None:
    root = _folder(tmp_path / "photos", {"espresso": 2, "tiger_cat": 1})
    Image.fromarray(np.zeros((30, 30, 3), np.uint8)).save(root / "loose.png")  # no class folder
    source = open_source(f"folder:root='{root}'", imagenet_model)
    batch = source.batch(list(range(len(source))))
    assert sorted(batch["labels"].tolist()) == [-1, 282, 967, 967]
    assert "1 image(s) directly in" in capsys.readouterr().err
    folder = ImageFolder.for_model(root, imagenet_model)
    assert folder.unlabelled == ["loose.png"]


def test_models_without_names_number_folders_and_say_so(tmp_path: Path, capsys) -> None:
    model = tiny_vit()  # 5 classes, no names
    assert model_class_names(model) is None
    assert match_folders(["b", "a"], model) == {"a": 0, "b": 1}
    assert "no class names" in capsys.readouterr().err
    assert match_folders(["3", "0"], model) == {"3": 3, "0": 0}


def test_bench_on_own_folder_with_class_map(tmp_path: Path, capsys) -> None:
    """`vitlens bench --data folder:root=DIR --class-map FILE` on a 1000-class timm ViT: labels are ImageNet
    indices, and with no masks the default metric is insertion/deletion."""
    import json
    import sqlite3

    from vitlens.cli import main

    root = _folder(tmp_path / "mine", {"espresso": 2, "kitty": 2})
    (tmp_path / "map.txt").write_text("kitty: tabby cat\n")
    out = tmp_path / "run"
    code = main(["bench", "--model", "timm:vit_tiny_patch16_224", "--model-option", "pretrained=False",
                 "--model-option", "img_size=32", "--model-option", "patch_size=8",
                 "--data", f"folder:root='{root}'", "--class-map", str(tmp_path / "map.txt"),
                 "--methods", "random", "--batch", "4", "--quiet", "--out", str(out)])
    assert code == 0
    config = json.loads((out / "config.json").read_text())
    assert config["metrics"] == [["insertion_deletion", {"preset": "aha"}]]
    con = sqlite3.connect(out / "results.sqlite")
    try:
        labels = sorted(v for (v,) in con.execute("SELECT label FROM predictions"))
    finally:
        con.close()
    assert labels == [281, 281, 967, 967]
    assert "Accuracy on these images" in (out / "report.html").read_text()
    capsys.readouterr()
    assert main(["bench", "--data", "scenes", "--class-map", "x.txt", "--out", str(tmp_path / "no")]) != 0
    assert "--class-map is for --data folder" in capsys.readouterr().err
