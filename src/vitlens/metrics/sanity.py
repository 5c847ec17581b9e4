"""Model-parameter randomisation sanity check (Adebayo et al., "Sanity Checks for Saliency Maps", NeurIPS 2018).

A faithful explanation depends on the model's parameters: when they are replaced by random ones, the map must change.
The *cascading* variant re-initialises the model from the top down — first the classifier head, then the transformer
blocks from the last to the first, each stage keeping the earlier ones randomised — and compares the map of every
stage with the map of the trained model.

Models whose adapter has no transformer blocks (timm CNNs such as EfficientNet, ConvNeXt, MobileNetV3) are walked
through their own stage container (``blocks``/``stages``/``layers``/``features``), in execution order traced with
hooks during the forward pass that resolves the targets: the head, then every parameterised layer that runs after
the last stage (e.g. EfficientNet's ``conv_head`` + ``bn2``) as one stage, then the stages from the last to the first,
then every parameterised layer that runs before the first stage (the stem) as the last stage. Skipping the layers
above the last stage would leave a trained layer on top of randomised ones: on EfficientNet-Lite0 the trained
``conv_head`` + ``bn2`` (BatchNorm + ReLU6) then output zeros everywhere for every photo and every gradient map
vanishes from the first block stage on.

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
import itertools
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


def _owns_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False))


def _traced_cascade(model: nn.Module, adapter: Any, x: Tensor, container: tuple[str, list[nn.Module]],
                    heads: list[nn.Module]) -> tuple[Tensor, list[tuple[str, list[nn.Module]]]]:
    """Logits of ``x`` and the cascade below the head of a model walked through its stage container.

    The order comes from the forward pass itself (pre-hooks on the model's children and on the container's stages,
    removed before returning): parameterised children that run after the last stage form one stage (named by their
    module names joined with ``+``), then the stages from the last to the first, then the parameterised children that
    run before the first stage. Head modules (and their parameters) are left out; so are children that never run and
    parameters registered on the model itself.

    Raises:
        UnsupportedModelError: a parameterised child runs between two stages (no top-down order exists).
    """
    cname, stages = container
    names = {id(m): n for n, m in model.named_modules()}
    in_head = {id(m) for h in heads for m in h.modules()}
    units: dict[str, list[nn.Module]] = {}  # child name -> its modules to re-initialise, heads excluded
    for name, child in model.named_children():
        if name == cname or id(child) in in_head:
            continue
        inner = list(child.modules())
        if not any(id(m) in in_head for m in inner):
            mods = [child] if any(True for _ in child.parameters()) else []
        else:  # e.g. ConvNeXt's `head` holds the classifier and a norm: keep only the norm
            mods = [m for m in inner if id(m) not in in_head and _owns_parameters(m)]
        if mods:
            units[name] = mods
    first: dict[str, int] = {}  # child name -> time of its first call
    stage_calls: list[int] = []
    clock = itertools.count()

    def unit_hook(name: str) -> Any:
        def hook(module: nn.Module, args: tuple) -> None:
            if name not in first:
                first[name] = next(clock)
        return hook

    def stage_hook(module: nn.Module, args: tuple) -> None:
        stage_calls.append(next(clock))

    handles = [model.get_submodule(name).register_forward_pre_hook(unit_hook(name)) for name in units]
    handles += [stage.register_forward_pre_hook(stage_hook) for stage in stages]
    try:
        with torch.no_grad():
            logits = adapter.forward(x)
    finally:
        for handle in handles:
            handle.remove()
    if not stage_calls:
        raise UnsupportedModelError(f"{type(model).__name__}: the stages in '{cname}' never ran in the forward pass")
    lo, hi = min(stage_calls), max(stage_calls)
    between = [n for n, t in first.items() if lo < t < hi]
    if between:
        raise UnsupportedModelError(
            f"{type(model).__name__}: {', '.join(between)} run(s) between the stages of '{cname}'; the cascade needs "
            "every other parameterised layer to run before or after all stages"
        )
    ran = sorted(first, key=first.__getitem__)
    above = [m for n in ran if first[n] > hi for m in units[n]]
    below = [m for n in ran if first[n] < lo for m in units[n]]
    cascade: list[tuple[str, list[nn.Module]]] = []
    if above:
        cascade.append(("+".join(names[id(m)] for m in above), above))
    cascade += [(f"{cname}.{i}", [stages[i]]) for i in reversed(range(len(stages)))]
    if below:
        cascade.append(("+".join(names[id(m)] for m in below), below))
    return logits, cascade


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
    """Cascading model-parameter randomisation (Adebayo et al. 2018) for a ViT (timm or HuggingFace) or a timm CNN.

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
        blocks ``i..L-1`` randomised); for a model walked through its stage container (see the module doc) the
        layers above the last stage come after the head and the stem comes last, named by their modules, e.g.
        EfficientNet's ``["head", "conv_head+bn2", "blocks.6", …, "blocks.0", "conv_stem+bn1"]``;
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
    except NotImplementedError:  # no transformer blocks (CNNs): the model's own stage container, traced
        blocks = []
    container = None if blocks else adapter.stage_container()
    if not blocks and container is None:
        raise UnsupportedModelError(
            f"{type(model).__name__}: no blocks or stages found (the cascade needs an adapter with blocks(), or a "
            "model with a 'blocks', 'stages', 'layers' or 'features' container, as timm models have)"
        )
    heads = adapter.classifier_modules()
    device = next(work.parameters()).device
    x = x.to(device=device, dtype=adapter.dtype())  # fp16/bf16 models take their dtype
    adapter.check_input(x)
    if blocks:
        with torch.no_grad():
            logits = adapter.forward(x)
        body = [(f"blocks.{i}", [blocks[i]]) for i in reversed(range(len(blocks)))]
    else:
        assert container is not None
        logits, body = _traced_cascade(work, adapter, x, container, heads)
    # fixed for every stage: select() turns a resolved target into one with explicit class indices
    target = make_target(targets).resolve(logits).select(slice(None))

    def maps_of() -> Tensor:
        return explain(work, x, method, target=target, **method_options).maps.detach()

    original = maps_of()
    stages = [("head", heads)] + body
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
        "targets": target.resolved_classes().detach().clone(),
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
