"""The protocol matrix script's evaluation images: a replication from image ``first`` on scores the images a larger
run would score there, and never reaches the digits AHA validates on (issue #27)."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import load_benchmark  # noqa: E402

import vitlens
from vitlens.models import get_adapter


@pytest.mark.parametrize("name", ["shapes-vit", "digits-vit", "planted-vit"])
def test_eval_images_from_first_are_the_tail_of_a_larger_run(name):
    script = load_benchmark("aha_protocols")
    model = vitlens.load_model(name).eval()
    whole = script.eval_images(name, model, 5)
    tail = script.eval_images(name, model, 3, first=2)
    assert tail.shape[0] == 3
    assert torch.equal(tail, whole[2:])


def test_eval_digits_stop_before_the_validation_digits():
    script = load_benchmark("aha_protocols")
    model = vitlens.load_model("digits-vit").eval()
    with pytest.raises(SystemExit, match="validation digits"):
        script.eval_images("digits-vit", model, 10, first=script.DIGITS_VAL_FROM - 5)


def _result(first, n, other="gae", seed=0):
    g = torch.Generator().manual_seed(seed)
    cells = ["mean/pixel/21", "mean/pixel/21:ins", "mean/pixel/21:del", "posneg"]
    rows = {r: {c: torch.rand(n, generator=g).tolist() for c in cells}
            for r in ("aha_t0", "aha_t3", "gradskip", "best_other")}
    return {"model": "shapes-vit", "n": n, "first": first, "best_other": other, "unit": 8, "rows": rows,
            "candidates": {other: {"mean/pixel/21": 0.1 * (seed + 1)}}, "seconds_per_image": {"aha_t0": 0.01},
            "seconds": 5.0}


def test_pool_concatenates_disjoint_runs_per_image():
    script = load_benchmark("aha_protocols")
    a, b = _result(0, 4, seed=1), _result(4, 3, seed=2)
    p = script.pool([b, a])
    assert p["n"] == 7 and p["ranges"] == [(0, 4), (4, 7)] and p["best_other"] == "gae"
    assert p["rows"]["gradskip"]["mean/pixel/21"] == b["rows"]["gradskip"]["mean/pixel/21"] + \
        a["rows"]["gradskip"]["mean/pixel/21"]
    # the paired interval is over all seven images, in the same pairing
    d = [x - y for x, y in zip(p["rows"]["aha_t0"]["mean/pixel/21"], p["rows"]["gradskip"]["mean/pixel/21"])]
    m, h = script.paired(p["rows"]["aha_t0"]["mean/pixel/21"], p["rows"]["gradskip"]["mean/pixel/21"])
    assert m == pytest.approx(sum(d) / 7)
    assert h > 0
    lines, count = script.model_section(p)
    assert "7 evaluation images, 0–3 and 4–6" in lines[0]
    assert count["cells"] == 1


def test_pool_refuses_overlapping_images_and_names_both_choices():
    script = load_benchmark("aha_protocols")
    with pytest.raises(SystemExit, match="overlap"):
        script.pool([_result(0, 4), _result(3, 4)])
    p = script.pool([_result(0, 2, "gae"), _result(2, 2, "attnlrp", seed=3)])
    assert p["best_other"] == "gae/attnlrp" and p["candidates"] == {}


def test_validation_gap_scores_the_cards_validation_images(tmp_path, capsys):
    from vitlens.aha.network import pool_maps

    script = load_benchmark("aha_validation_gap")
    model = vitlens.load_model("shapes-deit").eval()
    raw = torch.randn(2, 64, 64)
    # the constant-per-token row is the shipped pooling of the same decoder output
    torch.testing.assert_close(script.spread(raw, 8, "tokens"), pool_maps(raw, get_adapter(model), "tokens"))
    assert script.spread(raw, 8, "none") is raw
    assert script.spread(raw, 8, "tokens-bilinear").shape == raw.shape
    assert script.main(["--models", "shapes-deit", "--n", "2", "--points", "21", "--threads", "1",
                        "--work", str(tmp_path)]) == 0
    res = __import__("json").loads((tmp_path / "shapes-deit.json").read_text())
    assert res["n"] == 2 and res["val_seed"] == 20000 and res["shipped_pool"] == "tokens"
    assert set(res["rows"]) == {"aha_tokens", "aha_tokens-bilinear", "aha_none", "gradskip"}
    assert all(len(v) == 2 for row in res["rows"].values() for v in row.values())
    out = capsys.readouterr().out
    assert "AHA T=0, `tokens` (shipped)" in out and "AHA `tokens` − GradSkip" in out


def test_validation_gap_scores_another_training_on_the_same_images(tmp_path, capsys):
    """``--explainer FOLDER`` adds a row for another training of the target's explainer, scored on the shipped
    card's validation images: a copy of the shipped files gives exactly the shipped row; it takes one model."""
    import json
    import shutil

    from vitlens.aha import WEIGHTS_DIR

    script = load_benchmark("aha_validation_gap")
    other = tmp_path / "copy-of-shipped"
    other.mkdir()
    for suffix in (".safetensors", ".json"):
        shutil.copy(WEIGHTS_DIR / f"shapes-deit-aha{suffix}", other)
    assert script.main(["--models", "shapes-deit", "--n", "2", "--points", "21", "--threads", "1",
                        "--work", str(tmp_path / "work"), "--explainer", str(other)]) == 0
    res = json.loads((tmp_path / "work" / "shapes-deit.json").read_text())
    key = "aha_tokens (copy-of-shipped)"
    assert res["explainers"] == [str(other)] and key in res["rows"]
    assert res["rows"][key] == res["rows"]["aha_tokens"]
    assert "`tokens (copy-of-shipped)` − GradSkip" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        script.main(["--models", "shapes-deit", "shapes-vit", "--explainer", str(other)])


def test_curve_gap_curves_integrate_to_the_matrix_auc_and_per_token_keeps_token_cells(tmp_path):
    """``aha_curve_gap.py``: its curves integrate to the protocol matrix's AUCs (the same function scores both),
    GradSkip per token is constant inside each token and equals GradSkip under token ranking, and the page has the
    rows and both curve tables."""
    script = load_benchmark("aha_curve_gap")
    protocols = load_benchmark("aha_protocols")
    model = vitlens.load_model("planted-vit").eval()
    maps = torch.rand(2, 16, 16)
    tok = script.per_token(maps, get_adapter(model))  # planted-vit: 8×8-pixel patches
    assert tok.shape == maps.shape
    assert torch.equal(tok[:, :8, :8], tok[:, :1, :1].expand(2, 8, 8))
    torch.testing.assert_close(tok[:, 0, 0], maps[:, :8, :8].mean(dim=(1, 2)))

    x = protocols.eval_images("planted-vit", model, 2)
    with torch.no_grad():
        cls = model(x).argmax(-1)
    ref = torch.zeros_like(x)
    mp = torch.rand(2, *x.shape[-2:])
    curves = protocols.del_and_ins_curves(model, x, mp, cls, ref, 1, 21)
    assert curves.shape == (2, 2, 21)
    torch.testing.assert_close(torch.from_numpy(script.auc(curves.numpy())).float(),
                               protocols.ins_minus_del(model, x, mp, cls, ref, 1, 21))

    out = tmp_path / "page.md"
    assert script.main(["--models", "planted-vit", "--n", "2", "--threads", "1", "--work", str(tmp_path / "w"),
                        "--out", str(out)]) == 0
    page = out.read_text()
    assert "### planted-vit (2 evaluation images, 0–1; token = 8×8 px)" in page
    assert "Deletion curve, AHA T=0 − GradSkip" in page and "Insertion curve, AHA T=0 − GradSkip" in page
    for line in page.splitlines():
        if line.startswith("| mean colour, token | ") and line.count("|") == 8:  # the AUC table's token row
            assert line.rstrip(" |").endswith("+0.000 ± 0.000")  # GradSkip − GradSkip per token
    stored = json.loads((tmp_path / "w" / "planted-vit.json").read_text())
    assert set(stored["curves"]) == set(script.ROWS)


def test_select_scores_the_meanimage_reference_with_the_training_mean_image(monkeypatch):
    """``aha_select`` deletes to the per-pixel mean of the first 512 training images under ``meanimage``, the image
    training and the protocol matrix use (it once took the mean of one training scene)."""
    from vitlens.aha.data import mean_image

    select = load_benchmark("aha_select")
    protocols = load_benchmark("aha_protocols")
    seen = {}
    monkeypatch.setattr(select, "validate", lambda net, data, dist, **kw: seen.update(kw, n=len(data)) or {})
    select.score("shapes-deit", vitlens.aha.shipped_explainer(vitlens.load_model("shapes-deit"))[1], 8)
    model = vitlens.load_model("shapes-deit")
    expect = protocols.training_mean_image("shapes-deit", model, 10)
    assert seen["n"] == 8 and torch.equal(seen["mean_img"], expect)
    one = mean_image(select.datasets("scenes", model, select.AHATrainConfig(n_val=1, steps=1, batch_size=1), 10)[0])
    assert not torch.allclose(seen["mean_img"], one)  # not the mean of a single scene


def test_select_authors_protocol_scores_candidates_and_gradskip_on_validation_images():
    """``aha_select --authors N``: GradSkip and each candidate at T = 0 and at the default refinement under the AHA
    authors' protocol, on the first N validation images (not the evaluation images), each row per image."""
    select = load_benchmark("aha_select")
    authors = load_benchmark("aha_authors_protocol")
    path = vitlens.aha.shipped_explainer(vitlens.load_model("digits-vit"))[1]
    res = select.authors_choice("digits-vit", {"shipped": path}, 2, batch=2)
    assert set(res) == {"gradskip", "shipped T=0", f"shipped {authors.TR}"}
    for row in res.values():
        assert set(row) == set(authors.REFERENCES) and all(len(v) == 2 for v in row.values())
        assert all(-1.0 <= a <= 1.0 for v in row.values() for a in v)
    model = vitlens.load_model("digits-vit").eval()
    x = select.validation_images("digits-vit", model, 2, 10)
    with torch.no_grad():
        cls = model(x).argmax(-1)
    direct = authors.score(model, x, vitlens.explain(model, x, "gradskip").maps.detach(), cls)
    for r in authors.REFERENCES:
        assert res["gradskip"][r] == pytest.approx(direct[r], abs=1e-6)
    assert res["shipped T=0"] != res[f"shipped {authors.TR}"]  # the refinement changes the maps
