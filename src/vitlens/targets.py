"""What to explain: targets turn model output into one scalar per image.

A target is an object, not a bare class index. It is *resolved* against the model's output once (``None`` becomes
the predicted class, per-sample indices are checked against the batch and the number of classes), and then called on
logits to give the scores ``y`` (shape ``(B,)``) whose gradients and relevance an explainer computes.

>>> t = make_target(None)                       # the predicted class, logit
>>> t = make_target(3)                          # class 3 for every image
>>> t = make_target([3, 1])                     # per-sample classes
>>> t = ClassProbability(3)                     # softmax probability of class 3
>>> t = Contrast(3, 5, gamma=1.0)               # y_3 - 1.0 * y_5
>>> t = SegmentationTarget(3)                   # segmentation: Σ of class-3 logits over the pixels predicted as 3
"""

from __future__ import annotations

import copy
from typing import Any, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from .errors import TargetError

__all__ = ["Target", "ClassLogit", "ClassProbability", "Contrast", "SegmentationTarget", "make_target", "TargetSpec",
           "CLASS_SCORES", "class_score"]

#: how :func:`class_score` scores a class from classifier logits.
CLASS_SCORES = ("logit", "probability", "accuracy")

ClassSpec = Union[None, int, Sequence[int], Tensor]


def _as_class_tensor(classes: ClassSpec, logits: Tensor, what: str) -> Tensor:
    """Resolve a class spec to a ``(B,)`` long tensor on the logits' device, validating range and batch size."""
    if logits.ndim != 2:
        hint = " (per-pixel logits: use vitlens.targets.SegmentationTarget)" if logits.ndim == 4 else ""
        raise TargetError(f"{what} expects logits of shape (B, K); got shape {tuple(logits.shape)}{hint}")
    b, k = logits.shape
    if k == 0:
        raise TargetError(f"{what}: the model has no classifier head (0 classes, e.g. num_classes=0); there is no "
                          "class to explain — load it with its classifier, or explain a feature target")
    if classes is None:
        return logits.detach().argmax(dim=-1)
    if isinstance(classes, bool):
        raise TargetError(f"{what}: a class index must be an int, got a bool")
    if isinstance(classes, int):
        if not 0 <= classes < k:
            raise TargetError(f"{what}: class {classes} is out of range for a model with {k} classes "
                              f"(valid: 0..{k - 1})")
        idx = torch.full((b,), classes, dtype=torch.long, device=logits.device)
    else:
        if isinstance(classes, Tensor) and classes.device.type == "meta":
            raise TargetError(f"{what}: the class indices are a tensor on the 'meta' device (a shape, no values); "
                              "pass them on the CPU or the model's device")
        try:
            idx = torch.as_tensor(classes, device=logits.device)
        except (TypeError, ValueError) as e:
            raise TargetError(f"{what}: cannot read class indices from {type(classes).__name__}: {e}") from None
        if idx.is_floating_point() or idx.is_complex() or idx.dtype == torch.bool:
            raise TargetError(f"{what}: class indices must be integers, got dtype {idx.dtype}")
        if idx.ndim > 1:
            raise TargetError(f"{what}: class indices must be one per image, shape ({b},); got shape "
                              f"{tuple(idx.shape)}")
        idx = idx.long().reshape(-1)
        if idx.numel() == 1 and b != 1:
            idx = idx.expand(b).clone()
        if idx.numel() != b:
            raise TargetError(f"{what}: {idx.numel()} class indices given for a batch of {b} images")
    bad = (idx < 0) | (idx >= k)
    if bool(bad.any()):
        first = int(idx[bad][0])
        raise TargetError(
            f"{what}: class {first} is out of range for a model with {k} classes (valid: 0..{k - 1})"
        )
    return idx


def _resolved(value: Tensor | None, target: "Target") -> Tensor:
    """``value``, filled in by ``resolve``; a clear :class:`TargetError` for a target scored or sliced unresolved."""
    if value is None:
        raise TargetError(f"{type(target).__name__} is not resolved: call it on the logits (target(logits)) or "
                          "resolve(logits) before score() or select()")
    return value


class Target:
    """Base class: maps logits ``(B, K)`` to target scores ``(B,)``.

    Subclasses implement :meth:`resolve` (fix every class index for a concrete batch) and :meth:`score`.
    ``classes`` holds the explained class per image once resolved.
    """

    classes: Tensor | None = None

    def resolve(self, logits: Tensor) -> "Target":
        """Return a copy with all class indices fixed for this batch of logits (validated)."""
        raise NotImplementedError

    def bind(self, model: Any) -> "Target":
        """This target for ``model`` (a module or its adapter), before anything runs: a target that needs the model
        itself, not only its output (a text prompt: the model's tokenizer and text encoder,
        :mod:`vitlens.targets_text`), returns a copy that holds what it needs. Default: ``self``."""
        return self

    def score(self, logits: Tensor) -> Tensor:
        """Target score per image, ``(B,)``, differentiable w.r.t. the logits."""
        raise NotImplementedError

    def resolved_classes(self) -> Tensor:
        """``classes`` of this resolved target, ``(B,)``; a :class:`TargetError` if it has not been resolved."""
        return _resolved(self.classes, self)

    def check_logits(self, logits: Tensor) -> None:
        """Raise :class:`TargetError` unless ``logits`` have the shape this kind of target scores (``(B, K)``)."""
        if logits.ndim != 2:
            raise TargetError(f"targets expect logits of shape (B, K); got shape {tuple(logits.shape)}")

    def __call__(self, logits: Tensor) -> Tensor:
        self.check_logits(logits)
        if self.classes is None:
            return self.resolve(logits).score(logits)
        if self.classes.shape[0] != logits.shape[0]:
            raise TargetError(
                f"target was resolved for a batch of {self.classes.shape[0]}, got logits for {logits.shape[0]}"
            )
        return self.score(logits)

    def select(self, index: Tensor | slice) -> "Target":
        """The same (resolved) target restricted to some images of the batch."""
        raise NotImplementedError

    #: names of the attributes that hold per-image class specs, sliced by :meth:`chunk`.
    _per_image: tuple[str, ...] = ()

    def chunk(self, index: slice, batch: int) -> "Target":
        """This (unresolved) target for images ``index`` of a batch of ``batch`` images: per-image class specs are
        sliced, everything else is shared (``explain(batch_size=…)`` chunking). The whole batch returns ``self``."""
        if index.start == 0 and index.stop == batch:
            return self
        clone = copy.copy(self)
        for key in self._per_image:
            spec = getattr(clone, key, None)
            if spec is None or isinstance(spec, int):
                continue
            t = torch.as_tensor(spec).reshape(-1)
            if t.numel() == 1:
                continue
            if t.numel() != batch:
                raise TargetError(f"{t.numel()} class indices given for a batch of {batch} images")
            setattr(clone, key, t[index])
        return clone

    def describe(self) -> dict:
        """JSON-friendly description for provenance records."""
        return {"kind": type(self).__name__}


class ClassLogit(Target):
    """The logit of a class. ``classes=None`` explains the predicted class of each image."""

    _per_image = ("_spec",)

    def __init__(self, classes: ClassSpec = None) -> None:
        self._spec = classes
        self.classes = None

    def resolve(self, logits: Tensor) -> "ClassLogit":
        t = type(self).__new__(type(self))
        t.__dict__.update(self.__dict__)
        t.classes = _as_class_tensor(self._spec, logits, type(self).__name__)
        return t

    def score(self, logits: Tensor) -> Tensor:
        return logits.gather(1, _resolved(self.classes, self).to(logits.device)[:, None])[:, 0]

    def select(self, index: Tensor | slice) -> "ClassLogit":
        t = type(self).__new__(type(self))
        t.__dict__.update(self.__dict__)
        t.classes = _resolved(self.classes, self)[index]
        t._spec = t.classes
        return t

    def describe(self) -> dict:
        spec = self._spec
        if isinstance(spec, Tensor):
            spec = spec.tolist()
        return {"kind": type(self).__name__, "classes": "predicted" if spec is None else spec}


class ClassProbability(ClassLogit):
    """The softmax probability of a class (``classes=None``: the predicted class)."""

    def score(self, logits: Tensor) -> Tensor:
        return logits.softmax(dim=-1).gather(1, _resolved(self.classes, self).to(logits.device)[:, None])[:, 0]


class Contrast(Target):
    """Contrast target ``y_c - gamma * y_d`` (logits).

    ``classes`` (c) defaults to the predicted class; ``versus`` (d) defaults to the runner-up, i.e. the class with
    the highest logit other than c.
    """

    _per_image = ("_spec", "_versus_spec")

    def __init__(self, classes: ClassSpec = None, versus: ClassSpec = None, gamma: float = 1.0) -> None:
        self._spec = classes
        self._versus_spec = versus
        self.gamma = float(gamma)
        self.classes = None
        self.versus: Tensor | None = None

    def resolve(self, logits: Tensor) -> "Contrast":
        t = Contrast(self._spec, self._versus_spec, self.gamma)
        t.classes = _as_class_tensor(self._spec, logits, "Contrast")
        if logits.shape[1] < 2:
            raise TargetError("Contrast needs a model with at least 2 classes")
        if self._versus_spec is None:
            masked = logits.detach().clone()
            masked.scatter_(1, t.classes[:, None], float("-inf"))
            t.versus = masked.argmax(dim=-1)
        else:
            t.versus = _as_class_tensor(self._versus_spec, logits, "Contrast(versus)")
            same = t.versus == t.classes
            if bool(same.any()):
                i = int(same.nonzero()[0, 0])
                raise TargetError(f"Contrast: image {i} contrasts class {int(t.classes[i])} with itself (classes == "
                                  "versus explains y_c - y_c); choose another versus class")
        return t

    def score(self, logits: Tensor) -> Tensor:
        yc = logits.gather(1, _resolved(self.classes, self).to(logits.device)[:, None])[:, 0]
        yd = logits.gather(1, _resolved(self.versus, self).to(logits.device)[:, None])[:, 0]
        return yc - self.gamma * yd

    def select(self, index: Tensor | slice) -> "Contrast":
        t = Contrast(None, None, self.gamma)
        t.classes = _resolved(self.classes, self)[index]
        t.versus = _resolved(self.versus, self)[index]
        t._spec, t._versus_spec = t.classes, t.versus
        return t

    def describe(self) -> dict:
        def plain(v: ClassSpec):
            return v.tolist() if isinstance(v, Tensor) else v

        return {
            "kind": "Contrast",
            "classes": "predicted" if self._spec is None else plain(self._spec),
            "versus": "runner-up" if self._versus_spec is None else plain(self._versus_spec),
            "gamma": self.gamma,
        }


class SegmentationTarget(Target):
    """Segmentation target: the sum of class-``c`` logits over a region, ``y = Σ_{p ∈ region} z_c[p]``.

    For models with per-pixel logits ``(B, K, h, w)`` (SegFormer: ``h, w`` ≈ input size / 4).

    Args:
        class_index: the class ``c`` — an int for every image, or one int per image (sequence or ``(B,)`` tensor).
        region: where to sum, a bool mask:

            * ``None`` (default): the pixels of the logit grid whose argmax prediction is ``c``, fixed when the target
              is resolved on the model's output for the unperturbed images (perturbation methods keep this region).
              If no pixel of an image is predicted as ``c``, that image's region is **all pixels** (so ``y`` is the
              summed class-``c`` logit of the whole image); ``fallback`` ``(B,)`` records which images fell back.
            * ``(h, w)`` or ``(B, h, w)`` at the logits' resolution: summed as is.
            * ``(H, W)`` or ``(B, H, W)`` at input resolution (any size with an integer factor ``f ≥ 2`` such that
              ``⌈H/f⌉ = h`` and ``⌈W/f⌉ = w``): the class-``c`` logits are first bilinearly upsampled to ``(H, W)``
              (half-pixel centres, as HF's loss does) and summed over the mask — ``y`` is then in units of input
              pixels (≈ ``f²`` times the logit-grid sum).

            An empty region gives ``y = 0``. A ``(B, …)`` region belongs to one batch: ``explain(batch_size=…)``
            chunking does not split it (a clear :class:`TargetError`); pass one ``(h, w)`` / ``(H, W)`` mask or no
            chunking.
    """

    _per_image = ("_spec",)

    def __init__(self, class_index: ClassSpec, region: Tensor | None = None) -> None:
        if class_index is None:
            raise TargetError("SegmentationTarget needs a class index (the class whose logits are summed)")
        if region is not None:
            if not isinstance(region, Tensor) or region.dtype != torch.bool:
                got = region.dtype if isinstance(region, Tensor) else type(region).__name__
                raise TargetError(f"SegmentationTarget region must be a bool tensor (h, w) or (B, h, w); got {got}")
            if region.ndim not in (2, 3):
                raise TargetError(
                    f"SegmentationTarget region must have shape (h, w) or (B, h, w); got {tuple(region.shape)}"
                )
        self._spec = class_index
        self._region = region
        self.classes = None
        self.mask: Tensor | None = None  # (B, h', w') bool once resolved
        self.upsample_to: tuple[int, int] | None = None  # input-resolution region: logits are upsampled to this
        self.fallback: Tensor | None = None  # (B,) bool: default region fell back to all pixels

    def check_logits(self, logits: Tensor) -> None:
        if logits.ndim != 4:
            raise TargetError(
                f"SegmentationTarget needs per-pixel logits (B, K, h, w); got shape {tuple(logits.shape)} "
                "(for a classifier use ClassLogit)"
            )

    def resolve(self, logits: Tensor) -> "SegmentationTarget":
        self.check_logits(logits)
        b, _, h, w = logits.shape
        t = type(self).__new__(type(self))
        t.__dict__.update(self.__dict__)
        t.classes = _as_class_tensor(self._spec, logits[:, :, 0, 0], "SegmentationTarget")
        t.upsample_to = None
        if self._region is None:
            mask = logits.detach().argmax(dim=1) == t.classes[:, None, None]
            t.fallback = ~mask.flatten(1).any(dim=1)
            t.mask = mask | t.fallback[:, None, None]
            return t
        region = self._region.to(logits.device)
        if region.ndim == 2:
            region = region[None].expand(b, -1, -1)
        if region.shape[0] != b:
            raise TargetError(
                f"SegmentationTarget region has {region.shape[0]} masks for a batch of {b} images "
                "(explain's batch_size chunking does not split per-image regions)"
            )
        hr, wr = region.shape[-2:]
        if (hr, wr) != (h, w):
            fits = any(-(-hr // f) == h and -(-wr // f) == w for f in range(2, max(hr, wr) + 1))
            if not fits:
                raise TargetError(
                    f"SegmentationTarget region of size {hr}x{wr} matches neither the logits' {h}x{w} grid nor an "
                    f"input size that the model maps to it"
                )
            t.upsample_to = (hr, wr)
        t.mask = region
        t.fallback = torch.zeros(b, dtype=torch.bool, device=logits.device)
        return t

    def score(self, logits: Tensor) -> Tensor:
        classes, mask = _resolved(self.classes, self), _resolved(self.mask, self)
        z = logits[torch.arange(logits.shape[0], device=logits.device), classes.to(logits.device)]  # (B, h, w)
        if self.upsample_to is not None:
            z = F.interpolate(z[:, None], size=self.upsample_to, mode="bilinear", align_corners=False)[:, 0]
        if z.shape[-2:] != mask.shape[-2:]:
            raise TargetError(
                f"SegmentationTarget was resolved for {tuple(mask.shape[-2:])} logits, got {tuple(z.shape[-2:])}"
            )
        return (z * mask.to(device=z.device, dtype=z.dtype)).sum(dim=(1, 2))

    def select(self, index: Tensor | slice) -> "SegmentationTarget":
        t = type(self).__new__(type(self))
        t.__dict__.update(self.__dict__)
        t.classes = _resolved(self.classes, self)[index]
        t.mask = _resolved(self.mask, self)[index]
        t.fallback = _resolved(self.fallback, self)[index]
        t._spec = t.classes
        t._region = t.mask if self._region is not None else None
        return t

    def describe(self) -> dict:
        spec = self._spec.tolist() if isinstance(self._spec, Tensor) else self._spec
        if self._region is None:
            region = "predicted as the class (all pixels if none)"
        else:
            region = f"given mask {list(self._region.shape)}"
        out = {"kind": "SegmentationTarget", "classes": spec, "region": region}
        if self.fallback is not None:
            out["fallback_to_all_pixels"] = self.fallback.tolist()
        return out


TargetSpec = Union[Target, ClassSpec, str]


def make_target(spec: TargetSpec) -> Target:
    """Turn what a user passed as ``target=`` into a :class:`Target`.

    ``None`` or ``"predicted"`` → :class:`ClassLogit` of the predicted class; an int, a sequence of ints or an
    integer tensor → :class:`ClassLogit` of those classes; a :class:`Target` → itself.
    """
    if isinstance(spec, Target):
        return spec
    if spec is None or (isinstance(spec, str) and spec == "predicted"):
        return ClassLogit(None)
    if isinstance(spec, str):
        try:
            return ClassLogit(int(spec))
        except ValueError:
            raise TargetError(
                f"unknown target {spec!r}: use None/'predicted', a class index, a list of indices or a Target object "
                f"(a text prompt for a vision-language model: vitlens.TextPrompt({spec!r}))"
            ) from None
    if isinstance(spec, float):
        raise TargetError(f"a class index must be an int, got the float {spec}")
    if isinstance(spec, Tensor) and spec.device.type == "meta":
        raise TargetError("the target is a tensor on the 'meta' device (a shape, no values): pass the class indices "
                          "on the CPU or the model's device")
    return ClassLogit(spec)


def class_score(logits: Tensor, classes: Tensor, kind: str) -> Tensor:
    """Score ``(B,)`` of class ``classes[i]`` in each row of classifier logits ``(B, K)``, as float32.

    ``kind``: ``"logit"``; ``"probability"`` (softmax over the classes); ``"accuracy"`` (1.0 where the argmax — the
    lowest index on ties — is the class, else 0.0). The one place the perturbation metrics and the perturbation
    methods turn logits into a class score.
    """
    logits = logits.float()
    if kind == "logit":
        return logits.gather(1, classes[:, None])[:, 0]
    if kind == "probability":
        return torch.softmax(logits, dim=1).gather(1, classes[:, None])[:, 0]
    if kind == "accuracy":
        return (logits.argmax(dim=1) == classes).float()
    raise TargetError(f"unknown class score {kind!r}; expected one of {', '.join(CLASS_SCORES)}")
