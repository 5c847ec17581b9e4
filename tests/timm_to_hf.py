"""A HuggingFace ``ViTForImageClassification`` with exactly the weights of a CLS-readout timm ViT.

One copy for the tests (``conftest.timm_to_hf_vit``), the LXT cross-check (``tests/test_lxt_crosscheck.py``, run in
LXT's environment) and ``benchmarks/lxt_side_by_side.py``. A plain module: no pytest, and it works with the
transformers 4.x layout (``attention.attention.query``, ``intermediate.dense``, ...) as well as the 5.x one
(``attention.q_proj``, ``mlp.fc1``, ...); the layout is read from the HF model's own parameter names.
"""

from __future__ import annotations

from typing import Any

#: HF parameter name (inside a layer) -> timm parameter name (inside a block), per transformers layout
_LAYOUTS = {
    "4.x": (("attention.attention.query", "attention.attention.key", "attention.attention.value"),
            {"attention.output.dense": "attn.proj", "layernorm_before": "norm1", "layernorm_after": "norm2",
             "intermediate.dense": "mlp.fc1", "output.dense": "mlp.fc2"}),
    "5.x": (("attention.q_proj", "attention.k_proj", "attention.v_proj"),
            {"attention.o_proj": "attn.proj", "layernorm_before": "norm1", "layernorm_after": "norm2",
             "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2"}),
}


def timm_to_hf_vit(tm: Any, **config: Any) -> Any:
    """``tm``: a timm ``VisionTransformer`` with a CLS readout; ``config``: extra ``ViTConfig`` fields (for example
    ``attn_implementation="eager"``). Returns the HF model in eval mode, loaded with ``strict=True``."""
    from transformers import ViTConfig, ViTForImageClassification

    d = tm.embed_dim
    cfg = ViTConfig(
        image_size=tm.patch_embed.img_size[0], patch_size=tm.patch_embed.patch_size[0], hidden_size=d,
        num_hidden_layers=len(tm.blocks), num_attention_heads=tm.blocks[0].attn.num_heads,
        intermediate_size=tm.blocks[0].mlp.fc1.out_features, num_labels=tm.num_classes, layer_norm_eps=1e-6,
        hidden_act="gelu", qkv_bias=True, **config,
    )
    hm = ViTForImageClassification(cfg).eval()
    sd = tm.state_dict()
    hsd = hm.state_dict()
    layers = "vit.layers" if any(k.startswith("vit.layers.") for k in hsd) else "vit.encoder.layer"
    qkv, pairs = _LAYOUTS["4.x" if f"{layers}.0.attention.attention.query.weight" in hsd else "5.x"]
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
        for j, n in enumerate(qkv):
            new[q + n + ".weight"] = w[j * d:(j + 1) * d]
            new[q + n + ".bias"] = b[j * d:(j + 1) * d]
        for hk, tk in pairs.items():
            new[q + hk + ".weight"] = sd[p + tk + ".weight"]
            new[q + hk + ".bias"] = sd[p + tk + ".bias"]
    hm.load_state_dict(new, strict=True)
    return hm
