"""LeGrad: its definition (per-layer autograd, as the paper and legrad-torch write it), the numbers of the reference
implementation ``legrad-torch`` pinned on a model both accept, and its refusals."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import vitlens
from vitlens.errors import InputError, UnsupportedModelError
from vitlens.explainers import get_method

from conftest import tiny_deit_distilled, tiny_vit


def _per_layer_reference(model: nn.Module, x: torch.Tensor, start: int = 0) -> torch.Tensor:
    """LeGrad written out the slow way: one autograd call per block on the explicit attention of a timm ViT."""
    attns, feats, hooks = {}, {}, []
    for i, blk in enumerate(model.blocks):
        blk.attn.fused_attn = False
        hooks.append(blk.attn.attn_drop.register_forward_hook(lambda m, a, o, i=i: attns.__setitem__(i, o)))
        hooks.append(blk.register_forward_hook(lambda m, a, o, i=i: feats.__setitem__(i, o)))
    try:
        logits = model(x)
        c = logits.argmax(-1)
        total = 0
        p = model.num_prefix_tokens
        for layer in range(start % len(model.blocks), len(model.blocks)):
            s = model.forward_head(model.norm(feats[layer]))[torch.arange(len(c)), c].sum()
            (g,) = torch.autograd.grad(s, attns[layer], retain_graph=True)
            total = total + g.clamp_min(0).mean(1).mean(1)[:, p:]
    finally:
        for h in hooks:
            h.remove()
        for blk in model.blocks:
            blk.attn.fused_attn = True
    lo, hi = total.amin(-1, keepdim=True), total.amax(-1, keepdim=True)
    return ((total - lo) / (hi - lo)).reshape(len(x), 4, 4)


_MODELS = [tiny_vit, tiny_deit_distilled, partial(tiny_vit, class_token=False, global_pool="avg"),
           partial(tiny_vit, reg_tokens=2)]


@pytest.mark.parametrize("make", _MODELS, ids=["cls", "distilled", "gap", "cls+reg"])
@pytest.mark.parametrize("start", [0, -2])
def test_one_backward_equals_one_autograd_call_per_layer(make, start):
    model = make()
    x = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    e = get_method("legrad", start_layer=start).explain(model, x)
    torch.testing.assert_close(e.token_maps, _per_layer_reference(model, x, start), atol=2e-5, rtol=0)
    assert e.cost.forward_passes == 1 and e.cost.backward_passes == 1
    assert float(e.token_maps.amin()) == 0.0 and float(e.token_maps.amax()) == 1.0


class _Normalize(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(x, dim=-1)


def _clip_like_vit(seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    """A timm ViT whose readout is legrad-torch's CLIP readout: the mean over every token (CLS included), LayerNorm,
    projection, normalised, scored against two fixed unit text embeddings (logit = cosine similarity)."""
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(seed)
    m = VisionTransformer(img_size=32, patch_size=8, embed_dim=64, depth=3, num_heads=4, mlp_ratio=4.0, pre_norm=True,
                          global_pool="avg", pool_include_prefix=True, fc_norm=True, num_classes=2,
                          norm_layer=partial(nn.LayerNorm, eps=1e-5))
    for p in m.parameters():
        p.data.normal_(0, 0.2)
    proj = torch.randn(64, 16) * 0.2
    text = F.normalize(torch.randn(2, 16), dim=-1)
    head = nn.Sequential(nn.Linear(64, 16, bias=False), _Normalize(), nn.Linear(16, 2, bias=False))
    head[0].weight.data = proj.T.clone()
    head[2].weight.data = text.clone()
    m.head = head
    x = torch.randn(2, 3, 32, 32)
    return m.eval(), x


#: legrad-torch 1.1 (``LeWrapper(model, layer_index).compute_legrad_clip(text, image)``, open_clip 2.23.0, in a
#: scratch venv: its pin ``open-clip-torch<=2.23.0`` conflicts with the project's open_clip) on an open_clip
#: ``VisionTransformer`` holding the weights of :func:`_clip_like_vit` (conv1, class/positional embeddings, ln_pre, the
#: blocks, ln_post = fc_norm, proj), one image and one prompt per call; the map (B, 1, 32, 32) sampled at pixels
#: (3 + 8i, 3 + 8j), per layer_index, image, prompt. Script: benchmarks/legrad_torch_crosscheck.py.
LEGRAD_TORCH = {
    0: [
        [[0.319147, 0.931439, 0.418282, 0.314565, 0.191204, 0.918840, 0.613768, 0.097592, 0.986257, 0.258412, 0.425902,
          0.130337, 0.442400, 0.263729, 0.923299, 0.067170],
         [0.564080, 0.328891, 0.490244, 0.731354, 0.713208, 0.259773, 0.606889, 0.730105, 0.029460, 0.500261, 0.612458,
          0.697231, 0.235006, 0.553938, 0.278078, 0.936081]],
        [[0.701336, 0.024228, 0.292777, 0.779047, 0.687924, 0.804102, 0.150353, 0.930632, 0.835488, 0.764654, 0.211574,
          0.362312, 0.990337, 0.463865, 0.250095, 0.424716],
         [0.000000, 0.782475, 0.503938, 0.127313, 0.448572, 0.368145, 0.969998, 0.456667, 0.172117, 0.296903, 0.853188,
          0.882489, 0.081877, 0.378524, 0.784160, 0.659329]],
    ],
    -2: [
        [[0.796787, 0.590566, 0.716801, 0.177366, 0.012650, 0.000000, 0.388756, 0.387596, 0.714662, 0.965828, 0.911435,
          0.962238, 0.366365, 0.386244, 0.368398, 0.805727],
         [0.445802, 0.634464, 0.110510, 0.541284, 0.390674, 0.101204, 0.382020, 0.766095, 0.788775, 0.626899, 0.011447,
          0.931798, 0.988472, 0.814348, 0.202507, 0.417800]],
        [[0.069001, 0.417787, 0.972682, 0.487837, 0.224607, 0.462141, 0.515319, 0.512654, 0.719734, 0.449722, 0.351396,
          0.715322, 0.470149, 0.210465, 0.021406, 0.923758],
         [0.725623, 0.790470, 0.422712, 0.488068, 0.986355, 0.603686, 0.007891, 0.421784, 0.499062, 0.863492, 0.775872,
          0.983533, 0.804929, 0.557366, 0.462818, 0.513822]],
    ],
}


@pytest.mark.parametrize("start", [0, -2])
def test_matches_legrad_torch(start):
    """legrad-torch min-max normalises the bilinear upsampling (× patch size) of the layers' sum; the min-max of the
    token map commutes with that upsampling (an affine map per image), so the same steps on vitlens' token map
    must give its numbers."""
    model, x = _clip_like_vit()
    for prompt in range(2):
        e = get_method("legrad", start_layer=start).explain(model, x, target=[prompt, prompt])
        up = F.interpolate(e.token_maps[:, None], scale_factor=8, mode="bilinear")[:, 0]
        lo, hi = up.flatten(1).amin(1)[:, None, None], up.flatten(1).amax(1)[:, None, None]
        ours = ((up - lo) / (hi - lo))[:, 3::8, 3::8].flatten(1)
        want = torch.tensor([LEGRAD_TORCH[start][i][prompt] for i in range(2)])
        torch.testing.assert_close(ours, want, atol=2e-5, rtol=0)


def test_refusals_and_options():
    with pytest.raises(InputError, match="start_layer"):
        get_method("legrad", start_layer=1.5)
    with pytest.raises(InputError, match="out of range"):
        get_method("legrad", start_layer=3).explain(tiny_vit(), torch.randn(1, 3, 32, 32))
    assert "legrad" in vitlens.methods()
    cnn = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))
    with pytest.raises(UnsupportedModelError, match="legrad"):
        get_method("legrad").explain(cnn, torch.randn(1, 3, 16, 16))


def test_hf_vit_with_timm_weights_gives_the_same_maps():
    """HF ViT reads every layer through its own final layernorm and classifier (``HFViTAdapter.stream_logits``):
    with the weights of a timm ViT it gives the timm model's LeGrad maps; DeiT with teacher averages its two heads."""
    transformers = pytest.importorskip("transformers")
    from timm_to_hf import timm_to_hf_vit

    tm = tiny_vit()
    hm = timm_to_hf_vit(tm)
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(4))
    a = get_method("legrad").explain(tm, x)
    b = get_method("legrad").explain(hm, x)
    assert torch.equal(a.targets, b.targets)
    torch.testing.assert_close(a.token_maps, b.token_maps, atol=1e-4, rtol=0)
    cfg = transformers.DeiTConfig(image_size=32, patch_size=8, hidden_size=48, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=96, num_labels=5)
    torch.manual_seed(0)
    deit = transformers.DeiTForImageClassificationWithTeacher(cfg).eval()
    adapter = vitlens.get_adapter(deit)
    with torch.no_grad(), adapter.session(capture=True) as rec:
        logits = adapter.forward(x)
        torch.testing.assert_close(adapter.stream_logits(rec.final), logits)
    assert get_method("legrad").explain(deit, x).token_maps.shape == (2, 4, 4)
