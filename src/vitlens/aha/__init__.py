"""AHA (Amortized Hybrid Attribution): an explainer network trained to optimise deletion and insertion directly.

``image → explainer network E(x, c) (frozen backbone + small class-conditional decoder) → pixel map S``; trained by
making the deletion/insertion AUCs of the frozen target differentiable with a Gumbel-Sinkhorn soft sort over regions.

Modules: :mod:`.sorter` (soft permutations), :mod:`.soft_metrics` (soft curves and the loss), :mod:`.network`
(the explainer network, saving/loading), :mod:`.train` (training, ``vitlens train-aha``; split into
:mod:`.config`, :mod:`.data`, :mod:`.plan`, :mod:`.loop`, :mod:`.card`, :mod:`.cli`), :mod:`.refine`
(test-time refinement), :mod:`.evaluation` (hard pixel-level deletion/insertion, the authors' protocol).
The method itself is ``vitlens.explain(model, x, method="aha")`` (:mod:`vitlens.explainers.aha`); the equations are
in docs/methods/aha.md.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from ..models import get_adapter
from .network import AHANet, load_explainer, save_explainer

__all__ = ["AHANet", "SHIPPED", "WEIGHTS_DIR", "load_explainer", "save_explainer", "shipped_explainer"]

#: Folder of the shipped explainers (``<name>.safetensors`` + ``.json`` metadata + ``.md`` model card).
WEIGHTS_DIR: Path = Path(__file__).resolve().parent / "weights"

#: target architecture (``model.pretrained_cfg["architecture"]``) → (shipped explainer name, command that trains it)
SHIPPED: dict[str, tuple[str, str]] = {
    "vit_shapes_convstem8_64": (
        "shapes-vit-aha",
        "vitlens train-aha --model shapes-vit --data scenes --name shapes-vit-aha --out DIR "
        "(full command in src/vitlens/aha/weights/shapes-vit-aha.md; copy DIR/shapes-vit-aha.* here)",
    ),
    "deit_distilled_shapes_convstem8_64": (
        "shapes-deit-aha",
        "vitlens train-aha --model shapes-deit --data scenes --pool tokens --name shapes-deit-aha --out DIR "
        "(full command in src/vitlens/aha/weights/shapes-deit-aha.md; copy DIR/shapes-deit-aha.* here)",
    ),
    "vit_shapes_gap_reg4_convstem8_64": (
        "shapes-vit-gap-reg-aha",
        "vitlens train-aha --model shapes-vit-gap-reg --data scenes --pool tokens --name shapes-vit-gap-reg-aha "
        "--out DIR (full command in src/vitlens/aha/weights/shapes-vit-gap-reg-aha.md; copy the files here)",
    ),
    "vit_digits_patch7_28": (
        "digits-vit-aha",
        "vitlens train-aha --model digits-vit --data digits --name digits-vit-aha --out DIR "
        "(full command in src/vitlens/aha/weights/digits-vit-aha.md; copy DIR/digits-vit-aha.* here)",
    ),
    "vit_planted_convstem8_64": (
        "planted-vit-aha",
        "vitlens train-aha --model planted-vit --data planted --pool tokens --name planted-vit-aha --out DIR "
        "(full command in src/vitlens/aha/weights/planted-vit-aha.md; copy DIR/planted-vit-aha.* here)",
    ),
}


def shipped_explainer(model: nn.Module) -> tuple[str, Path, str] | None:
    """``(name, weights path, training command)`` of the shipped explainer for ``model``'s architecture, or ``None``.

    The path may not exist (a checkout without the trained file).
    """
    arch = get_adapter(model).architecture()
    if arch not in SHIPPED:
        return None
    name, command = SHIPPED[arch]
    return name, WEIGHTS_DIR / f"{name}.safetensors", command
