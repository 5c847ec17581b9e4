"""Architecture of the bundled ``digits-vit`` model (registered in :data:`vitlens.models.zoo.BUNDLED`).

``digits-vit``
    timm ``VisionTransformer`` for 28×28 handwritten digits (:func:`vitlens.data.load_mnist5k`): patch 7 (a 4×4 token
    grid + CLS token), CLS-token readout, 6 blocks, 6 heads, width 192, MLP ratio 4, 10 classes ``"0"``…``"9"``.
    Input: RGB in ``[0, 1]`` (the grey digit replicated into three channels), normalised per channel as
    ``(x - 0.1307) / 0.3081`` — MNIST's pixel mean and standard deviation (the 5,000-image subset measures 0.1313 and
    0.3086). The values are in ``model.pretrained_cfg`` (``mean``/``std``), which is what
    ``timm.data.resolve_model_data_config(model)`` and :func:`vitlens.load_images` read. ``dynamic_img_size=True``:
    other input sizes that are multiples of 7 are accepted (position embeddings interpolated).

Example::

    import vitlens
    from vitlens.data import load_mnist5k, split_mnist5k
    model = vitlens.load_model("digits-vit")                         # offline, eval mode
    _, test = split_mnist5k(load_mnist5k())
    mean = torch.tensor(model.pretrained_cfg["mean"]).view(1, 3, 1, 1)
    std = torch.tensor(model.pretrained_cfg["std"]).view(1, 3, 1, 1)
    x = (test.images[:8] - mean) / std                               # (8, 3, 28, 28)
    explanation = vitlens.explain(model, x, method="gradskip")       # token_maps (8, 4, 4)
"""

from __future__ import annotations

from typing import Any

from vitlens.data.digits import DIGIT_CLASS_NAMES

__all__ = ["DIGITS_MEAN", "DIGITS_STD", "build_digits_vit"]

#: Per-channel normalisation of ``digits-vit``: ``x_norm = (x - mean) / std`` for ``x`` in ``[0, 1]``.
DIGITS_MEAN: tuple[float, float, float] = (0.1307, 0.1307, 0.1307)
DIGITS_STD: tuple[float, float, float] = (0.3081, 0.3081, 0.3081)


def build_digits_vit() -> Any:
    """Build the (untrained) ``digits-vit`` architecture.

    Returns:
        ``timm.models.vision_transformer.VisionTransformer``: img_size 28, patch 7 (4×4 token grid + CLS token),
        embed_dim 192, depth 6, 6 heads, MLP ratio 4, 10 classes, CLS-token readout, ``dynamic_img_size=True``.
        Input ``(B, 3, H, W)`` normalised with :data:`DIGITS_MEAN`/:data:`DIGITS_STD`; output logits ``(B, 10)``.
        ``model.pretrained_cfg`` (also aliased as ``model.default_cfg``) holds the data config and label names.
    """
    try:
        from timm.models.vision_transformer import VisionTransformer
    except ImportError as exc:  # pragma: no cover - timm is an optional dependency
        raise ImportError(
            "the bundled digits-vit model needs timm; install it with: pip install 'vitlens[timm]'"
        ) from exc

    model = VisionTransformer(
        img_size=28,
        patch_size=7,
        in_chans=3,
        num_classes=len(DIGIT_CLASS_NAMES),
        embed_dim=192,
        depth=6,
        num_heads=6,
        mlp_ratio=4.0,
        class_token=True,
        global_pool="token",
        dynamic_img_size=True,
    )
    cfg = {
        "architecture": "vit_digits_patch7_28",
        "input_size": (3, 28, 28),
        "mean": DIGITS_MEAN,
        "std": DIGITS_STD,
        "interpolation": "bilinear",
        "crop_pct": 1.0,
        "crop_mode": "center",
        "num_classes": len(DIGIT_CLASS_NAMES),
        "label_names": tuple(DIGIT_CLASS_NAMES),
        "first_conv": "patch_embed.proj",
        "classifier": "head",
        "license": "apache-2.0",
    }
    setattr(model, "pretrained_cfg", cfg)  # a plain attribute (nn.Module.__setattr__ is typed for tensors/modules)
    setattr(model, "default_cfg", cfg)  # timm's backwards-compatible alias
    return model
