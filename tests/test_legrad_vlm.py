"""LeGrad on vision–language models with text targets (issues 52/53): ``VLMAdapter.stream_logits`` reads the model's
output from the image tower's residual stream (the tower's own readout, then what the model applies after the tower,
then for a ``ZeroShotClassifier`` the prompt scores), so every block's score is the model's own score function."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import vitlens
from vitlens.errors import UnsupportedModelError

from tiny_vlms import hf_model, tokenizer

PROMPTS = ["a ring", "a triangle"]


def images(n: int = 2, h: int = 32, w: int = 32, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 3, h, w, generator=torch.Generator().manual_seed(seed))


def _timm_tower(naflex: bool = False) -> nn.Module:
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    if naflex:
        return timm.create_model("naflexvit_base_patch16_siglip", pretrained=False, depth=2, embed_dim=64,
                                 num_heads=2, num_classes=0).eval()
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=0, img_size=32, depth=2).eval()


def _tower_vlm(naflex: bool) -> vitlens.VisionLanguageModel:
    tower = _timm_tower(naflex)
    dim = 64 if naflex else 192
    text = torch.randn(len(PROMPTS), dim, generator=torch.Generator().manual_seed(2))
    return vitlens.VisionLanguageModel(tower, text_embeddings=dict(zip(PROMPTS, text)), scale=20.0)


def _open_clip_vlm(timm_trunk: bool = False) -> vitlens.VisionLanguageModel:
    """open_clip's own ViT, or (``timm_trunk``) a timm ViT trunk with open_clip's projection head after it."""
    open_clip = pytest.importorskip("open_clip")
    torch.manual_seed(0)
    vision = dict(image_size=32, timm_model_name="vit_tiny_patch16_224", timm_model_pretrained=False, timm_pool="",
                  timm_proj="linear") if timm_trunk else dict(image_size=32, layers=2, width=64, head_width=32,
                                                                 patch_size=8)
    model = open_clip.CLIP(embed_dim=32, vision_cfg=vision,
                           text_cfg=dict(context_length=16, vocab_size=49408, width=32, heads=2, layers=2)).eval()
    if timm_trunk:
        model.visual.set_input_size(32)
    return vitlens.VisionLanguageModel(model, open_clip.get_tokenizer("ViT-B-16", context_length=16))


_SHAPES_CLIP: dict[str, vitlens.VisionLanguageModel] = {}


def build(kind: str) -> tuple[vitlens.VisionLanguageModel, torch.Tensor]:
    """A vision–language model of ``kind`` and two images it takes."""
    if kind in ("clip", "siglip", "siglip2"):
        return vitlens.VisionLanguageModel(hf_model(kind), tokenizer()), images()
    if kind == "shapes-clip":
        if "m" not in _SHAPES_CLIP:
            _SHAPES_CLIP["m"] = vitlens.VisionLanguageModel(vitlens.load_model("shapes-clip"))
        m = _SHAPES_CLIP["m"]
        h, w = vitlens.get_adapter(m).default_size or (64, 64)
        return m, images(2, h, w)
    if kind == "open_clip":
        return _open_clip_vlm(), images()
    if kind == "open_clip-timm":
        m = _open_clip_vlm(timm_trunk=True)
        assert vitlens.get_adapter(m).family == "vlm(timm-vit)"
        return m, images()
    if kind == "timm-tower":
        return _tower_vlm(naflex=False), images()
    if kind == "naflexvit-tower":
        return _tower_vlm(naflex=True), images(2, 32, 48)
    raise ValueError(kind)


KINDS = ["clip", "siglip", "siglip2", "shapes-clip", "open_clip", "open_clip-timm", "timm-tower", "naflexvit-tower"]


def last_block_tokens(adapter: vitlens.models.Adapter, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's output and its image tower's last block output ``(B, T, D)`` (read by a hook of the test's own)."""
    seen: list[torch.Tensor] = []

    def hook(module: nn.Module, args: tuple, output: object) -> None:
        seen.append(output[0] if isinstance(output, (tuple, list)) else output)  # type: ignore[arg-type]

    handle = adapter.blocks()[-1].register_forward_hook(hook)
    try:
        with torch.no_grad():
            out = adapter.forward(x)
    finally:
        handle.remove()
    assert len(seen) == 1 and seen[0].ndim == 3
    return out, seen[0]


@pytest.mark.parametrize("zero_shot", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_stream_logits_of_the_last_block_is_the_models_output(kind, zero_shot):
    m, x = build(kind)
    model: nn.Module = vitlens.ZeroShotClassifier(m, PROMPTS) if zero_shot else m
    adapter = vitlens.get_adapter(model)
    assert adapter.provides("stream_head"), adapter.capability_notes.get("stream_head")
    out, tokens = last_block_tokens(adapter, x)
    assert out.shape == ((2, len(PROMPTS)) if zero_shot else (2, out.shape[1]))
    with torch.no_grad():
        got = adapter.stream_logits(tokens)
    torch.testing.assert_close(got, out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_legrad_with_text_prompts(kind):
    m, x = build(kind)
    h, w = x.shape[-2:]
    e = vitlens.explain(m, x, "legrad", target=vitlens.TextPrompt(PROMPTS))
    assert e.maps.shape == (2, h, w) and bool(torch.isfinite(e.maps).all())
    assert float(e.token_maps.min()) >= 0 and float(e.token_maps.max()) <= 1
    assert e.targets.tolist() == [0, 1]
    # the explained score is the model's own image–text score
    with torch.no_grad():
        want = m.similarity(m(x), m.encode_text(PROMPTS)).diagonal()
    torch.testing.assert_close(e.scores, want, rtol=1e-5, atol=1e-5)
    # batch-equivariant: each image alone (with its prompt) gives its row of the batch's maps
    alone = [vitlens.explain(m, x[i:i + 1], "legrad", target=vitlens.TextPrompt(PROMPTS[i])).token_maps
             for i in range(2)]
    torch.testing.assert_close(torch.cat(alone), e.token_maps, rtol=1e-4, atol=1e-5)
    # two prompts explain differently
    a = vitlens.explain(m, x, "legrad", target=vitlens.TextPrompt(PROMPTS[0])).token_maps
    b = vitlens.explain(m, x, "legrad", target=vitlens.TextPrompt(PROMPTS[1])).token_maps
    assert float((a - b).abs().max()) > 1e-3


@pytest.mark.parametrize("kind", ["clip", "siglip", "shapes-clip"])
def test_zero_shot_prompt_map_equals_the_text_prompt_map(kind):
    m, x = build(kind)
    zs = vitlens.ZeroShotClassifier(m, PROMPTS)
    for k in range(len(PROMPTS)):
        by_class = vitlens.explain(zs, x, "legrad", target=k, start_layer=-2)
        by_text = vitlens.explain(m, x, "legrad", target=vitlens.TextPrompt(PROMPTS[k]), start_layer=-2)
        torch.testing.assert_close(by_class.token_maps, by_text.token_maps, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(by_class.scores, by_text.scores, rtol=1e-5, atol=1e-5)


class _UnknownCLIP(nn.Module):
    """A model with the transformers CLIP interface whose image features apply something vitlens cannot know."""

    def __init__(self) -> None:
        super().__init__()
        self.vision_model = _timm_tower()
        self.extra = nn.Linear(192, 16)
        self.text = nn.Embedding(4, 16)
        self.logit_scale = nn.Parameter(torch.tensor(2.0))

    def get_image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.extra(self.vision_model(pixel_values).tanh())

    def get_text_features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.text(input_ids).mean(1)


def test_refuses_in_one_line_where_the_step_after_the_tower_is_unknown():
    m = vitlens.VisionLanguageModel(_UnknownCLIP().eval(), text_embeddings={"a ring": torch.randn(16)})
    adapter = vitlens.get_adapter(m)
    assert not adapter.provides("stream_head")
    with pytest.raises(UnsupportedModelError) as err:
        vitlens.explain(m, images(), "legrad", target=vitlens.TextPrompt("a ring"))
    msg = str(err.value)
    assert "\n" not in msg and "stream_head" in msg and "after its image tower" in msg
    with pytest.raises(UnsupportedModelError, match="after its image tower"):
        adapter.stream_logits(torch.randn(2, 5, 192))
    # the other methods still run on it
    e = vitlens.explain(m, images(), "gradskip", target=vitlens.TextPrompt("a ring"))
    assert bool(torch.isfinite(e.maps).all())


def test_model_unchanged_after_legrad():
    m, x = build("clip")
    before = {k: v.clone() for k, v in m.state_dict().items()}
    modes = [mod.training for mod in m.modules()]
    vitlens.explain(m, x, "legrad", target=vitlens.TextPrompt(PROMPTS))
    assert not any(mod._forward_hooks or mod._forward_pre_hooks for mod in m.modules())
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    assert [mod.training for mod in m.modules()] == modes
