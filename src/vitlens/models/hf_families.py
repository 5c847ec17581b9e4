"""Adapters for HuggingFace image classifiers beyond ViT/DeiT: DINOv2 (with and without registers), BEiT and
Data2VecVision (relative position bias inside the softmax, when configured), ViTMSN and I-JEPA (the ViT layer; I-JEPA
has no CLS token and reads the token mean), CLIP and SigLIP vision towers with a classification head, and backbones
with a linear head (:class:`vitlens.models.LinearProbe`: DINOv3 with RoPE and registers, DINOv2). They share the
capture in :mod:`._sequence`; eager attention (which returns the probabilities) is switched on through every config's
``_attn_implementation`` for the duration of a session (restored in ``finally``), and for the families that still
choose their attention class when the model is built (Data2VecVision) the SDPA attention modules run as their eager
parent class for the session (:func:`._hf.eager_modules`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

from torch import Tensor, nn

from ..errors import UnsupportedModelError
from ._hf import eager_attention, eager_modules
from ._sequence import BlockParts, SequenceAdapter, not_plain
from .capabilities import LINEAR_HEAD, LRP_LINEARS, TOKENS
from .base import LRPLinears, linears_at, logits_of
from .data_configs import processor_defaults  # re-exported: the families' processors

__all__ = ["HFSequenceAdapter", "processor_defaults"]


@dataclass(frozen=True)
class _Layout:
    """Where a family keeps its parts: backbone attribute, path to the layer list, attention / norm2 names, and
    how the classifier reads (``"cls"``, ``"pooled"`` or ``"config"``: BEiT's ``use_mean_pooling``). ``probs``: path
    below the attention module to the module that returns ``(context, probabilities)`` (``""``: the attention module
    itself); ``value``: path below the attention module to the value projection; ``cls_token``: whether the
    embeddings put a CLS token first; ``legacy``: the transformers 4.x layer layout (attention class chosen when the
    model is built; probabilities returned only when the forward is asked for them with ``output_attentions``)."""

    backbone: str
    layers: str
    attention: str
    norm2: str
    readout: str
    embeddings: str = "embeddings"
    probs: str = ""
    value: str = "v_proj"
    cls_token: bool = True
    legacy: bool = False


#: family → the capabilities it adds to the shared ones, and the notes on what it lacks (``LinearTaps`` still checks
#: q/k/v, the output projection and the MLP numerically per block, and raises if they are not what it expects).
_HEAD = "the classifier reads [CLS, mean of patch tokens] concatenated"
_EXTRA: dict[str, tuple[frozenset[str], dict[str, str]]] = {
    "hf-dinov2": (frozenset({LRP_LINEARS}), {LINEAR_HEAD: _HEAD}),
    "hf-beit": (frozenset(), {}),
    "hf-clip": (frozenset({LRP_LINEARS, LINEAR_HEAD}), {}),
    "hf-siglip": (frozenset({LRP_LINEARS}), {LINEAR_HEAD: "the vision tower's attention-pool head runs after the blocks "
                                                          "although the classifier reads the token mean"}),
    "hf-dinov3": (frozenset(), {LRP_LINEARS: not_plain("RoPE rotates queries and keys (cos/sin applied to q and k "
                                                       "before the softmax)")}),
    "hf-dinov2-probe": (frozenset({LRP_LINEARS}), {LINEAR_HEAD: "the linear probe reads the backbone through its own "
                                                                "forward"}),
    "hf-vit-msn": (frozenset({LRP_LINEARS, LINEAR_HEAD}), {}),
    "hf-ijepa": (frozenset({LRP_LINEARS, LINEAR_HEAD}), {}),
    "hf-data2vec-vision": (frozenset(), {LINEAR_HEAD: "the pooler normalises the patch-token mean after the blocks",
                                         TOKENS: "its embeddings return (tokens, patch grid), which the layers "
                                                 "read, not a token sequence to take a subset of"}),
}
#: the families whose relative position bias is a config switch: with it off they are plain ViT blocks for LRP
_REL_BIAS = ("hf-beit", "hf-data2vec-vision")
_REL_BIAS_NOTE = not_plain("a relative position bias enters the softmax")

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
        "hf-siglip", _Layout("vision_model", "encoder.layers", "self_attn", "layer_norm2", "pooled", cls_token=False)),
    "ViTMSNForImageClassification": ("hf-vit-msn", _Layout("vit", "layers", "attention", "layernorm_after", "cls")),
    "IJepaForImageClassification": (
        "hf-ijepa", _Layout("ijepa", "layers", "attention", "layernorm_after", "pooled", cls_token=False)),
    "Data2VecVisionForImageClassification": (
        "hf-data2vec-vision", _Layout("data2vec_vision", "encoder.layer", "attention", "layernorm_after", "config",
                                      probs="attention", value="attention.value", legacy=True)),
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
    """HuggingFace DINOv2 (+registers), BEiT, Data2VecVision, ViTMSN, I-JEPA, CLIP and SigLIP image classifiers
    (pre-norm layers, eager attention). Readout: ViTMSN reads CLS; DINOv2 CLS and the mean of the patch tokens, CLIP
    the mean of the patch tokens, SigLIP and I-JEPA the mean of all tokens (pooled readouts); BEiT and
    Data2VecVision read CLS, or the patch mean with ``use_mean_pooling``."""

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
        self.num_prefix_tokens = int(lay.cls_token) + int(getattr(vcfg, "num_register_tokens", 0) or 0)
        mean_pool = lay.readout == "pooled" or (lay.readout == "config" and bool(vcfg.use_mean_pooling)) or (
            lay.readout == "probe" and model.readout != "cls")
        self.readout_tokens = None if mean_pool else (0,)
        self._embeddings = _get(self.backbone, lay.embeddings)
        self._legacy = lay.legacy
        self._capturing = False
        rel_bias = self.family in _REL_BIAS and bool(getattr(vcfg, "use_relative_position_bias", False) or
                                                     getattr(vcfg, "use_shared_relative_position_bias", False))
        if rel_bias:
            self.capability_notes[LRP_LINEARS] = _REL_BIAS_NOTE
            self.capability_notes.setdefault(TOKENS, "the relative position bias is built for the full token grid")
        elif self.family in _REL_BIAS:
            self.capabilities = self.capabilities | {LRP_LINEARS}
        if self.family == "hf-dinov3":
            self.capability_notes[TOKENS] = "RoPE is computed for the full token grid"
        elif TOKENS not in self.capability_notes:  # absolute position embeddings, added in the embeddings module:
            self.capabilities = self.capabilities | {TOKENS}  # tokens can be dropped after them
        layers = _get(self.backbone, lay.layers)
        if layers is None:
            raise UnsupportedModelError(f"{type(model).__name__}: no layer list at {lay.backbone}.{lay.layers}")
        heads = int(vcfg.num_attention_heads)
        self._attention_name = lay.attention
        self._parts = []
        for i, layer in enumerate(layers):
            att, norm2 = getattr(layer, lay.attention, None), getattr(layer, lay.norm2, None)
            v = _get(att, lay.value) if isinstance(att, nn.Module) else None
            probs = _get(att, lay.probs) if lay.probs and isinstance(att, nn.Module) else att
            if not isinstance(att, nn.Module) or not isinstance(v, nn.Linear) or not isinstance(norm2, nn.Module) \
                    or not isinstance(probs, nn.Module):
                raise UnsupportedModelError(
                    f"{type(model).__name__} layer {i} ({type(layer).__name__}) is not a pre-norm layer with a "
                    f"{lay.attention}.{lay.value} value projection"
                )
            self._parts.append(BlockParts(block=layer, attention=att, probs_at=probs, probs_index=1, norm2=norm2,
                                          value=(v.weight, v.bias), heads=heads))

    def parts(self) -> list[BlockParts]:
        return self._parts

    def lrp_linears(self) -> list[LRPLinears]:
        a = self._attention_name  # transformers 5.x names first, then the 4.x layout (Data2VecVision)
        return [linears_at(p.block, i, qkv=[(f"{a}.q_proj", f"{a}.k_proj", f"{a}.v_proj"),
                                            (f"{a}.attention.query", f"{a}.attention.key", f"{a}.attention.value")],
                           proj=(f"{a}.o_proj", f"{a}.out_proj", f"{a}.output.dense"),
                           fc1=("mlp.fc1", "intermediate.dense"), fc2=("mlp.fc2", "output.dense"))
                for i, p in enumerate(self._parts)]

    def _forward(self, x: Tensor) -> Tensor:
        # the 4.x layout returns the attention probabilities only when asked (and only while capturing: 5.x models
        # would install capture hooks of their own)
        kwargs = {"output_attentions": True} if self._legacy and self._capturing else {}
        return logits_of(self.model(pixel_values=x, **kwargs))

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
        with eager_attention(configs.values()), eager_modules(p.probs_at for p in self._parts):
            self._capturing = True
            try:
                yield
            finally:
                self._capturing = False


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
