"""vitlens: faithful, fast attribution maps for vision transformers.

>>> import vitlens
>>> model = vitlens.load_model("shapes-vit")
>>> scenes = vitlens.data.make_scenes(n=4, seed=0)
>>> x = vitlens.load_images(scenes.images, model)
>>> exp = vitlens.explain(model, x, method="gradskip")
>>> exp.maps.shape
torch.Size([4, 64, 64])
"""

from typing import TYPE_CHECKING

from ._version import __version__

# The public names load on first use (PEP 562), so that ``import vitlens`` and the command line start without
# importing torch first: a Ctrl-C during start-up then reaches the command line's own handler (one line, exit 130)
# instead of printing a traceback from the middle of an import. ``from vitlens import explain`` works as usual.
_LAZY: dict[str, tuple[str, str | None]] = {
    "explain": (".api", "explain"),
    "methods": (".api", "methods"),
    "describe_methods": (".catalog", "describe_methods"),
    "list_models": (".catalog", "list_models"),
    "load_model": (".models", "load_model"),
    "get_adapter": (".models", "get_adapter"),
    "load_images": (".images", "load_images"),
    "Explainer": (".explainers", "Explainer"),
    "Explanation": (".explainers", "Explanation"),
    "conformance": (".explainers.support", "conformance"),
    "working_methods": (".explainers.support", "working_methods"),
    "ClassLogit": (".targets", "ClassLogit"),
    "ClassProbability": (".targets", "ClassProbability"),
    "Contrast": (".targets", "Contrast"),
    "SegmentationTarget": (".targets", "SegmentationTarget"),
    "TextPrompt": (".targets_text", "TextPrompt"),
    "TextContrast": (".targets_text", "TextContrast"),
    "TextProbability": (".targets_text", "TextProbability"),
    "TextEmbedding": (".targets_text", "TextEmbedding"),
    "VisionLanguageModel": (".models.vlm", "VisionLanguageModel"),
    "ZeroShotClassifier": (".models.vlm", "ZeroShotClassifier"),
    "data": (".data", None),
    "metrics": (".metrics", None),
    "targets": (".targets", None),
    "viz": (".viz", None),
    "VitlensError": (".errors", "VitlensError"),
    "InputError": (".errors", "InputError"),
    "TargetError": (".errors", "TargetError"),
    "UnsupportedModelError": (".errors", "UnsupportedModelError"),
    "WeightsUnavailableError": (".errors", "WeightsUnavailableError"),
    "ImageLoadError": (".errors", "ImageLoadError"),
}


def __getattr__(name: str) -> object:
    import importlib

    if name not in _LAZY:  # a subpackage (vitlens.explainers, vitlens.bench, ...) as an attribute, as before
        if name.startswith("_"):
            raise AttributeError(f"module 'vitlens' has no attribute {name!r}")
        try:
            return importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module 'vitlens' has no attribute {name!r}") from None
    module_name, attr = _LAZY[name]
    module = importlib.import_module(module_name, __name__)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


if TYPE_CHECKING:
    from . import data, metrics, targets, viz
    from .api import explain, methods
    from .catalog import describe_methods, list_models
    from .errors import (
        ImageLoadError,
        InputError,
        TargetError,
        UnsupportedModelError,
        VitlensError,
        WeightsUnavailableError,
    )
    from .explainers import Explainer, Explanation
    from .explainers.support import conformance, working_methods
    from .images import load_images
    from .models import get_adapter, load_model
    from .models.vlm import VisionLanguageModel, ZeroShotClassifier
    from .targets import ClassLogit, ClassProbability, Contrast, SegmentationTarget
    from .targets_text import TextContrast, TextEmbedding, TextProbability, TextPrompt

__all__ = [
    "explain",
    "methods",
    "describe_methods",
    "list_models",
    "load_model",
    "load_images",
    "get_adapter",
    "conformance",
    "working_methods",
    "Explainer",
    "Explanation",
    "ClassLogit",
    "ClassProbability",
    "Contrast",
    "SegmentationTarget",
    "TextPrompt",
    "TextContrast",
    "TextProbability",
    "TextEmbedding",
    "VisionLanguageModel",
    "ZeroShotClassifier",
    "data",
    "metrics",
    "targets",
    "viz",
    "VitlensError",
    "InputError",
    "TargetError",
    "UnsupportedModelError",
    "WeightsUnavailableError",
    "ImageLoadError",
]
