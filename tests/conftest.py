"""Tiny deterministic models shared by the tests (seconds on a CPU)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

timm = pytest.importorskip("timm")
from timm.models.vision_transformer import VisionTransformer  # noqa: E402


def sharpen(model: nn.Module, gain: float = 4.0) -> nn.Module:
    """Scale the query/key projections so attention is peaked and heads differ (random init is near-uniform)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("qkv.weight"):
                d = p.shape[0] // 3
                p[: 2 * d].mul_(gain)
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(gain)
    return model


def tiny_vit(seed: int = 0, **kw) -> VisionTransformer:
    """A 3-block, 4-head, 32-px timm ViT with patch 8 (4x4 tokens). ``kw`` override the architecture."""
    torch.manual_seed(seed)
    args = dict(img_size=32, patch_size=8, embed_dim=48, depth=3, num_heads=4, num_classes=5, qkv_bias=True)
    args.update(kw)
    return sharpen(VisionTransformer(**args)).eval()


def tiny_deit_distilled(seed: int = 0, **kw) -> nn.Module:
    from timm.models.deit import VisionTransformerDistilled

    torch.manual_seed(seed)
    args = dict(img_size=32, patch_size=8, embed_dim=48, depth=3, num_heads=4, num_classes=5, qkv_bias=True)
    args.update(kw)
    m = VisionTransformerDistilled(**args)
    with torch.no_grad():  # the distillation head starts as zeros in timm; make both heads matter
        m.head_dist.weight.normal_(0, 0.2)
    return sharpen(m).eval()


#: prefix-token configurations: (name, constructor) — 0 (GAP), 1 (CLS), 2 (distilled), 1 + 4 registers.
VARIANTS = {
    "gap": lambda: tiny_vit(class_token=False, global_pool="avg"),
    "cls": lambda: tiny_vit(),
    "distilled": lambda: tiny_deit_distilled(),
    "cls+4reg": lambda: tiny_vit(reg_tokens=4),
    "gap+4reg": lambda: tiny_vit(reg_tokens=4, global_pool="avg", class_token=False),
}


@pytest.fixture(params=sorted(VARIANTS))
def variant(request):
    return request.param, VARIANTS[request.param]()


def timm_to_hf_vit(tm: VisionTransformer):
    """Build a HuggingFace ViTForImageClassification with exactly the weights of a CLS-readout timm ViT."""
    from transformers import ViTConfig, ViTForImageClassification

    d = tm.embed_dim
    cfg = ViTConfig(
        image_size=tm.patch_embed.img_size[0], patch_size=tm.patch_embed.patch_size[0], hidden_size=d,
        num_hidden_layers=len(tm.blocks), num_attention_heads=tm.blocks[0].attn.num_heads,
        intermediate_size=tm.blocks[0].mlp.fc1.out_features, num_labels=tm.num_classes, layer_norm_eps=1e-6,
        hidden_act="gelu", qkv_bias=True,
    )
    hm = ViTForImageClassification(cfg).eval()
    sd = tm.state_dict()
    hsd = hm.state_dict()
    layers = "vit.layers" if any(k.startswith("vit.layers.") for k in hsd) else "vit.encoder.layer"
    new = {
        "vit.embeddings.cls_token": sd["cls_token"],
        "vit.embeddings.position_embeddings": sd["pos_embed"],
        "vit.embeddings.patch_embeddings.projection.weight": sd["patch_embed.proj.weight"],
        "vit.embeddings.patch_embeddings.projection.bias": sd["patch_embed.proj.bias"],
        "vit.layernorm.weight": sd["norm.weight"], "vit.layernorm.bias": sd["norm.bias"],
        "classifier.weight": sd["head.weight"], "classifier.bias": sd["head.bias"],
    }
    for i in range(len(tm.blocks)):
        p, q = f"blocks.{i}.", f"{layers}.{i}."
        w, b = sd[p + "attn.qkv.weight"], sd[p + "attn.qkv.bias"]
        for j, n in enumerate(["q_proj", "k_proj", "v_proj"]):
            new[q + f"attention.{n}.weight"] = w[j * d:(j + 1) * d]
            new[q + f"attention.{n}.bias"] = b[j * d:(j + 1) * d]
        pairs = {"attention.o_proj": "attn.proj", "layernorm_before": "norm1", "layernorm_after": "norm2",
                 "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2"}
        for hk, tk in pairs.items():
            new[q + hk + ".weight"] = sd[p + tk + ".weight"]
            new[q + hk + ".bias"] = sd[p + tk + ".bias"]
    hm.load_state_dict(new, strict=True)
    return hm


def model_fingerprint(model: nn.Module) -> dict:
    """Everything an explainer could leave changed on a model."""
    import io

    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    state = {
        "weights": buf.getvalue(),
        "training": [(n, m.training) for n, m in model.named_modules()],
        "requires_grad": [(n, p.requires_grad) for n, p in model.named_parameters()],
        "hooks": [
            (n, len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks),
             len(getattr(m, "_backward_pre_hooks", {})))
            for n, m in model.named_modules()
        ],
        "fused": [(n, getattr(m, "fused_attn", None)) for n, m in model.named_modules()],
        "grads": [(n, p.grad is None) for n, p in model.named_parameters()],
    }
    cfg = getattr(model, "config", None)
    if cfg is not None:
        state["attn_impl"] = cfg._attn_implementation
    return state
