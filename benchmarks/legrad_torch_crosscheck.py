"""The numbers tests/test_legrad.py pins: legrad-torch 1.1 on an open_clip ViT holding the weights of the test's timm
ViT, and vitlens' legrad on the timm ViT, side by side.

legrad-torch pins ``open-clip-torch<=2.23.0`` (the project has open_clip 3.x), so it runs in a scratch venv that sees
the project's packages::

    python -m venv /tmp/legrad_venv
    echo /path/to/vitlens/.venv/lib/python3.11/site-packages > /tmp/legrad_venv/lib/python3.11/site-packages/zz.pth
    /tmp/legrad_venv/bin/pip install --no-deps open_clip_torch==2.23.0 legrad-torch==1.1 opencv-python-headless einops
    /tmp/legrad_venv/bin/python benchmarks/legrad_torch_crosscheck.py

Prints the largest difference per ``layer_index`` and legrad-torch's map at the token centres (the pinned values).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "src"), os.path.join(ROOT, "tests")]


def open_clip_copy(m: nn.Module, proj: torch.Tensor) -> nn.Module:
    """An open_clip ``VisionTransformer`` with the weights of the timm ViT ``m`` (see tests/test_legrad.py)."""
    from open_clip.transformer import VisionTransformer

    oc = VisionTransformer(image_size=32, patch_size=8, width=64, layers=len(m.blocks), heads=4, mlp_ratio=4.0,
                           output_dim=proj.shape[1]).eval()
    oc.conv1.weight.data = m.patch_embed.proj.weight.data.clone()
    oc.class_embedding.data = m.cls_token.data[0, 0].clone()
    oc.positional_embedding.data = m.pos_embed.data[0].clone()
    oc.ln_pre.load_state_dict(m.norm_pre.state_dict())
    for rb, b in zip(oc.transformer.resblocks, m.blocks):
        rb.ln_1.load_state_dict(b.norm1.state_dict())
        rb.ln_2.load_state_dict(b.norm2.state_dict())
        rb.attn.in_proj_weight.data = b.attn.qkv.weight.data.clone()
        rb.attn.in_proj_bias.data = b.attn.qkv.bias.data.clone()
        rb.attn.out_proj.load_state_dict(b.attn.proj.state_dict())
        rb.mlp.c_fc.load_state_dict(b.mlp.fc1.state_dict())
        rb.mlp.c_proj.load_state_dict(b.mlp.fc2.state_dict())
    oc.ln_post.load_state_dict(m.fc_norm.state_dict())
    oc.proj.data = proj.clone()
    return oc


class _Holder(nn.Module):
    """What ``LeWrapper`` wraps: ``visual`` and ``encode_image``."""

    def __init__(self, visual: nn.Module) -> None:
        super().__init__()
        self.visual = visual

    def encode_image(self, image: torch.Tensor, normalize: bool = False) -> torch.Tensor:
        f = self.visual(image)
        return F.normalize(f, dim=-1) if normalize else f


def main() -> None:
    from legrad import LeWrapper
    from test_legrad import _clip_like_vit

    from vitlens.explainers import get_method

    model, x = _clip_like_vit()
    proj = model.head[0].weight.data.T.clone()
    text = model.head[2].weight.data.clone()
    oc = open_clip_copy(model, proj)
    for layer_index in (0, -2):
        wrapper = LeWrapper(_Holder(oc), layer_index=layer_index)
        theirs = torch.stack([torch.stack([wrapper.compute_legrad_clip(text_embedding=text[p:p + 1],
                                                                        image=x[i:i + 1])[0, 0].detach()
                                           for p in range(len(text))]) for i in range(len(x))])
        worst = 0.0
        for p in range(len(text)):
            e = get_method("legrad", start_layer=layer_index).explain(model, x, target=[p] * len(x))
            up = F.interpolate(e.token_maps[:, None], scale_factor=8, mode="bilinear")[:, 0]
            lo, hi = up.flatten(1).amin(1)[:, None, None], up.flatten(1).amax(1)[:, None, None]
            worst = max(worst, float(((up - lo) / (hi - lo) - theirs[:, p]).abs().max()))
        print(f"layer_index {layer_index}: max |vitlens - legrad-torch| = {worst:.2e}")
        print("  legrad-torch at the token centres:",
              [[[round(float(v), 6) for v in theirs[i, p, 3::8, 3::8].flatten()] for p in range(len(text))]
               for i in range(len(x))])


if __name__ == "__main__":
    main()
