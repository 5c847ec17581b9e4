"""Planted-evidence scenes, the causal verification of evidence use, and the metrics on verified evidence."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from vitlens.data import make_scenes
from vitlens.data.evidence import (
    CUE_CLASS_NAMES,
    CUE_KINDS,
    PLANTED_CUE_COLOURS,
    make_cue_scenes,
    make_planted_scenes,
)
from vitlens.errors import InputError
from vitlens.metrics import evidence_auc, get_metric, verify_evidence


@pytest.fixture(scope="module")
def planted():
    return make_planted_scenes(120, seed=5)


def test_planted_scenes_are_the_shape_scenes_plus_a_cue(planted):
    base = make_scenes(120, seed=5)
    assert torch.equal(planted.without_cue().images, base.images)
    assert torch.equal(planted.object_labels, base.labels)
    assert torch.equal(planted.object_masks, base.masks)
    has = planted.cue_labels >= 0
    assert 0.3 < has.float().mean() < 0.7
    # the cue decides where present, the object otherwise; masks are the deciding evidence
    assert torch.equal(planted.labels, torch.where(has, planted.cue_labels, planted.object_labels))
    assert torch.equal(planted.decided_by.bool(), has)
    assert torch.equal(planted.masks[has], planted.cue_masks[has])
    assert torch.equal(planted.masks[~has], planted.object_masks[~has])
    # the cue is an 8x8 square that never touches the object; images without a cue have no cue pixels
    assert (planted.cue_masks.sum((1, 2))[has] == 64).all()
    assert not planted.cue_masks[~has].any()
    assert not (planted.cue_masks & planted.object_masks).any()
    # the cue pixels carry the class's two colours in a checkerboard
    i = int(has.nonzero()[0])
    ys, xs = planted.cue_masks[i].nonzero(as_tuple=True)
    patch = planted.images[i][:, ys.min():ys.max() + 1, xs.min():xs.max() + 1]
    a, b = (torch.tensor(c) for c in PLANTED_CUE_COLOURS[int(planted.cue_labels[i])])
    assert (patch[:, 0, 0] - a).abs().max() < 0.1 and (patch[:, 0, 1] - b).abs().max() < 0.1
    assert (patch[:, 1, 1] - a).abs().max() < 0.1


def test_planted_scenes_are_deterministic_and_sliceable(planted):
    again = make_planted_scenes(120, seed=5)
    assert torch.equal(again.images, planted.images)
    part = make_planted_scenes(7, seed=5, start=30)
    assert torch.equal(part.images, planted.images[30:37])
    assert torch.equal(part.cue_masks, planted.cue_masks[30:37])
    sub = planted.subset([3, 30, 31])
    assert torch.equal(sub.without_cue().images, planted.without_cue().images[[3, 30, 31]])
    assert torch.equal(sub.cue_labels, planted.cue_labels[[3, 30, 31]])
    assert not torch.equal(make_planted_scenes(5, seed=6).images, planted.images[:5])


def test_removing_the_object_changes_only_the_object(planted):
    no_obj = planted.without_object()
    changed = (no_obj.images != planted.images).any(1)
    assert not changed[~planted.object_masks].any()
    assert changed.float().sum() > 0.5 * planted.object_masks.float().sum()
    assert not no_obj.object_masks.any()
    # removing the deciding evidence: the cue where it decides, the object elsewhere
    gone = planted.without_evidence()
    has = planted.cue_labels >= 0
    assert torch.equal(gone.images[has], planted.without_cue().images[has])
    assert torch.equal(gone.images[~has], no_obj.images[~has])


def test_cue_frac_extremes_and_bad_arguments():
    assert (make_planted_scenes(30, cue_frac=0.0).cue_labels == -1).all()
    assert (make_planted_scenes(30, cue_frac=1.0).cue_labels >= 0).all()
    for bad in (dict(cue_frac=1.5), dict(cue_frac=float("nan")), dict(cue_frac="half"), dict(n=0), dict(size=16)):
        with pytest.raises(InputError):
            make_planted_scenes(**{"n": 3, **bad})


def _components(mask: np.ndarray) -> int:
    """4-connected components of a small bool mask (flood fill)."""
    seen = np.zeros_like(mask)
    count = 0
    for y, x in zip(*np.nonzero(mask)):
        if seen[y, x]:
            continue
        count += 1
        stack = [(y, x)]
        while stack:
            cy, cx = stack.pop()
            if 0 <= cy < mask.shape[0] and 0 <= cx < mask.shape[1] and mask[cy, cx] and not seen[cy, cx]:
                seen[cy, cx] = True
                stack += [(cy + 1, cx), (cy - 1, cx), (cy, cx + 1), (cy, cx - 1)]
    return count


def test_cue_scenes_each_class_has_its_kind_of_evidence():
    sc = make_cue_scenes(160, seed=2)
    assert sc.class_names == CUE_CLASS_NAMES and len(CUE_KINDS) == len(CUE_CLASS_NAMES)
    assert set(sc.labels.tolist()) == set(range(8))
    assert (sc.masks.flatten(1).any(1)).all()
    assert (sc.cue_labels == -1).all() and not sc.decided_by.any()
    red, blue = torch.tensor([0.92, 0.08, 0.08]), torch.tensor([0.08, 0.16, 0.92])
    for i in range(len(sc)):
        name = CUE_CLASS_NAMES[int(sc.labels[i])]
        m = sc.masks[i]
        if name in ("two", "four"):
            assert _components(m.numpy()) == (2 if name == "two" else 4)
        inside = sc.images[i][:, m].mean(1)
        if name in ("red", "blue"):
            assert (inside - (red if name == "red" else blue)).abs().max() < 0.1
        # nothing but the colour classes' objects comes close to saturated red or blue
        outside = sc.images[i][:, ~m]
        for ref in (red, blue):
            assert ((outside - ref[:, None]).norm(dim=0) > 0.2).all()
    assert not sc.without_evidence().masks.any()
    changed = (sc.without_evidence().images != sc.images).any(1)
    assert not changed[~sc.masks].any()


def test_evidence_auc_is_the_pairwise_rank_probability():
    g = torch.Generator().manual_seed(0)
    maps = torch.randint(0, 4, (3, 6, 6), generator=g).float()  # many ties
    masks = torch.rand(3, 6, 6, generator=g) > 0.6
    got = evidence_auc(maps, masks)
    for i in range(3):
        pos, neg = maps[i][masks[i]], maps[i][~masks[i]]
        d = pos[:, None] - neg[None, :]
        want = ((d > 0).float() + 0.5 * (d == 0).float()).mean()
        assert got[i] == pytest.approx(float(want), abs=1e-6)
    m = torch.zeros(1, 8, 8, dtype=torch.bool)
    m[0, 2:4, 2:4] = True
    assert evidence_auc(m.float(), m)[0] == 1.0
    assert evidence_auc(-m.float(), m)[0] == 0.0
    assert evidence_auc(torch.ones(1, 8, 8), m)[0] == 0.5
    assert torch.isnan(evidence_auc(torch.ones(1, 8, 8), torch.zeros(1, 8, 8, dtype=torch.bool)))[0]
    with pytest.raises(InputError):
        evidence_auc(torch.ones(1, 8, 8), torch.ones(1, 4, 4, dtype=torch.bool))


def test_evidence_metric_outputs():
    m = torch.zeros(2, 8, 8, dtype=torch.bool)
    m[:, :2, :2] = True
    maps = torch.zeros(2, 8, 8)
    maps[0, 0, 0] = 1.0  # all relevance on the evidence
    maps[1, 7, 7] = 1.0  # none
    res = get_metric("evidence")(maps, masks=m)
    assert res.values["evidence_share"].tolist() == [1.0, 0.0]
    assert res.values["evidence_pointing"].tolist() == [1.0, 0.0]
    assert res.values["evidence_auc"][0] > 0.5 > res.values["evidence_auc"][1]
    assert all(res.higher_is_better.values())
    with pytest.raises(InputError, match="needs masks"):
        get_metric("evidence")(maps)
    with pytest.raises(InputError):
        get_metric("evidence", tolerance=-1)


class Oracle(nn.Module):
    """Looks each image up among known ones and answers with a fixed class: a model whose evidence use is known."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        super().__init__()
        self.bank = torch.cat([p[0].flatten(1) for p in pairs])
        self.answer = torch.cat([p[1] for p in pairs])
        self.pretrained_cfg = {"input_size": (3, 64, 64), "mean": (0.0, 0.0, 0.0), "std": (1.0, 1.0, 1.0),
                               "crop_pct": 1.0, "interpolation": "bilinear"}
        self.w = nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = torch.cdist(x.flatten(1), self.bank)
        return torch.nn.functional.one_hot(self.answer[d.argmin(1)], 6).float() + 0 * self.w


def _oracle(sc, uses_cue: bool) -> Oracle:
    no_obj = sc.without_object()
    pairs = [(sc.images, sc.labels if uses_cue else sc.object_labels),
             (sc.without_cue().images, sc.object_labels),
             (no_obj.images, torch.where(sc.cue_labels >= 0, sc.labels if uses_cue else (sc.object_labels + 1) % 6,
                                         (sc.object_labels + 1) % 6))]
    return Oracle(pairs)


def test_verify_evidence_finds_the_evidence_a_model_uses(planted):
    v = verify_evidence(_oracle(planted, uses_cue=True), planted)
    conflict = (planted.cue_labels >= 0) & (planted.cue_labels != planted.object_labels)
    assert torch.equal(v["cue_verified"], conflict)
    assert torch.equal(v["object_verified"], planted.cue_labels < 0)
    v2 = verify_evidence(_oracle(planted, uses_cue=False), planted)  # ignores the cue: nothing cue-decided
    assert not v2["cue_verified"].any()
    assert torch.equal(v2["object_verified"], planted.cue_labels < 0)


@pytest.mark.slow
def test_evidence_source_serves_only_verified_images():
    from vitlens.bench.sources import open_source

    cands = make_planted_scenes(250, seed=11)
    model = _oracle(cands, uses_cue=True)
    src = open_source("planted:seed=11", model, n=10)
    assert len(src) == 10 and src.groups.count("cue") == 5
    b = src.batch(list(range(10)))
    for j, gid in enumerate(b["ids"]):
        i = int(gid.split("-")[2])
        want = cands.cue_masks[i] if gid.endswith("cue") else cands.object_masks[i]
        assert torch.equal(b["masks"][j], want)
        assert torch.equal(b["pixels"][j], cands.images[i])
    assert src.stats["cue_images_verified"] == 5
    with pytest.raises(InputError, match="verified on too few"):
        open_source("planted:seed=11;decided=cue", _oracle(cands, uses_cue=False), n=3)
    with pytest.raises(InputError):
        open_source("planted:seed=11;decided=maybe", model, n=3)
    with pytest.raises(InputError):
        open_source("planted:colour=red", model, n=3)


def test_the_bundled_planted_model_uses_the_cue_and_bench_scores_it():
    """planted-vit follows a conflicting cue and flips back without it; `vitlens bench` on verified images."""
    import subprocess
    import sys

    import vitlens

    model = vitlens.load_model("planted-vit")
    sc = make_planted_scenes(120, seed=77)
    v = verify_evidence(model, sc)
    conflict = v["conflict"]
    assert (v["pred"][conflict] == sc.cue_labels[conflict]).float().mean() > 0.95
    assert v["cue_verified"].sum() > 0.5 * conflict.sum()
    assert v["object_verified"].sum() > 0.4 * (~v["has_cue"]).sum()
    meta = vitlens.models.zoo.model_card("planted-vit")
    assert "What the model uses" in meta


@pytest.mark.slow
def test_bench_cli_runs_on_verified_evidence(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "vitlens", "bench", "--model", "planted-vit", "--data",
                        "planted:decided=both", "--methods", "gradskip,random", "--metrics", "evidence", "--n", "4",
                        "--out", str(out), "--quiet"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    from vitlens.bench.store import read_rows

    rows = read_rows(out / "results.sqlite", "SELECT image_id, method, output, value FROM results")
    ids = {i for i, *_ in rows}
    assert len(ids) == 4 and sum(i.endswith("-cue") for i in ids) == 2
    auc = {m: [v for _, mm, o, v in rows if mm == m and o == "evidence_auc"] for m in ("gradskip", "random")}
    assert len(auc["gradskip"]) == 4 and sum(auc["gradskip"]) > sum(auc["random"])


@pytest.mark.parametrize("name", ["cues-vit-12h", "cues-vit-12h-s1", "cues-vit-12h-s2"])
def test_the_cue_models_are_12_head_models_that_use_the_evidence(name):
    import vitlens
    from vitlens.metrics.heads import head_statistics

    model = vitlens.load_model(name)
    assert len(model.blocks) == 8 and model.blocks[0].attn.num_heads == 12 and model.num_classes == 8
    assert tuple(model.pretrained_cfg["label_names"]) == CUE_CLASS_NAMES
    sc = make_cue_scenes(96, seed=123)
    v = verify_evidence(model, sc)
    assert (v["pred"] == sc.labels).float().mean() > 0.9
    assert v["object_verified"].sum() > 0.7 * len(sc)
    st = head_statistics(model, vitlens.load_images(sc.images[:16], model))
    assert st["gini"].shape == (8, 12) and st["distance"].shape == (8, 12)
    assert ((st["gini"] >= 0) & (st["gini"] <= 1)).all() and (st["distance"] >= 0).all()
    assert (st["gini"].amax(1) - st["gini"].amin(1)).mean() > 0.1  # heads differ within a layer
