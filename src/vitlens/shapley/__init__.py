"""ViT-Shapley (Covert, Lundberg & Lee, ICLR 2023): an explainer ViT trained to output the patches' Shapley values of a
surrogate game in one forward pass.

``image → surrogate trunk → {surrogate's last blocks → v(1); explainer branch → φ̂} → additive normalisation → φ``.
Modules: :mod:`.surrogate` (the model with patches held out), :mod:`.sampling` (keyed random subsets, the Shapley
kernel), :mod:`.network` (the explainer, its files), :mod:`.kernelshap` (the KernelSHAP reference estimate),
:mod:`.config`, :mod:`.loop` (training), :mod:`.card`, :mod:`.cli` (``vitlens train-shapley``). The method is
``vitlens.explain(model, x, method="vit_shapley")`` (:mod:`vitlens.explainers.vit_shapley`); docs/methods/vit_shapley.md.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from ..models import get_adapter
from .config import ShapleyTrainConfig, ShapleyTrainResult
from .loop import train_shapley
from .network import ShapleyExplainer, load_shapley, save_shapley
from .surrogate import masked_logits, patch_layout

__all__ = ["SHIPPED", "ShapleyExplainer", "ShapleyTrainConfig", "ShapleyTrainResult", "WEIGHTS_DIR", "load_shapley",
           "masked_logits", "patch_layout", "save_shapley", "shipped_shapley", "train_shapley"]

#: Folder of the shipped explainers (``<name>.safetensors`` + ``.json`` + ``.md`` card).
WEIGHTS_DIR: Path = Path(__file__).resolve().parent / "weights"

#: target architecture → (shipped explainer name, the command that trains it; full command in the card)
SHIPPED: dict[str, tuple[str, str]] = {
    "vit_shapes_convstem8_64": ("shapes-vit-shapley", "vitlens train-shapley --model shapes-vit --data scenes --out DIR "
                                "(full command in src/vitlens/shapley/weights/shapes-vit-shapley.md)"),
    "vit_digits_patch7_28": ("digits-vit-shapley", "vitlens train-shapley --model digits-vit --data digits --out DIR "
                             "(full command in src/vitlens/shapley/weights/digits-vit-shapley.md)"),
}


def shipped_shapley(model: nn.Module) -> tuple[str, Path, str] | None:
    """``(name, weights path, training command)`` of the shipped explainer for ``model``'s architecture, or ``None``
    (the path may not exist in a checkout without the trained file)."""
    arch = get_adapter(model).architecture()
    if arch not in SHIPPED:
        return None
    name, command = SHIPPED[arch]
    return name, WEIGHTS_DIR / f"{name}.safetensors", command
