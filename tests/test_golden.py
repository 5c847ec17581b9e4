"""Golden outputs: every registered method and every metric on fixed tiny inputs, pinned to stored values.

The fixture ``tests/golden/outputs.pt`` was generated from the code before the structural refactor of issue #11
(behaviour must stay identical). Write into it only for an intended change of results (then say why in the commit
message):

- a new method, or an intended change of one: ``VITLENS_WRITE_GOLDEN=mymethod python -m pytest tests/test_golden.py``
  adds or refreshes the cases of the named methods only (comma-separated names; a method's cases are
  ``<setting>/<method>``: ``vit/mymethod`` and any setting the file adds for it); every other stored value is kept as
  it was, so nothing else is re-pinned;
- ``VITLENS_WRITE_GOLDEN=1`` rewrites the whole fixture (an intended change of everything, e.g. a new torch rounding).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import vitlens
from vitlens.explainers import get_method
from vitlens.explainers.registry import _METHODS
from vitlens.metrics import (
    FaithfulnessViolation,
    InsertionDeletion,
    Evidence,
    PointingGame,
    PositiveNegativePerturbation,
    SaCo,
    Segmentation,
    metric_names,
    randomisation_check,
    spearman,
    ssim,
)
from vitlens.targets import ClassProbability, Contrast, SegmentationTarget

from conftest import assert_close_at_scale, tiny_vit

GOLDEN = Path(__file__).parent / "golden" / "outputs.pt"
WRITE = os.environ.get("VITLENS_WRITE_GOLDEN", "")
#: the methods whose cases VITLENS_WRITE_GOLDEN=name[,name] adds or refreshes (empty: none, or all with "1")
WRITE_ONLY = frozenset(n.strip() for n in WRITE.split(",") if n.strip()) - {"1"}
#: values that are a difference of larger terms, and where those terms' scale is (conftest's assert_close_at_scale:
#: rounding follows the terms, not the small difference): the remainder is the score minus what the map holds; the
#: faithfulness violation's deltas are differences of the tiny ViT's logits, whose scale the scores of the same
#: model on inputs of the same distribution give.
SCALE_FROM: dict[str, tuple[str | None, str]] = {"remainder": (None, "scores"),
                                                 "curves.delta": ("vit/gradskip", "scores")}

#: GradSkip's gates and head weights are ratios of sums that can cancel (a token whose attention change is nearly
#: orthogonal to its gradient has c_main ≈ 0): their rounding is the sum's condition number times eps, not bounded by
#: their [0, 1] range, so float32 rounding at their own scale does not hold on every machine. What they do to the
#: results is pinned by the maps and remainders (float32 rounding above); the ratios themselves to sqrt(eps) ≈ 3.5e-4
#: absolute, the usual bound for ill-conditioned intermediates, far below what a changed rule moves (>= 1e-2).
#: The same holds for the randomisation check's rank correlations and SSIM between two maps: they jump when rounding
#: swaps two nearly tied pixel values, so they too are pinned to sqrt(eps) on their [-1, 1] range.
RATIOS = {"extras.beta_main", "extras.head_weights", "spearman", "spearman_signed", "ssim"}
RATIO_ATOL = float(torch.finfo(torch.float32).eps) ** 0.5


def _scale(golden: dict[str, dict[str, torch.Tensor]], case: str, field: str) -> float:
    def top(t: torch.Tensor) -> float:
        return float(t.abs().nan_to_num().max()) if t.numel() else 0.0

    own = top(golden[case][field])
    if field not in SCALE_FROM:
        return own
    other_case, other_field = SCALE_FROM[field]
    return max(own, top(golden[other_case or case][other_field]))


def _x(n: int = 2, size: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


def _fields(exp) -> dict[str, torch.Tensor]:
    # every second pixel of the maps keeps the fixture small (a change anywhere shows in it)
    out = {"maps[::2,::2]": exp.maps[:, ::2, ::2], "targets": exp.targets, "scores": exp.scores}
    if exp.token_maps is not None:
        out["token_maps"] = exp.token_maps
    if exp.remainder is not None:
        out["remainder"] = exp.remainder
    for k, v in exp.extras.items():
        out[f"extras.{k}"] = v
    return {k: v.detach().cpu().clone() for k, v in out.items()}


def _method(name: str, model, x, target=None, batch_size=None):
    return get_method(name, **_METHODS[name].fast_options).explain(model, x, target, batch_size=batch_size)


def _methods_on_tiny_vit() -> dict[str, dict[str, torch.Tensor]]:
    model, x = tiny_vit(), _x()
    out = {f"vit/{name}": _fields(_method(name, model, x)) for name in vitlens.methods()}
    # other targets and chunking (per-sample specs sliced per chunk)
    for name in ("gradskip", "gradient", "rise", "gradcam", "tis"):
        out[f"vit-contrast-chunked/{name}"] = _fields(
            _method(name, model, x, target=Contrast([1, 3], gamma=0.5), batch_size=1))
        out[f"vit-perclass-chunked/{name}"] = _fields(_method(name, model, x, target=[2, 4], batch_size=1))
    out["vit-prob/gradient"] = _fields(_method("gradient", model, x, target=ClassProbability(0)))
    # prefix-token variants of a few methods
    for label, m in {"gap+reg": tiny_vit(class_token=False, global_pool="avg", reg_tokens=2)}.items():
        for name in ("gradskip", "attnlrp", "rollout", "gae", "transformer_attribution"):
            out[f"{label}/{name}"] = _fields(_method(name, m, x))
    return out


def _methods_on_segformer() -> dict[str, dict[str, torch.Tensor]]:
    from test_gradskip_segformer import images, majority_classes, tiny_segformer

    model = tiny_segformer("2stage-sr2")
    x = images(2, (32, 32))
    target = SegmentationTarget(majority_classes(model, x))
    out = {}
    for name in ("gradskip", "gradcam", "gradient"):
        out[f"segformer/{name}"] = _fields(vitlens.explain(model, x, name, target=target))
    return out


def _methods_on_shapes_vit() -> dict[str, dict[str, torch.Tensor]]:
    from vitlens.data import make_scenes
    from vitlens.models import zoo

    model = zoo.load_bundled("shapes-vit")
    s = make_scenes(n=2, seed=3)
    x = (s.images - 0.5) / 0.25  # the model's data config: mean 0.5, std 0.25
    out = {f"shapes-vit/{n}": _fields(vitlens.explain(model, x, n)) for n in ("gradskip", "attnlrp", "gradcam")}
    return out


def _metrics() -> dict[str, dict[str, torch.Tensor]]:
    model, x = tiny_vit(), _x(3)
    gen = torch.Generator().manual_seed(5)
    maps = torch.rand(3, 32, 32, generator=gen)
    maps[2] = 0.0
    maps[1, :8, :8] = maps[1, :8, :8] - 1.0  # some negative weights for the violation test
    targets = torch.tensor([0, 3, 1])
    masks = torch.zeros(3, 32, 32, dtype=torch.bool)
    masks[0, 4:12, 4:20] = True
    masks[1, 20:, 10:] = True
    out: dict[str, dict[str, torch.Tensor]] = {}
    dc = {"mean": (0.5, 0.4, 0.3), "std": (0.25, 0.2, 0.3)}
    metrics = {
        "insertion_deletion/rise-8": InsertionDeletion("rise", steps=8, data_config=dc),
        "insertion_deletion/aha": InsertionDeletion("aha", data_config=dc),
        "insertion_deletion/mutex": InsertionDeletion("mutex", data_config=dc, batch_size=7),
        "insertion_deletion/noise-logit": InsertionDeletion(steps=5, deletion_baseline="noise", granularity=4,
                                                            insertion_baseline="blur", score="logit", data_config=dc),
        "pos_neg_perturbation/default": PositiveNegativePerturbation(data_config=dc),
        "pos_neg_perturbation/prob-patch": PositiveNegativePerturbation(score="probability", granularity="patch",
                                                                         baseline="mean", data_config=dc),
        "faithfulness_violation/k1": FaithfulnessViolation(data_config=dc),
        "faithfulness_violation/k5-pixel": FaithfulnessViolation(5, patch_size=1, score="logit", baseline="blur",
                                                                 data_config=dc),
        "saco/default": SaCo(data_config=dc),
        "saco/patch-logit-black": SaCo(4, granularity="patch", score="logit", baseline="black", data_config=dc),
    }
    for key, metric in metrics.items():
        r = metric(maps, model=model, x=x, targets=targets)
        out[key] = {**{f"values.{k}": v for k, v in r.values.items()},
                    **{f"curves.{k}": v for k, v in r.curves.items()}}
    for key, metric in {"pointing_game/0": PointingGame(), "pointing_game/tol3": PointingGame(tolerance=3.0),
                        "segmentation/mean": Segmentation(), "segmentation/otsu": Segmentation("otsu"),
                        "evidence/0": Evidence(), "evidence/tol3": Evidence(tolerance=3.0)}.items():
        r = metric(maps, masks=masks)
        out[key] = {f"values.{k}": v for k, v in r.values.items()}
    maps2 = torch.rand(3, 32, 32, generator=gen)
    out["similarity"] = {"ssim": ssim(maps, maps2), "spearman": spearman(maps, maps2),
                         "spearman_signed": spearman(maps, maps2, absolute=False)}
    r = randomisation_check(model, x[:2], "gradient", seed=1)
    out["randomisation_check/gradient"] = {"ssim": r["ssim"], "spearman": r["spearman"], "targets": r["targets"],
                                           "maps[:,:,::2,::2]": r["maps"][:, :, ::2, ::2]}
    return {k: {n: v.detach().cpu().clone() for n, v in d.items()} for k, d in out.items()}


#: the cases that are one method's outputs (``<setting>/<method>``), filled by :func:`_compute`
METHOD_CASES: set[str] = set()


def _compute() -> dict[str, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    out = {}
    out.update(_methods_on_tiny_vit())
    out.update(_methods_on_segformer())
    out.update(_methods_on_shapes_vit())
    METHOD_CASES.update(out)
    out.update(_metrics())
    return out


def merged(stored: dict[str, dict[str, torch.Tensor]], computed: dict[str, dict[str, torch.Tensor]],
           methods: frozenset[str]) -> dict[str, dict[str, torch.Tensor]]:
    """``stored`` with the cases of ``methods`` (``<setting>/<method>`` among :data:`METHOD_CASES`) added or
    replaced by their ``computed`` values; every other case is kept as stored."""
    unknown = sorted(methods - set(vitlens.methods()))
    if unknown:
        raise SystemExit(f"VITLENS_WRITE_GOLDEN: no registered method {', '.join(unknown)}")
    mine = {case for case in computed if case in METHOD_CASES and case.rpartition("/")[2] in methods}
    return {**stored, **{case: computed[case] for case in mine}}


@pytest.fixture(scope="module")
def computed() -> dict[str, dict[str, torch.Tensor]]:
    # one intra-op thread, as when the fixture was written: reductions round the same way whatever ran before
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng():
            return _compute()
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def golden(computed) -> dict[str, dict[str, torch.Tensor]]:
    if WRITE == "1":
        GOLDEN.parent.mkdir(exist_ok=True)
        torch.save(computed, GOLDEN)
    elif WRITE_ONLY:
        stored = torch.load(GOLDEN, weights_only=True) if GOLDEN.exists() else {}
        torch.save(merged(stored, computed, WRITE_ONLY), GOLDEN)
    return torch.load(GOLDEN, weights_only=True)


def test_every_method_and_metric_is_pinned(golden):
    for name in vitlens.methods():
        assert f"vit/{name}" in golden, f"method {name} has no golden output (regenerate the fixture)"
    for name in metric_names():
        assert any(k.startswith(f"{name}/") for k in golden), f"metric {name} has no golden output"


def test_outputs_match_golden(computed, golden):
    assert sorted(computed) == sorted(golden)
    for case, fields in golden.items():
        got = computed[case]
        assert sorted(got) == sorted(fields), case
        for field, want in fields.items():
            have = got[field]
            assert have.dtype == want.dtype and have.shape == want.shape, f"{case} {field}"
            if want.is_floating_point() and field.split("_stage")[0] in RATIOS:
                torch.testing.assert_close(have, want, rtol=0, atol=RATIO_ATOL, equal_nan=True,
                                           msg=lambda m, c=case, f=field: f"{c} {f}: {m}")
            elif want.is_floating_point():
                assert_close_at_scale(have, want, scale=_scale(golden, case, field),
                                      msg=lambda m, c=case, f=field: f"{c} {f}: {m}")
            else:
                assert torch.equal(have, want), f"{case} {field}"


def test_metrics_take_the_explainers_targets():
    """Perturbation metrics accept Target objects like explainers do: same numbers as the class indices they name."""
    from vitlens.targets import ClassLogit, make_target

    model, x = tiny_vit(), _x(2)
    maps = torch.rand(2, 32, 32, generator=torch.Generator().manual_seed(1))
    dc = {"mean": (0.5, 0.5, 0.5), "std": (0.25, 0.25, 0.25)}
    metric = InsertionDeletion(steps=4, data_config=dc)
    with torch.no_grad():
        predicted = model(x).argmax(1)
    want = metric(maps, model=model, x=x, targets=predicted).values
    for spec in (ClassLogit(None), make_target(None), predicted.tolist(), ClassProbability(predicted),
                 ClassLogit(None).resolve(model(x).detach())):
        got = metric(maps, model=model, x=x, targets=spec).values
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)
    with pytest.raises(vitlens.TargetError, match="3 class indices given for a batch of 2"):
        metric(maps, model=model, x=x, targets=ClassLogit([0, 1, 2]))


def test_architecture_doc_shows_the_real_method_file():
    """docs/architecture.md's worked example is the complete, current file of a real method (no drift)."""
    root = Path(__file__).parents[1]
    doc = (root / "docs" / "architecture.md").read_text(encoding="utf-8")
    source = (root / "src" / "vitlens" / "explainers" / "gae.py").read_text(encoding="utf-8")
    assert f"```python\n{source}```" in doc


def test_writing_one_method_keeps_every_other_stored_value(computed, golden):
    """``VITLENS_WRITE_GOLDEN=gae`` replaces the cases of GAE (``vit/gae``, ``gap+reg/gae``) and nothing else: a
    newcomer's method is added without re-pinning any other method's fields (not even the metric case named after a
    method, ``insertion_deletion/aha``)."""
    shifted = {case: {f: (v + 1 if v.is_floating_point() else v) for f, v in fields.items()}
               for case, fields in computed.items()}
    out = merged(golden, shifted, frozenset({"gae", "aha"}))
    assert sorted(out) == sorted(golden)
    changed = {case for case in out if out[case] is not golden[case]}
    assert changed == {"vit/gae", "gap+reg/gae", "vit/aha"}
    new = {case: fields for case, fields in computed.items() if case != "vit/random"}
    assert "vit/random" in merged({}, computed, frozenset({"random"})) and not merged({}, new, frozenset({"random"}))
    with pytest.raises(SystemExit, match="no registered method nosuch"):
        merged(golden, computed, frozenset({"nosuch"}))
