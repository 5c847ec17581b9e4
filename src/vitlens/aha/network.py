"""The AHA explainer network ``E(x, c) → S``: a frozen backbone and a small class-conditional DPT-style decoder.

* :class:`FeatureBackbone` — frozen features at ``n_levels`` (default 4) evenly spaced depths of any model: the
  blocks of a ViT (through the vitlens adapter: prefix tokens dropped, tokens laid out on the model's token grid) or
  the ``feature_info`` modules of a timm model (ConvNeXt, ResNet, …). By default the backbone is the target model
  itself: one forward gives the features *and* the logits, so no second model is needed. Not an ``nn.Module``: the
  backbone's weights are never part of the explainer's state.
* :class:`AHADecoder` — the only trained part (with the class embedding): per depth, every feature vector is
  concatenated with a learned class embedding and mixed by ``Linear(C + E → C) + GELU``; projected to ``width``
  channels (1×1 conv), resized (bilinear) to 4 scales (×4, ×2, ×1, ×½ of the token grid when all depths share one
  grid, their own resolutions otherwise) and refined by a 3×3 conv; fused top-down with residual conv units and
  bilinear upsampling; a small conv head gives one channel at input resolution. The last conv starts near zero.
* :class:`AHANet` — both together, plus :func:`save_explainer` / :func:`load_explainer` (safetensors + JSON).

Shapes: input ``x`` ``(B, C, H, W)`` normalised for the target model, ``classes`` ``(B,)`` long; output map logits
``(B, H, W)`` (any real values; only their order matters, see :mod:`vitlens.aha.sorter`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
from pathlib import Path
from typing import Any, Sequence, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import InputError, UnsupportedModelError, WeightsUnavailableError
from ..models import get_adapter
from ..models.base import Adapter, int_pair
from ..models.capabilities import TOKEN_SEQUENCE
from ..models.feature_maps import feature_modules

__all__ = [
    "AHADecoder",
    "AHANet",
    "FeatureBackbone",
    "build_explainer",
    "evenly_spaced",
    "load_explainer",
    "model_digest",
    "pool_maps",
    "SPREADS",
    "check_spread",
    "save_explainer",
]


def evenly_spaced(n_total: int, n_levels: int = 4) -> list[int]:
    """Indices of ``n_levels`` depths out of ``n_total``, ending at the last: ``⌊(k+1)·n/L + ½⌋ − 1``.

    12 blocks → [2, 5, 8, 11] (DPT's choice for ViT-B); 6 → [1, 2, 4, 5]; 3 → [0, 1, 1, 2].
    """
    if n_total < 1:
        raise ValueError("the backbone has no feature levels")
    return [max(0, min(n_total - 1, int(math.floor((k + 1) * n_total / n_levels + 0.5)) - 1)) for k in range(n_levels)]


def model_digest(model: nn.Module) -> str:
    """SHA-256 (first 16 hex digits) of a model's state dict (names, dtypes, shapes and float32 values)."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        if not isinstance(t, Tensor):
            continue
        h.update(name.encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


# --------------------------------------------------------------------------------------------------------------------
# Backbone
# --------------------------------------------------------------------------------------------------------------------


class FeatureBackbone:
    """Frozen multi-depth features of a model.

    Args:
        model: the backbone (the target model itself by default, see :class:`AHANet`).
        depths: indices of the levels to read (ViT blocks, or timm ``feature_info`` entries); default
            :func:`evenly_spaced` over all of them.
        n_levels: number of levels when ``depths`` is not given.

    ``__call__(x) → (features, logits)``: ``features`` is a list of ``(B, C_l, h_l, w_l)`` tensors (detached), the
    logits ``(B, K)`` are the model's output on ``x`` (the same forward pass). Runs without gradient.
    """

    def __init__(self, model: nn.Module, depths: Sequence[int] | None = None, n_levels: int = 4) -> None:
        self.model = model
        adapter = get_adapter(model)
        self.adapter = adapter
        # token blocks: any single-sequence family whose blocks vitlens reads (not Swin/SegFormer stages, not CaiT's
        # class-attention blocks); their outputs are (B, prefix + patches, D)
        self.tokens = adapter.provides(TOKEN_SEQUENCE)  # token blocks (B, prefix + patches, D) vitlens reads
        if self.tokens:
            self.modules: list[nn.Module] = list(adapter.blocks())
            self.module_names = [f"block {i}" for i in range(len(self.modules))]
            width = _vit_width(model)
            self.all_channels = [width] * len(self.modules)
        else:
            try:
                self.modules, self.module_names, self.all_channels = feature_modules(model)
            except UnsupportedModelError as e:
                raise UnsupportedModelError(
                    f"{e}; AHA reads vitlens token blocks or timm feature_info maps: pass a timm model or a supported "
                    "ViT as backbone (AHANet(target, backbone=...))") from None
        self.depths = list(depths) if depths is not None else evenly_spaced(len(self.modules), n_levels)
        bad = [d for d in self.depths if not 0 <= d < len(self.modules)]
        if bad:
            raise InputError(f"backbone depths {bad} out of range [0, {len(self.modules)})")
        self.channels = [self.all_channels[d] for d in self.depths]

    def _to_map(self, out: Any, k: int, hw: tuple[int, int]) -> Tensor:
        t = out[0] if isinstance(out, (tuple, list)) else out
        if self.tokens:
            gh, gw = self.adapter.grid(hw)
            p = self.adapter.feature_prefix_tokens()
            t = t[:, p:p + gh * gw]
            return t.reshape(t.shape[0], gh, gw, t.shape[-1]).permute(0, 3, 1, 2)
        c = self.channels[k]
        if t.ndim == 4 and t.shape[1] != c and t.shape[-1] == c:  # NHWC (Swin-style)
            t = t.permute(0, 3, 1, 2)
        if t.ndim != 4:
            raise UnsupportedModelError(
                f"AHA reads the target's features as (B, C, h, w) maps or vitlens token blocks; feature "
                f"{self.module_names[self.depths[k]]} of {type(self.model).__name__} has shape {tuple(t.shape)} "
                "(train the explainer with a separate backbone: AHANet(target, backbone=...))")
        return t

    def __call__(self, x: Tensor) -> tuple[list[Tensor], Tensor]:
        hw = (int(x.shape[-2]), int(x.shape[-1]))
        found: dict[int, Tensor] = {}
        handles = []
        wanted: dict[int, list[int]] = {}
        for k, d in enumerate(self.depths):
            wanted.setdefault(d, []).append(k)

        def hook_for(d: int):
            def hook(module: nn.Module, args: tuple, out: Any) -> None:
                for k in wanted[d]:
                    found[k] = self._to_map(out, k, hw).detach()
            return hook

        try:
            for d in wanted:
                handles.append(self.modules[d].register_forward_hook(hook_for(d)))
            with torch.no_grad():
                logits = self.adapter.forward(x)
        finally:
            for h in handles:
                h.remove()
        absent = [self.module_names[self.depths[k]] for k in range(len(self.depths)) if k not in found]
        if absent:
            raise UnsupportedModelError(f"AHA: the feature module(s) {', '.join(absent)} of {type(self.model).__name__} "
                                        "were never called in the forward (containers, not layers)")
        return [found[k] for k in range(len(self.depths))], logits.detach()

    def describe(self) -> dict[str, Any]:
        return {"depths": self.depths, "channels": self.channels, "levels": [self.module_names[d] for d in self.depths]}


def _vit_width(model: nn.Module) -> int:
    for attr in ("embed_dim", "num_features"):
        v = getattr(model, attr, None)
        if isinstance(v, int):
            return v
    cfg = getattr(model, "config", None)
    cfg = getattr(cfg, "vision_config", None) or cfg  # CLIP / SigLIP classifiers keep it in the vision config
    if cfg is not None and isinstance(getattr(cfg, "hidden_size", None), int):
        return int(cfg.hidden_size)
    raise UnsupportedModelError(f"cannot find the token width of {type(model).__name__}")


# --------------------------------------------------------------------------------------------------------------------
# Decoder
# --------------------------------------------------------------------------------------------------------------------


def conv1x1_resized(conv: nn.Conv2d, x: Tensor, size: tuple[int, int]) -> Tensor:
    """``conv(resize(x, size))`` (bilinear, ``align_corners=False``) for a 1×1 ``conv``, computed on the smaller side.

    Both are linear maps, one over channels and one over pixels, so they commute; the resize's two weights per axis
    sum to one, so the bias passes through unchanged. Upsampling ×2 then convolves 4× fewer pixels (equal up to
    rounding); the same size skips the resize (the identity).
    """
    hw = (int(x.shape[-2]), int(x.shape[-1]))
    size = (int(size[0]), int(size[1]))
    if hw == size:
        return conv(x)
    if size[0] * size[1] >= hw[0] * hw[1]:
        return F.interpolate(conv(x), size=size, mode="bilinear", align_corners=False)
    return conv(F.interpolate(x, size=size, mode="bilinear", align_corners=False))


class ResidualConvUnit(nn.Module):
    """``x + conv3(ReLU(conv3(ReLU(x))))`` (no normalisation: every image is processed independently)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(width, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        # in place on conv1's output (a fresh tensor its backward does not keep): one activation buffer less
        return x + self.conv2(F.relu(self.conv1(F.relu(x)), inplace=True))


class FusionBlock(nn.Module):
    """DPT fusion: ``y = RCU2(x + RCU1(skip))``, resized (bilinear) to ``size``, then a 1×1 conv."""

    def __init__(self, width: int, skip: bool = True) -> None:
        super().__init__()
        self.rcu1 = ResidualConvUnit(width) if skip else None
        self.rcu2 = ResidualConvUnit(width)
        self.out = nn.Conv2d(width, width, 1)

    def forward(self, x: Tensor, skip: Tensor | None, size: tuple[int, int]) -> Tensor:
        if skip is not None and self.rcu1 is not None:
            x = x + self.rcu1(skip)
        x = self.rcu2(x)
        return conv1x1_resized(self.out, x, size)


class AHADecoder(nn.Module):
    """Class-conditional DPT-style decoder (the trained part of the explainer).

    Args:
        in_channels: channels ``C_l`` of each backbone level (fine → deep order as read).
        num_classes: number of classes of the target (size of the class embedding table).
        width: channels of the fusion path (the main cost knob; default 32).
        embed_dim: class-embedding size ``E`` (default: the largest ``C_l``; for a ViT ``E = D`` as in the paper).
        head_width: hidden channels of the head (default ``max(8, width // 2)``).
        last_init_std: standard deviation of the last conv's initial weights (it has no bias): near zero, so
            training starts from an almost constant map.

    ``forward(features, classes, out_hw)`` → ``(B, H, W)`` map logits.
    """

    def __init__(self, in_channels: Sequence[int], num_classes: int, width: int = 32, embed_dim: int | None = None,
                 head_width: int | None = None, last_init_std: float = 1e-3) -> None:
        super().__init__()
        in_channels = [int(c) for c in in_channels]
        if num_classes < 1:
            raise InputError(f"num_classes must be >= 1, got {num_classes}")
        e = int(embed_dim or max(in_channels))
        hw_ = int(head_width or max(8, width // 2))
        self.n_levels = len(in_channels)
        self.class_embed = nn.Embedding(num_classes, e)
        nn.init.normal_(self.class_embed.weight, std=0.02)
        self.mix = nn.ModuleList(nn.Linear(c + e, c) for c in in_channels)
        self.proj = nn.ModuleList(nn.Conv2d(c, width, 1) for c in in_channels)
        self.post = nn.ModuleList(nn.Conv2d(width, width, 3, padding=1) for _ in in_channels)
        n = len(in_channels)
        self.fuse = nn.ModuleList(FusionBlock(width, skip=k < n - 1) for k in range(n))  # the deepest has no skip
        self.head1 = nn.Conv2d(width, hw_, 3, padding=1)
        self.head2 = nn.Conv2d(hw_, hw_, 3, padding=1)
        # no bias: the sorter and the loss are invariant to a constant offset of the map, so a bias would only
        # receive rounding noise (which Adam would amplify to full-size steps)
        self.head3 = nn.Conv2d(hw_, 1, 1, bias=False)
        nn.init.normal_(self.head3.weight, std=last_init_std)

    def level_sizes(self, features: Sequence[Tensor]) -> list[tuple[int, int]]:
        """Target size of each level: ×2^(L−2−l) of the deepest level's grid when all levels share one grid (ViT:
        ×4, ×2, ×1, ×½ for 4 levels), else each level's own size (CNN stages are already multi-scale)."""
        sizes = [int_pair(f.shape[-2:]) for f in features]
        if len(set(sizes)) > 1:
            return sizes
        h, w = sizes[-1]
        out = []
        for level in range(len(features)):
            f = 2.0 ** (len(features) - 2 - level)
            out.append((max(1, int(math.ceil(h * f))), max(1, int(math.ceil(w * f)))))
        return out

    def forward(self, features: Sequence[Tensor], classes: Tensor, out_hw: tuple[int, int]) -> Tensor:
        if len(features) != self.n_levels:
            raise InputError(f"decoder expects {self.n_levels} feature levels, got {len(features)}")
        emb = self.class_embed(classes)  # (B, E)
        sizes = self.level_sizes(features)
        levels = []
        for k, f in enumerate(features):
            _, c, h, w = f.shape
            # mix(cat[z, e]) = z·W_zᵀ + (e·W_eᵀ + b): the class half is one vector per image, computed once per image
            # instead of at every token (and no concatenated (B, h, w, C + E) copy)
            mix = cast(nn.Linear, self.mix[k])
            weight, bias = mix.weight, mix.bias
            cond = F.linear(emb, weight[:, c:], bias)  # (B, C)
            z = torch.matmul(f.to(emb.dtype).permute(0, 2, 3, 1), weight[:, :c].t()) + cond[:, None, None, :]
            z = F.gelu(z).permute(0, 3, 1, 2)
            z = self.proj[k](z)
            if (h, w) != sizes[k]:
                z = F.interpolate(z, size=sizes[k], mode="bilinear", align_corners=False)
            levels.append(self.post[k](z))
        y = None
        for k in range(self.n_levels - 1, -1, -1):
            nxt = sizes[k - 1] if k > 0 else (2 * sizes[0][0], 2 * sizes[0][1])
            y = self.fuse[k](levels[k] if y is None else y, None if y is None else levels[k], nxt)
        y = self.head1(y)
        if tuple(y.shape[-2:]) != tuple(out_hw):  # a bilinear resize to the same size is the identity
            y = F.interpolate(y, size=tuple(out_hw), mode="bilinear", align_corners=False)
        y = self.head3(F.relu(self.head2(y), inplace=True))
        return y[:, 0]


# --------------------------------------------------------------------------------------------------------------------
# The explainer network
# --------------------------------------------------------------------------------------------------------------------


class AHANet(nn.Module):
    """``E(x, c) → S``: frozen backbone + trainable :class:`AHADecoder`.

    Args:
        target: the model to explain.
        backbone: ``None`` (default: the target itself), a timm model name (``"timm:convnext_atto"`` or
            ``"convnext_atto"``, random weights unless cached — see :func:`vitlens.load_model`) or an ``nn.Module``.
        depths, n_levels: backbone levels (see :class:`FeatureBackbone`).
        width, embed_dim, head_width: decoder size (see :class:`AHADecoder`).
        num_classes: classes of the target (default: the adapter's ``num_classes``).
        seed: if given, the decoder is initialised from ``torch.manual_seed(seed)`` without touching the global RNG.

    ``forward(x, classes, features=None)`` → map logits ``(B, H, W)``; :meth:`features` → ``(features, logits)``
    where ``logits`` are the *target*'s logits on ``x`` (from the same pass when the backbone is the target).
    ``state_dict()`` holds the decoder only.
    """

    # set with object.__setattr__ in __init__: not registered as submodules, so never part of the state
    target: nn.Module
    target_adapter: Adapter
    backbone: FeatureBackbone

    def __init__(self, target: nn.Module, backbone: str | nn.Module | None = None, depths: Sequence[int] | None = None,
                 n_levels: int = 4, width: int = 32, embed_dim: int | None = None, head_width: int | None = None,
                 num_classes: int | None = None, seed: int | None = None, output_pool: str = "none",
                 spread: float = 0.0) -> None:
        super().__init__()
        if output_pool not in OUTPUT_POOLS:
            raise InputError(f"output_pool must be one of {', '.join(OUTPUT_POOLS)}, got {output_pool!r}")
        spread = check_spread(spread)
        self.backbone_spec = "target" if backbone is None or backbone is target else (
            backbone if isinstance(backbone, str) else f"module:{type(backbone).__name__}")
        if isinstance(backbone, str):
            from ..models import load_model

            name = backbone if ":" in backbone else f"timm:{backbone}"
            try:
                backbone_model = load_model(name)
            except WeightsUnavailableError as exc:  # offline without cached weights: say so, never silently
                import warnings

                warnings.warn(f"AHA backbone {name}: {exc}; using random weights", RuntimeWarning, stacklevel=2)
                backbone_model = load_model(name, pretrained=False)
            backbone_model.eval()
        else:
            backbone_model = backbone if backbone is not None else target
        object.__setattr__(self, "target", target)  # not registered: never part of the state
        object.__setattr__(self, "target_adapter", get_adapter(target))
        object.__setattr__(self, "backbone", FeatureBackbone(backbone_model, depths, n_levels))
        k = int(num_classes or self.target_adapter.num_classes)
        if k < 1:
            raise InputError("cannot tell the number of classes of the target; pass num_classes=")
        self.num_classes = k
        self.arch: dict[str, Any] = {"backbone": self.backbone_spec, "depths": list(self.backbone.depths),
                     "channels": list(self.backbone.channels), "width": int(width), "embed_dim": embed_dim,
                     "head_width": head_width, "num_classes": k, "output_pool": output_pool}
        if spread:
            self.arch["spread"] = spread
        rng = torch.random.fork_rng(devices=[]) if seed is not None else contextlib.nullcontext()
        with rng:
            if seed is not None:
                torch.manual_seed(seed)
            self.decoder = AHADecoder(self.backbone.channels, k, width=width, embed_dim=embed_dim,
                                      head_width=head_width)

    @property
    def uses_target_backbone(self) -> bool:
        return self.backbone.model is self.target

    def features(self, x: Tensor) -> tuple[list[Tensor], Tensor]:
        """Backbone features on ``x`` and the target's logits ``(B, K)`` (no gradient)."""
        if self.uses_target_backbone:
            return self.backbone(x)
        feats, _ = self.backbone(self._backbone_input(x))
        with torch.no_grad():
            logits = self.target_adapter.forward(x)
        return feats, logits.detach()

    def _backbone_input(self, x: Tensor) -> Tensor:
        """Re-normalise ``x`` from the target's data config to the backbone's (and resize if it needs a fixed size)."""
        from ..images import data_config

        try:
            src, dst = data_config(self.target), data_config(self.backbone.model)
        except UnsupportedModelError as exc:  # a model of no known family without vitlens_data_config
            import warnings

            warnings.warn(f"AHA: the backbone gets the target's input as it is (not re-normalised): {exc}; set "
                          "vitlens_data_config on both models to re-normalise", RuntimeWarning, stacklevel=2)
            return x
        ms = torch.tensor(src.mean, device=x.device, dtype=x.dtype).view(1, 3, 1, 1)
        ss = torch.tensor(src.std, device=x.device, dtype=x.dtype).view(1, 3, 1, 1)
        md = torch.tensor(dst.mean, device=x.device, dtype=x.dtype).view(1, 3, 1, 1)
        sd = torch.tensor(dst.std, device=x.device, dtype=x.dtype).view(1, 3, 1, 1)
        y = ((x * ss + ms) - md) / sd
        if not self.backbone.adapter.any_size and tuple(y.shape[-2:]) != dst.size_hw:
            y = F.interpolate(y, size=dst.size_hw, mode="bilinear", align_corners=False)
        return y

    @property
    def output_pool(self) -> str:
        """``"none"``: the decoder's pixel map; ``"tokens"``: its average over each of the target's patches (nearest
        upsampled back), i.e. one score per token. Chosen per explainer on held-out data (docs/methods/aha.md §1)."""
        return str(self.arch.get("output_pool", "none"))

    @output_pool.setter
    def output_pool(self, value: str) -> None:
        if value not in OUTPUT_POOLS:
            raise InputError(f"output_pool must be one of {', '.join(OUTPUT_POOLS)}, got {value!r}")
        self.arch["output_pool"] = value

    @property
    def spread(self) -> float:
        """``λ`` of the ``tokens`` pooling: its map is ``(1 − λ)·`` the constant token scores ``+ λ·`` the same
        scores upsampled bilinearly (0: one constant score per token). Chosen per explainer on held-out data with
        the pooling; files written before it existed read as 0."""
        return float(self.arch.get("spread", 0.0))

    @spread.setter
    def spread(self, value: float) -> None:
        self.arch["spread"] = check_spread(value)

    def finish(self, maps: Tensor, pool: str | None = None, spread: float | None = None) -> Tensor:
        """Apply the output pooling (``pool`` or :attr:`output_pool`, with ``spread`` or :attr:`spread`) to
        decoder maps ``(B, H, W)``."""
        return pool_maps(maps, self.target_adapter, self.output_pool if pool is None else pool,
                         self.spread if spread is None else spread)

    def forward(self, x: Tensor, classes: Tensor, features: Sequence[Tensor] | None = None) -> Tensor:
        if features is None:
            features, _ = self.features(x)
        return self.finish(self.decoder(features, classes.to(x.device).long(), tuple(x.shape[-2:])))


#: output poolings of :class:`AHANet`
OUTPUT_POOLS: tuple[str, ...] = ("none", "tokens")


#: the ``spread`` values a training (and ``benchmarks/aha_spread.py`` for a finished explainer) chooses among
#: (0.5 added when two explainers chose the grid's edge, 0.25; λ = 1 lost on both: docs/methods/aha.md §1)
SPREADS: tuple[float, ...] = (0.0, 0.1, 0.25, 0.5)


def check_spread(value: float) -> float:
    """``value`` as a float in [0, 1], or a clear error."""
    v = float(value)
    if not 0.0 <= v <= 1.0:
        raise InputError(f"spread must be in [0, 1], got {value!r}")
    return v


def pool_maps(maps: Tensor, adapter: Any, pool: str, spread: float = 0.0) -> Tensor:
    """``pool="tokens"``: the average of ``maps`` ``(B, H, W)`` over each ``patch_size`` cell of the target, spread
    back over the cell's pixels (edge cells average the pixels they have); ``"none"``: ``maps`` unchanged.

    A ViT reads its input token by token: deleting 5 % of the pixels scattered over many patches barely changes
    it, deleting whole patches does. Pixel-level deletion/insertion therefore rewards maps that are constant per
    patch, which is what this pooling gives a map learned at pixel level.

    ``spread`` ``λ`` (tokens only): ``(1 − λ)·`` the constant cells ``+ λ·`` the cell scores upsampled
    bilinearly (``align_corners=False``, as GradSkip's token maps). A constant cell leaves the order of its own
    pixels to the metric's tie-breaking (raster order); a small ``λ`` orders them towards the higher-scored
    neighbours and, where two cells' scores are within ``λ`` of the map's range, may swap pixels between them.
    """
    spread = check_spread(spread)
    if pool == "none":
        return maps
    if pool != "tokens":
        raise InputError(f"output_pool must be one of {', '.join(OUTPUT_POOLS)}, got {pool!r}")
    ps = adapter.patch_size
    if ps is None:
        raise InputError(f"output_pool='tokens' needs a model with patches; {type(adapter.model).__name__} has none")
    ph, pw = int_pair(ps)
    h, w = maps.shape[-2:]
    pooled = F.avg_pool2d(maps[:, None], (ph, pw), stride=(ph, pw), ceil_mode=True, count_include_pad=False)
    out = pooled.repeat_interleave(ph, dim=2).repeat_interleave(pw, dim=3)[:, 0, :h, :w]
    if spread == 0.0:
        return out.contiguous()
    size = (pooled.shape[-2] * ph, pooled.shape[-1] * pw)
    smooth = F.interpolate(pooled, size=size, mode="bilinear", align_corners=False)[:, 0, :h, :w]
    return torch.lerp(out, smooth, spread)


def build_explainer(target: nn.Module, **arch: Any) -> AHANet:
    """An :class:`AHANet` for ``target`` from architecture keywords (as stored in the JSON metadata)."""
    arch = dict(arch)
    channels = arch.pop("channels", None)
    spec = arch.pop("backbone", "target")
    net = AHANet(target, backbone=None if spec in (None, "target") else spec, **arch)
    if channels is not None and list(channels) != list(net.backbone.channels):
        raise InputError(
            f"the explainer was trained on backbone features with {list(channels)} channels; this model gives "
            f"{list(net.backbone.channels)} (an explainer works only with the model it was trained for)"
        )
    return net


def _explainer_from_metadata(target: nn.Module, arch: dict[str, Any], jpath: Path) -> AHANet:
    """:func:`build_explainer` from a metadata file's ``arch``: a key :class:`AHANet` does not take, or a value of the
    wrong kind, is a damaged file (one line naming it), not a stack trace."""
    import inspect

    allowed = (set(inspect.signature(AHANet.__init__).parameters) - {"self", "target"}) | {"channels"}
    unknown = sorted(set(arch) - allowed)
    if unknown:
        raise WeightsUnavailableError(f"AHA explainer metadata {jpath} is damaged (unknown architecture keys: "
                                      f"{', '.join(repr(k)[:40] for k in unknown[:5])})")
    try:
        return build_explainer(target, **arch)
    except InputError:  # a real mismatch with this model: said as it is
        raise
    except (TypeError, ValueError) as exc:
        raise WeightsUnavailableError(f"AHA explainer metadata {jpath} is damaged (architecture "
                                      f"{' '.join(str(exc).split())[:120]})") from None


def save_explainer(net: AHANet, path: str | Path, meta: dict[str, Any] | None = None) -> tuple[Path, Path]:
    """Write the decoder weights to ``path`` (``.safetensors``) and ``{arch, ...meta}`` to the ``.json`` beside it."""
    from safetensors.torch import save_file

    path = Path(path)
    if path.suffix != ".safetensors":
        path = path.with_suffix(".safetensors")
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in net.state_dict().items()}
    from ..atomic import atomic_path, write_failure, write_text

    try:
        with atomic_path(path) as tmp:  # a killed or failed save never leaves truncated weights
            save_file(state, str(tmp))
            tmp.chmod(0o644)  # safetensors writes owner-only files; the weights are meant to be shipped
    except Exception as e:  # safetensors reports a full disk as its own SafetensorError ("... os error 28")
        if isinstance(e, OSError) or "error" not in str(e).lower():
            raise
        raise write_failure(path, str(e)) from None
    info = {"format": "vitlens-aha-1", "arch": net.arch, **(meta or {})}
    jpath = path.with_suffix(".json")
    write_text(jpath, json.dumps(info, indent=2, default=str) + "\n")
    return path, jpath


def load_explainer(path: str | Path, target: nn.Module, check_target: bool = True) -> AHANet:
    """Build the explainer described by ``path`` (``.safetensors`` with its ``.json``) on ``target`` and load it.

    With ``check_target``, a warning is issued when the target's weights differ from those the explainer was trained
    for (``target.sha`` in the metadata).
    """
    import warnings

    from safetensors.torch import load_file

    path = Path(path)
    if path.is_dir():
        found = sorted(path.glob("*.safetensors"))
        if len(found) != 1:
            raise WeightsUnavailableError(f"expected one .safetensors explainer in {path}, found {len(found)}")
        path = found[0]
    jpath = path.with_suffix(".json")
    if not path.is_file() or not jpath.is_file():
        raise WeightsUnavailableError(f"AHA explainer {path} (and its {jpath.name} metadata) not found")
    from ..files import read_text_file

    try:
        info = json.loads(read_text_file(jpath, f"AHA explainer metadata {jpath}", error=WeightsUnavailableError))
        if not isinstance(info, dict) or not isinstance(info.get("arch"), dict):
            raise ValueError("no 'arch' object")
    except ValueError as exc:  # (WeightsUnavailableError is no ValueError: passed on as it is)
        raise WeightsUnavailableError(f"AHA explainer metadata {jpath} is damaged ({' '.join(str(exc).split())[:120]})"
                                      ) from None
    net = _explainer_from_metadata(target, info["arch"], jpath)
    try:
        net.load_state_dict(load_file(str(path), device="cpu"), strict=True)
    except Exception as exc:  # a shape that does not fit, or a truncated / foreign file (SafetensorError)
        raise WeightsUnavailableError(f"AHA explainer {path} does not match its metadata: {str(exc)[:200]}") from None
    sha = (info.get("target") or {}).get("sha")
    if check_target and sha and sha != model_digest(target):
        warnings.warn(
            f"the AHA explainer {path.name} was trained for a model with weights {sha}; this model's differ "
            f"({model_digest(target)}): its maps may not be faithful to this model",
            stacklevel=2,
        )
    device = next((p.device for p in target.parameters()), torch.device("cpu"))
    setattr(net, "meta", info)
    return net.to(device).eval()
