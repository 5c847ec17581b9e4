"""Loaders for the papers' data sets, on tiny fixtures written here in the same on-disk formats."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from vitlens.data.loaders import (ADE20K, BLOODMNIST_CLASSES, BloodMNIST, ImageFolder, ImageNetVal, collate,
                                  transform_label_map, voc_to_pixel_box)
from vitlens.errors import ImageLoadError, InputError
from vitlens.images import DataConfig, denormalize, preprocess

CFG = {"input_size": (3, 32, 32)}


def _save(path, w, h, colour=(200, 30, 30), fmt=None):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (w, h), colour).save(path, format=fmt)
    return path


def _voc(path, w, h, objects, size=True):
    path.parent.mkdir(parents=True, exist_ok=True)
    objs = "".join(
        f"<object><name>{n}</name><bndbox><xmin>{b[0]}</xmin><ymin>{b[1]}</ymin><xmax>{b[2]}</xmax>"
        f"<ymax>{b[3]}</ymax></bndbox></object>"
        for n, b in objects
    )
    sz = f"<size><width>{w}</width><height>{h}</height><depth>3</depth></size>" if size else ""
    path.write_text(f"<annotation><folder>val</folder><filename>{path.stem}</filename>{sz}{objs}</annotation>")


# -- ImageNet -----------------------------------------------------------------------------------------------------


@pytest.fixture
def imagenet(tmp_path):
    root, boxes = tmp_path / "val", tmp_path / "boxes"
    _save(root / "n02" / "ILSVRC2012_val_00000001.JPEG", 40, 30, fmt="JPEG")
    _save(root / "n01" / "ILSVRC2012_val_00000002.JPEG", 20, 20, fmt="JPEG")
    _save(root / "n01" / "ILSVRC2012_val_00000003.JPEG", 40, 20, fmt="JPEG")
    # flat: whole image in VOC (1..W) plus a box of another class that must be dropped
    _voc(boxes / "ILSVRC2012_val_00000001.xml", 40, 30, [("n02", (1, 1, 40, 30)), ("n01", (5, 5, 10, 10))])
    # per-class subfolder; xmin = 0 occurs in the official files and clips to 0
    _voc(boxes / "n01" / "ILSVRC2012_val_00000002.xml", 20, 20, [("n01", (0, 3, 5, 8)), ("n01", (11, 11, 20, 20))])
    # annotated at twice the size of the stored image (a resized copy): boxes are scaled
    _voc(boxes / "ILSVRC2012_val_00000003.xml", 80, 40, [("n01", (11, 1, 40, 20))])
    # an annotation without an image is ignored for ImageNet (the folder may cover the full val set)
    _voc(boxes / "ILSVRC2012_val_00009999.xml", 10, 10, [("n01", (1, 1, 2, 2))])
    return root, boxes


def test_voc_conversion():
    assert voc_to_pixel_box(1, 1, 40, 30) == (0, 0, 40, 30)
    assert voc_to_pixel_box(5, 6, 5, 6) == (4, 5, 5, 6)  # one pixel


def test_imagenet_val(imagenet):
    root, boxes = imagenet
    ds = ImageNetVal(root, boxes_dir=boxes)
    assert len(ds) == 3 and ds.class_names == ["n01", "n02"]
    items = [ds[i] for i in range(3)]
    assert [it["id"][-2:] for it in items] == ["02", "03", "01"]  # class folders in sorted order, files sorted
    assert [it["label"] for it in items] == [0, 0, 1]
    assert [it["index"] for it in items] == [0, 1, 2]
    assert items[0]["image"].mode == "RGB" and items[0]["image"].size == (20, 20)
    assert items[0]["boxes"].dtype == torch.int64
    assert items[0]["boxes"].tolist() == [[0, 2, 5, 8], [10, 10, 20, 20]]
    assert items[1]["boxes"].tolist() == [[5, 0, 20, 10]]  # (10, 0, 40, 20) annotated at 80x40, image 40x20
    assert items[2]["boxes"].tolist() == [[0, 0, 40, 30]]  # the n01 box is dropped
    assert ds[-1]["id"] == items[2]["id"]
    with pytest.raises(IndexError):
        ds[3]
    assert "boxes" not in ImageNetVal(root)[0]
    # the model's own class order (e.g. a subset of the 1000 classes)
    ordered = ImageNetVal(root, class_order=["n00", "n02", "n01"])
    assert [ordered[i]["label"] for i in range(3)] == [2, 2, 1] and ordered.class_names == ["n00", "n02", "n01"]
    with pytest.raises(InputError, match="'n01'.*not in class_order"):
        ImageNetVal(root, class_order=["n02"])
    (root / "n03").mkdir()  # an empty class folder keeps its place in the sorted order
    assert ImageNetVal(root).class_names == ["n01", "n02", "n03"]


def test_imagenet_errors(tmp_path, imagenet):
    root, boxes = imagenet
    with pytest.raises(InputError, match="does not exist"):
        ImageNetVal(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="no images found"):
        ImageNetVal(tmp_path / "empty")
    flat = tmp_path / "flat"
    _save(flat / "ILSVRC2012_val_00000001.JPEG", 8, 8, fmt="JPEG")
    with pytest.raises(InputError, match="ImageFolder layout"):
        ImageNetVal(flat)
    _save(root / "n01" / "ILSVRC2012_val_00000004.JPEG", 8, 8, fmt="JPEG")
    with pytest.raises(InputError, match="1 of 4 images have no bounding-box file.*00000004"):
        ImageNetVal(root, boxes_dir=boxes)
    (boxes / "ILSVRC2012_val_00000004.xml").write_text("<annotation><object><name>n01")
    with pytest.raises(InputError, match="not a readable XML"):
        ImageNetVal(root, boxes_dir=boxes)[2]
    _voc(boxes / "ILSVRC2012_val_00000004.xml", 8, 8, [("n01", (1, 1, 4, 4))])
    _voc(boxes / "n02" / "ILSVRC2012_val_00000004.xml", 8, 8, [])
    with pytest.raises(InputError, match="two bounding-box files"):
        ImageNetVal(root, boxes_dir=boxes)
    (boxes / "n02" / "ILSVRC2012_val_00000004.xml").unlink()
    (boxes / "ILSVRC2012_val_00000004.xml").write_text(
        "<annotation><object><name>n01</name><bndbox><xmin>1</xmin></bndbox></object></annotation>"
    )
    with pytest.raises(InputError, match="missing <ymin>"):
        ImageNetVal(root, boxes_dir=boxes)[2]
    _voc(boxes / "ILSVRC2012_val_00000004.xml", 16, 8, [("n01", (1, 1, 4, 4))])
    (root / "n01" / "ILSVRC2012_val_00000004.JPEG").unlink()
    _save(root / "n01" / "ILSVRC2012_val_00000004.JPEG", 8, 16, fmt="JPEG")
    with pytest.raises(InputError, match="rotated"):
        ImageNetVal(root, boxes_dir=boxes)[2]
    (root / "n01" / "ILSVRC2012_val_00000004.JPEG").write_bytes(b"not a jpeg")
    with pytest.raises(ImageLoadError):
        ImageNetVal(root)[2]


# -- BloodMNIST ---------------------------------------------------------------------------------------------------


def _npz(path, grey=False, **override):
    rng = np.random.default_rng(0)
    shape = (28, 28) if grey else (28, 28, 3)
    arrays = {}
    for split, n in (("train", 5), ("val", 2), ("test", 3)):
        arrays[f"{split}_images"] = rng.integers(0, 256, (n, *shape), dtype=np.uint8)
        arrays[f"{split}_labels"] = (np.arange(n) % 8).reshape(n, 1).astype(np.uint8)
    arrays.update(override)
    arrays = {k: v for k, v in arrays.items() if v is not None}
    np.savez(path, **arrays)
    return path, arrays


def test_bloodmnist(tmp_path):
    path, arrays = _npz(tmp_path / "bloodmnist.npz")
    ds = BloodMNIST(path)  # default split: test
    assert len(ds) == 3 and ds.class_names == list(BLOODMNIST_CLASSES) and len(ds.class_names) == 8
    it = ds[2]
    assert it["label"] == 2 and it["index"] == 2 and it["id"] == "test_2"
    assert it["image"].mode == "RGB" and it["image"].size == (28, 28)
    np.testing.assert_array_equal(np.asarray(it["image"]), arrays["test_images"][2])
    assert len(BloodMNIST(path, split="train")) == 5
    gpath, garr = _npz(tmp_path / "grey.npz", grey=True)
    img = np.asarray(BloodMNIST(gpath, split="val")[1]["image"])
    assert img.shape == (28, 28, 3) and (img == garr["val_images"][1][..., None]).all()


def test_bloodmnist_errors(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        BloodMNIST(tmp_path / "missing.npz")
    path, _ = _npz(tmp_path / "b.npz")
    with pytest.raises(InputError, match="split must be one of"):
        BloodMNIST(path, split="validation")
    bad, _ = _npz(tmp_path / "bad.npz", test_images=None)
    with pytest.raises(InputError, match="no 'test_images'.*keys"):
        BloodMNIST(bad)
    lab, _ = _npz(tmp_path / "lab.npz", test_labels=np.full((3, 1), 9, np.uint8))
    with pytest.raises(InputError, match="0..7"):
        BloodMNIST(lab)
    n, _ = _npz(tmp_path / "n.npz", test_labels=np.zeros((2, 1), np.uint8))
    with pytest.raises(InputError, match="N = 3"):
        BloodMNIST(n)
    f, _ = _npz(tmp_path / "f.npz", test_images=np.zeros((3, 28, 28, 3), np.float32))
    with pytest.raises(InputError, match="uint8"):
        BloodMNIST(f)
    (tmp_path / "junk.npz").write_bytes(b"junk")
    with pytest.raises(InputError, match="not a readable .npz"):
        BloodMNIST(tmp_path / "junk.npz")


# -- ADE20K -------------------------------------------------------------------------------------------------------


def _ade(root, stems=("ADE_val_00000001", "ADE_val_00000002"), split="validation"):
    for k, stem in enumerate(stems):
        _save(root / "images" / split / f"{stem}.jpg", 12, 10, fmt="JPEG")
        seg = np.zeros((10, 12), np.uint8)
        if k == 0:
            seg[:, :5] = 3  # 50 px of class 3
            seg[:, 5:9] = 7  # 40 px of class 7
        (root / "annotations" / split).mkdir(parents=True, exist_ok=True)
        Image.fromarray(seg).save(root / "annotations" / split / f"{stem}.png")


def test_ade20k(tmp_path):
    root = tmp_path / "ADEChallengeData2016"
    _ade(root)
    ds = ADE20K(root)
    assert len(ds) == 2 and ds.class_names is None
    it = ds[0]
    assert it["id"] == "ADE_val_00000001" and it["image"].size == (12, 10)
    assert it["seg"].dtype == torch.int64 and it["seg"].shape == (10, 12)
    assert it["label"] == 3  # the most frequent non-zero class
    assert ds[1]["label"] == -1  # all "other"
    rows = ["Idx\tRatio\tTrain\tVal\tName"] + [f"{i}\t0.01\t10\t1\tclass{i}, alias" for i in range(1, 151)]
    (root / "objectInfo150.txt").write_text("\n".join(rows) + "\n")
    names = ADE20K(root).class_names
    assert len(names) == 151 and names[0] == "other" and names[3] == "class3, alias"


def test_ade20k_errors(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        ADE20K(tmp_path / "nope")
    root = tmp_path / "ade"
    (root / "images").mkdir(parents=True)
    with pytest.raises(InputError, match="no 'annotations' folder"):
        ADE20K(root)
    _ade(root)
    with pytest.raises(InputError, match="split 'training' not found.*validation"):
        ADE20K(root, split="training")
    Image.fromarray(np.zeros((10, 12), np.uint8)).save(root / "annotations" / "validation" / "orphan.png")
    with pytest.raises(InputError, match="1 annotation.*no image.*orphan"):
        ADE20K(root)
    (root / "annotations" / "validation" / "orphan.png").unlink()
    _save(root / "images" / "validation" / "lonely.jpg", 4, 4, fmt="JPEG")
    with pytest.raises(InputError, match="1 image.*no annotation.*lonely"):
        ADE20K(root)
    (root / "images" / "validation" / "lonely.jpg").unlink()
    Image.new("RGB", (12, 10)).save(root / "annotations" / "validation" / "ADE_val_00000002.png")
    with pytest.raises(InputError, match="single-channel label PNG"):
        ADE20K(root)[1]
    Image.fromarray(np.zeros((9, 12), np.uint8)).save(root / "annotations" / "validation" / "ADE_val_00000002.png")
    with pytest.raises(InputError, match="12x9 but its image is 12x10"):
        ADE20K(root)[1]
    Image.fromarray(np.full((10, 12), 200, np.uint8)).save(root / "annotations" / "validation" / "ADE_val_00000002.png")
    with pytest.raises(InputError, match="label 200 > 150"):
        ADE20K(root)[1]
    empty = tmp_path / "empty"
    (empty / "images" / "validation").mkdir(parents=True)
    (empty / "annotations" / "validation").mkdir(parents=True)
    with pytest.raises(InputError, match="is empty"):
        ADE20K(empty)


# -- ImageFolder --------------------------------------------------------------------------------------------------


def test_image_folder(tmp_path):
    _save(tmp_path / "a.png", 8, 8, fmt="PNG")
    _save(tmp_path / "dogs" / "x.jpg", 8, 6, fmt="JPEG")
    _save(tmp_path / "cats" / "deep" / "y.PNG", 6, 8, fmt="PNG")
    (tmp_path / "notes.txt").write_text("not an image")
    _save(tmp_path / ".hidden" / "z.png", 4, 4, fmt="PNG")
    ds = ImageFolder(tmp_path)
    got = {ds[i]["id"]: ds[i]["label"] for i in range(len(ds))}
    assert got == {"a.png": -1, "cats/deep/y.PNG": 0, "dogs/x.jpg": 1}
    assert ds.class_names == ["cats", "dogs"]
    flat = tmp_path / "dogs"
    assert ImageFolder(flat).class_names is None and ImageFolder(flat)[0]["label"] == -1
    # RGBA is composited onto white, as the image pipeline does
    Image.new("RGBA", (4, 4), (0, 0, 0, 0)).save(tmp_path / "dogs" / "t.png")
    assert np.asarray(ImageFolder(flat)[0]["image"]).min() == 255


def test_image_folder_errors(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        ImageFolder(tmp_path / "nope")
    (tmp_path / "f.txt").write_text("x")
    with pytest.raises(InputError, match="not a directory"):
        ImageFolder(tmp_path / "f.txt")
    with pytest.raises(InputError, match="no images found"):
        ImageFolder(tmp_path)
    (tmp_path / "broken.png").write_bytes(b"\x89PNG garbage")
    with pytest.raises(ImageLoadError, match="broken.png"):
        ImageFolder(tmp_path)[0]


# -- collate and the geometry of masks ----------------------------------------------------------------------------

GEOMETRIES = [
    {"input_size": (3, 32, 32)},
    {"input_size": (3, 32, 32), "crop_pct": 1.0, "crop_mode": "squash"},
    {"input_size": (3, 32, 32), "crop_pct": 0.9, "crop_mode": "border"},
    {"input_size": (3, 24, 40), "crop_pct": 0.8},
    {"input_size": (3, 32, 32), "crop_pct": 1.3},
    {"input_size": (3, 96, 96), "interpolation": "bilinear"},
]


def _centroid(mask):
    ys, xs = torch.nonzero(mask, as_tuple=True)
    return torch.stack([ys.float().mean(), xs.float().mean()])


@pytest.mark.parametrize("cfg", GEOMETRIES, ids=lambda c: f"{c['input_size'][1:]}-{c.get('crop_mode', 'center')}")
@pytest.mark.parametrize("wh", [(50, 40), (37, 61), (64, 64)])
def test_mask_lands_where_the_image_square_lands(cfg, wh):
    w, h = wh
    mask = np.zeros((h, w), bool)
    mask[int(h * 0.3):int(h * 0.7), int(w * 0.2):int(w * 0.65)] = True
    pixels = np.zeros((h, w, 3), np.uint8)
    pixels[mask] = 255
    config = DataConfig.from_dict(cfg)
    seen = denormalize(preprocess(Image.fromarray(pixels), config), config).mean(0) > 0.5
    moved = transform_label_map(torch.from_numpy(mask), config)
    assert moved.dtype == torch.bool and moved.shape == seen.shape == config.size_hw
    # every disagreement sits on the square's edge (antialiased resampling vs nearest), within one pixel of it
    edge = torch.nn.functional.max_pool2d(moved[None, None].float(), 3, 1, 1)[0, 0].bool() & ~(
        -torch.nn.functional.max_pool2d(-moved[None, None].float(), 3, 1, 1)[0, 0]
    ).bool()
    assert not bool(((seen ^ moved) & ~edge).any())
    assert float((_centroid(seen) - _centroid(moved)).abs().max()) < 0.6
    if wh == (50, 40) and cfg == GEOMETRIES[0]:
        assert torch.equal(seen, moved)  # edges on whole pixels after scaling: identical


def test_label_map_values_survive(tmp_path):
    seg = torch.arange(20 * 30).reshape(20, 30) % 151
    out = transform_label_map(seg, CFG)
    assert out.dtype == torch.int64 and out.shape == (32, 32)
    assert set(out.unique().tolist()) <= set(seg.unique().tolist())  # nearest: no blended labels
    with pytest.raises(InputError, match=r"\(H, W\)"):
        transform_label_map(torch.zeros(2, 3, 4, dtype=torch.bool), CFG)
    with pytest.raises(InputError, match="bool or integer"):
        transform_label_map(torch.zeros(3, 4), CFG)


def test_collate(tmp_path, imagenet):
    root, boxes = imagenet
    ds = ImageNetVal(root, boxes_dir=boxes)
    items = [ds[i] for i in range(3)]
    x, labels, masks = collate(items, CFG)
    assert x.shape == (3, 3, 32, 32) and x.dtype == torch.float32
    assert labels.tolist() == [0, 0, 1] and labels.dtype == torch.int64
    assert masks.shape == (3, 32, 32) and masks.dtype == torch.bool
    assert torch.equal(x[0], preprocess(items[0]["image"], CFG))
    assert bool(masks[2].all())  # the whole-image box
    # boxes → mask → geometry equals transforming the drawn mask
    drawn = torch.zeros(20, 20, dtype=torch.bool)
    drawn[2:8, 0:5] = drawn[10:20, 10:20] = True
    assert torch.equal(masks[0], transform_label_map(drawn, CFG))
    # seg items give seg == label
    ade = tmp_path / "ade"
    _ade(ade)
    a = ADE20K(ade)
    _, lab, m = collate([a[0], a[1]], CFG)
    assert lab.tolist() == [3, -1]
    assert torch.equal(m[0], transform_label_map(a[0]["seg"] == 3, CFG)) and not bool(m[1].any())
    # no ground truth at all → None; only some → error
    plain = dict(items[0])
    del plain["boxes"]
    assert collate([plain], CFG)[2] is None
    with pytest.raises(InputError, match="no ground truth"):
        collate([plain, items[1]], CFG)
    with pytest.raises(InputError, match="at least one"):
        collate([], CFG)
    with pytest.raises(InputError, match="not a loader item"):
        collate([{"label": 1}], CFG)
    bad = dict(plain, mask=torch.zeros(5, 5, dtype=torch.bool))
    with pytest.raises(InputError, match="ground truth is 5x5"):
        collate([bad], CFG)
