"""What preprocessing a model expects, derived from the model: timm's pretrained config, the HuggingFace families'
processor defaults, or a ``vitlens_data_config`` the model carries. The family knowledge behind
:func:`vitlens.images.data_config` and :meth:`vitlens.models.Adapter.data_config`.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from vitlens.errors import UnsupportedModelError
from vitlens.preprocessing import (
    HF_VIT_MEAN,
    HF_VIT_STD,
    IMAGENET_DEFAULT_MEAN,
    IMAGENET_DEFAULT_STD,
    DataConfig,
    apply_overrides,
    int_pair,
)

__all__ = ["model_data_config", "processor_defaults"]

#: the HF image processors' defaults per family (the processor configs of the published checkpoints: DINOv2 resizes
#: the short side to 256/224 of the input and centre-crops with ImageNet mean/std; CLIP resizes the short side to the
#: input size and centre-crops with OpenAI's mean/std; SigLIP and BEiT resize both sides, mean/std 0.5), bicubic.
_OPENAI_CLIP = ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))
_PREPROCESS = {
    "dinov2": dict(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225), crop_pct=224 / 256, crop_mode="center"),
    "dinov2_with_registers": dict(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225), crop_pct=224 / 256,
                                  crop_mode="center"),
    "clip": dict(mean=_OPENAI_CLIP[0], std=_OPENAI_CLIP[1], crop_pct=1.0, crop_mode="center"),
    "siglip": dict(mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5), crop_pct=1.0, crop_mode="squash"),
    "beit": dict(mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5), crop_pct=1.0, crop_mode="squash"),
    "dinov3_vit": dict(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225), crop_pct=1.0, crop_mode="squash"),
}


def processor_defaults(model: nn.Module) -> dict | None:
    """The data-config fields (``input_size``, ``mean``, ``std``, ``interpolation``, ``crop_pct``, ``crop_mode``) of
    the HF image processor a model of a family in this module is published with, or ``None`` for other models."""
    cfg = getattr(model, "config", None)
    kind = getattr(cfg, "model_type", None)
    if cfg is None or kind not in _PREPROCESS:
        return None
    vcfg = getattr(cfg, "vision_config", None) or cfg
    s = vcfg.image_size
    return {"input_size": (3, *int_pair(s)), "interpolation": "bicubic", **_PREPROCESS[kind]}


def _timm_config(model: torch.nn.Module) -> DataConfig:
    import timm.data  # lazy: timm is an optional dependency

    cfg = DataConfig.from_dict(dict(timm.data.resolve_model_data_config(model)))
    # timm resolves input_size from the pretrained config, even for a model built with another img_size (then
    # feeding that size would fail). Trust the model's own fixed patch-embedding size where it has one.
    patch_embed = getattr(model, "patch_embed", None)
    img_size = getattr(patch_embed, "img_size", None)
    dynamic = bool(getattr(patch_embed, "dynamic_img_size", False) or getattr(model, "dynamic_img_size", False))
    if img_size is not None and not dynamic:
        hw = int_pair(img_size)
        if hw != cfg.size_hw:
            cfg = cfg.replace(input_size=(3, *hw))
    return cfg


def _hf_config(model: torch.nn.Module) -> DataConfig:
    config: Any = model.config
    known = processor_defaults(model)
    if known is not None:
        extra = getattr(config, "vitlens_data_config", None)
        return DataConfig(**known) if extra is None else apply_overrides(DataConfig(**known), extra, "model.config")
    hw = int_pair(config.image_size)
    if getattr(config, "model_type", None) == "deit":
        # DeiTImageProcessor: resize to 256 (bicubic), centre-crop 224, ImageNet mean/std → crop_pct = 224/256.
        base = DataConfig(
            input_size=(3, *hw), mean=IMAGENET_DEFAULT_MEAN, std=IMAGENET_DEFAULT_STD, interpolation="bicubic",
            crop_pct=0.875, crop_mode="center",
        )
    else:
        # HF ViT processors resize both sides to image_size (no crop, aspect not kept): 'squash' at crop_pct 1.0.
        base = DataConfig(
            input_size=(3, *hw), mean=HF_VIT_MEAN, std=HF_VIT_STD, interpolation="bilinear", crop_pct=1.0,
            crop_mode="squash",
        )
    extra = getattr(config, "vitlens_data_config", None)
    return base if extra is None else apply_overrides(base, extra, "model.config")


def _is_hf_model(model: Any) -> bool:
    transformers = sys.modules.get("transformers")  # an HF model implies transformers is already imported
    if transformers is None:
        return False
    config = getattr(model, "config", None)
    vision = getattr(config, "vision_config", None)  # CLIP / SigLIP keep the image size in their vision config
    return isinstance(model, transformers.PreTrainedModel) and (hasattr(config, "image_size") or
                                                                hasattr(vision, "image_size"))


def _is_timm_model(model: Any) -> bool:
    return isinstance(getattr(model, "pretrained_cfg", None), Mapping) and "timm" in sys.modules


def model_data_config(model: Any) -> DataConfig:
    """The :class:`~vitlens.preprocessing.DataConfig` of ``model``: for a timm model
    ``timm.data.resolve_model_data_config(model)`` (with ``input_size`` from the model's fixed ``patch_embed.img_size``
    when that differs); for a HuggingFace vision model its processor defaults (:func:`processor_defaults`; other HF
    models: ``config.image_size``, bilinear, squash, ImageNet mean/std for DeiT and 0.5/0.5 otherwise), overridden by
    ``model.config.vitlens_data_config``; any ``nn.Module``'s ``vitlens_data_config`` attribute overrides what was
    derived (timm's defaults for a model of no known family).

    Raises:
        UnsupportedModelError: when none of these applies.
    """
    own = getattr(model, "vitlens_data_config", None) if isinstance(model, torch.nn.Module) else None
    if _is_timm_model(model):
        base = _timm_config(model)
    elif _is_hf_model(model):
        base = _hf_config(model)
    elif own is not None:
        base = DataConfig()
    else:
        raise UnsupportedModelError(
            f"cannot derive a data config from {type(model).__name__} (not a timm or HuggingFace vision model); "
            "pass a config dict such as {'input_size': (3, 224, 224), 'mean': ..., 'std': ...} instead"
        )
    return base if own is None else apply_overrides(base, own, "model")
