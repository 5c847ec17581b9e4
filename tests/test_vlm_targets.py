"""Text targets (issue #52, item 1): TextPrompt, TextContrast, TextEmbedding and ZeroShotClassifier — the model's own
image–text score, text embeddings computed once per distinct prompt and reused, clear one-line errors, and every
class-based metric over a prompt set."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import vitlens
from vitlens.errors import InputError, TargetError

from tiny_vlms import vlm

CAT, DOG, RING = "a photo of a cat", "a photo of a dog", "a ring"


def images(n: int = 3, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


class Counting:
    """Counts the prompts the text encoder is asked for (wraps ``get_text_features``)."""

    def __init__(self, model: vitlens.VisionLanguageModel) -> None:
        self.asked: list[list[str]] = []
        inner, tok = model.model, model.tokenizer
        original = inner.get_text_features

        def counted(**kwargs):
            self.asked.append(tok.batch_decode(kwargs["input_ids"], skip_special_tokens=True))
            return original(**kwargs)

        inner.get_text_features = counted  # this instance only


def test_one_prompt_per_image_and_the_same_for_all():
    m = vlm("clip")
    x = images()
    per = vitlens.explain(m, x, "gradskip", target=vitlens.TextPrompt([CAT, DOG, CAT]))
    assert per.targets.tolist() == [0, 1, 0] and per.target["prompts"] == [CAT, DOG]
    same = vitlens.explain(m, x, "gradskip", target=vitlens.TextPrompt(CAT))
    assert same.targets.tolist() == [0, 0, 0]
    torch.testing.assert_close(per.scores[[0, 2]], same.scores[[0, 2]])
    with torch.no_grad():
        img = m(x)
        text = m.encode_text([CAT, DOG, CAT])
    want = m.scale * F.cosine_similarity(img, text, dim=-1)
    torch.testing.assert_close(per.scores, want, rtol=1e-5, atol=1e-5)


def test_text_embeddings_computed_once_per_prompt_and_reused():
    m = vlm("clip")
    counter = Counting(m)
    x = images()
    vitlens.explain(m, x, "gradskip", target=vitlens.TextPrompt([CAT, DOG, CAT]))
    assert counter.asked == [["a photo of a cat", "a photo of a dog"]]  # distinct prompts, one call
    vitlens.explain(m, x, "rise", target=vitlens.TextPrompt([DOG, CAT, DOG]), n_masks=16, score="target")
    assert len(counter.asked) == 1  # reused across explanations and the 16 masked forwards
    with torch.no_grad():
        m.model.text_projection.weight.mul_(2.0)  # the text side changed: computed again
    vitlens.explain(m, x, "gradskip", target=vitlens.TextPrompt(CAT))
    assert counter.asked[1:] == [["a photo of a cat"]]


def test_embeddings_computed_without_gradients_in_eval_mode():
    m = vlm("siglip")
    m.train()
    emb = m.encode_text([CAT])
    assert not emb.requires_grad and m.training and m.model.text_model.training  # modes restored


def test_siglip_score_has_its_bias():
    m = vlm("siglip")
    e = vitlens.explain(m, images(), "gae", target=vitlens.TextPrompt(DOG))
    assert e.target["bias"] == pytest.approx(-1.5) and e.target["scale"] == pytest.approx(torch.tensor(2.3).exp())
    with torch.no_grad():
        want = m.similarity(m(images()), m.encode_text([DOG]))[:, 0]
    torch.testing.assert_close(e.scores, want)


def test_contrast_between_two_prompts():
    m = vlm("clip")
    x = images()
    cat = vitlens.explain(m, x, "gradskip", target=vitlens.TextPrompt(CAT))
    dog = vitlens.explain(m, x, "gradskip", target=vitlens.TextPrompt(DOG))
    c = vitlens.explain(m, x, "gradskip", target=vitlens.TextContrast(CAT, DOG, gamma=0.5))
    torch.testing.assert_close(c.scores, cat.scores - 0.5 * dog.scores)
    assert c.target["versus"] == DOG and c.target["gamma"] == 0.5
    total = c.token_maps.sum((1, 2)) + c.remainder
    torch.testing.assert_close(total, c.scores, rtol=1e-4, atol=1e-5)
    with pytest.raises(TargetError, match="with itself"):
        vitlens.explain(m, x, "gradskip", target=vitlens.TextContrast(CAT, CAT))


def test_text_embedding_matches_the_prompt():
    m = vlm("clip")
    x = images()
    emb = m.encode_text([CAT, DOG, RING])
    by_prompt = vitlens.explain(m, x, "gradskip", target=vitlens.TextPrompt([CAT, DOG, RING]))
    by_embedding = vitlens.explain(m, x, "gradskip", target=vitlens.TextEmbedding(emb))
    torch.testing.assert_close(by_embedding.scores, by_prompt.scores)
    torch.testing.assert_close(by_embedding.maps, by_prompt.maps)


def test_chunked_batches_give_the_same_maps():
    m = vlm("clip")
    x = images(4)
    t = vitlens.TextPrompt([CAT, DOG, RING, CAT])
    whole = vitlens.explain(m, x, "gradskip", target=t)
    chunked = vitlens.explain(m, x, "gradskip", target=t, batch_size=3)
    torch.testing.assert_close(chunked.maps, whole.maps, rtol=1e-4, atol=1e-6)
    assert chunked.targets.tolist() == whole.targets.tolist() == [0, 1, 2, 0]
    emb = vitlens.explain(m, x, "gradskip", target=vitlens.TextEmbedding(m.encode_text([CAT, DOG, RING, CAT])),
                          batch_size=3)
    torch.testing.assert_close(emb.maps, whole.maps, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("make,match", [
    (lambda: vitlens.TextPrompt([CAT, DOG]), "2 prompts given for a batch of 3"),
    (lambda: vitlens.TextPrompt([]), "non-empty list"),
    (lambda: vitlens.TextPrompt(3), "takes a prompt"),
    (lambda: vitlens.TextEmbedding(torch.randn(5)), r"image embeddings \(B, 5\)"),
    (lambda: vitlens.TextEmbedding(torch.tensor([float("nan"), 1.0])), "NaN"),
])
def test_bad_text_targets_one_line(make, match):
    with pytest.raises(TargetError, match=match) as err:
        vitlens.explain(vlm("clip"), images(), "gradskip", target=make())
    assert "\n" not in str(err.value)


def test_text_prompt_needs_a_vision_language_model():
    from conftest import tiny_vit

    with pytest.raises(TargetError, match="needs a vision–language model") as err:
        vitlens.explain(tiny_vit(), images(), "gradskip", target=vitlens.TextPrompt(CAT))
    assert "\n" not in str(err.value)
    zs = vitlens.ZeroShotClassifier(vlm("clip"), [CAT, DOG])
    with pytest.raises(TargetError, match="prompt scores"):
        vitlens.explain(zs, images(), "gradskip", target=vitlens.TextPrompt(CAT))


def test_zero_shot_classifier_scores_and_metrics():
    m = vlm("clip")
    prompts = [CAT, DOG, RING]
    zs = vitlens.ZeroShotClassifier(m, prompts)
    x = images()
    with torch.no_grad():
        logits = zs(x)
        want = m.similarity(m(x), m.encode_text(prompts))
    torch.testing.assert_close(logits, want)
    e = vitlens.explain(zs, x, "gradskip", target=None)  # the best-matching prompt
    assert e.targets.tolist() == logits.argmax(1).tolist()
    assert float((e.token_maps.sum((1, 2)) + e.remainder - e.scores).abs().max()) < 1e-4
    by_text = vitlens.explain(m, x, "gradskip", target=vitlens.TextPrompt([prompts[i] for i in e.targets]))
    torch.testing.assert_close(by_text.maps, e.maps)  # the same score, the same maps
    ins = vitlens.metrics.InsertionDeletion(steps=4).compute(e.maps, model=zs, x=x, targets=e.targets)
    assert set(ins.values) >= {"insertion", "deletion"}
    masks = torch.zeros(3, 32, 32, dtype=torch.bool)
    masks[:, :16, :16] = True
    pg = vitlens.metrics.PointingGame().compute(e.maps, masks=masks)
    assert all(v.shape == (3,) for v in pg.values.values())
    c = vitlens.explain(zs, x, "gradskip", target=vitlens.Contrast(0, 1))
    torch.testing.assert_close(c.scores, logits[:, 0] - logits[:, 1], rtol=1e-5, atol=1e-5)


def test_zero_shot_classifier_bad_prompts():
    with pytest.raises(InputError, match="distinct"):
        vitlens.ZeroShotClassifier(vlm("clip"), [CAT, CAT])
    with pytest.raises(InputError, match="non-empty list"):
        vitlens.ZeroShotClassifier(vlm("clip"), CAT)


def test_text_embedded_inside_inference_mode_still_explains():
    m = vlm("clip")
    x = images()
    with torch.inference_mode():
        emb = m.encode_text([CAT])  # cached from inside inference mode
        e = vitlens.explain(m, x, "gradskip", target=vitlens.TextPrompt(CAT))
    assert emb.is_inference()  # the caller's tensor; the cache and TextEmbedding keep ordinary copies
    again = vitlens.explain(m, x, "gradskip", target=vitlens.TextEmbedding(emb))
    torch.testing.assert_close(again.maps, e.maps)
