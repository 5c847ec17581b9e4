"""ViT-Shapley (Covert, Lundberg & Lee, ICLR 2023): a trained explainer's patch Shapley values, one pass.

The surrogate, the explainer network and their training live in :mod:`vitlens.shapley`; this file only runs a trained
explainer as a vitlens method. Equations and measured numbers: docs/methods/vit_shapley.md.
"""

from __future__ import annotations

import copy
import weakref
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import UnsupportedModelError, WeightsUnavailableError
from ..models import Adapter
from ..models.capabilities import ATTENTION_MASK, CLASS_LOGITS
from ..options import custom
from ..targets import Target
from .base import Attribution, Explainer, image_size
from .registry import register

__all__ = ["ViTShapley"]


def _explainer_ok(value: Any) -> bool:
    """A ``.safetensors`` path (read when the method meets its model), ``'untrained'`` or a ShapleyExplainer."""
    if isinstance(value, (str, Path)):
        return str(value) == "untrained" or (bool(str(value).strip()) and Path(value).suffix == ".safetensors")
    if isinstance(value, nn.Module):
        from ..shapley import ShapleyExplainer

        return isinstance(value, ShapleyExplainer)
    return False


@register
class ViTShapley(Explainer):
    """ViT-Shapley: ``φ_c(x)`` ``(gh, gw)``, the target class's Shapley values of the patches, signed.

    The game is ``v(S)`` = the fine-tuned surrogate's softmax probability of the class with only the patches ``S``
    present (held-out patches zeroed and masked out of attention, :mod:`vitlens.shapley.surrogate`); the values sum to
    ``v(1) − v(∅)`` over the patches (additive efficient normalisation). ``extras``: ``grand`` and ``null``, the
    surrogate's probabilities ``v(1)`` and ``v(∅)`` of the class, ``(B,)``.

    Options:
        explainer: ``None`` (the explainer shipped for a bundled model: ``shapes-vit``, ``digits-vit``), a path to a
            ``.safetensors`` explainer written by ``vitlens train-shapley`` (its ``.json`` beside it), a
            :class:`vitlens.shapley.ShapleyExplainer`, or ``"untrained"`` (fresh weights on a copy of the model,
            seed 0: only for smoke tests).

    Cost per image: one forward of the model (its logits resolve the target and give the score) plus one pass of the
    explainer network, which has its own weights (the surrogate's trunk, its last blocks and the explainer branch: about
    ``(L + t + 1) / L`` forwards of a model of the same size for ``t`` fine-tuned blocks) and so is not counted as a
    pass of the model by the cost meter; no backward pass. The class explained is the target's class, whatever its
    score (logit or probability): the values are always those of the surrogate's probability.
    """

    name = "vit_shapley"
    value_kind = "signed"  # Shapley values: for (> 0) and against (< 0) the class (issue 55 declaration)
    description = "ViT-Shapley: learned patch Shapley values of a surrogate, one pass (needs a trained explainer)"
    needs = (CLASS_LOGITS, ATTENTION_MASK)
    display_name = "ViT-Shapley"
    level = "token"
    defaults: dict[str, Any] = {"explainer": None}
    option_specs = {
        "explainer": custom(_explainer_ok, "a .safetensors file written by vitlens train-shapley, a ShapleyExplainer "
                            "or 'untrained'", none=True, invalid=["", "x.pt", 3, nn.Linear(1, 1)],
                            valid=["untrained", Path("x.safetensors")]),
    }
    fast_options: dict[str, Any] = {"explainer": "untrained"}

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._cache: dict[int, tuple[weakref.ref, Any]] = {}

    def declared_cost(self) -> dict[str, float]:
        return {"forward": 1.0, "backward": 0.0}

    def prepare(self, model: nn.Module) -> None:
        """Load the explainer for ``model`` now, so a missing one is refused before a benchmark writes anything."""
        self._network(model)

    def _network(self, model: nn.Module) -> Any:
        hit = self._cache.get(id(model))
        if hit is not None and hit[0]() is model:
            return hit[1]
        first = next(model.parameters(), None)  # the explainer runs in the model's precision and on its device
        net = self._build(model) if first is None else self._build(model).to(device=first.device, dtype=first.dtype)
        self._cache[id(model)] = (weakref.ref(model), net)
        return net

    def _build(self, model: nn.Module) -> Any:
        from ..shapley import SHIPPED, ShapleyExplainer, load_shapley, shipped_shapley

        spec = self.options["explainer"]
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        if isinstance(spec, ShapleyExplainer):
            return spec.to(device).eval()
        if spec is None:
            shipped = shipped_shapley(model)
            if shipped is None:
                raise UnsupportedModelError(
                    f"no shipped ViT-Shapley explainer for {type(model).__name__} (shipped for: "
                    f"{', '.join(n.removesuffix('-shapley') for n, _ in SHIPPED.values())}); train one with "
                    "`vitlens train-shapley --model MODEL --data DATA --out DIR` and pass explainer='DIR/NAME.safetensors'")
            name, path, command = shipped
            if not path.is_file():
                raise WeightsUnavailableError(f"the shipped ViT-Shapley explainer {name} is missing ({path}); train it "
                                              f"with: {command}")
            return load_shapley(path, model)
        if str(spec) == "untrained":
            blocks: Any = getattr(model, "blocks", ())
            net = ShapleyExplainer(copy.deepcopy(model).cpu().eval(), tune_blocks=min(2, len(blocks)), seed=0)
            for p in net.parameters():
                p.requires_grad_(False)
            return net.to(device).eval()
        return load_shapley(Path(spec), model)

    def attribute(self, adapter: Adapter, x: Tensor, target: Target) -> tuple[Attribution, Tensor, Target]:
        net = self._network(adapter.model)
        with adapter.session(capture=False), torch.no_grad():
            logits = adapter.forward(x)
            tgt = self.resolve_target(target, logits)
            classes = tgt.resolved_classes().to(x.device).long()
            if bool(torch.isnan(net.null).any()):  # an untrained explainer: v(∅) from this input's size
                net.set_null(x[:1])
            out = net(x)
        pick = classes[:, None]
        values = out.values.gather(2, pick[:, None, :].expand(-1, out.values.shape[1], 1))[..., 0]
        extras = {"grand": out.grand.gather(1, pick)[:, 0], "null": out.null[classes]}
        return Attribution(values=self.on_grid(adapter, values, image_size(x)), extras=extras), logits, tgt
