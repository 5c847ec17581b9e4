"""The top-level functions: ``explain`` and ``methods``."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from .explainers import Explainer, Explanation, get_method, methods
from .targets import TargetSpec

__all__ = ["explain", "methods"]


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
