"""Architecture of the bundled ``shapes-segformer`` model (registered in :data:`vitlens.models.zoo.BUNDLED`).

``shapes-segformer``
    HuggingFace ``transformers.SegformerForSemanticSegmentation`` (a small Mix Transformer encoder + the all-MLP
    decode head) for 64×64 multi-object synthetic scenes (:func:`vitlens.data.make_multi_scenes`), 7 labels:
    ``0`` = background, ``k + 1`` = class ``CLASS_NAMES[k]`` (:data:`SEGFORMER_LABELS`).

    Encoder: 4 stages with overlapping patch embeddings (kernels 7/3/3/3, strides 4/2/2/2 → token grids 16×16, 8×8,
    4×4, 2×2 for a 64-px input), widths 32/64/128/160, 2 blocks per stage, 1/2/4/5 heads, MLP ratio 4. The
    spatial-reduction ratios of the efficient self-attention are 4/2/1/1 instead of SegFormer-B0's 8/4/2/1 (which is
    sized for 512-px inputs): every stage then attends over a 4×4 (stages 1–2) or its full (stages 3–4) key grid.
    Decoder width 64. No dropout, no stochastic depth. ``attn_implementation="eager"`` (attention probabilities are
    materialised, which is what attention-reading explainers need; the sequences are short so it costs nothing).

    **Output resolution:** like every HF SegFormer, ``model(pixel_values=x).logits`` is ``(B, 7, H/4, W/4)`` — a
    quarter of the input size (16×16 for 64×64 inputs). Upsample bilinearly
    (``F.interpolate(logits, size=(H, W), mode="bilinear", align_corners=False)``) before taking the per-pixel
    argmax; the model card's mIoU and pixel accuracy are measured that way, at the input resolution.

    Input: RGB in ``[0, 1]`` normalised as ``(x - 0.5) / 0.25`` per channel (the same as ``shapes-vit``); the values
    are in ``model.config.vitlens_data_config`` (with ``model.config.image_size = 64``), which is what
    :func:`vitlens.images.data_config` reads. Other input sizes work too (nothing in the model is tied to 64 px);
    for sides that are multiples of 4 the logits are exactly ``H/4 × W/4``.

Example::

    import torch.nn.functional as F
    import vitlens
    from vitlens.data import make_multi_scenes
    model = vitlens.load_model("shapes-segformer")                 # offline, eval mode
    s = make_multi_scenes(8, seed=123)
    cfg = model.config.vitlens_data_config
    mean = torch.tensor(cfg["mean"]).view(1, 3, 1, 1)
    std = torch.tensor(cfg["std"]).view(1, 3, 1, 1)
    logits = model(pixel_values=(s.images - mean) / std).logits      # (8, 7, 16, 16)
    pred = F.interpolate(logits, size=(64, 64), mode="bilinear", align_corners=False).argmax(1)  # (8, 64, 64)
"""

from __future__ import annotations

from typing import Any

from vitlens.data.scenes import CLASS_NAMES

__all__ = [
    "SEGFORMER_LABELS",
    "SHAPES_SEGFORMER_MEAN",
    "SHAPES_SEGFORMER_STD",
    "SHAPES_SEGFORMER_SIZE",
    "build_shapes_segformer",
]

#: Output labels of ``shapes-segformer``: index 0 is the background, ``k + 1`` is ``CLASS_NAMES[k]``.
SEGFORMER_LABELS: tuple[str, ...] = ("background",) + tuple(CLASS_NAMES)
#: Per-channel normalisation: ``x_norm = (x - mean) / std`` for ``x`` in ``[0, 1]`` (same as ``shapes-vit``).
SHAPES_SEGFORMER_MEAN: tuple[float, float, float] = (0.5, 0.5, 0.5)
SHAPES_SEGFORMER_STD: tuple[float, float, float] = (0.25, 0.25, 0.25)
#: Input side the model was trained at, in pixels.
SHAPES_SEGFORMER_SIZE: int = 64


def build_shapes_segformer() -> Any:
    """Build the (untrained) ``shapes-segformer`` architecture.

    Returns:
        ``transformers.SegformerForSemanticSegmentation`` with 7 labels (:data:`SEGFORMER_LABELS`), widths
        32/64/128/160, depths 2/2/2/2, heads 1/2/4/5, spatial-reduction ratios 4/2/1/1, decoder width 64, eager
        attention. Input ``pixel_values (B, 3, H, W)`` normalised with :data:`SHAPES_SEGFORMER_MEAN` /
        :data:`SHAPES_SEGFORMER_STD` (``H, W`` multiples of 4); output ``.logits (B, 7, H/4, W/4)``.
        ``model.config.vitlens_data_config`` holds the data config, ``model.config.id2label`` the label names.
    """
    try:
        from transformers import SegformerConfig, SegformerForSemanticSegmentation
    except ImportError as exc:  # pragma: no cover - transformers is an optional dependency
        raise ImportError(
            "the bundled shapes-segformer model needs transformers; install it with: pip install 'vitlens[hf]'"
        ) from exc

    # num_labels and attn_implementation are PretrainedConfig keywords: accepted at run time, though transformers 5's
    # typed SegformerConfig signature lists only the model's own settings
    base_settings: dict[str, Any] = {"num_labels": len(SEGFORMER_LABELS), "attn_implementation": "eager"}
    config = SegformerConfig(
        num_channels=3,
        num_encoder_blocks=4,
        depths=[2, 2, 2, 2],
        sr_ratios=[4, 2, 1, 1],
        hidden_sizes=[32, 64, 128, 160],
        patch_sizes=[7, 3, 3, 3],
        strides=[4, 2, 2, 2],
        num_attention_heads=[1, 2, 4, 5],
        mlp_ratios=[4, 4, 4, 4],
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        classifier_dropout_prob=0.0,
        drop_path_rate=0.0,
        decoder_hidden_size=64,
        id2label=dict(enumerate(SEGFORMER_LABELS)),
        label2id={name: i for i, name in enumerate(SEGFORMER_LABELS)},
        **base_settings,
    )
    # what vitlens.images.data_config reads for HuggingFace models (the processor of this model is not shipped)
    config.image_size = SHAPES_SEGFORMER_SIZE
    config.vitlens_data_config = {
        "input_size": (3, SHAPES_SEGFORMER_SIZE, SHAPES_SEGFORMER_SIZE),
        "mean": SHAPES_SEGFORMER_MEAN,
        "std": SHAPES_SEGFORMER_STD,
        "interpolation": "bilinear",
        "crop_pct": 1.0,
        "crop_mode": "squash",
    }
    model = SegformerForSemanticSegmentation(config)
    return model
