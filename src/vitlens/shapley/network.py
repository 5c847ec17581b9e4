"""ViT-Shapley's explainer network and its files.

:class:`ShapleyExplainer` holds the fine-tuned surrogate (a full copy of the target classifier, :mod:`.surrogate`) and
the explainer branch (:class:`ExplainerHead`). The paper's explainer is a ViT initialised from the surrogate, one extra
attention block, a LayerNorm and a three-layer MLP (``D → 4D → 4D → K``) with a ``tanh``, giving every class's value for
every patch; here the explainer shares the surrogate's first ``L − t`` blocks and fine-tunes copies of its last
``t = tune_blocks`` blocks (``t = L``: the paper's full fine-tuning), so one pass of the shared trunk gives both the
surrogate's logits on the whole image (the grand value ``v(1)``) and the explainer's tokens — the method is one
forward. The additive efficient normalisation (the paper's eq. 6) makes the values sum to ``v(1) − v(∅)`` exactly::

    φ_i = φ̂_i + (v(1) − v(∅) − Σ_j φ̂_j) / n

``v(∅)``, the surrogate with every patch held out, does not depend on the image (only the prefix tokens are visible):
it is computed once and kept as the buffer ``null``.

Files: ``<name>.safetensors`` (the state dict, float16 — the surrogate is rounded to float16 before the explainer
trains, so the shipped surrogate is the one the explainer was fitted to) and ``<name>.json`` (``format``,
``arch``, the target's digest, the training metadata). Neither is ever unpickled.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from ..errors import InputError, WeightsUnavailableError
from .surrogate import PatchLayout, masked_logits, patch_layout

__all__ = ["ExplainerHead", "FORMAT", "ShapleyExplainer", "ShapleyOutput", "load_shapley", "round_half",
           "save_shapley"]

FORMAT = "vitlens-vit-shapley-1"


class ShapleyOutput(NamedTuple):
    """What :meth:`ShapleyExplainer.forward` returns: ``values`` ``(B, n, K)`` (every class's patch values, summing to
    ``grand − null`` over the patches), ``grand`` ``(B, K)`` and ``null`` ``(K,)`` (the surrogate's probabilities with
    every / no patch), ``logits`` ``(B, K)`` (the surrogate's logits on the whole image)."""

    values: Tensor
    grand: Tensor
    null: Tensor
    logits: Tensor


def _reinit(module: nn.Module) -> None:
    """timm's initialisation of a ViT block: truncated normal (std 0.02) linears with zero bias, unit LayerNorms."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


class ExplainerHead(nn.Module):
    """The trained part: copies of the surrogate's last ``tune_blocks`` blocks and final norm (initialised from it), one
    extra attention block (fresh weights), LayerNorm, MLP ``D → 4D → 4D → K``, ``tanh``."""

    def __init__(self, surrogate: nn.Module, num_classes: int, tune_blocks: int, seed: int = 0) -> None:
        super().__init__()
        blocks: list[nn.Module] = list(surrogate.blocks)  # type: ignore[arg-type]
        dim = int(surrogate.embed_dim)  # type: ignore[arg-type]
        self.blocks = nn.ModuleList(copy.deepcopy(b) for b in blocks[len(blocks) - tune_blocks:])
        self.norm: nn.Module = copy.deepcopy(surrogate.norm)  # type: ignore[assignment]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.extra: nn.Module = copy.deepcopy(blocks[-1])
            _reinit(self.extra)
            self.mlp = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, 4 * dim),
                                     nn.GELU(), nn.Linear(4 * dim, num_classes))
            _reinit(self.mlp)

    def forward(self, tokens: Tensor) -> Tensor:
        """Raw values ``(B, N, K)`` of all tokens (prefix tokens included) from the trunk's tokens ``(B, N, D)``."""
        for blk in self.blocks:
            tokens = blk(tokens)
        return torch.tanh(self.mlp(self.extra(self.norm(tokens))))


class ShapleyExplainer(nn.Module):
    """Surrogate + explainer branch (module docstring). ``arch`` is what :func:`load_shapley` rebuilds it from."""

    null: Tensor
    surrogate: Any

    def __init__(self, surrogate: nn.Module, tune_blocks: int = 2, seed: int = 0) -> None:
        super().__init__()
        self.layout: PatchLayout = patch_layout(surrogate)
        n_blocks = len(surrogate.blocks)  # type: ignore[arg-type]
        if not 1 <= int(tune_blocks) <= n_blocks:
            raise InputError(f"tune_blocks must be in 1..{n_blocks} (the surrogate's blocks), got {tune_blocks}")
        self.surrogate = surrogate
        self.num_classes = int(surrogate.num_classes)  # type: ignore[arg-type]
        self.head = ExplainerHead(surrogate, self.num_classes, int(tune_blocks), seed)
        self.register_buffer("null", torch.full((self.num_classes,), float("nan")))
        self.arch = {"tune_blocks": int(tune_blocks), "seed": int(seed), "num_classes": self.num_classes}
        self.meta: dict[str, Any] = {}

    @property
    def n(self) -> int:
        return self.layout.n

    def trunk(self, x: Tensor) -> Tensor:
        """The surrogate's tokens after its first ``L − tune_blocks`` blocks (shared by both branches)."""
        s: Any = self.surrogate
        t = s.norm_pre(s.patch_drop(s._pos_embed(s.patch_embed(x))))
        for blk in list(s.blocks)[:len(s.blocks) - len(self.head.blocks)]:
            t = blk(t)
        return t

    def surrogate_logits(self, tokens: Tensor) -> Tensor:
        """The surrogate's logits on the whole image from the trunk's tokens."""
        s: Any = self.surrogate
        for blk in list(s.blocks)[len(s.blocks) - len(self.head.blocks):]:
            tokens = blk(tokens)
        return s.forward_head(s.norm(tokens))

    @torch.no_grad()
    def set_null(self, example: Tensor) -> Tensor:
        """Compute and keep ``v(∅)``: the surrogate's probabilities with every patch held out (``example``: any image
        ``(1, C, H, W)`` of the model's size; its pixels are all held out, so which one does not matter)."""
        x = example[:1].to(self.null.device)
        lay = patch_layout(self.surrogate, (int(x.shape[-2]), int(x.shape[-1])))
        keep = torch.zeros(1, lay.n, device=x.device)
        p = masked_logits(self.surrogate, x, keep, lay).float().softmax(-1)[0]
        self.null.copy_(p)
        return p

    def values_from(self, tokens: Tensor, grand: Tensor, head: nn.Module | None = None) -> Tensor:
        """Normalised values ``(B, n, K)`` from the trunk's tokens and the grand probabilities (``head``: the
        explainer branch or its DDP wrapper)."""
        raw = (head or self.head)(tokens)[:, self.layout.prefix:].float()
        gap = grand.float() - self.null.float()[None] - raw.sum(1)
        return raw + gap[:, None, :] / raw.shape[1]

    def forward(self, x: Tensor) -> ShapleyOutput:
        if bool(torch.isnan(self.null).any()):
            raise InputError("the explainer's null value v(∅) is not set (call set_null() after training the surrogate)")
        tokens = self.trunk(x)
        logits = self.surrogate_logits(tokens)
        grand = logits.float().softmax(-1)
        return ShapleyOutput(self.values_from(tokens, grand), grand, self.null.float(), logits)


def round_half(module: nn.Module) -> None:
    """Round every floating parameter and buffer of ``module`` to float16 precision in place (kept float32): what the
    file will hold, so training after it sees the shipped weights."""
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            if t.is_floating_point():
                t.copy_(t.half().to(t.dtype))


def save_shapley(net: ShapleyExplainer, path: str | Path, meta: dict[str, Any]) -> tuple[Path, Path]:
    """Write ``path`` (``.safetensors``, float16) and its ``.json`` (format, arch, ``meta``) atomically."""
    from safetensors.torch import save_file

    from ..atomic import atomic_path, write_text

    path = Path(path).with_suffix(".safetensors")
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {k: (v.detach().to("cpu").half() if v.is_floating_point() else v.detach().to("cpu")).contiguous()
             for k, v in net.state_dict().items()}
    with atomic_path(path) as tmp:
        save_file(state, str(tmp))
        tmp.chmod(0o644)
    jpath = path.with_suffix(".json")
    write_text(jpath, json.dumps({"format": FORMAT, "arch": net.arch, **meta}, indent=2, default=str) + "\n")
    return path, jpath


def load_shapley(path: str | Path, target: nn.Module, check_target: bool = True) -> ShapleyExplainer:
    """The explainer in ``path`` (``.safetensors`` + ``.json``) for ``target``: the surrogate is built as a copy of
    ``target`` and gets the file's weights. A missing, foreign or mismatched file is one
    :class:`WeightsUnavailableError` line; a target whose weights differ from the trained one's warns."""
    import warnings

    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from ..aha.network import model_digest

    path = Path(path)
    jpath = path.with_suffix(".json")
    if path.suffix != ".safetensors" or not path.is_file() or not jpath.is_file():
        raise WeightsUnavailableError(f"ViT-Shapley explainer {path} (a .safetensors file with its {jpath.name} "
                                      "beside it) not found")
    try:
        info = json.loads(jpath.read_text(encoding="utf-8"))
        if info.get("format") != FORMAT:
            raise ValueError(f"format {info.get('format')!r}, expected {FORMAT!r}")
        state = load_file(str(path), device="cpu")
        net = ShapleyExplainer(copy.deepcopy(target).cpu(), **{k: info["arch"][k] for k in ("tune_blocks", "seed")})
        net.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()}, strict=True)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, SafetensorError) as exc:
        why = (str(exc).splitlines() or ["unreadable"])[0][:160]
        raise WeightsUnavailableError(f"ViT-Shapley explainer {path} does not fit this model or is damaged "
                                      f"({type(exc).__name__}: {why})") from None
    sha = (info.get("target") or {}).get("sha")
    if check_target and sha and sha != model_digest(target):
        warnings.warn(f"the ViT-Shapley explainer {path.name} was trained for a model with weights {sha}; this "
                      f"model's differ ({model_digest(target)}): its values explain the other model", stacklevel=2)
    for p in net.parameters():
        p.requires_grad_(False)
    net.meta = info
    device = next((p.device for p in target.parameters()), torch.device("cpu"))
    return net.to(device).eval()
