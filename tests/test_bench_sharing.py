"""A bench of k methods shares, per batch, what does not depend on the method (issue #26): the batch itself and the
perturbation metrics' scores of the unperturbed and the fully perturbed images. Results equal those of runs that
share nothing (up to float rounding: the shared logits come from other forward batches); the model runs exactly
the saved images fewer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vitlens.bench.runner import BenchConfig, run_benchmark
from vitlens.errors import InputError
from vitlens.metrics import get_metric
from vitlens.metrics.perturbation import SharedScores

from conftest import F32_ROUNDING, result_rows, tiny_vit

pytestmark = pytest.mark.usefixtures("one_thread_per_module")

METHODS = [("gradskip", {}), ("inputxgradient", {}), ("random", {})]
#: deletion to black and insertion from blur (two baselines), positive/negative perturbation to black, the
#: faithfulness violation: every kind of shareable input (the images, the all-black and the all-blur images)
METRICS = [("insertion_deletion", {"steps": 4}), ("pos_neg_perturbation", {"fractions": (0.25, 0.5)}),
           ("faithfulness_violation", {"k": 2})]
N, BATCH = 6, 4


def target():
    m = tiny_vit(seed=1, num_classes=6)
    m.vitlens_data_config = {"input_size": (3, 32, 32), "mean": (0.5, 0.5, 0.5), "std": (0.25, 0.25, 0.25),
                             "crop_pct": 1.0}
    return m


def run(out: Path, share: bool, methods=METHODS) -> tuple[dict[tuple, float], int]:
    """Rows ``{(image, method, metric, output): value}`` of a run and the images the model was run on."""
    model = target()
    seen = [0]
    handle = model.register_forward_hook(lambda mod, args, res: seen.__setitem__(0, seen[0] + args[0].shape[0]))
    try:
        cfg = BenchConfig(model="tiny", data="scenes:seed=3", methods=list(methods), metrics=METRICS, n=N,
                          batch_size=BATCH, show=0, share=share)
        run_benchmark(cfg, out, model=model, progress=False)
    finally:
        handle.remove()
    rows = {r[:4]: r[4] for r in result_rows(out)}
    return rows, seen[0]


def test_shared_run_equals_separate_runs_with_fewer_forwards(tmp_path):
    shared, n_shared = run(tmp_path / "shared", share=True)
    unshared, n_unshared = run(tmp_path / "unshared", share=False)
    separate: dict[tuple, float] = {}
    for name, opts in METHODS:  # k separate runs, one method each
        separate.update(run(tmp_path / f"only-{name}", share=False, methods=[(name, opts)])[0])
    assert sorted(shared) == sorted(unshared) == sorted(separate)
    assert len(shared) == N * len(METHODS) * (3 + 3 + 1)
    for key, want in separate.items():
        assert unshared[key] == want, key  # sharing nothing, one run of k methods = k runs of one
        if want != want:  # NaN (an image without counted features) stays NaN
            assert shared[key] != shared[key], key
        else:
            assert abs(shared[key] - want) <= 16 * F32_ROUNDING * (abs(want) + 1.0), (key, shared[key], want)
    # per image and method without sharing: insertion/deletion's original, all-black end and all-blur start, the
    # original of positive/negative perturbation and of the violation test = 5 images; shared: the three source
    # batches (images, black, blur) once per batch
    k = len(METHODS)
    assert n_unshared - n_shared == N * (5 * k - 3)


def test_shared_scores_are_used_only_for_their_batch():
    model = target()
    x = torch.randn(3, 3, 32, 32)
    maps = torch.rand(3, 32, 32)
    metric = get_metric("insertion_deletion", steps=3)  # deletion to black, insertion from blur
    plain = metric(maps, model=model, x=x, targets=[0, 1, 2])
    shared = SharedScores(x)
    first = metric(maps, model=model, x=x, targets=[0, 1, 2], shared=shared)
    assert shared.forwards == 3 * 3  # the images, the all-black and the all-blur images, once
    for name in plain.values:
        torch.testing.assert_close(first.values[name], plain.values[name], rtol=1e-5, atol=1e-6)
    again = metric(torch.rand(3, 32, 32), model=model, x=x, targets=[0, 1, 2], shared=shared)
    assert shared.forwards == 3 * 3 and torch.isfinite(again.values["insertion"]).all()  # nothing run again
    other = metric(maps, model=model, x=x + 1, targets=[0, 1, 2], shared=shared)  # other images: not used
    assert shared.forwards == 3 * 3
    assert torch.equal(other.values["deletion"], metric(maps, model=model, x=x + 1, targets=[0, 1, 2]).values["deletion"])
    with pytest.raises(InputError, match="shared must be a vitlens SharedScores"):
        metric(maps, model=model, x=x, targets=[0, 1, 2], shared={"x": x})
