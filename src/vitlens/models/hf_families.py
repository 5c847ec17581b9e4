"""Adapters for HuggingFace image classifiers beyond ViT/DeiT: DINOv2 (with and without registers), BEiT (relative
position bias inside the softmax), CLIP and SigLIP vision towers with a classification head, and backbones with a
linear head (:class:`vitlens.models.LinearProbe`: DINOv3 with RoPE and registers, DINOv2). They share the capture
in :mod:`._sequence`; eager attention (which returns the probabilities) is switched on through every config's
``_attn_implementation`` for the duration of a session (restored in ``finally``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

from torch import Tensor, nn

from ..errors import UnsupportedModelError
from ._hf import eager_attention
from ._sequence import BlockParts, SequenceAdapter, not_plain
from .capabilities import LINEAR_HEAD, LRP_LINEARS, TOKENS
from .base import LRPLinears, linears_at, logits_of
from .data_configs import processor_defaults  # re-exported: the families' processors

__all__ = ["HFSequenceAdapter", "processor_defaults"]


@dataclass(frozen=True)
class _Layout:
    """Where a family keeps its parts: backbone attribute, path to the layer list, attention / norm2 names, and
    how the classifier reads (``"cls"``, ``"pooled"`` or ``"config"``: BEiT's ``use_mean_pooling``)."""

    backbone: str
    layers: str
    attention: str
    norm2: str
    readout: str
    embeddings: str = "embeddings"


#: family → the capabilities it adds to the shared ones, and the notes on what it lacks (``LinearTaps`` still checks
#: q/k/v, the output projection and the MLP numerically per block, and raises if they are not what it expects).
_HEAD = "the classifier reads [CLS, mean of patch tokens] concatenated"
_EXTRA: dict[str, tuple[frozenset[str], dict[str, str]]] = {
    "hf-dinov2": (frozenset({LRP_LINEARS}), {LINEAR_HEAD: _HEAD}),
    "hf-beit": (frozenset(), {LRP_LINEARS: not_plain("a relative position bias enters the softmax")}),
    "hf-clip": (frozenset({LRP_LINEARS, LINEAR_HEAD}), {}),
    "hf-siglip": (frozenset({LRP_LINEARS}), {LINEAR_HEAD: "the vision tower's attention-pool head runs after the blocks "
                                                          "although the classifier reads the token mean"}),
    "hf-dinov3": (frozenset(), {LRP_LINEARS: not_plain("RoPE rotates queries and keys (cos/sin applied to q and k "
                                                       "before the softmax)")}),
    "hf-dinov2-probe": (frozenset({LRP_LINEARS}), {LINEAR_HEAD: "the linear probe reads the backbone through its own "
                                                                "forward"}),
}

#: backbone class → (family, layout) for :class:`vitlens.models.LinearProbe` models
_PROBES = {
    "DINOv3ViTModel": ("hf-dinov3", _Layout("backbone", "model.layer", "attention", "norm2", "probe")),
    "Dinov2Model": ("hf-dinov2-probe", _Layout("backbone", "encoder.layer", "attention", "norm2", "probe")),
    "Dinov2WithRegistersModel": ("hf-dinov2-probe",
                                 _Layout("backbone", "encoder.layer", "attention", "norm2", "probe")),
}

_FAMILIES = {
    "Dinov2ForImageClassification": ("hf-dinov2", _Layout("dinov2", "encoder.layer", "attention", "norm2", "pooled")),
    "Dinov2WithRegistersForImageClassification": (
        "hf-dinov2", _Layout("dinov2_with_registers", "encoder.layer", "attention", "norm2", "pooled")),
    "BeitForImageClassification": ("hf-beit", _Layout("beit", "layers", "attention", "layernorm_after", "config")),
    "CLIPForImageClassification": (
        "hf-clip", _Layout("vision_model", "encoder.layers", "self_attn", "layer_norm2", "pooled")),
    "SiglipForImageClassification": (
        "hf-siglip", _Layout("vision_model", "encoder.layers", "self_attn", "layer_norm2", "pooled")),
}


def _get(module: nn.Module, path: str) -> Any:
    """The attribute at dotted ``path`` under ``module`` (a submodule, list or config), or ``None``."""
    found: Any = module
    for part in path.split("."):
        found = getattr(found, part, None)
        if found is None:
            return None
    return found


class HFSequenceAdapter(SequenceAdapter):
    """HuggingFace DINOv2 (+registers), BEiT, CLIP and SigLIP image classifiers (pre-norm layers, eager attention).
    Readout: DINOv2 reads CLS and the mean of the patch tokens, CLIP the mean of the patch tokens and SigLIP the
    mean of all tokens (pooled readouts); BEiT reads CLS, or the patch mean with ``use_mean_pooling``."""

    family = "hf-sequence"

    @staticmethod
    def matches(model: nn.Module) -> bool:
        if _is_probe(model):
            return type(model.backbone).__name__ in _PROBES
        return type(model).__name__ in _FAMILIES and hasattr(model, "config")

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        probe = _is_probe(model)
        self.family, lay = _PROBES[type(model.backbone).__name__] if probe else _FAMILIES[type(model).__name__]
        extra, notes = _EXTRA[self.family]
        self.capabilities = self.capabilities | extra
        self.capability_notes = dict(notes)
        self.backbone = getattr(model, lay.backbone)
        vcfg = getattr(self.model.config, "vision_config", None) or self.model.config
        self.num_classes = _probe_classes(model) if probe else int(self.model.config.num_labels)
        p, s = vcfg.patch_size, vcfg.image_size
        self.patch_size = (p, p) if isinstance(p, int) else tuple(p)
        self.default_size = (s, s) if isinstance(s, int) else tuple(s)
        # DINOv2 always interpolates its position embeddings; DINOv3's RoPE is computed for the input's grid
        self.any_size = self.family in ("hf-dinov2", "hf-dinov2-probe", "hf-dinov3")
        self.in_chans = int(vcfg.num_channels)
        has_cls = self.family != "hf-siglip"
        self.num_prefix_tokens = int(has_cls) + int(getattr(vcfg, "num_register_tokens", 0) or 0)
        mean_pool = lay.readout == "pooled" or (lay.readout == "config" and bool(vcfg.use_mean_pooling)) or (
            lay.readout == "probe" and model.readout != "cls")
        self.readout_tokens = None if mean_pool else (0,)
        self._embeddings = _get(self.backbone, lay.embeddings)
        if self.family == "hf-beit":
            self.capability_notes[TOKENS] = "the relative position bias is built for the full token grid"
        elif self.family == "hf-dinov3":
            self.capability_notes[TOKENS] = "RoPE is computed for the full token grid"
        else:  # absolute position embeddings, added in the embeddings module: tokens can be dropped after them
            self.capabilities = self.capabilities | {TOKENS}
        layers = _get(self.backbone, lay.layers)
        if layers is None:
            raise UnsupportedModelError(f"{type(model).__name__}: no layer list at {lay.backbone}.{lay.layers}")
        heads = int(vcfg.num_attention_heads)
        self._attention_name = lay.attention
        self._parts = []
        for i, layer in enumerate(layers):
            att, norm2 = getattr(layer, lay.attention, None), getattr(layer, lay.norm2, None)
            v = getattr(att, "v_proj", None)
            if att is None or not isinstance(v, nn.Linear) or not isinstance(norm2, nn.Module):
                raise UnsupportedModelError(
                    f"{type(model).__name__} layer {i} ({type(layer).__name__}) is not a pre-norm layer with a "
                    f"v_proj value projection (transformers 5.x layout)"
                )
            self._parts.append(BlockParts(block=layer, attention=att, probs_at=att, probs_index=1, norm2=norm2,
                                          value=(v.weight, v.bias), heads=heads))

    def parts(self) -> list[BlockParts]:
        return self._parts

    def lrp_linears(self) -> list[LRPLinears]:
        a = self._attention_name
        return [linears_at(p.block, i, qkv=[(f"{a}.q_proj", f"{a}.k_proj", f"{a}.v_proj")],
                           proj=(f"{a}.o_proj", f"{a}.out_proj"), fc1=("mlp.fc1",), fc2=("mlp.fc2",))
                for i, p in enumerate(self._parts)]

    def _forward(self, x: Tensor) -> Tensor:
        return logits_of(self.model(pixel_values=x))

    def classifier_modules(self) -> list[nn.Module]:
        if _is_probe(self.model):
            return [self.model.head]
        return super().classifier_modules()

    def _embedding_module(self) -> nn.Module:
        if TOKENS not in self.capabilities or self._embeddings is None:
            return super()._embedding_module()
        return self._embeddings

    @contextlib.contextmanager
    def _explicit_attention(self) -> Iterator[None]:
        configs = {id(c): c for c in [self.model.config] + [getattr(m, "config", None) for m in self.model.modules()]
                   if c is not None and hasattr(c, "_attn_implementation")}
        for c in list(configs.values()):
            sub = getattr(c, "vision_config", None)
            if sub is not None:
                configs[id(sub)] = sub
        with eager_attention(configs.values()):
            yield


def _is_probe(model: nn.Module) -> bool:
    from .probe import LinearProbe

    return isinstance(model, LinearProbe)


def _probe_classes(model: Any) -> int:
    """Outputs of a probe's head: its last ``nn.Linear``'s ``out_features``."""
    linears = [m for m in model.head.modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise UnsupportedModelError(f"LinearProbe head {type(model.head).__name__} has no nn.Linear to read the "
                                    "number of classes from")
    return int(linears[-1].out_features)
