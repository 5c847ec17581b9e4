"""vitlens: faithful, fast attribution maps for vision transformers.

>>> import vitlens
>>> model = vitlens.load_model("shapes-vit")
>>> scenes = vitlens.data.make_scenes(n=4, seed=0)
>>> x = vitlens.load_images(scenes.images, model)
>>> exp = vitlens.explain(model, x, method="gradskip")
>>> exp.maps.shape
torch.Size([4, 64, 64])
"""

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
from .targets import ClassLogit, ClassProbability, Contrast, SegmentationTarget

from ._version import __version__

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
