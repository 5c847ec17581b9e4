"""Multi-depth feature maps of a model from timm's ``feature_info`` (the AHA decoder's input on models without token
blocks vitlens reads), and a probe that says whether they can be read as ``(B, C, h, w)`` maps."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import UnsupportedModelError

__all__ = ["feature_modules", "as_map", "feature_maps_reason"]


def feature_modules(model: nn.Module) -> tuple[list[nn.Module], list[str], list[int]]:
    """The modules named by timm's ``feature_info`` (input side first), their names and channels; raises
    :class:`UnsupportedModelError` when the model has no ``feature_info`` or an entry names no submodule."""
    info = getattr(model, "feature_info", None)
    if info is None:
        raise UnsupportedModelError(f"{type(model).__name__} has no timm feature_info to read multi-depth features from")
    entries = [dict(e) for e in (info.info if hasattr(info, "info") else info)]
    modules, names, chans = [], [], []
    for e in entries:
        name = str(e.get("module", ""))
        try:
            modules.append(model.get_submodule(name))
        except AttributeError:
            raise UnsupportedModelError(f"{type(model).__name__}'s feature_info names {name!r}, which is not one of its "
                                        "submodules") from None
        names.append(name)
        chans.append(int(e["num_chs"]))
    if not modules:
        raise UnsupportedModelError(f"{type(model).__name__}'s feature_info is empty")
    return modules, names, chans


def as_map(out: Any, channels: int) -> Tensor | None:
    """A feature module's output as ``(B, C, h, w)`` (NHWC outputs are permuted), or ``None`` if it is not a map."""
    t = out[0] if isinstance(out, (tuple, list)) else out
    if not isinstance(t, Tensor) or t.ndim != 4:
        return None
    if t.shape[1] != channels and t.shape[-1] == channels:
        t = t.permute(0, 3, 1, 2)
    return t


_PROBED: "weakref.WeakKeyDictionary[nn.Module, str | None]" = weakref.WeakKeyDictionary()


def feature_maps_reason(model: nn.Module, size: tuple[int, int] | None) -> str | None:
    """``None`` if every ``feature_info`` module of ``model`` outputs a ``(B, C, h, w)`` map in one forward of a zero
    image of ``size`` (default 224×224), else why not. The model's train/eval flags and hooks are restored; the
    answer is cached per model."""
    if model in _PROBED:
        return _PROBED[model]
    try:
        modules, names, chans = feature_modules(model)
    except UnsupportedModelError as e:
        _PROBED[model] = str(e)
        return str(e)
    found: dict[int, Any] = {}
    handles = [m.register_forward_hook(lambda mod, a, out, i=i: found.setdefault(i, out)) for i, m in enumerate(modules)]
    modes = {m: m.training for m in model.modules()}
    in_chans = _input_channels(model)
    reason: str | None = None
    try:
        model.eval()
        with torch.no_grad():
            p = next(iter(model.parameters()), None)
            model(torch.zeros(1, in_chans, *(size or (224, 224)), dtype=p.dtype if p is not None else torch.float32,
                              device=p.device if p is not None else None))
    except Exception as e:  # noqa: BLE001 - any failure of the probe means the maps cannot be read
        reason = f"a forward to read its feature_info modules failed ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
    finally:
        for h in handles:
            h.remove()
        for m, flag in modes.items():
            m.training = flag
    if reason is None:
        for i, name in enumerate(names):
            if i not in found:
                reason = f"its feature_info module {name!r} is never called in the forward (a container, not a layer)"
                break
            if as_map(found[i], chans[i]) is None:
                t = found[i][0] if isinstance(found[i], (tuple, list)) else found[i]
                shape = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
                reason = f"its feature_info module {name!r} outputs {shape}, not a (B, C, h, w) map"
                break
    _PROBED[model] = reason
    return reason


def _input_channels(model: nn.Module) -> int:
    cfg = getattr(model, "pretrained_cfg", None)
    size = cfg.get("input_size") if isinstance(cfg, dict) else None
    if isinstance(size, (tuple, list)) and len(size) == 3:
        return int(size[0])
    return 3
