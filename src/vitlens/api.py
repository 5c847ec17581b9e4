"""The top-level functions: ``explain``, ``methods``, and the provenance records written next to every map and run
(:func:`model_provenance`, :func:`file_sha256`, :func:`weights_sha256`)."""

from __future__ import annotations

import hashlib
import os
from typing import Any

import torch
from torch import Tensor, nn

from .explainers import Explainer, Explanation, get_method, methods
from .targets import TargetSpec

__all__ = ["explain", "methods", "model_provenance", "run_provenance", "file_sha256", "weights_sha256"]


def explain(model: nn.Module, x: Tensor, method: str | Explainer = "gradskip", target: TargetSpec = None, *,
            batch_size: int | None = None, **options: Any) -> Explanation:
    """Explain the model's predictions on a batch.

    Args:
        model: a supported model (see ``vitlens.load_model``) or any ``nn.Module`` for model-agnostic methods.
        x: ``(B, C, H, W)`` float batch, preprocessed as the model expects (``vitlens.load_images``).
        method: a registered method name (``vitlens.methods()``) or an :class:`Explainer` instance.
        target: ``None`` (predicted class), a class index, per-sample indices, or a :class:`vitlens.targets.Target`.
        batch_size: process the batch in chunks of this size (memory knob; results do not depend on it). For a
            method with its own ``batch_size`` option (images per forward call: rise, tis, vitcx, mutex, mda) it
            sets that option instead.
        **options: method options (e.g. ``alpha=0.5`` for GradSkip); unknown options are an error.

    Returns:
        An :class:`Explanation` with ``maps`` ``(B, H, W)``, ``token_maps``, ``targets``, ``scores``, ``remainder``
        and ``cost``.
    """
    if batch_size is not None and isinstance(method, str) and "batch_size" in _own_options(method):
        # the method has its own batch_size option (rise, tis, vitcx, mutex, mda: images per forward call):
        # that is the one meant; both are memory knobs and neither changes the maps
        options = {**options, "batch_size": batch_size}
        batch_size = None
    return get_method(method, **options).explain(model, x, target=target, batch_size=batch_size)


def _own_options(method: str) -> dict[str, Any]:
    from .explainers.registry import method_classes

    cls = method_classes().get(method)
    return dict(cls.defaults) if cls is not None else {}


def file_sha256(path: str | os.PathLike) -> str:
    """SHA-256 of a file's bytes (hex), read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def weights_sha256(model: nn.Module) -> str:
    """SHA-256 (hex) of a model's weights: every entry of its ``state_dict`` in name order, each as its name, dtype,
    shape and bytes (on the CPU). The same weights give the same digest on any device; any change of a value, a
    shape or a dtype gives another."""
    digest = hashlib.sha256()
    for name, value in sorted(model.state_dict().items()):
        if not isinstance(value, Tensor):
            continue
        t = value.detach().cpu().contiguous().reshape(-1)
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def model_provenance(model: nn.Module, spec: str | None = None, options: dict[str, Any] | None = None,
                     seed: int | None = None) -> dict[str, Any]:
    """What a reader needs to rebuild the model a map was made with: ``spec`` and ``options`` (as given to
    :func:`vitlens.load_model`; default: what the model was loaded with, ``model.vitlens_source``), ``pretrained``,
    the weights file, the ``seed`` of random weights, the class, the number of parameters, the weights' SHA-256
    (:func:`weights_sha256`) and the preprocessing (the model's data config: input size, interpolation, crop,
    mean and std)."""
    from .images import data_config
    from .errors import VitlensError

    source = dict(getattr(model, "vitlens_source", None) or {})
    given = dict(options if options is not None else source.get("options") or {})
    info: dict[str, Any] = {
        "spec": spec if spec is not None else source.get("name"),
        "options": {k: v for k, v in given.items() if k != "seed"},
        "pretrained": given.get("pretrained", source.get("pretrained")),
        "weights_file": source.get("weights"),
        "seed": seed if seed is not None else given.get("seed", source.get("seed")),
        "class": f"{type(model).__module__}.{type(model).__qualname__}",
        "parameters": int(sum(p.numel() for p in model.parameters())),
        "weights_sha256": weights_sha256(model),
    }
    try:
        info["preprocessing"] = data_config(model).to_dict()
    except VitlensError:  # a module of no known family: its inputs are the caller's business
        info["preprocessing"] = None
    return _jsonable(info)


def run_provenance(model: nn.Module, device: Any = None) -> dict[str, Any]:
    """The ``provenance.json`` of a benchmark run: the model (:func:`model_provenance`), the device, the versions of
    vitlens, torch, timm and transformers, and the Python version."""
    import contextlib
    import platform

    from ._version import __version__

    info: dict[str, Any] = {"vitlens": __version__, "torch": torch.__version__, "python": platform.python_version(),
                            "device": None if device is None else str(device), "model": model_provenance(model)}
    for mod in ("timm", "transformers"):
        with contextlib.suppress(ImportError):
            info[mod] = __import__(mod).__version__
    return _jsonable(info)


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return repr(obj)
