"""MDA: metric-driven attribution (Walker, Jha & Ewetz, ICLR 2025).

The attribution is built from the metrics that judge it: regions are ordered by greedy searches that optimise the
insertion and then the deletion curve, and each region gets its marginal effect on the smoothed deletion curve.
As implemented (choices the paper and reference code leave open are listed in
``docs/methods/perturbation_methods.md``):

1. Regions: SLIC superpixels of the image (``n_regions``, default the model's token count; ``compactness`` 10000
   as in the reference code, which makes them nearly square patches).
2. Reference ordering: the mean ``|map|`` per region of a cheap reference method (default ``inputxgradient``; the
   reference code uses a bidirectional-attention map, not in this package).
3. Insertion search: from a blurred image (Gaussian, kernel 31 / σ 31 grown by 4 until the target probability is
   ≤ 1 %), repeatedly try inserting each of the ``window`` best-ranked regions not yet inserted
   (``window = min(2·⌊√R⌋, 28)``) and keep the one with the highest response, until the normalised response
   reaches ``cutoff`` (0.9). These regions, in that order, are the most important ones.
4. Deletion search: from the ``fill`` image (0 in the model's input space), build the *worst* insertion order of the
   other regions — repeatedly insert the candidate (``window`` lowest-ranked remaining) with the lowest response —
   and finish with the step-3 regions in reverse. Reversed, this is the deletion order (most important first) and its
   response curve.
5. The deletion curve is normalised (``(p − p_fill)/|p(x) − p_fill|``, clipped to [0, 1], made non-increasing) and
   smoothed: the closest convex curve with the same end points (least squares). Region ``k`` of the deletion order
   gets ``Δ_k = y[k−1] − y[k]``, spread evenly over its pixels (so a region's pixels sum to its marginal gain).

Cost: 1 + (blur trials) + 1 + Σ candidates tried in both searches + (step-3 regions − 1) forwards, plus the
reference method's cost; data-dependent, so :meth:`MDA.declared_cost` reports the last call's mean per image.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import InputError, VitlensError
from ..models import Adapter
from ..targets import Target
from ..options import choice, custom, integer, number
from ._perturbation import SCORE_KINDS, resolve, score_needs, target_scores
from .base import Attribution, Explainer, Explanation, image_size
from .registry import get_method, methods, register

__all__ = ["MDA", "slic_regions", "gaussian_blur", "convex_fit", "search_window"]


def slic_regions(image: Tensor, n_regions: int, compactness: float) -> Tensor:
    """SLIC superpixels of ``image`` ``(C, H, W)`` (min–max scaled to [0, 1] first): labels ``(H, W)`` long,
    consecutive from 0."""
    try:
        from skimage.segmentation import slic
    except ImportError:  # pragma: no cover - scikit-image is an optional dependency
        raise VitlensError("method 'mda' needs scikit-image: pip install scikit-image") from None
    img = image.detach().float().cpu()
    lo, hi = img.min(), img.max()
    img = ((img - lo) / (hi - lo)) if hi > lo else torch.zeros_like(img)
    labels = slic(img.permute(1, 2, 0).numpy().astype(np.float64), n_segments=int(n_regions),
                  compactness=float(compactness), start_label=0, channel_axis=-1)
    _, inverse = np.unique(labels, return_inverse=True)
    return torch.as_tensor(inverse.reshape(labels.shape), dtype=torch.long)


def gaussian_blur(x: Tensor, size: int, sigma: float) -> Tensor:
    """Per-channel Gaussian blur of ``x`` ``(B, C, H, W)`` with a normalised ``size``-tap kernel and zero padding
    (as the reference's ``conv2d(x, kernel, padding=size // 2)``)."""
    t = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    k1 = torch.exp(-0.5 * (t / sigma) ** 2)
    k1 = (k1 / k1.sum()).to(x.dtype).to(x.device)
    c = x.shape[1]
    pad = size // 2
    y = F.conv2d(x, k1.reshape(1, 1, 1, -1).expand(c, 1, 1, size), padding=(0, pad), groups=c)
    y = F.conv2d(y, k1.reshape(1, 1, -1, 1).expand(c, 1, size, 1), padding=(pad, 0), groups=c)
    return y[..., : x.shape[-2], : x.shape[-1]]


def convex_fit(curve: np.ndarray) -> np.ndarray:
    """The convex curve closest to ``curve`` (least squares) with the same two end points, clipped to [0, 1].

    Convex curves with fixed ends are ``y_i = a_i + Σ_j c_j φ_j(i)`` with ``c_j ≥ 0`` (hinges at every interior
    point, made zero at both ends), so the fit is one non-negative least-squares problem. The reference code solves
    the same objective with the bounds ``0 ≤ y ≤ 1`` as constraints (cvxopt); clipping afterwards keeps the curve
    convex and equals that solution whenever the bounds are inactive.
    """
    from scipy.optimize import nnls

    r = np.asarray(curve, dtype=np.float64)
    n = r.shape[0]
    if n <= 2:
        return np.clip(r, 0.0, 1.0)
    i = np.arange(n, dtype=np.float64)[:, None]
    j = np.arange(1, n - 1, dtype=np.float64)[None]
    base = r[0] + i[:, 0] * (r[-1] - r[0]) / (n - 1)
    phi = np.maximum(0.0, i - j) - i * (n - 1 - j) / (n - 1)
    coef, _ = nnls(phi, r - base, maxiter=50 * n)
    return np.clip(base + phi @ coef, 0.0, 1.0)


def search_window(n_regions: int) -> int:
    """Candidates tried per greedy step in the reference code: ``min(2·⌊√R⌋, 28)``."""
    return max(1, min(2 * int(math.isqrt(n_regions)), 28))


def _reference_ok(value: Any) -> bool:
    """``'none'`` (index order) or the name of a registered method other than MDA itself."""
    return value == "none" or (isinstance(value, str) and value != "mda" and value in methods())


@register
class MDA(Explainer):
    """Metric-driven attribution ``(B, H, W)``: greedy insertion/deletion orderings of SLIC regions, each region
    valued by its marginal drop on the smoothed deletion curve.

    Options:
        n_regions: SLIC segments requested (default: the model's token count; 196 for models without tokens).
        compactness: SLIC compactness (reference: 10000). reference: method whose map ranks the candidates
            (a registered method name, or ``"none"`` for index order). window: candidates per greedy step
            (default ``min(2·⌊√R⌋, 28)``). cutoff: normalised insertion response that ends the insertion search.
        blur_size, blur_sigma, blur_step, blur_max_size, blur_max_prob: the insertion start image: blur grown by
            ``blur_step`` until the target score is ``≤ blur_max_prob`` or the kernel exceeds ``blur_max_size``.
        fill: deletion start value in the model's input space. score: ``"probability"`` (paper) or ``"target"``.
        batch_size: most images in one forward call.
    """

    name = "mda"
    value_kind = "nonnegative"
    description = "greedy insertion/deletion orderings of superpixels"
    display_name = "MDA"
    level = "pixel"
    defaults: dict[str, Any] = {
        "n_regions": None,
        "compactness": 10000.0,
        "reference": "inputxgradient",
        "window": None,
        "cutoff": 0.9,
        "blur_size": 31,
        "blur_sigma": 31.0,
        "blur_step": 4,
        "blur_max_size": 101,
        "blur_max_prob": 0.01,
        "fill": 0.0,
        "score": "probability",
        "batch_size": 64,
    }
    option_specs = {
        "n_regions": custom(lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 2,
                            "an integer >= 2 (SLIC segments, at most the image's pixels)", none=True,
                            invalid=[1, 0, -3, 2.5, "9", True], valid=[2, 196]),
        "compactness": number(0, low_open=True),
        "reference": custom(_reference_ok, "'none' or a registered method other than 'mda' (vitlens methods)",
                            invalid=["mda", "no-such-method", 3, ""], valid=["none", "inputxgradient", "random"]),
        "window": integer(1, none=True),
        "cutoff": number(0, 1, low_open=True),
        "blur_size": integer(1),
        "blur_sigma": number(0, low_open=True),
        "blur_step": integer(1),
        "blur_max_size": integer(1),
        "blur_max_prob": number(),  # a target score when score='target'
        "fill": number(),
        "score": choice(*SCORE_KINDS),
        "batch_size": integer(1),
    }
    fast_options: dict[str, Any] = {"n_regions": 9, "blur_size": 5, "blur_sigma": 2.0, "blur_max_size": 9}

    def required(self) -> tuple[str | tuple[str, ...], ...]:
        """``score='probability'`` (a softmax over classes) also needs class logits."""
        return self.needs + score_needs(self.options["score"])

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._forwards: list[int] = []
        self._reference_cost = {"forward": 0.0, "backward": 0.0}

    def check_input_options(self, shape: tuple[int, ...]) -> None:
        """Also: SLIC cannot make more segments than the image has pixels."""
        super().check_input_options(shape)
        n, (h, w) = self.options["n_regions"], (int(shape[-2]), int(shape[-1]))
        if n is not None and n > h * w:
            raise InputError(f"option n_regions={n} of method 'mda' does not fit the {h}x{w} input: at most "
                             f"{h * w} segments (one per pixel)")

    def explain(self, *args: Any, **kwargs: Any) -> Explanation:
        self._forwards = []
        return super().explain(*args, **kwargs)

    __call__ = explain

    def declared_cost(self) -> dict[str, float]:
        """Forwards per image of the last call (mean over its images; NaN before the first call) plus the
        reference method's declared cost."""
        own = sum(self._forwards) / len(self._forwards) if self._forwards else float("nan")
        ref = self._reference_cost
        return {"forward": own + float(ref["forward"]), "backward": float(ref["backward"]), "search_forwards": own}

    # -- one chunk ------------------------------------------------------------------------------------------------
    def attribute(self, adapter: Adapter, x: Tensor, target: Target) -> tuple[Attribution, Tensor, Target]:
        o = self.options
        with adapter.session(capture=False), torch.no_grad():
            logits = torch.cat([adapter.forward(xi[None]) for xi in x])  # one by one: batch-independent numerics
        tgt = resolve(target, logits)
        rankings = [self._reference_map(adapter, x[i:i + 1], tgt.select(slice(i, i + 1)))[0] for i in range(len(x))]
        maps, forwards, blur_sizes = [], [], []
        n_default = 196
        if "tokens" in adapter.capabilities:
            gh, gw = adapter.grid(image_size(x))
            n_default = gh * gw
        with adapter.session(capture=False), torch.no_grad():
            for i, xi in enumerate(x):
                regions = slic_regions(xi, o["n_regions"] or n_default, float(o["compactness"])).to(xi.device)
                m, n_fwd, size = self._attribute_one(adapter, xi, logits[i:i + 1], regions, rankings[i], tgt, i)
                maps.append(m)
                forwards.append(1 + n_fwd)
                blur_sizes.append(size)
        self._forwards.extend(forwards)
        extras = {"search_forwards": torch.tensor(forwards, dtype=torch.long),
                  "blur_size": torch.tensor(blur_sizes, dtype=torch.long)}
        return Attribution(values=torch.stack(maps), extras=extras), logits, tgt

    def _reference_map(self, adapter: Adapter, x: Tensor, tgt: Target) -> Tensor:
        name = self.options["reference"]
        if name == "none":
            self._reference_cost = {"forward": 0.0, "backward": 0.0}
            return torch.zeros(x.shape[0], *x.shape[-2:], device=x.device)
        method = get_method(name)
        exp = method.explain(adapter, x, target=tgt)
        self._reference_cost = method.declared_cost()
        return exp.maps.to(x.device)

    def _scores(self, adapter: Adapter, images: Tensor, tgt: Target, index: int) -> Tensor:
        bs = int(self.options["batch_size"])
        return torch.cat([target_scores(adapter.forward(images[s:s + bs]), tgt, index, self.options["score"])
                          for s in range(0, images.shape[0], bs)])

    def _search(self, adapter: Adapter, start: Tensor, image: Tensor, regions: Tensor, ranking: list[int],
                highest: bool, window: int, tgt: Target, index: int, stop=None) -> tuple[list[int], list[float], int]:
        """Greedy insertion of ``image``'s regions into ``start``: at each step try the first ``window`` regions of
        ``ranking`` not yet inserted and keep the one with the highest (``highest``) or lowest response."""
        state = start.clone()
        remaining = list(ranking)
        order: list[int] = []
        responses: list[float] = []
        n_fwd = 0
        while remaining:
            cand = remaining[:window]
            masks = regions[None] == torch.tensor(cand, device=regions.device)[:, None, None]  # (k, H, W)
            trial = torch.where(masks[:, None], image[None], state[None])
            scores = self._scores(adapter, trial, tgt, index)
            n_fwd += len(cand)
            j = int(scores.argmax() if highest else scores.argmin())
            state = trial[j]
            order.append(cand[j])
            responses.append(float(scores[j]))
            remaining.remove(cand[j])
            if stop is not None and stop(responses[-1]):
                break
        return order, responses, n_fwd

    def _attribute_one(self, adapter: Adapter, image: Tensor, logits: Tensor, regions: Tensor, ref_map: Tensor,
                       tgt: Target, index: int) -> tuple[Tensor, int, int]:
        o = self.options
        n_regions = int(regions.max()) + 1
        window = int(o["window"] or search_window(n_regions))
        p_orig = float(target_scores(logits, tgt, index, o["score"])[0])
        # insertion start: blur grown until the target score is low enough (reference procedure)
        n_fwd = 0
        size, sigma = int(o["blur_size"]), float(o["blur_sigma"])
        while True:
            blurred = gaussian_blur(image[None], size, sigma)[0]
            p_blur = float(self._scores(adapter, blurred[None], tgt, index)[0])
            n_fwd += 1
            if p_blur <= float(o["blur_max_prob"]) or size > int(o["blur_max_size"]):
                break
            size, sigma = size + int(o["blur_step"]), sigma + float(o["blur_step"])
        black = torch.full_like(image, float(o["fill"]))
        p_black = float(self._scores(adapter, black[None], tgt, index)[0])
        n_fwd += 1
        # reference ranking: mean |map| per region, most important first (stable: ties in index order)
        counts = torch.bincount(regions.flatten(), minlength=n_regions).to(torch.float64)
        importance = torch.zeros(n_regions, dtype=torch.float64, device=regions.device)
        importance.index_add_(0, regions.flatten(), ref_map.abs().flatten().to(torch.float64))
        importance = importance / counts.clamp_min(1).to(importance.device)
        ranked = importance.cpu().argsort(descending=True, stable=True).tolist()
        cutoff = float(o["cutoff"])
        span_ins = max(abs(p_orig - p_blur), 1e-12)
        stop = None if cutoff >= 1.0 else (lambda r: (r - p_blur) / span_ins >= cutoff)
        prefix, _, n = self._search(adapter, blurred, image, regions, ranked, True, window, tgt, index, stop)
        n_fwd += n
        # deletion: worst insertion order of the other regions from the fill image, then the prefix reversed
        rest = [r for r in ranked[::-1] if r not in set(prefix)]
        worst, responses, n = self._search(adapter, black, image, regions, rest, False, window, tgt, index)
        n_fwd += n
        state = black.clone()
        for r in worst:
            state = torch.where(regions[None] == r, image, state)
        tail = prefix[::-1]
        if len(tail) > 1:
            cum, imgs = state, []
            for r in tail[:-1]:
                cum = torch.where(regions[None] == r, image, cum)
                imgs.append(cum)
            responses += self._scores(adapter, torch.stack(imgs), tgt, index).tolist()
            n_fwd += len(imgs)
        responses.append(p_orig)  # every region inserted = the image itself
        insertion = np.asarray([p_black] + responses)  # worst insertion curve, R + 1 points
        deletion = insertion[::-1]  # deletion curve of the order reversed(worst + tail)
        order = (worst + tail)[::-1]
        span = max(abs(p_orig - p_black), 1e-12)
        norm = np.minimum.accumulate(np.clip((deletion - p_black) / span, 0.0, 1.0))
        smooth = convex_fit(norm)
        gains = torch.as_tensor(smooth[:-1] - smooth[1:], dtype=torch.float32, device=image.device)  # (R,)
        per_region = torch.zeros(n_regions, dtype=torch.float32, device=image.device)
        per_region[torch.tensor(order, device=image.device)] = gains
        per_pixel = per_region / counts.to(image.device, torch.float32)
        return per_pixel[regions], n_fwd, size
