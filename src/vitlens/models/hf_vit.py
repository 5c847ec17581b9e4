"""Adapter for HuggingFace ViT and DeiT image classifiers (``ViTForImageClassification``, ``DeiTForImageClassification``,
``DeiTForImageClassificationWithTeacher``)."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator, Sequence

import torch
from torch import Tensor, nn

from ..errors import InputError, UnsupportedModelError
from ._hf import eager_attention
from .capabilities import (ATTENTION, BLOCK_IO, CLASS_LOGITS, FEATURE_MAPS, FEATURES, LINEAR_HEAD, LRP_LINEARS,
                           STREAM_HEAD, TOKEN_GRID, TOKEN_SEQUENCE, TOKENS)
from .base import Adapter, BlockRecord, LRPLinears, Recording, linears_at, logits_of

__all__ = ["HFViTAdapter"]


@functools.lru_cache(maxsize=1)
def _transformers_major() -> int:
    import transformers  # only reached with an HF model, so transformers is installed

    return int(transformers.__version__.split(".")[0])

_SUPPORTED = {
    "ViTForImageClassification": ("vit", (0,)),
    "DeiTForImageClassification": ("deit", (0,)),
    "DeiTForImageClassificationWithTeacher": ("deit", (0, 1)),
}


class HFViTAdapter(Adapter):
    """HuggingFace ViT/DeiT classifiers. Eager attention is switched on for the duration of a session."""

    #: the wrapped model; typed ``Any`` because the family's submodules and config are reached by attribute
    #: (``nn.Module.__getattr__`` types them loosely), after :meth:`matches` and ``__init__`` checked the layout
    model: Any
    #: read from the config in ``__init__``: never ``None`` for this family
    patch_size: tuple[int, int]
    default_size: tuple[int, int]

    family = "hf-vit"
    capabilities = frozenset({CLASS_LOGITS, ATTENTION, BLOCK_IO, TOKEN_SEQUENCE, LRP_LINEARS, LINEAR_HEAD, STREAM_HEAD,
                              TOKENS, FEATURES, FEATURE_MAPS, TOKEN_GRID})

    @staticmethod
    def matches(model: nn.Module) -> bool:
        return type(model).__name__ in _SUPPORTED and hasattr(model, "config")

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        base_name, readout = _SUPPORTED[type(model).__name__]
        self.backbone = getattr(model, base_name)
        cfg = self.model.config
        self.num_prefix_tokens = 2 if base_name == "deit" else 1
        self.readout_tokens = readout
        self.num_classes = int(cfg.num_labels)
        p = cfg.patch_size
        self.patch_size = (p, p) if isinstance(p, int) else tuple(p)
        s = cfg.image_size
        self.default_size = (s, s) if isinstance(s, int) else tuple(s)
        self.in_chans = int(cfg.num_channels)
        encoder = getattr(self.backbone, "encoder", None)  # transformers 4.x: backbone.encoder.layer
        self.layers = list(encoder.layer if encoder is not None else self.backbone.layers)
        self._capturing = False
        self.any_size = self.interpolate  # other sizes only with interpolated position embeddings, when asked
        for i, layer in enumerate(self.layers):
            if not (hasattr(layer, "layernorm_after") and hasattr(layer, "attention")):
                raise UnsupportedModelError(f"HF layer {i} ({type(layer).__name__}) is not a pre-norm ViT layer")
            if self._value_linear(layer) is None:
                raise UnsupportedModelError(f"cannot find the value projection of HF layer {i}")

    @staticmethod
    def _value_linear(layer: nn.Module) -> nn.Linear | None:
        att = layer.attention
        for path in ("v_proj", "attention.value", "value"):  # transformers 5.x, 4.x
            mod: Any = att
            for part in path.split("."):
                mod = getattr(mod, part, None)
            if isinstance(mod, nn.Linear):
                return mod
        return None

    def _attention_module(self, layer: nn.Module) -> nn.Module:
        att: Any = layer.attention
        # transformers 4.x nests the self-attention (which returns the probabilities) one level down.
        return att.attention if hasattr(att, "attention") and isinstance(att.attention, nn.Module) else att

    def blocks(self) -> Sequence[nn.Module]:
        return self.layers

    def stream_logits(self, tokens: Tensor) -> Tensor:
        """The backbone's final ``layernorm``, then the classifier on CLS (DeiT with teacher: the mean of the CLS and
        distillation heads), as the model's forward reads its last layer."""
        seq = self.backbone.layernorm(tokens)
        if hasattr(self.model, "cls_classifier"):
            return (self.model.cls_classifier(seq[:, 0]) + self.model.distillation_classifier(seq[:, 1])) / 2
        return self.model.classifier(seq[:, 0])

    def lrp_linears(self) -> list[LRPLinears]:
        # transformers 5.x names first, then 4.x (attention.attention.query/…, intermediate/output.dense)
        return [linears_at(layer, i, qkv=[("attention.q_proj", "attention.k_proj", "attention.v_proj"),
                                          ("attention.attention.query", "attention.attention.key",
                                           "attention.attention.value")],
                           proj=("attention.o_proj", "attention.output.dense"), fc1=("mlp.fc1", "intermediate.dense"),
                           fc2=("mlp.fc2", "output.dense")) for i, layer in enumerate(self.layers)]

    def grid(self, input_hw: tuple[int, int]) -> tuple[int, int]:
        return input_hw[0] // self.patch_size[0], input_hw[1] // self.patch_size[1]

    def check_input(self, x: Tensor) -> None:
        if x.shape[1] != self.in_chans:
            raise InputError(f"model expects {self.in_chans} input channels; got a batch with {x.shape[1]}")
        h, w = x.shape[-2:]
        ph, pw = self.patch_size
        if h % ph or w % pw:
            raise InputError(f"input size {h}x{w} is not a multiple of the patch size {ph}x{pw}")
        if (h, w) != tuple(self.default_size) and not self.interpolate:
            raise InputError(self._size_refusal(x))

    @property
    def interpolate(self) -> bool:
        """Whether inputs of another size than the model's ``image_size`` are explained with interpolated position
        embeddings (``interpolate_pos_encoding=True``): only when the user asks, by setting
        ``model.vitlens_interpolate_pos_encoding = True``; otherwise such inputs are refused with the model's reason."""
        return bool(getattr(self.model, "vitlens_interpolate_pos_encoding", False))

    def _size_refusal(self, x: Tensor) -> str:
        """The model's own reason for refusing ``x``'s size (the error of its forward without interpolation), and how
        to opt in."""
        reason = "its position embeddings are built for that size"
        try:
            with torch.no_grad():
                self.model(pixel_values=x[:1].detach())
        except (ValueError, RuntimeError) as e:
            reason = f"the model refuses it: {str(e).splitlines()[0][:200]}"
        return (f"{type(self.model).__name__} expects {self.default_size[0]}x{self.default_size[1]} inputs; got "
                f"{x.shape[-2]}x{x.shape[-1]} ({reason}; set model.vitlens_interpolate_pos_encoding = True to explain "
                "it with interpolated position embeddings)")

    def _forward(self, x: Tensor) -> Tensor:
        # transformers 4.x returns attention probabilities only when asked; 5.x always returns them from the
        # attention module, and asking would make it install permanent capture hooks on the model.
        kwargs = {"output_attentions": True} if self._capturing and _transformers_major() < 5 else {}
        if tuple(x.shape[-2:]) != self.default_size and self.interpolate:
            kwargs["interpolate_pos_encoding"] = True
        return logits_of(self.model(pixel_values=x, **kwargs))

    def _embedding_module(self) -> nn.Module:
        return self.backbone.embeddings

    @contextlib.contextmanager
    def _explicit_attention(self) -> Iterator[None]:
        cfg = self.model.config
        with eager_attention((cfg, getattr(self.backbone, "config", cfg))):
            self._capturing = True
            try:
                yield
            finally:
                self._capturing = False

    def _install_capture(self, rec: Recording, hooks: list) -> None:
        rec.blocks.extend(BlockRecord() for _ in self.layers)
        heads = int(self.model.config.num_attention_heads)
        for i, layer in enumerate(self.layers):
            hooks.append(layer.register_forward_pre_hook(self._leaf_first_block_hook(rec, i), with_kwargs=True))
            hooks.append(layer.layernorm_after.register_forward_pre_hook(self._record_h_hook(rec, i)))

            def attn_hook(module, args, output, i=i):
                probs = output[1] if isinstance(output, tuple) and len(output) > 1 else None
                if probs is None:
                    raise UnsupportedModelError("HF attention returned no probabilities although eager was set")
                rec.blocks[i].attn = probs

            def value_hook(module, args, output, i=i):
                b, n, d = output.shape
                rec.blocks[i].value = output.detach().reshape(b, n, heads, d // heads).permute(0, 2, 1, 3)

            hooks.append(self._attention_module(layer).register_forward_hook(attn_hook))
            value = self._value_linear(layer)
            assert value is not None  # __init__ refused layers without a value projection
            hooks.append(value.register_forward_hook(value_hook))

        def final_hook(module, args, output):
            rec.final = output[0] if isinstance(output, tuple) else output

        hooks.append(self.layers[-1].register_forward_hook(final_hook))
