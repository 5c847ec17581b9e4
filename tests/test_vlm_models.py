"""Vision–language models (issue #52, item 2): transformers CLIP / SigLIP / SigLIP2 (objects and hf:DIR folders with
their tokenizer), open_clip, timm image towers (ViT, NaFlexVit) with text embeddings. The explainers see the image
tower; GradSkip stays complete for the image–text score; the other methods run or refuse in one line."""

from __future__ import annotations

import pytest
import torch

import vitlens
from vitlens.errors import UnsupportedModelError

from tiny_vlms import hf_model, tokenizer, vlm

PROMPTS = ["a photo of a cat", "a photo of a dog"]


def images(n: int = 2, h: int = 32, w: int = 32, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 3, h, w, generator=torch.Generator().manual_seed(seed))


def complete(e: vitlens.Explanation) -> float:
    """Largest relative gap between map + remainder and the explained score."""
    total = e.token_maps.double().sum((1, 2)) + e.remainder.double()
    return float(((total - e.scores.double()).abs() / e.scores.double().abs().clamp_min(1e-12)).max())


@pytest.mark.parametrize("kind", ["clip", "siglip", "siglip2"])
def test_score_is_the_models_own_logit(kind):
    model, tok = hf_model(kind), tokenizer()
    x = images()
    e = vitlens.explain(vitlens.VisionLanguageModel(model, tok), x, "gradskip", target=vitlens.TextPrompt(PROMPTS))
    padding = {"padding": "max_length", "max_length": 16} if kind != "clip" else {"padding": True}
    enc = tok(PROMPTS, return_tensors="pt", **padding)
    with torch.no_grad():
        if kind == "siglip2":
            from vitlens.models.vlm import naflex_inputs

            out = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], **naflex_inputs(model, x))
        elif kind == "siglip":
            out = model(input_ids=enc["input_ids"], pixel_values=x)
        else:
            out = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], pixel_values=x)
    own = out.logits_per_image.diagonal()  # image i against prompt i
    torch.testing.assert_close(e.scores, own, rtol=1e-5, atol=1e-5)


def test_clip_readout_path_same_maps():
    m, x, t = vlm("clip"), images(3), vitlens.TextPrompt(PROMPTS + ["a ring"])
    adapter = vitlens.get_adapter(m)
    assert adapter.recomputes_attention()  # SDPA: GradSkip keeps the fused attention
    with adapter.readout_only() as active:
        assert active
        with torch.no_grad():
            torch.testing.assert_close(m(x), vlm("clip")(x), rtol=1e-5, atol=1e-6)
    assert "forward" not in vars(adapter.blocks()[-1])  # restored
    fast = vitlens.explain(m, x, "gradskip", target=t)
    full = vitlens.explain(m, x, "gradskip", target=t, readout_path=False)
    torch.testing.assert_close(fast.maps, full.maps, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(fast.scores, full.scores, rtol=1e-5, atol=1e-6)
    assert complete(fast) < 1e-4


@pytest.mark.parametrize("kind", ["clip", "siglip", "siglip2"])
def test_gradskip_complete_for_the_similarity_score(kind):
    e = vitlens.explain(vlm(kind), images(3), "gradskip", target=vitlens.TextPrompt("a photo of a cat"))
    assert e.maps.shape == (3, 32, 32) and e.token_maps.shape == (3, 4, 4)
    assert complete(e) < 1e-4
    assert e.cost.forward_passes == 1 and e.cost.backward_passes == 1


@pytest.mark.parametrize("method,options", [("gradskip", {}), ("attnlrp", {}), ("cplrp", {}), ("gae", {}),
                                            ("gradcam", {}), ("rollout", {}), ("integrated_gradients", {"n_steps": 4}),
                                            ("rise", {"n_masks": 16, "score": "target"})])
@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_methods_run_with_text_targets(kind, method, options):
    if kind == "siglip" and method in ("attnlrp", "cplrp"):
        with pytest.raises(UnsupportedModelError, match="attention-pool head") as err:
            vitlens.explain(vlm(kind), images(), method, target=vitlens.TextPrompt(PROMPTS))
        assert "\n" not in str(err.value)
        return
    e = vitlens.explain(vlm(kind), images(), method, target=vitlens.TextPrompt(PROMPTS), **options)
    assert e.maps.shape == (2, 32, 32) and bool(torch.isfinite(e.maps).all())
    assert e.targets.tolist() == [0, 1]


@pytest.mark.parametrize("method,needs", [("transformer_attribution", "linear_head"), ("rise", "class_logits"),
                                          ("finercam", "class_logits"), ("aha", "class_logits")])
def test_methods_refuse_in_one_line_naming_why(method, needs):
    with pytest.raises(UnsupportedModelError) as err:
        vitlens.explain(vlm("clip"), images(), method, target=vitlens.TextPrompt("a photo of a cat"))
    msg = str(err.value)
    assert "\n" not in msg and needs in msg
    assert "image embedding" in msg  # why: the output is an embedding scored after the tower
    # and the option that lets it run, where one does: RISE scoring the text target itself needs no class logits
    assert ("runs on it with score='target'" in msg) == (method == "rise")


def test_the_way_out_keeps_the_other_options_and_is_none_where_no_option_helps():
    from vitlens.explainers import get_method
    from vitlens.explainers.support import way_out, why_not
    from vitlens.models import get_adapter

    adapter = get_adapter(vlm("clip"))
    assert way_out(adapter, get_method("rise", n_masks=5, grid_size=3)) == "score='target'"
    assert way_out(adapter, "finercam") is None  # needs class logits whatever its options
    assert str(why_not(adapter, "rise")).endswith("; it runs with score='target'")  # `vitlens conformance` says so
    assert "runs with" not in str(why_not(adapter, "finercam"))
    e = vitlens.explain(vlm("clip"), images(), "rise", target=vitlens.TextPrompt("a photo of a cat"), n_masks=5,
                        grid_size=3, score="target")  # the way out runs
    assert bool(torch.isfinite(e.maps).all())


def test_hf_folder_with_its_tokenizer(tmp_path):
    model, tok = hf_model("clip"), tokenizer()
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded = vitlens.load_model(f"hf:{tmp_path}")
    assert isinstance(loaded, vitlens.VisionLanguageModel) and loaded.tokenizer is not None
    x, t = images(), vitlens.TextPrompt(PROMPTS)
    got = vitlens.explain(loaded, x, "gradskip", target=t)
    want = vitlens.explain(vitlens.VisionLanguageModel(model, tok), x, "gradskip", target=t)
    torch.testing.assert_close(got.scores, want.scores)
    torch.testing.assert_close(got.maps, want.maps)
    assert vitlens.images.data_config(loaded).size_hw == (32, 32)


def test_siglip2_runs_other_sizes_on_its_grid():
    e = vitlens.explain(vlm("siglip2"), images(2, 32, 48), "gradskip", target=vitlens.TextPrompt("a photo of a dog"))
    assert e.token_maps.shape == (2, 4, 6) and complete(e) < 1e-4


def _open_clip_model():
    open_clip = pytest.importorskip("open_clip")
    torch.manual_seed(0)
    model = open_clip.CLIP(embed_dim=32, vision_cfg=dict(image_size=32, layers=2, width=64, head_width=32,
                                                         patch_size=8),
                           text_cfg=dict(context_length=16, vocab_size=49408, width=32, heads=2, layers=2)).eval()
    return model, open_clip.get_tokenizer("ViT-B-16", context_length=16)


def test_open_clip_random_weights():
    model, tok = _open_clip_model()
    m = vitlens.VisionLanguageModel(model, tok)
    x = images()
    adapter = vitlens.get_adapter(m)
    assert adapter.family == "vlm(open_clip-vit)"
    with torch.no_grad():
        before = m(x)
        with adapter.session(capture=True) as rec:
            during = m(x)
    torch.testing.assert_close(during, before, rtol=1e-5, atol=1e-6)  # probabilities recomputed, same output
    assert rec.blocks[0].attn.shape == (2, 2, 17, 17)
    e = vitlens.explain(m, x, "gradskip", target=vitlens.TextPrompt(PROMPTS))
    assert complete(e) < 1e-4
    with torch.no_grad():
        own = model.logit_scale.exp() * torch.nn.functional.cosine_similarity(
            model.encode_image(x), model.encode_text(tok(PROMPTS)), dim=-1)
    torch.testing.assert_close(e.scores, own, rtol=1e-5, atol=1e-5)
    assert not any(mod._forward_hooks or mod._forward_pre_hooks for mod in model.modules())  # all removed
    with pytest.raises(UnsupportedModelError, match="packed in_proj"):
        vitlens.explain(m, x, "attnlrp", target=vitlens.TextPrompt(PROMPTS))


def test_timm_tower_with_text_embeddings():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    tower = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=0, img_size=32, depth=2).eval()
    text = torch.randn(2, 192)
    x = images()
    direct = vitlens.explain(tower, x, "gradskip", target=vitlens.TextEmbedding(text, scale=50.0))
    wrapped = vitlens.VisionLanguageModel(tower, text_embeddings={"a": text[0], "b": text[1]}, scale=50.0)
    via_prompt = vitlens.explain(wrapped, x, "gradskip", target=vitlens.TextPrompt(["a", "b"]))
    torch.testing.assert_close(direct.scores, via_prompt.scores)
    torch.testing.assert_close(direct.maps, via_prompt.maps)
    assert complete(direct) < 1e-4
    with torch.no_grad():
        want = 50.0 * torch.nn.functional.cosine_similarity(tower(x), text, dim=-1)
    torch.testing.assert_close(direct.scores, want, rtol=1e-5, atol=1e-5)


def test_naflexvit_siglip2_tower():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    tower = timm.create_model("naflexvit_base_patch16_siglip", pretrained=False, depth=2, embed_dim=64, num_heads=2,
                              num_classes=0).eval()
    adapter = vitlens.get_adapter(tower)
    assert adapter.family == "timm-naflexvit" and adapter.provides("attention") and adapter.readout_tokens is None
    x = images(2, 32, 48)
    target = vitlens.TextEmbedding(torch.randn(64), scale=10.0, bias=-1.0)
    e = vitlens.explain(tower, x, "gradskip", target=target)
    assert e.token_maps.shape == (2, 2, 3) and complete(e) < 1e-4
    for method in ("gae", "gradcam", "rollout"):
        assert vitlens.explain(tower, x, method, target=target).maps.shape == (2, 32, 48)
    m = vitlens.VisionLanguageModel(tower, text_embeddings={"x": torch.randn(64)})
    assert vitlens.get_adapter(m).family == "vlm(timm-naflexvit)"
    assert complete(vitlens.explain(m, x, "gradskip", target=vitlens.TextPrompt("x"))) < 1e-4


def test_model_restored_after_an_exception():
    m = vlm("clip")
    before = {k: v.clone() for k, v in m.state_dict().items()}
    flags = [p.requires_grad for p in m.parameters()]
    impl = m.model.config._attn_implementation

    class Boom(vitlens.TextPrompt):
        def score(self, logits):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        vitlens.explain(m, images(), "gradskip", target=Boom("a photo of a cat"))
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    assert [p.requires_grad for p in m.parameters()] == flags
    assert m.model.config._attn_implementation == impl
    assert not any(mod._forward_hooks or mod._forward_pre_hooks for mod in m.modules())


@pytest.mark.slow  # a ViT-B image tower at 224 px (open_clip's SigLIP configs name timm's, nothing smaller)
def test_open_clip_with_a_timm_siglip_tower():
    open_clip = pytest.importorskip("open_clip")
    torch.manual_seed(0)
    model = open_clip.CustomTextCLIP(
        embed_dim=64, init_logit_bias=-10.0,
        vision_cfg=dict(timm_model_name="vit_base_patch16_siglip_224", timm_model_pretrained=False,
                        timm_proj="linear", image_size=224),
        text_cfg=dict(context_length=16, vocab_size=49408, width=64, heads=2, layers=2)).eval()
    tok = open_clip.get_tokenizer("ViT-B-16", context_length=16)
    m = vitlens.VisionLanguageModel(model, tok)
    assert vitlens.get_adapter(m).family == "vlm(timm-vit)" and m.bias == -10.0
    x = images(2, 224, 224)
    e = vitlens.explain(m, x, "gradskip", target=vitlens.TextPrompt(PROMPTS))
    assert complete(e) < 1e-4
    with torch.no_grad():
        own = model.logit_scale.exp() * (model.encode_image(x, normalize=True)
                                         * model.encode_text(tok(PROMPTS), normalize=True)).sum(-1) + model.logit_bias
    torch.testing.assert_close(e.scores, own, rtol=1e-5, atol=1e-5)
