"""The engine of the perturbation metrics (:mod:`.perturbation`): baselines, feature ranks, batched scoring of
perturbed inputs, validated inputs and settings. Package-internal; see :mod:`.perturbation` for the protocol.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import InputError, TargetError, VitlensError
from ..images import DataConfig, data_config
from ..models import Adapter, get_adapter
from ..models.base import int_pair
from ..targets import Target, class_score
from .base import Metric, MetricResult, check_maps

#: baseline kinds understood by every perturbation metric.
BASELINES = ("black", "mean", "blur", "noise")


class TargetRangeError(TargetError, InputError):
    """A target class outside the model's output (both a :class:`TargetError` and an :class:`InputError`)."""


# --------------------------------------------------------------------------------------------------------------------
# Baselines (pixel space, then normalised)
# --------------------------------------------------------------------------------------------------------------------


#: how the ``blur`` baseline extends the image past its border: ``replicate`` (the default) or ``reflect`` (the AHA
#: authors' evaluation code)
BLUR_PADDINGS = ("replicate", "reflect")


def gaussian_blur(images: Tensor, kernel: int, sigma: float, padding: str = "replicate") -> Tensor:
    """Separable Gaussian blur of ``(B, C, H, W)`` images: ``kernel`` taps (odd), ``sigma`` in pixels.

    Tap weights ``exp(-d² / 2σ²)`` for ``d = -(kernel//2) .. kernel//2``, normalised to sum 1; borders are extended
    by replicating the edge pixels (``padding="reflect"``: by reflecting them, the kernel then cropped to ``2·H − 1``
    taps on an image smaller than it, as reflection needs). Same shape, dtype and device out.
    """
    r = kernel // 2
    if padding == "reflect":
        r = min(r, images.shape[-2] - 1, images.shape[-1] - 1)
    d = torch.arange(-r, r + 1, dtype=torch.float64)
    w = torch.exp(-(d**2) / (2.0 * float(sigma) ** 2))
    w = (w / w.sum()).to(device=images.device, dtype=images.dtype)
    c = images.shape[1]
    out = F.pad(images, (r, r, r, r), mode=padding)
    out = F.conv2d(out, w.view(1, 1, 1, -1).expand(c, 1, 1, -1), groups=c)
    return F.conv2d(out, w.view(1, 1, -1, 1).expand(c, 1, -1, 1), groups=c)


def make_baseline(kind: str, x: Tensor, cfg: DataConfig, *, mean_color: Sequence[float] | None = None,
                  blur_kernel: int = 11, blur_sigma: float = 5.0, noise_seed: int = 0,
                  blur_padding: str = "replicate") -> Tensor:
    """The baseline ``(B, 3, H, W)`` for the normalised batch ``x``, in the model's input space.

    ``kind`` is one of :data:`BASELINES` (see the module doc for each). ``cfg`` gives the ``mean``/``std`` used to go
    to pixel space and back.
    """
    mean = torch.tensor(cfg.mean, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
    std = torch.tensor(cfg.std, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
    if kind == "black":
        pixels = torch.zeros_like(x)
    elif kind == "mean":
        colour = cfg.mean if mean_color is None else tuple(mean_color)
        pixels = torch.tensor(colour, dtype=x.dtype, device=x.device).view(1, 3, 1, 1).expand_as(x)
    elif kind == "blur":
        pixels = gaussian_blur(x * std + mean, blur_kernel, blur_sigma, blur_padding)
    elif kind == "noise":
        gen = torch.Generator().manual_seed(int(noise_seed))
        pixels = torch.rand((1, *x.shape[1:]), generator=gen, dtype=torch.float32).to(device=x.device, dtype=x.dtype)
        pixels = pixels.expand_as(x)
    else:  # validated in the constructors
        raise InputError(f"unknown baseline {kind!r}; expected one of {', '.join(BASELINES)}")
    return ((pixels - mean) / std).contiguous()


# --------------------------------------------------------------------------------------------------------------------
# Features and ranks
# --------------------------------------------------------------------------------------------------------------------


def feature_scores(maps: Tensor, size: tuple[int, int]) -> Tensor:
    """Mean of the maps ``(B, H, W)`` over ``size = (ph, pw)`` patches → ``(B, ceil(H/ph), ceil(W/pw))``.

    Patches tile the image from the top-left corner; a partial patch on the right/bottom edge averages the pixels it
    has. ``size = (1, 1)`` returns the maps unchanged.
    """
    ph, pw = size
    if (ph, pw) == (1, 1):
        return maps
    h, w = maps.shape[-2:]
    gh, gw = -(-h // ph), -(-w // pw)
    pad = (0, gw * pw - w, 0, gh * ph - h)
    total = F.pad(maps, pad).view(-1, gh, ph, gw, pw).sum(dim=(2, 4))
    ones = F.pad(torch.ones(1, h, w, dtype=maps.dtype, device=maps.device), pad)
    count = ones.view(1, gh, ph, gw, pw).sum(dim=(2, 4))
    return total / count


def feature_ranks(scores: Tensor, descending: bool = True) -> Tensor:
    """Rank of every feature, ``(B, F)`` long, 0 = first to be perturbed.

    Stable sort: equal scores keep their flat (raster) order, the lower index ranking first, in both directions.
    """
    order = torch.sort(scores, dim=1, descending=descending, stable=True).indices
    ranks = torch.empty_like(order)
    ranks.scatter_(1, order, torch.arange(order.shape[1], device=order.device).expand_as(order).contiguous())
    return ranks


def pixel_ranks(ranks: Tensor, grid: tuple[int, int], size: tuple[int, int], hw: tuple[int, int]) -> Tensor:
    """Feature ranks ``(B, gh*gw)`` → the rank of each pixel's feature, ``(B, H*W)`` int32."""
    gh, gw = grid
    ph, pw = size
    r = ranks.view(-1, gh, gw)
    if (ph, pw) != (1, 1):
        r = r.repeat_interleave(ph, dim=1).repeat_interleave(pw, dim=2)[:, : hw[0], : hw[1]]
    return r.reshape(r.shape[0], -1).to(torch.int32).contiguous()


# --------------------------------------------------------------------------------------------------------------------
# The engine
# --------------------------------------------------------------------------------------------------------------------


class Jobs:
    """Perturbed inputs to score, one row per input: pixels with ``lo <= rank[row] < hi`` come from source ``top``,
    the others from source ``rest``; the score is read for class ``target``."""

    def __init__(self) -> None:
        self.cols: dict[str, list[Tensor]] = {k: [] for k in ("row", "lo", "hi", "top", "rest", "target")}

    def add(self, **cols: Tensor) -> slice:
        n = self.count
        sizes = {int(v.numel()) for v in cols.values()}
        length = max(sizes)
        for k, v in cols.items():
            self.cols[k].append(v.reshape(-1).long().expand(length) if v.numel() == 1 else v.reshape(-1).long())
        return slice(n, n + length)

    @property
    def count(self) -> int:
        return sum(int(t.numel()) for t in self.cols["row"])

    def tensors(self) -> dict[str, Tensor]:
        return {k: torch.cat(v) for k, v in self.cols.items()}


def score_jobs(adapter: Adapter, sources: Tensor, pixel_ranks: Tensor, jobs: dict[str, Tensor], kind: str,
         batch_size: int, targets: Tensor) -> Tensor:
    """Scores ``(J,)`` of all jobs, at most ``batch_size`` images per forward.

    Consecutive jobs that share their ranks row and sources form a segment, built by one broadcast
    ``where(lo <= rank < hi, top, rest)`` straight into a reused input buffer (no per-job gather of the sources).
    The first forward's output size is used to check ``targets`` (all of them) before any score is read.
    """
    _, c, h, w = sources.shape
    n = jobs["row"].numel()
    keys = list(zip(jobs["row"].tolist(), jobs["top"].tolist(), jobs["rest"].tolist()))
    lo_all, hi_all = jobs["lo"].tolist(), jobs["hi"].tolist()
    lo_t = jobs["lo"].to(pixel_ranks.dtype)[:, None]
    hi_t = jobs["hi"].to(pixel_ranks.dtype)[:, None]
    out = torch.empty(n, dtype=torch.float32, device=sources.device)
    buf = torch.empty((min(batch_size, n), c, h, w), dtype=sources.dtype, device=sources.device)
    for start in range(0, n, batch_size):
        stop = min(n, start + batch_size)
        inputs = buf[: stop - start]
        i = start
        while i < stop:
            j = i + 1
            while j < stop and keys[j] == keys[i]:
                j += 1
            row, top, rest = keys[i]
            dst = inputs[i - start : j - start]
            if top == rest:
                dst.copy_(sources[top].expand_as(dst))
            else:
                rank = pixel_ranks[row][None]
                mask = rank < hi_t[i:j]
                if any(v != 0 for v in lo_all[i:j]):
                    mask &= rank >= lo_t[i:j]
                elif all(v == 0 for v in hi_all[i:j]):
                    dst.copy_(sources[rest].expand_as(dst))
                    i = j
                    continue
                torch.where(mask.view(-1, 1, h, w), sources[top], sources[rest], out=dst)
            i = j
        logits = adapter.forward(inputs.to(adapter.dtype()))  # fp16/bf16 models: the perturbation stays in x's dtype
        if logits.ndim != 2 or logits.shape[0] != inputs.shape[0]:
            raise InputError(f"the model must return logits (B, K); got shape {tuple(logits.shape)}")
        if start == 0:
            check_target_range(targets, int(logits.shape[1]))
        out[start:stop] = class_score(logits, jobs["target"][start:stop], kind)
    return out


def class_targets(targets: Any, b: int, device: torch.device, adapter: Adapter, x: Tensor) -> Tensor:
    """Class indices ``(B,)`` from ints (one, a sequence or a tensor) or a :class:`~vitlens.targets.Target`.

    A target object gives the class it explains per image (resolved on one forward of the clean batch when it is not
    resolved yet, e.g. ``ClassLogit(None)`` = the predicted classes); the metric's own score is then read for that
    class. Only classifier targets apply (the metrics score classes of ``(B, K)`` logits).
    """
    if isinstance(targets, Target):
        if targets.classes is None:
            with torch.no_grad(), adapter.session(capture=False):
                logits = adapter.forward(x)
            if logits.ndim != 2:
                raise TargetRangeError(f"the model must return logits (B, K); got shape {tuple(logits.shape)}")
            targets = targets.resolve(logits)
        if targets.classes is None or targets.classes.shape[0] != b:
            raise TargetRangeError(f"the target was resolved for a batch of {len(targets.classes)}, not {b} images")
        targets = targets.classes
    if isinstance(targets, bool):
        raise TargetRangeError("targets must be class indices (int), got a bool")
    try:
        t = torch.as_tensor(targets, device=device)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TargetRangeError(f"cannot read targets as class indices: {e}") from None
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TargetRangeError(f"targets must be integer class indices, got dtype {t.dtype}")
    t = t.reshape(-1).long()
    if t.numel() == 1 and b != 1:
        t = t.expand(b).clone()
    if t.numel() != b:
        raise TargetRangeError(f"{t.numel()} targets given for a batch of {b} images")
    if bool((t < 0).any()):
        raise TargetRangeError(f"target class {int(t[t < 0][0])} is negative")
    return t


def check_target_range(t: Tensor, k: int) -> None:
    bad = t >= k
    if bool(bad.any()):
        raise TargetRangeError(
            f"target class {int(t[bad][0])} is out of range for a model with {k} classes (valid: 0..{k - 1})"
        )


class SharedScores:
    """The target's logits on the inputs of one batch ``x`` that no map changes — the unperturbed images and the
    fully perturbed ones (every feature from a baseline: the end of a deletion curve, the start of an insertion
    curve) — computed once and reused by every metric and every method scored on the same batch (``vitlens bench``
    runs k methods × its metrics on each batch).

    Pass it as ``shared=`` to a perturbation metric. It holds one batch: a call with other images, another model or
    another dtype/device does not use it (it is checked, not assumed). The shared logits come from a forward of the
    whole source batch, so a metric's results with and without it differ by float rounding only (the batch
    composition of the model's matrix products).
    """

    def __init__(self, x: Tensor) -> None:
        self.x = x.detach()
        self._logits: dict[tuple[Any, ...], Tensor] = {}
        self.forwards = 0  # images run through the model for the shared logits (what a caller saved k−1 times)

    def fits(self, x: Tensor) -> bool:
        return (x.shape == self.x.shape and x.dtype == self.x.dtype and x.device == self.x.device
                and bool(torch.equal(x, self.x)))

    def logits(self, key: tuple[Any, ...], images: Tensor, adapter: Adapter, batch_size: int) -> Tensor:
        """Logits ``(B, K)`` of ``images`` (the source batch named by ``key``), computed on first use."""
        key = (id(adapter.model), *key)
        if key not in self._logits:
            parts = []
            for s in range(0, images.shape[0], batch_size):
                parts.append(adapter.forward(images[s:s + batch_size].to(adapter.dtype())))
            out = torch.cat(parts)
            if out.ndim != 2 or out.shape[0] != images.shape[0]:
                raise InputError(f"the model must return logits (B, K); got shape {tuple(out.shape)}")
            self._logits[key] = out
            self.forwards += int(images.shape[0])
        return self._logits[key]


def independent_sources(jobs: dict[str, Tensor], pixel_ranks: Tensor) -> Tensor:
    """For every job, the source it is entirely made of (``−1`` where the map decides): ``top == rest``, no pixel
    from ``top`` (``lo = hi = 0``), or every pixel from ``top`` (``lo = 0`` and ``hi`` above the row's largest rank)."""
    top, rest, lo, hi = jobs["top"], jobs["rest"], jobs["lo"], jobs["hi"]
    largest = pixel_ranks.amax(dim=1).long()[jobs["row"]]
    out = torch.full_like(top, -1)
    none = (lo == 0) & (hi == 0)
    full = (lo == 0) & (hi > largest)
    out = torch.where(full, top, out)
    out = torch.where(none, rest, out)
    return torch.where(top == rest, top, out)


class MetricInputs:
    """Validated inputs of one metric call (maps, x, targets, adapter, data config) on the maps' device."""

    def __init__(self, metric: PerturbationMetric, maps: Tensor, model: Any, x: Any, targets: Any,
                 shared: SharedScores | None = None) -> None:
        if not isinstance(x, Tensor) or x.ndim != 4 or x.shape[1] != 3:
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise InputError(f"x must be the normalised model input (B, 3, H, W); got {shape}")
        if not x.is_floating_point():
            raise InputError(f"x must be floating point (the normalised model input), got {x.dtype}")
        if x.shape[0] == 0:
            raise InputError("x is an empty batch")
        self.maps = check_maps(maps, batch=x.shape[0], size=(int(x.shape[-2]), int(x.shape[-1])))
        self.device = self.maps.device
        self.x = x.detach().to(self.device)
        if not bool(torch.isfinite(self.x).all()):
            raise InputError("x contains NaN or inf values")
        if not isinstance(model, nn.Module) and not isinstance(model, Adapter):
            raise InputError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.adapter = get_adapter(model)
        self.adapter.check_input(self.x)
        self.targets = class_targets(targets, x.shape[0], self.device, self.adapter, self.x)
        if shared is not None and not isinstance(shared, SharedScores):
            raise InputError(f"shared must be a vitlens SharedScores, got {type(shared).__name__}")
        self.shared = shared if shared is not None and shared.fits(self.x) else None
        self.source_keys: list[tuple[Any, ...]] = []
        cfg_setting = metric.settings.get("data_config")
        try:
            self.cfg = self.adapter.data_config() if cfg_setting is None else data_config(cfg_setting)
        except VitlensError:
            raise InputError(
                f"metric '{metric.name}' needs the model's pixel mean/std for its baselines and cannot derive them "
                f"from {type(self.adapter.model).__name__}; pass data_config={{'mean': ..., 'std': ...}} to the "
                "metric or set model.vitlens_data_config"
            ) from None

    def feature_size(self, granularity: str | int | Sequence[int]) -> tuple[int, int]:
        if granularity == "pixel":
            return (1, 1)
        if granularity == "patch":
            ps = self.adapter.patch_size
            if ps is None:
                raise InputError(
                    f"granularity 'patch' needs the model's patch size, but {type(self.adapter.model).__name__} "
                    "has none; give the patch size in pixels instead (e.g. granularity=16)"
                )
            return int_pair(ps)
        if isinstance(granularity, int):
            return (granularity, granularity)
        return (int(granularity[0]), int(granularity[1]))

    def features(self, granularity: str | int | Sequence[int]
                 ) -> tuple[Tensor, tuple[int, int], tuple[int, int], tuple[int, int]]:
        """The maps' feature scores ``(B, F)`` at ``granularity``, the feature grid, the feature size in pixels and
        the image size."""
        size = self.feature_size(granularity)
        scores = feature_scores(self.maps, size)
        grid = (scores.shape[-2], scores.shape[-1])
        return scores.reshape(self.x.shape[0], -1), grid, size, (self.x.shape[-2], self.x.shape[-1])

    @property
    def batch(self) -> int:
        """The number of images ``B``."""
        return int(self.x.shape[0])

    def sources(self, kinds: Sequence[str], settings: Mapping[str, Any]) -> Tensor:
        """The perturbation sources: the images, then one baseline batch per entry of ``kinds`` (``(B·(1 + len(kinds)),
        C, H, W)``; source ``i + k·B`` is image ``i``'s ``k``-th baseline)."""
        names = ("mean_color", "blur_kernel", "blur_sigma", "noise_seed", "blur_padding")
        self.source_keys = [("image",)] + [("baseline", kind, tuple(self.cfg.mean), tuple(self.cfg.std),
                                            *(repr(settings.get(n)) for n in names)) for kind in kinds]
        return torch.cat([self.x] + [self.baseline(kind, settings) for kind in kinds])

    def baseline(self, kind: str, settings: Mapping[str, Any]) -> Tensor:
        return make_baseline(kind, self.x, self.cfg, mean_color=settings.get("mean_color"),
                             blur_kernel=settings.get("blur_kernel", 11), blur_sigma=settings.get("blur_sigma", 5.0),
                             noise_seed=settings.get("noise_seed", 0),
                             blur_padding=settings.get("blur_padding", "replicate"))

    def jobs_with_originals(self) -> tuple[Jobs, slice, Tensor]:
        """A :class:`Jobs` whose first ``B`` rows score each image unperturbed (source ``i`` = image ``i``), those
        rows, and the image indices ``arange(B)``."""
        img = torch.arange(self.x.shape[0], device=self.device)
        zero = torch.zeros(1, device=self.device)
        jobs = Jobs()
        return jobs, jobs.add(row=img, lo=zero, hi=zero, top=img, rest=img, target=self.targets), img

    def score(self, sources: Tensor, ranks: Tensor, jobs: Jobs, kind: str, batch_size: int) -> Tensor:
        """:func:`score_jobs` of every job, without gradient, inside an adapter session (model state restored).

        With :class:`SharedScores` (``shared=``) the jobs that no map changes are read from the shared logits of
        their source batch instead of being run again; only the others go through the model."""
        cols = jobs.tensors()
        with torch.no_grad(), self.adapter.session(capture=False):
            if self.shared is None or len(self.source_keys) * self.batch != sources.shape[0]:
                return score_jobs(self.adapter, sources, ranks, cols, kind, batch_size, self.targets)
            whole = independent_sources(cols, ranks)
            fixed = whole >= 0
            out = torch.empty(whole.shape[0], dtype=torch.float32, device=sources.device)
            rows = []
            for block in sorted(set((whole[fixed] // self.batch).tolist())):
                imgs = sources[block * self.batch:(block + 1) * self.batch]
                logits = self.shared.logits(self.source_keys[block], imgs, self.adapter, batch_size)
                check_target_range(self.targets, int(logits.shape[1]))
                rows.append((block, logits))
            for block, logits in rows:
                sel = fixed & (whole // self.batch == block)
                out[sel] = class_score(logits[whole[sel] % self.batch], cols["target"][sel], kind)
            rest = ~fixed
            if bool(rest.any()):
                out[rest] = score_jobs(self.adapter, sources, ranks, {k: v[rest] for k, v in cols.items()}, kind,
                                       batch_size, self.targets)
            return out


# --------------------------------------------------------------------------------------------------------------------
# Settings validation
# --------------------------------------------------------------------------------------------------------------------


def choice(name: str, value: Any, options: Sequence[str]) -> str:
    if value not in options:
        raise InputError(f"{name} must be one of {', '.join(repr(o) for o in options)}; got {value!r}")
    return str(value)


def granularity_setting(value: Any) -> str | int | list[int]:
    if value in ("pixel", "patch"):
        return str(value)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return int(value)
    if isinstance(value, (tuple, list)) and len(value) == 2 and all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value):
        return [int(value[0]), int(value[1])]
    raise InputError(f"granularity must be 'pixel', 'patch' (the model's patch size) or a patch size in pixels "
                     f"(int >= 1 or (h, w)); got {value!r}")


def positive_int(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InputError(f"{name} must be an integer >= {minimum}; got {value!r}")
    return int(value)


def baseline_settings(mean_color: Any, blur_kernel: Any, blur_sigma: Any, noise_seed: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if mean_color is not None:
        try:
            colour = [float(v) for v in mean_color]
        except (TypeError, ValueError):
            colour = []
        if len(colour) != 3 or not all(math.isfinite(v) for v in colour):
            raise InputError(f"mean_color must be 3 finite pixel values in [0, 1] (RGB); got {mean_color!r}")
        out["mean_color"] = colour
    else:
        out["mean_color"] = None
    blur_kernel = positive_int("blur_kernel", blur_kernel)
    if blur_kernel % 2 == 0:
        raise InputError(f"blur_kernel must be odd; got {blur_kernel}")
    out["blur_kernel"] = blur_kernel
    try:
        sigma = float(blur_sigma)
    except (TypeError, ValueError):
        sigma = float("nan")
    if not (math.isfinite(sigma) and sigma > 0):
        raise InputError(f"blur_sigma must be a number > 0; got {blur_sigma!r}")
    out["blur_sigma"] = sigma
    if isinstance(noise_seed, bool) or not isinstance(noise_seed, int):
        raise InputError(f"noise_seed must be an int; got {noise_seed!r}")
    out["noise_seed"] = int(noise_seed)
    return out


def config_setting(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if isinstance(value, DataConfig):
        return value.to_dict()
    return data_config(value).to_dict()


class PerturbationMetric(Metric):
    """Shared parts: ``batch_size`` (a cost knob, kept out of the protocol), the baseline settings and data config
    (validated, after the metric's own settings in the protocol) and the resolved protocol."""

    needs = frozenset({"model", "x", "targets"})
    #: accepts ``shared=`` (:class:`SharedScores`): the scores of the inputs no map changes, shared across calls
    shares_scores = True

    def __init__(self, batch_size: int, settings: dict[str, Any], baseline: tuple[Any, Any, Any, Any],
                 data_config: Any) -> None:
        """``baseline``: ``(mean_color, blur_kernel, blur_sigma, noise_seed)`` as given to the metric."""
        settings.update(baseline_settings(*baseline))
        settings["data_config"] = config_setting(data_config)
        super().__init__(**settings)
        self.batch_size = positive_int("batch_size", batch_size)

    def _result(self, values: dict[str, Tensor], resolved: dict[str, Any], **extra: Any) -> MetricResult:
        protocol = {**self.protocol(), **resolved}
        return MetricResult(self.name, values, {k: self.outputs[k] for k in values}, protocol, **extra)

    @staticmethod
    def _resolved(inp: MetricInputs, size: tuple[int, int], num_features: int) -> dict[str, Any]:
        return {"feature_size": list(size), "num_features": num_features, "image_size": list(inp.x.shape[-2:]),
                "data_mean": list(inp.cfg.mean), "data_std": list(inp.cfg.std)}


def trapezoid(curves: Tensor, xs: Tensor) -> Tensor:
    return torch.trapezoid(curves, xs.to(curves), dim=1)
