"""AHA: one forward pass of a trained explainer network, optionally refined for ``T`` steps on the soft loss.

The network, its training and the soft deletion/insertion loss live in :mod:`vitlens.aha`; this file only runs them
as a vitlens method. Equations and measured numbers: docs/methods/aha.md.
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import InputError, UnsupportedModelError, WeightsUnavailableError
from ..models import Adapter
from ..models.capabilities import CLASS_LOGITS, FEATURE_MAPS, TOKEN_SEQUENCE
from ..targets import Target
from ..options import choice, custom, grid_cells, integer, number
from .base import Attribution, Explainer, image_size
from .registry import register

__all__ = ["AHA"]

#: the references a ``reference="mixed"`` refinement takes in turn, one per step
MIXED = ("mean", "black", "blur")


def _explainer_ok(value: Any) -> bool:
    """A path (non-empty string or Path: read when the method meets its model), ``'untrained'`` or an AHANet."""
    if isinstance(value, str):
        return bool(value.strip())
    if isinstance(value, Path):
        return True
    if isinstance(value, nn.Module):
        from ..aha import AHANet

        return isinstance(value, AHANet)
    return False


@register
class AHA(Explainer):
    """Amortized Hybrid Attribution: pixel map ``S = E(x, c)`` from a trained explainer network ``E``.

    Options:
        explainer: ``None`` (the shipped explainer of a bundled model, e.g. ``shapes-vit``), a path to a
            ``.safetensors`` explainer (with its ``.json``), an :class:`vitlens.aha.AHANet`, or ``"untrained"`` (a
            randomly initialised network, seed 0: only for smoke tests).
        refine_steps: ``T`` test-time Adam steps on the map logits (0: the network's map exactly).
        lr: step size of the refinement, as a fraction of each map's range.
        grid: refinement region grid (int or ``(gy, gx)``); ``None``: the model's token grid (pixels // 16 without).
        tau, m, n_iters: sorter temperature (default 0.03, the training's final one: docs/benchmarks/aha.md), curve
            points (incl. endpoints), Sinkhorn iterations of the refinement.
        reference: ``"mixed"`` (default): step ``t`` uses mean, black, blur in turn (no single protocol; chosen on
            validation images, docs/methods/aha.md), or one fixed reference ``"mean"`` | ``"black"`` | ``"blur"``.
        w_peak: weight of the peak penalty in the refinement loss.

    Cost per image: one target forward (the backbone is the target: features and logits in one pass) plus, when
    ``T > 0``, one forward on each reference used (3 for the default mixed reference) and ``T·2·(m − 2)`` forward+backward passes (:meth:`declared_cost`).
    The score explained is the softmax probability of the target's class (its class index is what the network is
    conditioned on, whatever the target object's score is).
    """

    name = "aha"
    value_kind = "score"
    description = "learned explainer trained on deletion/insertion, optional refinement (needs trained explainer weights)"
    needs = (CLASS_LOGITS, (TOKEN_SEQUENCE, FEATURE_MAPS))
    display_name = "AHA"
    option_symbols = {"refine_steps": "T"}
    level = "pixel"
    defaults: dict[str, Any] = {"explainer": None, "refine_steps": 6, "lr": 0.025, "grid": None, "tau": 0.03, "m": 16,
                                "n_iters": 30, "reference": "mixed", "w_peak": 0.0025}
    option_specs = {
        "explainer": custom(_explainer_ok, "a path to a .safetensors explainer, an AHANet or 'untrained'",
                            none=True, invalid=["", 3, nn.Linear(1, 1)], valid=["untrained", Path("x.safetensors")]),
        "refine_steps": integer(0, 10_000),
        "lr": number(0, low_open=True),
        "grid": grid_cells(none=True),
        "tau": number(0, low_open=True),
        "m": integer(2, unit="curve points incl. both ends; refinement needs >= 3"),
        "n_iters": integer(1),
        "reference": choice("mean", "black", "blur", "mixed"),
        "w_peak": number(0),
    }
    fast_options: dict[str, Any] = {"explainer": "untrained", "refine_steps": 1, "m": 4}

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._cache: dict[int, tuple[weakref.ref, Any]] = {}

    def check_options(self) -> None:
        o = self.options
        if int(o["refine_steps"]) > 0 and int(o["m"]) < 3:
            raise InputError(f"option m of method 'aha' must be >= 3 when refine_steps > 0 (refinement needs 3 "
                             f"curve points); got {o['m']}")

    def declared_cost(self) -> dict[str, float]:
        t = int(self.options["refine_steps"])
        inner = 2 * (int(self.options["m"]) - 2)
        n_refs = min(t, len(MIXED)) if self.options["reference"] == "mixed" else 1
        return {"forward": 1.0 + (n_refs + t * inner if t else 0.0), "backward": float(t * inner)}

    # -- the explainer network, built once per model --------------------------------------------------------------
    def prepare(self, model: nn.Module) -> None:
        """Build (and cache) the explainer network for ``model`` now, so a missing or mismatched explainer is refused
        before a benchmark writes anything."""
        self._network(model)

    def _network(self, model: nn.Module) -> Any:
        hit = self._cache.get(id(model))
        if hit is not None and hit[0]() is model:
            return hit[1]
        net = self._build(model)
        self._cache[id(model)] = (weakref.ref(model), net)
        return net

    def _build(self, model: nn.Module) -> Any:
        from ..aha import SHIPPED, AHANet, load_explainer, shipped_explainer
        from ..aha.network import build_explainer

        spec = self.options["explainer"]
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        if spec is None:
            shipped = shipped_explainer(model)
            if shipped is None:
                raise UnsupportedModelError(
                    f"no shipped AHA explainer for {type(model).__name__} (shipped for: "
                    f"{', '.join(n.removesuffix('-aha') for n, _ in SHIPPED.values())}); train one with "
                    "`vitlens train-aha --model MODEL --data DATA --out DIR` and pass explainer='DIR/NAME.safetensors'"
                )
            name, path, command = shipped
            if not path.is_file():
                raise WeightsUnavailableError(f"the shipped AHA explainer {name} is missing ({path}); train it with: "
                                              f"{command}")
            return load_explainer(path, model)
        if isinstance(spec, AHANet):
            if spec.target is model:
                return spec.eval()
            net = build_explainer(model, **spec.arch)  # same weights, bound to this model
            net.load_state_dict(spec.state_dict())
            return net.to(device).eval()
        if isinstance(spec, nn.Module):
            raise InputError(f"explainer must be an AHANet, got {type(spec).__name__}")
        if str(spec) == "untrained":
            return AHANet(model, seed=0).to(device).eval()
        return load_explainer(Path(spec), model)

    # -- one chunk ------------------------------------------------------------------------------------------------
    def attribute(self, adapter: Adapter, x: Tensor, target: Target) -> tuple[Attribution, Tensor, Target]:
        from ..aha.refine import refine_maps
        from ..aha.soft_metrics import reference
        from ..errors import UnsupportedModelError as _NoConfig
        from ..images import DataConfig, data_config

        o = self.options
        net = self._network(adapter.model)
        steps = int(o["refine_steps"])
        # the map alone (T = 0): no autograd bookkeeping at all; the refinement gets ordinary (no-grad) tensors
        no_autograd = torch.no_grad if steps else torch.inference_mode
        with adapter.session(capture=False):
            with no_autograd():
                feats, logits = net.features(x)
            tgt = self.resolve_target(target, logits)
            classes = tgt.resolved_classes().to(x.device).long()
            with no_autograd():
                maps = net(x, classes, feats)
            if steps:
                try:
                    cfg = data_config(adapter.model)
                except _NoConfig:
                    cfg = DataConfig()  # only the 'black' reference needs mean/std
                kinds = MIXED[:min(steps, len(MIXED))] if o["reference"] == "mixed" else (o["reference"],)
                refs = [reference(x, kind, cfg.mean, cfg.std) for kind in kinds]
                p0 = logits.float().softmax(-1).gather(1, classes[:, None])[:, 0]
                with torch.no_grad():
                    ends = [(p0, adapter.forward(r).float().softmax(-1).gather(1, classes[:, None])[:, 0])
                            for r in refs]

                def prob_fn(images: Tensor, cls: Tensor) -> Tensor:
                    return adapter.forward(images).float().softmax(-1).gather(1, cls[:, None])[:, 0]

                grid = o["grid"]
                if grid is None:
                    hw = image_size(x)
                    grid = adapter.grid(hw) if "tokens" in adapter.capabilities else (
                        max(1, hw[0] // 16), max(1, hw[1] // 16))
                maps = refine_maps(prob_fn, x, maps, classes, refs, ends, steps=steps, lr=float(o["lr"]),
                                   grid=grid, tau=float(o["tau"]), m=int(o["m"]), n_iters=int(o["n_iters"]),
                                   w_peak=float(o["w_peak"]))
        return Attribution(values=maps.detach()), logits, tgt
