"""Class-activation maps for vision transformers: Grad-CAM on tokens, Finer-CAM, and attention Grad-CAM.

All three are token-level and cost one forward and one activation-only backward pass. The tensors they read (the
residual stream entering a block, a CNN's or SegFormer's final feature map, the attention probabilities) come from
the adapter's capture session, so the token layout (prefix tokens, grid) is the model's own. Settings, sources and
cross-checks: ``docs/methods/cams.md``.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor

from ..errors import InputError, TargetError
from ..models import Adapter
from ..models.base import recorded
from ..models.capabilities import ATTENTION, FEATURES, TOKEN_SEQUENCE
from ..targets import Target
from .base import Attribution, Explainer, check_choices, image_size
from .registry import register

__all__ = ["GradCAM", "FinerCAM", "AttentionGradCAM", "FinerContrast", "similar_classes", "class_scores"]

_WEIGHTINGS = ("mean", "probability")


def _features(rec: Any, i: int) -> Tensor:
    """Feature layer ``i`` of a capture session, ``(B, T, D)``: ``rec.features[i]`` where the family records
    features of its own (SegFormer: the decode head's fused feature map), else the residual input of block ``i``
    (ViTs; a CNN records its one feature map as block 0)."""
    own = getattr(rec, "features", None)
    return own[i] if own is not None else rec.blocks[i].u


def token_gradcam(u: Tensor, grad: Tensor, num_prefix: int) -> Tensor:
    """Grad-CAM on token features: ``ReLU(Σ_k w_k · u[:, p:, k])`` with ``w_k = mean over patch tokens of ∂y/∂u_k``.

    ``u``, ``grad``: ``(B, T, D)``; returns ``(B, N)`` for the ``N = T − p`` patch tokens.
    """
    feats, g = u[:, num_prefix:], grad[:, num_prefix:]
    weights = g.mean(dim=1, keepdim=True)  # (B, 1, D): gradient averaged over patch tokens
    return (feats * weights).sum(dim=-1).clamp_min(0)


class _OneLayer(Explainer):
    """The machinery of the class-activation methods: one feature layer, chosen by the ``layer`` option (an int block
    index, negative counting from the end), on the model's token grid."""

    level = "token"

    def check_options(self) -> None:
        layer = self.options["layer"]
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise InputError(f"layer must be an int block index (negative counts from the end), got {layer!r}")

    def layer_index(self, adapter: Adapter) -> int:
        """The ``layer`` option as a non-negative index into ``adapter.feature_layers()`` (checked against it)."""
        layer, n = self.options["layer"], len(adapter.feature_layers())
        if not -n <= layer < n:
            own = type(adapter).feature_layers is not Adapter.feature_layers  # CNN, SegFormer: not the blocks
            kind = "feature layers" if own else "blocks"
            raise InputError(f"layer {layer} is out of range for a model with {n} {kind} (valid: {-n}..{n - 1})")
        return layer % n


@register
class GradCAM(_OneLayer):
    """Grad-CAM (Selvaraju et al., ICCV 2017) on the token features of a ViT, ``(B, gh, gw)``.

    Features: the residual stream entering block ``layer`` (default the last block), which is the input of that
    block's first LayerNorm; on a timm CNN the feature map the classifier pools, on a SegFormer the decode head's
    fused feature map (the input of its 1×1 classifier, on the logits' grid; one layer). Channel weights: the
    target's gradient with respect to those features, averaged over the patch tokens; map: ReLU of the weighted
    channel sum at every patch token, on the model's own token grid (prefix tokens — CLS, distillation, registers —
    are left out). With a :class:`~vitlens.targets.SegmentationTarget` this is Seg-Grad-CAM (Vinogradova et al.,
    AAAI 2020).

    Options:
        layer: feature layer index (negative counts from the end): a block of a ViT, 0/−1 on a CNN or SegFormer.
    """

    name = "gradcam"
    description = "Grad-CAM on the ViT's tokens (or a CNN's last feature map)"
    needs = (FEATURES,)
    display_name = "Grad-CAM"
    defaults: dict[str, Any] = {"layer": -1}

    def attribute(self, adapter: Adapter, x: Tensor, target: Target) -> tuple[Attribution, Tensor, Target]:
        i = self.layer_index(adapter)
        logits, tgt, (u,), (g,) = self.forward_and_gradients(adapter, x, target, lambda rec: [_features(rec, i)])
        cam = token_gradcam(u, g, adapter.feature_prefix_tokens())
        return Attribution(values=self.on_grid(adapter, cam, image_size(x), features=True)), logits, tgt


def similar_classes(logits: Tensor, classes: Tensor, k: int) -> Tensor:
    """The ``k`` classes (≠ the target class) whose logits are closest to the target's, ``(B, k)`` long, closest
    first. For the predicted class these are the runner-ups. ``logits``: ``(B, K)`` per-class scores (for a
    segmentation target, :func:`class_scores`)."""
    diff = (logits.detach() - logits.detach().gather(1, classes[:, None])).abs()
    diff.scatter_(1, classes[:, None], float("inf"))
    return diff.argsort(dim=1, stable=True)[:, :k]


def _with_classes(target: Target, classes: Tensor) -> Target:
    """A copy of a resolved target that scores ``classes`` ``(B,)`` by the same rule (a segmentation target keeps its
    region)."""
    t = copy.copy(target)
    t.classes = classes
    return t


def class_scores(target: Target, logits: Tensor) -> Tensor:
    """Every class's score under a resolved target's rule, ``(B, K)``: the logits for classifier logits ``(B, K)``;
    for per-pixel logits ``(B, K, h, w)`` and a :class:`~vitlens.targets.SegmentationTarget`, each class's logits
    summed over the target's region (the region of the target class, fixed at resolution)."""
    if logits.ndim == 2:
        return logits
    b, k = logits.shape[:2]
    return torch.stack([_with_classes(target, torch.full((b,), c, dtype=torch.long, device=logits.device))(logits)
                        for c in range(k)], dim=1)


class FinerContrast(Target):
    """Finer-CAM's target: a target's score against the logits of ``k`` reference classes ``d``.

    ``score = s − γ · Σ_d ω_d y_d`` with ``s`` the wrapped target's score (the logit ``y_c`` for the default
    :class:`~vitlens.targets.ClassLogit`) and ``Σ_d ω_d = 1``: ``weighting="mean"`` gives ``ω_d = 1/k``, i.e. the
    average of the ``k`` differences ``y_c − γ·y_d``; ``weighting="probability"`` gives ``ω_d = p_d / Σ_d' p_d'`` with
    ``p = softmax(y)`` (the weights are part of the graph), pytorch-grad-cam's ``FinerWeightedTarget``.

    Per-pixel logits ``(B, K, h, w)`` with a :class:`~vitlens.targets.SegmentationTarget` ``base``: each ``y_d`` is
    class ``d``'s logits summed over the base target's region (the same pixels as ``s``), so the score is
    ``Σ_{p∈Ω} (z_c[p] − γ · mean_d z_d[p])``, the target class's margin over its references on the region. Only
    ``weighting="mean"`` (a softmax over classes is defined per pixel, not for region sums).
    """

    def __init__(self, base: Target, versus: Tensor, gamma: float, weighting: str) -> None:
        self.base = base
        self.classes = base.classes
        self.versus = versus
        self.gamma = float(gamma)
        self.weighting = weighting

    def resolve(self, logits: Tensor) -> "FinerContrast":
        return self

    def __call__(self, logits: Tensor) -> Tensor:
        if self.versus.shape[0] != logits.shape[0]:
            raise TargetError(
                f"target was resolved for a batch of {self.versus.shape[0]}, got logits for {logits.shape[0]}"
            )
        return self.score(logits)

    def score(self, logits: Tensor) -> Tensor:
        s = self.base(logits)  # the base target checks the logits' shape (classifier or per-pixel)
        versus = self.versus.to(logits.device)
        if logits.ndim != 2:  # per-pixel logits: each reference scored over the base target's region
            if self.weighting != "mean":
                raise TargetError(
                    f"Finer-CAM weighting={self.weighting!r} needs classifier logits (B, K); with per-pixel logits "
                    "(SegmentationTarget) use weighting='mean'"
                )
            ref = torch.stack([_with_classes(self.base, versus[:, j])(logits) for j in range(versus.shape[1])], 1)
            return s - self.gamma * ref.mean(dim=1)
        yd = logits.gather(1, versus)  # (B, k)
        if self.weighting == "mean":
            ref = yd.mean(dim=1)
        else:
            p = logits.softmax(dim=-1).gather(1, versus)
            ref = (p * yd).sum(dim=1) / p.sum(dim=1).clamp_min(torch.finfo(p.dtype).tiny)
        return s - self.gamma * ref

    def select(self, index: Tensor | slice) -> "FinerContrast":
        return FinerContrast(self.base.select(index), self.versus[index], self.gamma, self.weighting)

    def describe(self) -> dict:
        return {"kind": "FinerContrast", "base": self.base.describe(), "versus": self.versus.tolist(),
                "gamma": self.gamma, "weighting": self.weighting}


@register
class FinerCAM(_OneLayer):
    """Finer-CAM (Zhang et al., CVPR 2025): Grad-CAM of the contrast between the target class and its most similar
    classes, ``(B, gh, gw)``.

    The target class ``c`` is the one the given target resolves to (the predicted class by default); the references
    ``d`` are the ``references`` classes whose logits are closest to ``y_c`` (the runner-ups when ``c`` is predicted).
    The explained score is the :class:`FinerContrast` of the given target (``y_c`` by default) against them: the
    ``k`` differences ``y_c − γ·y_d`` averaged (default) or softmax-weighted. Grad-CAM is linear in the gradient
    before its ReLU, so one backward pass of the combined score serves all comparisons. Everything else is
    :class:`GradCAM`; ``γ = 0`` gives Grad-CAM. With a :class:`~vitlens.targets.SegmentationTarget` every class is
    scored over the target's region (its logits summed there), the references are the classes closest to the target
    class by that score, and only ``weighting="mean"`` applies (see :class:`FinerContrast`).

    Options:
        references: number of similar classes compared against (default 3; capped at ``K − 1``).
        gamma: comparison strength γ (default 1). weighting: ``mean`` | ``probability`` (see :class:`FinerContrast`).
        layer: feature layer, as for :class:`GradCAM` (default the last).

    ``extras["references"]``: ``(B, k)`` the reference classes per image.
    """

    name = "finercam"
    description = "Grad-CAM of the target class against its closest competitor"
    needs = (FEATURES,)
    display_name = "Finer-CAM"
    defaults: dict[str, Any] = {"references": 3, "gamma": 1.0, "weighting": "mean", "layer": -1}

    def check_options(self) -> None:
        super().check_options()
        o = self.options
        k = o["references"]
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise InputError(f"references must be a positive int, got {k!r}")
        try:
            gamma = float(o["gamma"])
        except (TypeError, ValueError):
            raise InputError(f"gamma must be a number, got {o['gamma']!r}") from None
        if not gamma == gamma or gamma in (float("inf"), float("-inf")):
            raise InputError(f"gamma must be finite, got {o['gamma']!r}")
        check_choices(o, weighting=_WEIGHTINGS)

    def _retarget(self, tgt: Target, logits: Tensor) -> FinerContrast:
        n_classes = logits.shape[1]
        if n_classes < 2:
            raise TargetError("Finer-CAM needs a model with at least 2 classes")
        k = min(int(self.options["references"]), n_classes - 1)
        versus = similar_classes(class_scores(tgt, logits.detach()), tgt.resolved_classes().to(logits.device), k)
        return FinerContrast(tgt, versus, float(self.options["gamma"]), self.options["weighting"])

    def attribute(self, adapter: Adapter, x: Tensor, target: Target) -> tuple[Attribution, Tensor, Target]:
        i = self.layer_index(adapter)
        logits, tgt, (u,), (g,) = self.forward_and_gradients(adapter, x, target, lambda rec: [_features(rec, i)],
                                                             retarget=self._retarget)
        cam = token_gradcam(u, g, adapter.feature_prefix_tokens())
        assert isinstance(tgt, FinerContrast)  # what self._retarget made
        att = Attribution(values=self.on_grid(adapter, cam, image_size(x), features=True), extras={"references": tgt.versus})
        return att, logits, tgt


@register
class AttentionGradCAM(_OneLayer):
    """Attention Grad-CAM, the "GC" baseline of Chefer et al. (CVPR 2021) and MDA, ``(B, gh, gw)``.

    At block ``layer`` (default the last): the readout row of every head's attention over the patch tokens, weighted
    per head by the mean of its gradient over those patch tokens, averaged over heads, ReLU:
    ``ReLU(mean_h ḡ_h · A_h[r, p:])`` with ``ḡ_h = mean_j ∂y/∂A_h[r, p + j]``.

    Readout row ``r``: the CLS token's row. Models with several readout tokens (distilled DeiT: CLS and DIST) and
    pooled-readout models (no CLS; every patch token feeds the head) use several rows, each weighted by its own
    gradient mean and then averaged: the readout tokens' rows, or all patch-token rows.

    Options:
        layer: block index (negative counts from the end).
    """

    name = "attn_gradcam"
    description = "Grad-CAM on the last block's attention"
    needs = (ATTENTION, TOKEN_SEQUENCE)
    display_name = "Attention Grad-CAM"
    defaults: dict[str, Any] = {"layer": -1}

    def attribute(self, adapter: Adapter, x: Tensor, target: Target) -> tuple[Attribution, Tensor, Target]:
        i = self.layer_index(adapter)
        logits, tgt, (attn,), (grad,) = self.forward_and_gradients(
            adapter, x, target, lambda rec: [recorded(rec.blocks[i].attn, "attention")])
        p = adapter.num_prefix_tokens
        readout = adapter.readout_tokens
        rows = list(readout) if readout is not None else list(range(p, attn.shape[2]))
        a = attn[:, :, rows, p:]  # (B, H, R, N)
        g = grad[:, :, rows, p:]
        cam = (g.mean(dim=-1, keepdim=True) * a).mean(dim=(1, 2)).clamp_min(0)  # (B, N)
        return Attribution(values=self.on_grid(adapter, cam, image_size(x))), logits, tgt
