"""Model-parameter randomisation sanity check (Adebayo et al., "Sanity Checks for Saliency Maps", NeurIPS 2018).

A faithful explanation depends on the model's parameters: when they are replaced by random ones, the map must change.
The *cascading* variant re-initialises the model from the top down — first the classifier head, then the transformer
blocks from the last to the first, each stage keeping the earlier ones randomised — and compares the map of every
stage with the map of the trained model.

Protocol (see ``docs/data_and_segmentation.md``):

* Everything runs on a **deep copy** of the model (the user's model is never touched, not even its RNG-dependent
  state: the global RNG is forked).
* **Targets are fixed** on the trained model (``targets=None`` → its predicted classes; a :class:`Target` is
  resolved once) and kept for every stage, so each stage explains the same class.
* **Re-initialisation**: every sub-module of a stage that has ``reset_parameters()`` (``Linear``, ``LayerNorm``,
  ``Conv``, …) is reset with PyTorch's own initialiser; any other parameter (e.g. a LayerScale ``gamma``) is drawn
  from a truncated normal with std 0.02 (timm's ViT initialisation). Stage ``k`` uses seed ``seed + k``.
* **SSIM** (:func:`ssim`): both maps min-max normalised per image to ``[0, 1]``, Gaussian window ``σ = 1.5`` truncated
  at 3.5σ (11×11), ``K1 = 0.01``, ``K2 = 0.03``, data range 1, population (not sample) covariances, mean over the
  positions where the window fits inside the map (Wang et al. 2004; ``skimage.metrics.structural_similarity`` with
  ``gaussian_weights=True, sigma=1.5, use_sample_covariance=False, data_range=1``).
* **Spearman** (:func:`spearman`): rank correlation of the **absolute** values (as Adebayo et al. report; the sign of
  an attribution can flip under randomisation without its importance ranking changing), average ranks for ties.
  NaN when either map is constant (a rank correlation is undefined then).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import InputError, UnsupportedModelError
from ..targets import TargetSpec, make_target
from .segmentation import minmax_normalise

__all__ = ["randomisation_check", "reinitialise", "spearman", "ssim"]


# --------------------------------------------------------------------------------------------------------------------
# Similarities
# --------------------------------------------------------------------------------------------------------------------


def _check_pair(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    if not isinstance(a, Tensor) or not isinstance(b, Tensor):
        raise InputError("maps must be torch tensors (B, H, W)")
    if a.ndim != 3 or a.shape != b.shape:
        raise InputError(f"maps must be two (B, H, W) tensors of equal shape; got {tuple(a.shape)}, {tuple(b.shape)}")
    if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
        raise InputError("maps contain NaN or inf values")
    return a.double(), b.to(a.device).double()


def ssim(a: Tensor, b: Tensor, *, sigma: float = 1.5, truncate: float = 3.5, k1: float = 0.01, k2: float = 0.03,
         normalise: bool = True) -> Tensor:
    """Mean structural similarity of each pair of maps ``(B, H, W)`` → ``(B,)`` float64 in ``[-1, 1]``.

    Gaussian-weighted SSIM (Wang et al. 2004): window std ``sigma``, radius ``int(truncate * sigma + 0.5)``,
    constants ``(k1 * L)²`` and ``(k2 * L)²`` with data range ``L = 1``, population covariances; the SSIM image is
    averaged over the positions where the whole window lies inside the map (the rest is border). With ``normalise``
    (default) each map is min-max normalised to ``[0, 1]`` first (a constant map becomes 0); without, maps must
    already lie in ``[0, 1]``. Equal to ``skimage.metrics.structural_similarity(a, b, data_range=1,
    gaussian_weights=True, sigma=sigma, use_sample_covariance=False)``.
    """
    a, b = _check_pair(a, b)
    if sigma <= 0:
        raise InputError(f"sigma must be > 0, got {sigma}")
    r = int(truncate * sigma + 0.5)
    win = 2 * r + 1
    h, w = a.shape[-2:]
    if h < win or w < win:
        raise InputError(f"maps of {h}x{w} are smaller than the {win}x{win} SSIM window; lower sigma")
    if normalise:
        a, b = minmax_normalise(a), minmax_normalise(b)
    xs = torch.arange(-r, r + 1, dtype=torch.float64, device=a.device)
    g = torch.exp(-0.5 / sigma**2 * xs**2)
    g = g / g.sum()

    def blur(t: Tensor) -> Tensor:  # separable, 'valid' positions only
        t = F.conv2d(t[:, None], g.view(1, 1, -1, 1))
        return F.conv2d(t, g.view(1, 1, 1, -1))[:, 0]

    ux, uy = blur(a), blur(b)
    vx = blur(a * a) - ux * ux
    vy = blur(b * b) - uy * uy
    vxy = blur(a * b) - ux * uy
    c1, c2 = k1**2, k2**2
    s = ((2 * ux * uy + c1) * (2 * vxy + c2)) / ((ux**2 + uy**2 + c1) * (vx + vy + c2))
    return s.flatten(1).mean(1)


def _average_ranks(v: Tensor) -> Tensor:
    """Ranks (1-based) along dim 1 of ``(B, N)`` values, ties sharing their average rank (as scipy's ``rankdata``)."""
    b, n = v.shape
    srt, idx = torch.sort(v, dim=1, stable=True)
    new = torch.ones_like(srt, dtype=torch.bool)
    new[:, 1:] = srt[:, 1:] != srt[:, :-1]
    group = new.long().cumsum(1) - 1
    pos = torch.arange(1, n + 1, dtype=torch.float64, device=v.device).expand(b, n)
    total = torch.zeros(b, n, dtype=torch.float64, device=v.device).scatter_add_(1, group, pos)
    count = torch.zeros(b, n, dtype=torch.float64, device=v.device).scatter_add_(1, group, torch.ones_like(pos))
    avg = (total / count.clamp_min(1)).gather(1, group)
    return torch.empty_like(avg).scatter_(1, idx, avg)


def spearman(a: Tensor, b: Tensor, *, absolute: bool = True) -> Tensor:
    """Spearman rank correlation of each pair of maps ``(B, H, W)`` → ``(B,)`` float64.

    Pearson correlation of the average ranks of the pixel values — of their absolute values by default (see the
    module doc). NaN when either map is constant.
    """
    a, b = _check_pair(a, b)
    if absolute:
        a, b = a.abs(), b.abs()
    ra, rb = _average_ranks(a.flatten(1)), _average_ranks(b.flatten(1))
    ra = ra - ra.mean(1, keepdim=True)
    rb = rb - rb.mean(1, keepdim=True)
    den = torch.sqrt((ra * ra).sum(1) * (rb * rb).sum(1))
    rho = (ra * rb).sum(1) / den.clamp_min(1e-300)
    return torch.where(den > 0, rho.clamp(-1.0, 1.0), torch.full_like(rho, float("nan")))


# --------------------------------------------------------------------------------------------------------------------
# Cascading randomisation
# --------------------------------------------------------------------------------------------------------------------


def _classifier_modules(model: nn.Module) -> list[nn.Module]:
    """The classifier head(s): timm's ``get_classifier()`` (a tuple for distilled models), else HuggingFace's
    ``classifier`` / ``cls_classifier`` + ``distillation_classifier``."""
    getter = getattr(model, "get_classifier", None)
    if callable(getter):
        got = getter()
        heads = list(got) if isinstance(got, (tuple, list)) else [got]
    else:
        names = ("classifier", "cls_classifier", "distillation_classifier")
        heads = [getattr(model, n) for n in names if isinstance(getattr(model, n, None), nn.Module)]
    heads = [h for h in heads if isinstance(h, nn.Module) and any(True for _ in h.parameters())]
    if not heads:
        raise UnsupportedModelError(
            f"cannot find the classifier head of {type(model).__name__} (looked for get_classifier(), classifier)"
        )
    return heads


def _stage_modules(model: nn.Module) -> list[nn.Module]:
    """The stages of a model without an adapter: the children of its ``blocks``/``stages``/``layers``/``features``
    container (timm CNNs such as EfficientNet, ConvNeXt, ResNet-like ``layers``), input side first."""
    for name in ("blocks", "stages", "layers", "features"):
        container = getattr(model, name, None)
        if isinstance(container, (nn.Sequential, nn.ModuleList)) and len(container) > 0:
            return list(container)
    return []


def reinitialise(modules: list[nn.Module], seed: int) -> None:
    """Re-initialise the parameters of ``modules`` in place (rule in the module doc), reproducibly from ``seed``,
    without changing the caller's global RNG state."""
    devices = sorted({p.device.index or 0 for m in modules for p in m.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        torch.manual_seed(seed)
        covered: set[int] = set()
        for mod in modules:
            for m in mod.modules():
                reset = getattr(m, "reset_parameters", None)
                if callable(reset) and any(True for _ in m.parameters(recurse=False)):
                    reset()
                    covered |= {id(p) for p in m.parameters(recurse=False)}
        for mod in modules:
            for p in mod.parameters():
                if id(p) not in covered:
                    nn.init.trunc_normal_(p, std=0.02)
                    covered.add(id(p))


def randomisation_check(model: nn.Module, x: Tensor, method: str = "gradskip", targets: TargetSpec = None,
                        seed: int = 0, **method_options: Any) -> dict[str, Any]:
    """Cascading model-parameter randomisation (Adebayo et al. 2018) for a ViT (timm or HuggingFace).

    Args:
        model: the trained model; it is deep-copied and never modified.
        x: ``(B, 3, H, W)`` preprocessed batch (maps are compared at input size, which must be at least 11×11).
        method: a registered method name (``vitlens.methods()``) or an Explainer instance.
        targets: what to explain (as ``vitlens.explain``'s ``target``); resolved once on the trained model and kept
            fixed for every stage (``None``: the trained model's predicted classes).
        seed: stage ``k`` (0 = head) re-initialises with seed ``seed + k``.
        **method_options: passed to the method (e.g. ``alpha=0.5``).

    Returns:
        A dict with
        ``stages`` — ``["head", "blocks.{L-1}", …, "blocks.0"]`` (cumulative: stage ``blocks.i`` has the head and
        blocks ``i..L-1`` randomised);
        ``ssim``, ``spearman`` — ``(S, B)`` float64 similarity of each stage's map to the trained model's map;
        ``ssim_mean``, ``spearman_mean`` — ``(S,)`` means over images (NaN-skipping);
        ``original_maps`` ``(B, H, W)``, ``maps`` ``(S, B, H, W)``; ``targets`` ``(B,)`` long;
        ``protocol`` — the settings that define the numbers.
    """
    from ..api import explain
    from ..explainers.base import validate_batch
    from ..models import get_adapter

    if not isinstance(model, nn.Module):
        raise UnsupportedModelError(f"expected a torch.nn.Module, got {type(model).__name__}")
    x = validate_batch(x)
    h, w = x.shape[-2:]
    if min(h, w) < 11:
        raise InputError(f"input of {h}x{w} is smaller than the 11x11 SSIM window")
    work = copy.deepcopy(model).eval()
    adapter = get_adapter(work)
    try:
        blocks = list(adapter.blocks())
    except NotImplementedError:
        blocks = _stage_modules(work)
    if not blocks:
        raise UnsupportedModelError(
            f"{type(model).__name__}: no blocks or stages found (the cascade needs an adapter with blocks(), or a "
            "model with a 'blocks', 'stages', 'layers' or 'features' container, as timm models have)"
        )
    heads = _classifier_modules(work)
    device = next(work.parameters()).device
    x = x.to(device)
    adapter.check_input(x)
    with torch.no_grad():
        logits = adapter.forward(x)
    # fixed for every stage: select() turns a resolved target into one with explicit class indices
    target = make_target(targets).resolve(logits).select(slice(None))

    def maps_of() -> Tensor:
        return explain(work, x, method, target=target, **method_options).maps.detach()

    original = maps_of()
    stages = [("head", heads)] + [(f"blocks.{i}", [blocks[i]]) for i in reversed(range(len(blocks)))]
    names, all_maps, ssims, rhos = [], [], [], []
    for k, (name, modules) in enumerate(stages):
        reinitialise(modules, seed + k)
        m = maps_of()
        names.append(name)
        all_maps.append(m)
        ssims.append(ssim(original, m))
        rhos.append(spearman(original, m))
    s, r = torch.stack(ssims), torch.stack(rhos)
    return {
        "stages": names,
        "ssim": s,
        "spearman": r,
        "ssim_mean": torch.nanmean(s, dim=1),
        "spearman_mean": torch.nanmean(r, dim=1),
        "original_maps": original,
        "maps": torch.stack(all_maps),
        "targets": target.classes.detach().clone(),
        "protocol": {
            "check": "model-parameter randomisation, cascading from the top",
            "method": method if isinstance(method, str) else getattr(method, "name", repr(method)),
            "options": dict(method_options),
            "seed": int(seed),
            "targets": "fixed on the trained model",
            "reinit": "reset_parameters(); other parameters trunc_normal(std=0.02)",
            "ssim": {"normalise": "minmax", "sigma": 1.5, "truncate": 3.5, "k1": 0.01, "k2": 0.03, "data_range": 1.0},
            "spearman": {"absolute": True, "ties": "average"},
        },
    }
