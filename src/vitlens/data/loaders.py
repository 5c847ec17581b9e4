"""Loaders for the papers' real data sets, read from a user's disk (nothing is ever downloaded).

Every loader is a :class:`torch.utils.data.Dataset` whose items are dicts::

    {"image": PIL.Image (RGB), "label": int, "index": int, "id": str,
     optional "boxes": (K, 4) int64 tensor,   # x0, y0, x1, y1 in original-image pixels, x1/y1 exclusive
     optional "mask":  (H, W) bool tensor,
     optional "seg":   (H, W) int64 tensor}   # a label map

and has a ``class_names`` attribute (``None`` where the names are not known). :func:`collate` turns a list of items
into a model batch, moving the ground truth through exactly the resize/crop the images get.

Layouts (see ``docs/data_and_segmentation.md``):

* :class:`ImageNetVal` — ImageFolder layout ``root/<wnid>/*.JPEG`` with the official PASCAL-VOC-style bounding-box
  XML files in ``boxes_dir`` (flat or in per-class subfolders).
* :class:`BloodMNIST` — the MedMNIST ``bloodmnist*.npz`` file.
* :class:`ADE20K` — the SceneParsing (ADEChallengeData2016) layout ``root/images/<split>/*.jpg`` and
  ``root/annotations/<split>/*.png``.
* :class:`ImageFolder` — any folder of images, optionally in class subfolders.

Documented choices:

* **VOC boxes** are 1-based with inclusive ends (``xmin = 1`` is the first pixel column, ``xmax = W`` the last). They
  are converted to 0-based, end-exclusive pixel boxes: ``x0 = xmin - 1``, ``x1 = xmax`` (same for y), then clipped to
  the image (the ImageNet files contain some ``xmin = 0``, which clips to 0).
* If the XML's ``<size>`` differs from the image on disk (a resized copy of ImageNet val), boxes are scaled by the
  per-axis ratio (rounded to the nearest pixel); a rotated image (width and height swapped) is an error.
* **EXIF orientation** is *not* applied by the annotated loaders (ImageNet, ADE20K): annotations refer to the stored
  pixel grid. :class:`ImageFolder` (no annotations) applies it, as :func:`vitlens.load_images` does.
* **ADE20K "label"** is the most frequent non-zero class of the label map (ties: the smallest class id); ``-1`` when
  the map is all "other" (0). Class ids are the SceneParsing ids 1–150 (0 = other), not shifted.
"""

from __future__ import annotations

import csv
import math
import warnings
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps
from torch.utils.data import Dataset

from ..errors import InputError
from ..files import regular_files
from ..images import DataConfig, data_config, preprocess
from ..images import crop_or_pad as _crop_or_pad, open_image_file as _open_file, resize_shape as _resize_shape
from ..images import to_rgb as _to_rgb

__all__ = [
    "ADE20K",
    "BLOODMNIST_CLASSES",
    "BloodMNIST",
    "IMAGE_EXTENSIONS",
    "ImageFolder",
    "ImageNetVal",
    "collate",
    "transform_label_map",
    "voc_to_pixel_box",
]

#: file extensions :class:`ImageFolder` and :class:`ImageNetVal` accept (compared case-insensitively).
IMAGE_EXTENSIONS: tuple[str, ...] = (
    ".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm", ".pbm",
)

#: BloodMNIST class names, in label order (MedMNIST v2 metadata).
BLOODMNIST_CLASSES: tuple[str, ...] = (
    "basophil",
    "eosinophil",
    "erythroblast",
    "immature granulocytes(myelocytes, metamyelocytes and promyelocytes)",
    "lymphocyte",
    "monocyte",
    "neutrophil",
    "platelet",
)

_ADE_NUM_CLASSES = 150


# ---- Helpers ----


def _existing_dir(path: str | Path, what: str) -> Path:
    p = Path(path).expanduser()
    if not p.exists():
        raise InputError(f"{what} '{p}' does not exist (vitlens never downloads data sets; point it at your copy)")
    if not p.is_dir():
        raise InputError(f"{what} '{p}' is not a directory")
    return p


def _is_image_name(p: Path) -> bool:
    return p.suffix.lower() in IMAGE_EXTENSIONS and not p.name.startswith(".")


def _is_image(p: Path) -> bool:
    return p.is_file() and _is_image_name(p)


def _hidden(p: Path, folder: Path) -> bool:
    return any(part.startswith(".") for part in p.relative_to(folder).parts)


def _images_under(folder: Path, recursive: bool) -> list[Path]:
    """The image files under ``folder``; a FIFO, socket or device with an image's name is skipped with a warning."""
    it = folder.rglob("*") if recursive else folder.iterdir()
    found, skipped = regular_files([p for p in it if _is_image_name(p) and not _hidden(p, folder)], folder)
    if skipped:
        warnings.warn(skipped, RuntimeWarning, stacklevel=3)
    return sorted(p for p in found if p.is_file())


def _open_rgb(path: Path, exif: bool = False) -> Image.Image:
    img = _open_file(path, f"'{path}'")
    if exif:
        img = ImageOps.exif_transpose(img)
    return _to_rgb(img)


def _example(paths: Sequence[Any], n: int = 3) -> str:
    shown = ", ".join(f"'{p}'" for p in list(paths)[:n])
    return shown + (", …" if len(paths) > n else "")


class _Loader(Dataset):
    """Shared ``__len__``/``__repr__``; subclasses fill ``self._n`` and implement ``__getitem__``."""

    class_names: list[str] | None = None
    _n: int = 0

    def __len__(self) -> int:
        return self._n

    def _check_index(self, index: int) -> int:
        i = int(index)
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(f"index {index} out of range for a data set of {self._n} items")
        return i

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._n} items)"


# ---- ImageNet validation set with bounding boxes ----


def voc_to_pixel_box(xmin: float, ymin: float, xmax: float, ymax: float) -> tuple[int, int, int, int]:
    """A PASCAL VOC box (1-based, inclusive ends) as a 0-based pixel box ``(x0, y0, x1, y1)`` with exclusive ends.

    ``(1, 1, W, H)`` — the whole image in VOC — becomes ``(0, 0, W, H)``. Values are rounded to whole pixels first.
    """
    return int(round(xmin)) - 1, int(round(ymin)) - 1, int(round(xmax)), int(round(ymax))


def _xml_number(node: ET.Element | None, tag: str, path: Path) -> float:
    text = None if node is None else node.findtext(tag)
    if text is None:
        raise InputError(f"annotation '{path}': missing <{tag}>")
    try:
        value = float(text.strip())
    except ValueError:
        raise InputError(f"annotation '{path}': <{tag}> is not a number ({text.strip()!r})") from None
    if not math.isfinite(value):
        raise InputError(f"annotation '{path}': <{tag}> is not finite")
    return value


def _parse_voc(path: Path) -> tuple[tuple[int, int] | None, list[tuple[str, tuple[int, int, int, int]]]]:
    """Parse a VOC XML file → (``(width, height)`` or ``None``, [(name, pixel box), …])."""
    try:
        root = ET.parse(path).getroot()
    except (ET.ParseError, OSError) as exc:
        raise InputError(f"annotation '{path}': not a readable XML file ({' '.join(str(exc).split())})") from None
    size = root.find("size")
    wh = None
    if size is not None and size.findtext("width") is not None and size.findtext("height") is not None:
        wh = (int(_xml_number(size, "width", path)), int(_xml_number(size, "height", path)))
    objects = []
    for obj in root.iter("object"):
        name = (obj.findtext("name") or "").strip()
        if not name:
            raise InputError(f"annotation '{path}': an <object> has no <name>")
        bb = obj.find("bndbox")
        if bb is None:
            raise InputError(f"annotation '{path}': object '{name}' has no <bndbox>")
        coords = [_xml_number(bb, t, path) for t in ("xmin", "ymin", "xmax", "ymax")]
        objects.append((name, voc_to_pixel_box(*coords)))
    return wh, objects


def _fit_boxes(boxes: list[tuple[int, int, int, int]], annotated: tuple[int, int] | None, actual: tuple[int, int],
               path: Path) -> torch.Tensor:
    """Scale boxes from the annotated image size to the actual one, clip, drop empty ones → (K, 4) int64."""
    w, h = actual
    out = torch.tensor(boxes, dtype=torch.float64).reshape(-1, 4)
    if annotated is not None and annotated != (w, h):
        aw, ah = annotated
        if (aw, ah) == (h, w) and w != h:
            raise InputError(
                f"annotation '{path}' is for a {aw}x{ah} image but the image is {w}x{h} (rotated?); "
                "the boxes cannot be mapped"
            )
        if aw <= 0 or ah <= 0:
            raise InputError(f"annotation '{path}': invalid <size> {aw}x{ah}")
        out[:, 0::2] *= w / aw
        out[:, 1::2] *= h / ah
    out = torch.round(out).to(torch.int64)
    out[:, 0::2] = out[:, 0::2].clamp(0, w)
    out[:, 1::2] = out[:, 1::2].clamp(0, h)
    keep = (out[:, 2] > out[:, 0]) & (out[:, 3] > out[:, 1])
    return out[keep]


class ImageNetVal(_Loader):
    """ImageNet validation images in ImageFolder layout, with the official bounding boxes.

    Args:
        root: folder with one subfolder per class, named by WordNet id (``root/n01440764/*.JPEG``). The class index
            is the position of the wnid among the sorted subfolder names (empty folders count) — the standard
            ImageNet-1k order when all 1000 folders are there.
        boxes_dir: folder with the VOC-format XML annotations (``ILSVRC2012_val_00000001.xml``, …), found by the
            image's file stem, either flat or in per-class subfolders. When given, every image must have one; XML
            files without an image are ignored (the folder may cover the full val set while ``root`` holds a subset).
        class_order: the model's class list (wnids, in output order). When given, ``label`` is the wnid's position
            in it — use it when ``root`` holds only some classes, or when the model's order is not the sorted one;
            a folder whose name is not in the list is an error.

    Items: ``image``, ``label``, ``index``, ``id`` (file stem) and, with ``boxes_dir``, ``boxes`` ``(K, 4)`` int64 of
    the objects whose ``<name>`` is the image's own wnid, converted as in :func:`voc_to_pixel_box` and clipped
    (``K`` may be 0). ``class_names`` (= ``wnids``) are the wnids in label order.
    """

    def __init__(self, root: str | Path, boxes_dir: str | Path | None = None,
                 class_order: Sequence[str] | None = None) -> None:
        self.root = _existing_dir(root, "ImageNet root")
        class_dirs = sorted(p for p in self.root.iterdir() if p.is_dir() and not p.name.startswith("."))
        loose = [p for p in self.root.iterdir() if _is_image(p)]
        if loose:
            raise InputError(
                f"ImageNet root '{self.root}' holds images directly ({_example([p.name for p in loose])}); expected "
                "the ImageFolder layout root/<wnid>/<image>.JPEG (sort the validation images into class folders)"
            )
        names = [d.name for d in class_dirs] if class_order is None else [str(c) for c in class_order]
        position = {n: k for k, n in enumerate(names)}
        unknown = [d.name for d in class_dirs if d.name not in position]
        if unknown:
            raise InputError(f"class folder(s) {_example(unknown)} in '{self.root}' are not in class_order")
        self.samples: list[tuple[Path, int]] = []
        for d in class_dirs:
            self.samples += [(f, position[d.name]) for f in _images_under(d, recursive=False)]
        if not self.samples:
            raise InputError(f"no images found in ImageNet root '{self.root}' (expected root/<wnid>/*.JPEG)")
        self.class_names = names
        self.wnids = names
        self._n = len(self.samples)
        self.boxes_dir: Path | None = None
        self._xml: dict[str, Path] = {}
        if boxes_dir is not None:
            self.boxes_dir = _existing_dir(boxes_dir, "bounding-box folder")
            for p in sorted(f for f in self.boxes_dir.rglob("*.xml") if f.is_file()):  # (a FIFO would block)
                if p.stem in self._xml:
                    raise InputError(
                        f"two bounding-box files for image '{p.stem}': '{self._xml[p.stem]}' and '{p}'"
                    )
                self._xml[p.stem] = p
            missing = [f.stem for f, _ in self.samples if f.stem not in self._xml]
            if missing:
                raise InputError(
                    f"{len(missing)} of {self._n} images have no bounding-box file in '{self.boxes_dir}' "
                    f"(looked for <stem>.xml, flat or in subfolders), e.g. {_example(missing)}"
                )

    def __getitem__(self, index: int) -> dict[str, Any]:
        i = self._check_index(index)
        path, label = self.samples[i]
        image = _open_rgb(path)
        item: dict[str, Any] = {"image": image, "label": label, "index": i, "id": path.stem}
        if self.boxes_dir is not None:
            xml = self._xml[path.stem]
            annotated, objects = _parse_voc(xml)
            own = [box for name, box in objects if name == self.wnids[label]]
            item["boxes"] = _fit_boxes(own, annotated, image.size, xml)
        return item


# ---- BloodMNIST ----


class BloodMNIST(_Loader):
    """BloodMNIST (MedMNIST v2) from its ``.npz`` file (any size variant: 28, 64, 128, 224 px).

    Args:
        path_npz: the ``bloodmnist.npz`` / ``bloodmnist_224.npz`` file with ``{split}_images`` ``(N, H, W, 3)`` or
            ``(N, H, W)`` uint8 and ``{split}_labels`` ``(N, 1)`` (or ``(N,)``) integers in 0..7.
        split: ``"train"``, ``"val"`` or ``"test"``.

    Items: ``image`` (greyscale arrays are replicated to RGB), ``label``, ``index``, ``id`` = ``"{split}_{i}"``.
    The split is read into memory once.
    """

    SPLITS = ("train", "val", "test")

    def __init__(self, path_npz: str | Path, split: str = "test") -> None:
        if split not in self.SPLITS:
            raise InputError(f"BloodMNIST split must be one of {list(self.SPLITS)}, got {split!r}")
        path = Path(path_npz).expanduser()
        if not path.exists():
            raise InputError(f"BloodMNIST file '{path}' does not exist (vitlens never downloads data sets)")
        if not path.is_file():
            raise InputError(f"BloodMNIST path '{path}' is not a file (expected the .npz file)")
        try:
            with np.load(path, allow_pickle=False) as npz:
                keys = sorted(npz.files)
                ki, kl = f"{split}_images", f"{split}_labels"
                if ki not in keys or kl not in keys:
                    raise InputError(
                        f"'{path}' has no {ki!r}/{kl!r} arrays (keys: {keys}); expected a MedMNIST .npz with "
                        "train_images, val_images, test_images and the matching *_labels"
                    )
                images, labels = npz[ki], npz[kl]
        except InputError:
            raise
        except (OSError, ValueError) as exc:
            raise InputError(f"'{path}' is not a readable .npz file ({' '.join(str(exc).split())})") from None
        channels_ok = images.ndim == 3 or (images.ndim == 4 and images.shape[3] in (1, 3))
        if images.dtype != np.uint8 or not channels_ok:
            raise InputError(
                f"{ki} must be uint8 of shape (N, H, W, 3) or (N, H, W); got {images.dtype} {images.shape}"
            )
        if labels.ndim == 2 and labels.shape[1] == 1:
            labels = labels[:, 0]
        if labels.ndim != 1 or labels.shape[0] != images.shape[0]:
            raise InputError(f"{kl} must have shape (N, 1) with N = {images.shape[0]}; got {labels.shape}")
        if not np.issubdtype(labels.dtype, np.integer):
            raise InputError(f"{kl} must hold integers, got {labels.dtype}")
        if labels.size and (labels.min() < 0 or labels.max() >= len(BLOODMNIST_CLASSES)):
            raise InputError(f"{kl} must lie in 0..{len(BLOODMNIST_CLASSES) - 1}; got {labels.min()}..{labels.max()}")
        if images.shape[0] == 0:
            raise InputError(f"'{path}': split {split!r} is empty")
        if images.ndim == 4 and images.shape[3] == 1:
            images = images[..., 0]
        self.path, self.split = path, split
        self.images, self.labels = images, labels.astype(np.int64)
        self.class_names = list(BLOODMNIST_CLASSES)
        self._n = int(images.shape[0])

    def __getitem__(self, index: int) -> dict[str, Any]:
        i = self._check_index(index)
        image = Image.fromarray(np.ascontiguousarray(self.images[i])).convert("RGB")
        return {"image": image, "label": int(self.labels[i]), "index": i, "id": f"{self.split}_{i}"}


# ---- ADE20K (SceneParsing / ADEChallengeData2016) ----


def _ade_class_names(root: Path) -> list[str] | None:
    """``["other", name_1, …, name_150]`` from ``objectInfo150.txt`` (tab-separated) or ``.csv``, if present."""
    for fname, delim in (("objectInfo150.txt", "\t"), ("objectInfo150.csv", ",")):
        f = root / fname
        if not f.is_file():
            continue
        with open(f, newline="", encoding="utf-8") as fh:
            rows = [r for r in csv.reader(fh, delimiter=delim) if r]
        names: dict[int, str] = {}
        for r in rows:
            if r[0].strip().isdigit():
                names[int(r[0])] = r[-1].strip()
        if sorted(names) != list(range(1, _ADE_NUM_CLASSES + 1)):
            raise InputError(f"'{f}' does not list classes 1..{_ADE_NUM_CLASSES} (Idx ... Name rows)")
        return ["other"] + [names[k] for k in range(1, _ADE_NUM_CLASSES + 1)]
    return None


def _most_frequent_class(seg: torch.Tensor) -> int:
    """The most frequent non-zero label (ties: the smallest); ``-1`` if every pixel is 0."""
    fg = seg[seg > 0]
    if fg.numel() == 0:
        return -1
    return int(torch.bincount(fg).argmax())


class ADE20K(_Loader):
    """ADE20K-150 in the SceneParsing layout (``ADEChallengeData2016``).

    Args:
        root: folder holding ``images/<split>/*.jpg`` and ``annotations/<split>/*.png`` (single-channel 8-bit label
            maps: 0 = other, 1–150 the classes). ``objectInfo150.txt`` (or ``.csv``) in ``root``, if present,
            gives ``class_names`` (index 0 = "other"); otherwise ``class_names`` is ``None``.
        split: ``"validation"`` (default) or ``"training"`` — any subfolder present in both trees.

    Images and annotations are paired by file stem; an image without its annotation, or an annotation without its
    image, is an error. Items: ``image``, ``seg`` ``(H, W)`` int64, ``label`` = the most frequent non-zero class
    (ties: smallest id; ``-1`` if the map is all 0), ``index``, ``id`` (stem).
    """

    def __init__(self, root: str | Path, split: str = "validation") -> None:
        self.root = _existing_dir(root, "ADE20K root")
        img_root, ann_root = self.root / "images", self.root / "annotations"
        for d in (img_root, ann_root):
            if not d.is_dir():
                raise InputError(
                    f"ADE20K root '{self.root}' has no '{d.name}' folder; expected the SceneParsing layout "
                    "images/<split>/*.jpg and annotations/<split>/*.png"
                )
        img_dir, ann_dir = img_root / split, ann_root / split
        if not img_dir.is_dir() or not ann_dir.is_dir():
            found = sorted(p.name for p in img_root.iterdir() if p.is_dir())
            raise InputError(f"ADE20K split {split!r} not found under '{self.root}' (splits present: {found})")
        images = {p.stem: p for p in img_dir.iterdir() if p.is_file() and p.suffix.lower() in (".jpg", ".jpeg")}
        anns = {p.stem: p for p in ann_dir.iterdir() if p.is_file() and p.suffix.lower() == ".png"}
        if not images and not anns:
            raise InputError(f"ADE20K split {split!r} is empty: no .jpg in '{img_dir}' and no .png in '{ann_dir}'")
        orphans = sorted(set(anns) - set(images))
        if orphans:
            raise InputError(
                f"{len(orphans)} annotation(s) in '{ann_dir}' have no image in '{img_dir}', e.g. {_example(orphans)}"
            )
        unlabelled = sorted(set(images) - set(anns))
        if unlabelled:
            raise InputError(
                f"{len(unlabelled)} image(s) in '{img_dir}' have no annotation in '{ann_dir}', "
                f"e.g. {_example(unlabelled)}"
            )
        self.split = split
        self.samples = [(images[s], anns[s]) for s in sorted(images)]
        self.class_names = _ade_class_names(self.root)
        self._n = len(self.samples)

    def __getitem__(self, index: int) -> dict[str, Any]:
        i = self._check_index(index)
        img_path, ann_path = self.samples[i]
        image = _open_rgb(img_path)
        ann = _open_file(ann_path, f"annotation '{ann_path}'")
        if ann.mode not in ("L", "P", "I", "I;16"):
            raise InputError(
                f"annotation '{ann_path}' has mode {ann.mode}; expected a single-channel label PNG (SceneParsing "
                "format, 0 = other, 1-150). The full ADE20K release encodes classes in RGB and is not supported"
            )
        seg = torch.from_numpy(np.asarray(ann).astype(np.int64))
        if seg.numel() and int(seg.max()) > _ADE_NUM_CLASSES:
            raise InputError(f"annotation '{ann_path}' has label {int(seg.max())} > {_ADE_NUM_CLASSES}")
        if (seg.shape[1], seg.shape[0]) != image.size:
            raise InputError(
                f"annotation '{ann_path}' is {seg.shape[1]}x{seg.shape[0]} but its image is "
                f"{image.size[0]}x{image.size[1]}"
            )
        return {"image": image, "label": _most_frequent_class(seg), "index": i, "id": img_path.stem, "seg": seg}


# ---- Plain folder of images ----


class ImageFolder(_Loader):
    """Every image under ``root`` (recursive; extensions :data:`IMAGE_EXTENSIONS`, hidden files skipped).

    Images in a first-level subfolder (a class folder) are labelled ``class_to_index[folder]`` (e.g. from
    :func:`vitlens.data.classes.match_folders`; :meth:`for_model` does that), else by the folder's position among the
    sorted class folders (``class_names``). Images directly in ``root`` get ``-1`` (listed in ``unlabelled``). No
    subfolders: ``class_names`` is ``None``. EXIF orientation is applied. ``id`` is the path relative to ``root``.
    """

    @classmethod
    def for_model(cls, root: str | Path, model: Any, class_map: Any = None) -> "ImageFolder":
        """Labels are the model's class indices: folder names matched to its class names, or ``class_map``."""
        from .classes import match_folders

        plain = cls(root)
        return cls(root, match_folders(plain.class_names, model, class_map)) if plain.class_names else plain

    def __init__(self, root: str | Path, class_to_index: Mapping[str, int] | None = None) -> None:
        self.root = _existing_dir(root, "image folder")
        files = _images_under(self.root, recursive=True)
        if not files:
            raise InputError(
                f"no images found under '{self.root}' (extensions: {', '.join(IMAGE_EXTENSIONS)})"
            )
        rel = [f.relative_to(self.root) for f in files]
        classes = sorted({r.parts[0] for r in rel if len(r.parts) > 1})
        index = {c: k for k, c in enumerate(classes)} if class_to_index is None else dict(class_to_index)
        missing = [c for c in classes if c not in index]
        if missing:
            raise InputError(f"class folder(s) {_example(missing)} in '{self.root}' have no class index")
        self.samples = [(f, int(index[r.parts[0]]) if len(r.parts) > 1 else -1) for f, r in zip(files, rel)]
        self.class_names = classes or None
        self.unlabelled = [r.as_posix() for r in rel if len(r.parts) == 1] if classes else []
        self._n = len(self.samples)

    def __getitem__(self, index: int) -> dict[str, Any]:
        i = self._check_index(index)
        path, label = self.samples[i]
        return {"image": _open_rgb(path, exif=True), "label": label, "index": i,
                "id": path.relative_to(self.root).as_posix()}


# ---- Batching with geometry-consistent ground truth ----


def transform_label_map(labels: torch.Tensor | np.ndarray,
                        model_or_config: DataConfig | Mapping[str, Any] | torch.nn.Module) -> torch.Tensor:
    """Move a mask or label map ``(h, w)`` through the model's evaluation geometry (as :func:`vitlens.images.preprocess`
    moves the image of size ``(h, w)``): the same resize (with nearest-neighbour sampling instead of the image's
    filter) and the same centre crop/pad. Padded pixels are 0 (False / "other").

    Returns a tensor ``(H, W)`` of the input's dtype (bool stays bool; integer label maps come back int64).
    """
    cfg = data_config(model_or_config)
    t = torch.as_tensor(labels)
    if t.ndim != 2:
        raise InputError(f"a mask/label map must have shape (H, W); got {tuple(t.shape)}")
    is_bool = t.dtype == torch.bool
    if not is_bool and t.is_floating_point():
        raise InputError(f"a mask/label map must be bool or integer, got {t.dtype}")
    arr = t.detach().cpu().to(torch.int64).numpy()
    if arr.size and (arr.min() < -(2**31) or arr.max() >= 2**31):
        raise InputError("label values must fit in 32 bits")
    h, w = arr.shape
    new_h, new_w = _resize_shape(h, w, cfg)
    img = Image.fromarray(arr.astype(np.int32))  # PIL mode "I"
    if (new_h, new_w) != (h, w):
        img = img.resize((new_w, new_h), Image.Resampling.NEAREST)
    out = _crop_or_pad(np.asarray(img, dtype=np.int32)[..., None], cfg.size_hw, (0,))[..., 0]
    res = torch.from_numpy(np.ascontiguousarray(out).astype(np.int64))
    return res.bool() if is_bool else res


def _boxes_mask(boxes: torch.Tensor, size_wh: tuple[int, int]) -> torch.Tensor:
    """Union of boxes ``(K, 4)`` (x0, y0, x1, y1 exclusive) as an ``(h, w)`` bool mask."""
    w, h = size_wh
    mask = torch.zeros(h, w, dtype=torch.bool)
    for x0, y0, x1, y1 in torch.as_tensor(boxes).reshape(-1, 4).tolist():
        mask[max(0, y0):max(0, y1), max(0, x0):max(0, x1)] = True
    return mask


def _item_mask(item: Mapping[str, Any], k: int) -> torch.Tensor | None:
    """Ground-truth mask of the item's class at original size: "mask", else the union of "boxes", else seg == label."""
    size = item["image"].size
    if "mask" in item:
        m = torch.as_tensor(item["mask"]).bool()
    elif "boxes" in item:
        m = _boxes_mask(item["boxes"], size)
    elif "seg" in item:
        seg = torch.as_tensor(item["seg"])
        m = seg == int(item["label"]) if int(item["label"]) >= 0 else torch.zeros_like(seg, dtype=torch.bool)
    else:
        return None
    if (m.shape[1], m.shape[0]) != size:
        raise InputError(f"items[{k}]: ground truth is {m.shape[1]}x{m.shape[0]}, its image is {size[0]}x{size[1]}")
    return m


def collate(items: Sequence[Mapping[str, Any]],
            model_or_config: DataConfig | Mapping[str, Any] | torch.nn.Module
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Turn loader items into a model batch with aligned ground truth.

    Args:
        items: dicts from one of the loaders (or any dicts with ``image`` (PIL) and ``label``).
        model_or_config: the model, or its data config (anything :func:`vitlens.images.data_config` accepts).

    Returns:
        ``x`` ``(B, 3, H, W)`` float32 via :func:`vitlens.images.preprocess`; ``labels`` ``(B,)`` int64; ``masks``
        ``(B, H, W)`` bool — the ground-truth region of each item's label (its ``mask``, else the union of its
        ``boxes``, else ``seg == label``) moved through the same resize/crop as the image
        (:func:`transform_label_map`) — or ``None`` when no item carries ground truth.

    Raises:
        InputError: no items, an item without an image, or ground truth on only some items.
    """
    if len(items) == 0:
        raise InputError("collate needs at least one item")
    cfg = data_config(model_or_config)
    xs, labels, masks = [], [], []
    for k, it in enumerate(items):
        if not isinstance(it, Mapping) or not isinstance(it.get("image"), Image.Image):
            raise InputError(f"items[{k}] is not a loader item (a dict with a PIL 'image')")
        xs.append(preprocess(it["image"], cfg))
        labels.append(int(it.get("label", -1)))
        masks.append(_item_mask(it, k))
    have = [m is not None for m in masks]
    if any(have) and not all(have):
        raise InputError(
            f"items {[k for k, h in enumerate(have) if not h][:5]} have no ground truth (mask, boxes or seg) while "
            "others do; collate them separately"
        )
    out_masks = torch.stack([transform_label_map(m, cfg) for m in masks if m is not None]) if all(have) else None
    return torch.stack(xs), torch.tensor(labels, dtype=torch.int64), out_masks
