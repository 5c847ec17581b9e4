"""Real photographs bundled inside installed wheels (never downloaded), for demos and for the real ImageNet model.

- scikit-image ``data.chelsea``, ``astronaut``, ``coffee``, ``rocket`` (only names whose file is inside the wheel:
  several other ``skimage.data`` names download on first use and fail offline);
- scikit-learn ``load_sample_images`` (``china.jpg``, ``flower.jpg``);
- matplotlib's ``sample_data/grace_hopper.jpg``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import InputError

__all__ = ["bundled_photos"]


def bundled_photos() -> list[tuple[str, str, Any]]:
    """The bundled photographs as ``(name, source, image)``: ``image`` is a uint8 ``(H, W, 3)`` array or a file path
    (anything :func:`vitlens.load_images` accepts).

    Raises:
        vitlens.errors.InputError: scikit-image, scikit-learn or matplotlib is not installed.
    """
    try:
        import matplotlib.cbook
        from skimage import data
        from sklearn.datasets import load_sample_images
    except ImportError as exc:
        raise InputError(f"the bundled photos need scikit-image, scikit-learn and matplotlib ({exc.name} is missing); "
                         "install them with: pip install 'vitlens[perturbation]' matplotlib") from None
    photos: list[tuple[str, str, Any]] = [
        (name, f"skimage.data.{name}()", getattr(data, name)()) for name in ("chelsea", "astronaut", "coffee", "rocket")
    ]
    sample = load_sample_images()
    for path, image in zip(sample.filenames, sample.images):
        photos.append((Path(path).stem, f"sklearn load_sample_images: {Path(path).name}", image))
    hopper = matplotlib.cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)
    photos.append(("grace_hopper", "matplotlib sample_data/grace_hopper.jpg", str(hopper)))
    return photos
