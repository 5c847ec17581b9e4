"""shapes-clip: the proving ground's vision–language model (issue 52, item 3) — tokenizer, interface, captions,
contrastive loss, training with resume, and the shipped weights' zero-shot accuracy."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vitlens.data import CLASS_NAMES
from vitlens.data.captions import caption_positives, object_positions, scene_captions
from vitlens.data.multiscenes import make_multi_scenes
from vitlens.data.scenes import make_scenes
from vitlens.errors import InputError
from vitlens.models import zoo
from vitlens.models.shapes_clip import VOCABULARY, UnknownWordWarning, WordTokenizer


@pytest.fixture(scope="module")
def untrained():
    torch.manual_seed(0)
    return zoo.load_bundled("shapes-clip", weights=False)


# -- tokenizer ---------------------------------------------------------------------------------------------------------
def test_tokenizer_round_trip_lower_cases_and_splits_punctuation():
    tok = WordTokenizer()
    out = tok(["A Ring, and a STAR at the top left", "a disk"])
    assert out["input_ids"].dtype == torch.long and out["attention_mask"].dtype == torch.long
    assert tok.batch_decode(out["input_ids"]) == ["a ring, and a star at the top left", "a disk"]
    ids = out["input_ids"][0]
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert tok.vocabulary[int(ids[3])] == ","  # the comma is its own token


def test_tokenizer_pads_to_the_longest_text_and_masks_the_padding():
    tok = WordTokenizer()
    out = tok(["a ring", "a picture of a ring and a star"])
    ids, mask = out["input_ids"], out["attention_mask"]
    assert ids.shape == mask.shape == (2, 10)
    assert mask[0].tolist() == [1] * 4 + [0] * 6 and mask[1].all()
    assert (ids[0, 4:] == tok.pad_id).all()
    assert torch.equal(tok("a ring")["input_ids"], ids[:1, :4])


def test_unknown_words_become_unk_with_a_warning_or_an_error():
    tok = WordTokenizer()
    with pytest.warns(UnknownWordWarning, match="'cat'.*vocabulary: disk, square"):
        ids = tok(["a cat"])["input_ids"][0]
    assert ids.tolist() == [tok.bos_id, tok.ids["a"], tok.unk_id, tok.eos_id]
    with pytest.raises(InputError, match="does not know the word"):
        WordTokenizer(unknown="error")(["a cat"])
    with pytest.raises(InputError, match="at least one prompt"):
        tok([])
    with pytest.raises(InputError, match="more than"):
        tok(["a ring " * 20])


def test_every_caption_word_is_in_the_vocabulary():
    scenes = make_multi_scenes(40, seed=3, min_objects=1, max_objects=4)
    captions, _ = scene_captions(scenes.label_maps, np.random.default_rng(0), position_prob=0.5)
    words = {w for c in captions for w in WordTokenizer.words(c)}
    assert words <= set(VOCABULARY)
    assert {f"a {c}" for c in CLASS_NAMES} <= {WordTokenizer().decode(WordTokenizer()(f"a {c}")["input_ids"][0])
                                              for c in CLASS_NAMES}


# -- captions ----------------------------------------------------------------------------------------------------------
def test_captions_name_exactly_the_present_objects_and_their_positions():
    scenes = make_multi_scenes(30, seed=1, min_objects=1, max_objects=4)
    captions, with_pos = scene_captions(scenes.label_maps, np.random.default_rng(1), position_prob=0.5)
    pos = object_positions(scenes.label_maps)
    assert with_pos.any() and (~with_pos).any()
    for i, text in enumerate(captions):
        named = {c for c in CLASS_NAMES if f"a {c}" in text}
        assert named == {CLASS_NAMES[k] for k in torch.nonzero(scenes.present[i]).flatten().tolist()}
        assert (("the" in text.split()) or ("on" in text.split())) == bool(with_pos[i])
    # a horizontal flip swaps left and right
    flipped = object_positions(scenes.label_maps.flip(-1))
    present = pos >= 0
    assert torch.equal((flipped % 3)[present], 2 - (pos % 3)[present])
    assert torch.equal((flipped // 3)[present], (pos // 3)[present])


def test_caption_positives_are_the_true_captions_of_each_scene():
    scenes = make_multi_scenes(2, seed=0, min_objects=2, max_objects=2)
    maps = torch.cat([scenes.label_maps, scenes.label_maps[:1], scenes.label_maps[:1].flip(-1).flip(-2)])
    pos = caption_positives(maps, torch.tensor([False, False, True, True]))
    assert pos.diagonal().all()
    assert pos[0, 2] and not pos[0, 1]  # the same scene's caption; another scene's set of objects
    assert not pos[0, 3]  # the rotated scene's caption gives other positions (centroids not both in the centre)


def test_contrastive_loss_with_one_positive_each_is_clip_loss():
    from vitlens.training.shapes_clip import contrastive_loss

    g = torch.Generator().manual_seed(0)
    img, txt = torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g)
    scale = torch.tensor(2.0)
    logits = scale.exp() * F.normalize(img, dim=-1) @ F.normalize(txt, dim=-1).T
    ref = 0.5 * (F.cross_entropy(logits, torch.arange(6)) + F.cross_entropy(logits.T, torch.arange(6)))
    assert torch.allclose(contrastive_loss(img, txt, scale, torch.eye(6, dtype=torch.bool)), ref)
    assert contrastive_loss(img, img, scale, torch.eye(6, dtype=torch.bool)) < ref


def test_presence_loss_is_each_shown_class_against_the_classes_not_shown():
    from vitlens.training.shapes_clip import presence_loss

    g = torch.Generator().manual_seed(1)
    img, txt = torch.randn(2, 8, generator=g), torch.randn(4, 8, generator=g)
    scale = torch.tensor(1.5)
    present = torch.tensor([[True, False, True, False], [False, True, False, False]])
    s = scale.exp() * F.normalize(img, dim=-1) @ F.normalize(txt, dim=-1).T
    # image 0 shows classes 0 and 2 (each against 1 and 3 only); image 1 shows class 1 (against 0, 2, 3)
    terms = [F.cross_entropy(s[0, [0, 1, 3]][None], torch.tensor([0])),
             F.cross_entropy(s[0, [2, 1, 3]][None], torch.tensor([0])),
             F.cross_entropy(s[1][None], torch.tensor([1]))]
    assert torch.allclose(presence_loss(img, txt, scale, present), torch.stack(terms).mean(), atol=1e-6)
    # prompts that match exactly the shown classes score lower than prompts that match the others
    good = torch.stack([txt[0] + txt[2], txt[1]]) * 10
    assert presence_loss(good + 0.01 * img, txt, scale, present) < presence_loss(-good, txt, scale, present)


# -- the model's interface ---------------------------------------------------------------------------------------------
def test_interface_shapes_and_parts(untrained):
    from timm.models.vision_transformer import VisionTransformer

    m = untrained
    assert isinstance(m.vision_model, VisionTransformer)
    assert isinstance(m.logit_scale, torch.nn.Parameter) and m.logit_bias is None
    x = torch.randn(3, 3, 64, 64)
    tok = m.tokenizer(["a ring", "a triangle"])
    with torch.no_grad():
        img = m.get_image_features(x)
        txt = m.get_text_features(**tok)
        out = m(pixel_values=x, **tok)
        assert torch.equal(img, m.vision_model(x))
    assert img.shape == (3, 128) and txt.shape == (2, 128)
    assert out.logits_per_image.shape == (3, 2) and out.logits_per_text.shape == (2, 3)
    expected = m.logit_scale.exp() * F.normalize(img, dim=-1) @ F.normalize(txt, dim=-1).T
    assert torch.allclose(out.logits_per_image, expected, atol=1e-5)
    with pytest.raises(InputError, match=r"\(B, 3, H, W\)"):
        m.get_image_features(torch.randn(3, 64, 64))
    assert m.pretrained_cfg["mean"] == zoo.SHAPES_MEAN and m.pretrained_cfg["input_size"] == (3, 64, 64)


def test_text_features_are_deterministic_and_independent_of_padding(untrained):
    m = untrained
    with torch.no_grad():
        alone = m.encode_text(["a ring"])
        batch = m.encode_text(["a ring", "a scene with a star on the left and a disk at the top"])
        again = m.encode_text(["a ring", "a scene with a star on the left and a disk at the top"])
        no_mask = m.get_text_features(m.tokenizer("a ring")["input_ids"])
    assert torch.equal(batch, again)
    assert torch.allclose(alone[0], batch[0], atol=1e-5)
    assert torch.allclose(alone, no_mask, atol=1e-6)


# -- training ----------------------------------------------------------------------------------------------------------
def _train(out, *extra):
    from vitlens.training.shapes_clip import main

    args = ["--out", str(out), "--n-train", "48", "--n-test", "12", "--batch-size", "8", "--steps", "4",
            "--init-vision", "none", "--eval-every", "2", "--checkpoint-every", "1", "--no-progress", *extra]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnknownWordWarning)  # every caption word is known
        return main(args)


def test_training_steps_run_and_resume_continues_bit_for_bit(tmp_path):
    from safetensors.torch import load_file

    torch.set_num_threads(1)
    assert _train(tmp_path / "straight") in (0, 1)
    assert _train(tmp_path / "halves", "--stop-after", "2") == 0
    assert not (tmp_path / "halves" / "shapes-clip.safetensors").exists()  # stopped early: nothing exported
    ck = torch.load(tmp_path / "halves" / "checkpoint.pt", weights_only=True)
    assert ck["step"] == 2
    assert _train(tmp_path / "halves", "--resume") in (0, 1)
    a = load_file(str(tmp_path / "straight" / "shapes-clip.safetensors"))
    b = load_file(str(tmp_path / "halves" / "shapes-clip.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    meta = json.loads((tmp_path / "halves" / "shapes-clip.json").read_text())
    assert meta["steps"] == 4 and meta["resumed"] and meta["command"].startswith(
        "python -m vitlens.training.shapes_clip --out")
    assert 0.0 <= meta["evaluation"]["zero_shot_accuracy"] <= 1.0
    card = (tmp_path / "halves" / "shapes-clip.md").read_text()
    assert "Zero-shot accuracy" in card and meta["command"] in card


def test_training_with_the_presence_loss_runs_and_says_so_in_the_card(tmp_path):
    torch.set_num_threads(1)
    assert _train(tmp_path / "p", "--presence-weight", "1", "--steps", "2") in (0, 1)
    meta = json.loads((tmp_path / "p" / "shapes-clip.json").read_text())
    assert meta["presence_weight"] == 1.0 and "--presence-weight 1" in meta["command"]
    assert "presence loss" in (tmp_path / "p" / "shapes-clip.md").read_text()


# -- the shipped model -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def shipped():
    return zoo.load_bundled("shapes-clip")


def test_shipped_model_zero_shot_on_fixed_held_out_scenes(shipped):
    from vitlens.training.shapes_clip import TEST_SEED, zero_shot_accuracy

    scenes = make_scenes(120, seed=TEST_SEED)
    acc, _ = zero_shot_accuracy(shipped, scenes.images, scenes.labels)
    assert acc >= 0.95
    meta = json.loads((zoo.WEIGHTS_DIR / "shapes-clip.json").read_text())
    assert meta["evaluation"]["zero_shot_accuracy"] >= 0.95 and meta["test_data_seed"] == TEST_SEED


def test_shipped_model_loads_through_vitlens_and_its_card(shipped):
    import vitlens

    m = vitlens.load_model("shapes-clip")
    assert type(m).__name__ == "ShapesCLIP" and not m.training
    assert "shapes-clip" in zoo.model_card("shapes-clip")
    with torch.no_grad():
        assert torch.equal(m.encode_text(["a ring"]), shipped.encode_text(["a ring"]))


def test_twin_batches_hold_each_twin_beside_its_scene_flipped_alike():
    import argparse

    import numpy as np

    from vitlens.data.multiscenes import make_multi_scene_pairs
    from vitlens.training.shapes_clip import _batch, _normalise, twin_count

    full, twins = make_multi_scene_pairs(12, seed=3, min_objects=2, max_objects=4)
    data = (full.images, full.label_maps, twins.images, twins.label_maps)
    args = argparse.Namespace(twin_frac=0.25, batch_size=8, position_prob=0.5)
    assert twin_count(args) == 2 and twin_count(argparse.Namespace(twin_frac=0.9, batch_size=8)) == 4
    m = zoo.BUNDLED["shapes-clip"].build()
    idx = torch.tensor([4, 9, 0, 1, 2, 3])
    xb, tok, pos, present = _batch(args, data, idx, torch.Generator().manual_seed(0), np.random.default_rng(0),
                                   m.tokenizer)
    assert xb.shape == (8, 3, 64, 64) and present.shape == (8, len(full.class_names)) and pos.shape == (8, 8)
    for j, i in enumerate([4, 9]):  # the twins come last, in the order of their scenes
        assert torch.equal(present[6 + j], twins.present[i]) and torch.equal(present[j], full.present[i])
        differ = (xb[j] != xb[6 + j]).any(0)  # same flips: the pair differs only where the object was
        assert 0 < int(differ.sum()) == int((full.label_maps[i] != twins.label_maps[i]).sum())
    assert not pos[6, 0] and not pos[0, 6]  # a twin's caption is not true of its scene, nor the other way round
    assert torch.isclose(xb.mean(), _normalise(torch.cat([full.images[idx], twins.images[idx[:2]]])).mean())


def test_training_with_twins_from_stored_weights_says_so_in_the_card(tmp_path):
    torch.set_num_threads(1)
    assert _train(tmp_path / "a", "--twin-frac", "0.25", "--steps", "2") in (0, 1)
    meta = json.loads((tmp_path / "a" / "shapes-clip.json").read_text())
    assert meta["twin_frac"] == 0.25 and "twins" in (tmp_path / "a" / "shapes-clip.md").read_text()
    start = tmp_path / "a" / "shapes-clip.safetensors"
    assert _train(tmp_path / "b", "--init-from", str(start), "--steps", "2", "--lr", "0") in (0, 1)
    meta_b = json.loads((tmp_path / "b" / "shapes-clip.json").read_text())
    assert meta_b["init_vision"] == "stored weights shapes-clip.safetensors"
    from safetensors.torch import load_file

    a, b = load_file(str(start)), load_file(str(tmp_path / "b" / "shapes-clip.safetensors"))
    moved = [k for k in a if not torch.equal(a[k], b[k])]
    assert all("running" in k or "num_batches" in k for k in moved)  # lr 0: only the stem's BatchNorm statistics move


@pytest.mark.parametrize("extra,said", [(["--twin-frac", "0.7"], "--twin-frac must be in"),
                                        (["--twin-frac", "-0.1"], "--twin-frac must be in"),
                                        (["--init-from", "nowhere.safetensors"], "no such weights file")])
def test_bad_twin_and_init_options_are_one_line(tmp_path, capsys, extra, said):
    from vitlens.training.shapes_clip import main

    with pytest.raises(SystemExit) as info:
        main(["--out", str(tmp_path / "r"), *extra])
    assert info.value.code == 2 and said in capsys.readouterr().err
    assert not (tmp_path / "r").exists()  # refused before anything is written
