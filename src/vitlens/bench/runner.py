"""The benchmark harness: every method × every metric over a data set, stored as it is produced, resumable.

    vitlens bench --model shapes-vit --data scenes --methods gradskip,inputxgradient \
                  --metrics insertion_deletion:preset=aha,pointing_game:tolerance=4 --n 200 --out runs/x

A *unit* is one method on one batch of images with all metrics; units are committed atomically to the run's SQLite
shard, and a rerun of the same command skips the units already stored (``kill -9`` loses at most the unit in
flight). Under ``torchrun --nproc_per_node N`` images are sharded across processes (``image % N == rank``; gloo on
CPU, nccl on GPU) and rank 0 merges the shards and writes the summary and the report.

Nothing is written before the whole run is known to be valid (settings, method and metric options, data source,
what each metric needs from the data); only then ``config.json``. A run directory is reused only by the same
configuration (that is resuming); another configuration is refused unless ``overwrite=True`` (``--overwrite``),
which removes only the files a benchmark writes.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from ..atomic import atomic_path, write_text
from ..errors import DamagedFileError, InputError
from ..explainers import get_method
from ..metrics import get_metric
from ..pause import pause_point
from ..runtime import init_distributed
from .sources import open_source
from .specs import parse_spec, safe_label, spec_label, split_specs
from .store import ResultStore, dumps

__all__ = ["BenchConfig", "run_benchmark", "parse_spec", "split_specs", "spec_label"]


@dataclass
class BenchConfig:
    """Everything that defines a run (stored as ``config.json``; a resumed run must match it)."""

    model: str
    data: str
    methods: list[tuple[str, dict[str, Any]]]
    metrics: list[tuple[str, dict[str, Any]]]
    n: int | None = None
    batch_size: int = 25
    target: str = "predicted"
    seed: int = 0
    show: int = 6
    #: a vision-language model's prompts, one per class (the model is a ZeroShotClassifier over them)
    prompts: list[str] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    #: share across the methods of one batch what does not depend on the method (a cost knob, not part of the
    #: stored configuration: the results differ by float rounding only)
    share: bool = True

    def check(self) -> None:
        """Refuse settings that cannot make a valid run (one line naming the setting, the value, what is allowed)."""
        from ..options import check_int

        if self.n is not None:
            check_int("n (number of images)", self.n, low=1, owner="the benchmark")
        check_int("batch_size", self.batch_size, low=1, owner="the benchmark")
        check_int("show", self.show, low=0, owner="the benchmark")
        check_int("seed", self.seed, low=0, high=2 ** 63 - 1, owner="the benchmark")  # torch.manual_seed's range
        if self.target not in ("predicted", "label"):
            raise InputError(f"target must be 'predicted' or 'label'; got {self.target!r}")
        if not self.methods:
            raise InputError("no method given: --methods needs at least one method name (see `vitlens methods`)")
        if not self.metrics:
            raise InputError("no metric given: --metrics needs at least one metric name")
        for flag, specs in (("--methods", self.methods), ("--metrics", self.metrics)):
            labels = [spec_label(name, opts) for name, opts in specs]  # one label = one set of result rows
            twice = next((label for label in labels if labels.count(label) > 1), None)
            if twice is not None:
                raise InputError(f"{flag} lists {twice} twice; give each configured method or metric once")
            seen: dict[str, str] = {}
            for label in labels:
                other = seen.setdefault(safe_label(label).casefold(), label)
                if other != label:
                    raise InputError(f"{flag} {other} and {label} would share one name in the results "
                                     f"({safe_label(label)}); give them settings that differ in letters or digits")

    def to_json(self) -> dict[str, Any]:
        return json.loads(dumps({
            "model": self.model, "data": self.data, "n": self.n, "target": self.target, "seed": self.seed,
            "methods": [[m, o] for m, o in self.methods], "metrics": [[m, o] for m, o in self.metrics],
            **({"prompts": list(self.prompts)} if self.prompts else {}),
        }))


#: what a benchmark writes in its run directory (``overwrite`` removes these, and nothing else)
RUN_FILES = ("config.json", "results.sqlite", "results.sqlite.damaged", "summary.md", "summary.tex", "summary.csv",
             "summary.json", "curves.png", "curves-all.png", "examples.png", "report.html", "provenance.json")
RUN_DIRS = ("shards", "examples")


def _read_config(path: Path) -> dict[str, Any]:
    from ..files import read_text_file

    try:
        have = json.loads(read_text_file(path, "the file", error=DamagedFileError))
        if not isinstance(have, dict):
            raise ValueError("not a JSON object")
        return have
    except (ValueError, UnicodeDecodeError, DamagedFileError) as e:  # (not text, a FIFO: the same way out)
        raise DamagedFileError(
            f"{path} is damaged ({e}); restore it, or rerun with --overwrite to start this run directory over"
        ) from None


def _clear_run(run_dir: Path) -> None:
    import shutil

    for name in RUN_FILES:
        (run_dir / name).unlink(missing_ok=True)
    for name in RUN_DIRS:
        if (run_dir / name).is_dir():
            shutil.rmtree(run_dir / name)


def _check_out_dir(run_dir: Path) -> None:
    if run_dir.exists() and not run_dir.is_dir():
        raise InputError(f"--out {run_dir} is a file, not a directory; choose a directory for the run")
    probe = run_dir if run_dir.exists() else next((p for p in run_dir.parents if p.exists()), Path("."))
    if not os.access(probe, os.W_OK | os.X_OK):
        raise InputError(f"cannot write to {probe} (permission denied or read-only); choose another --out")


def _check_config(run_dir: Path, config: BenchConfig, overwrite: bool = False, write: bool = True) -> None:
    """Reuse ``run_dir`` if it holds this configuration, else refuse (or, with ``overwrite``, clear it); then
    write ``config.json`` (atomically) if it is not there yet."""
    path = run_dir / "config.json"
    want = config.to_json()
    if path.exists() and not overwrite:
        have = _read_config(path)
        diff = sorted(k for k in set(want) | set(have) if want.get(k) != have.get(k))
        if diff:
            raise InputError(
                f"run directory {run_dir} was written by another configuration (differs in: {', '.join(diff)}); "
                "use a new --out directory, the original settings, or --overwrite to replace it"
            )
    elif not path.exists() and not overwrite:
        leftovers = [n for n in RUN_FILES + RUN_DIRS if (run_dir / n).exists()]
        if leftovers:
            raise InputError(f"run directory {run_dir} holds benchmark files ({', '.join(leftovers)}) but no "
                             "config.json; use a new --out directory, or --overwrite to replace them")
    if not write:
        return
    if overwrite:
        _clear_run(run_dir)
    if not path.exists():
        run_dir.mkdir(parents=True, exist_ok=True)
        write_text(path, json.dumps(want, indent=2))


def _check_weights(run_dir: Path, digest: str, model: str) -> None:
    """Results already in ``run_dir`` must have been computed with these weights (SHA-256 ``digest``): a run is
    matched to its model by the weights' digest stored with its results (or, for a store written before that, in its
    ``provenance.json``), never by the model's name in ``config.json``, which anyone can edit."""
    from .store import stored_weights

    found = stored_weights(run_dir)
    if not found and (run_dir / "provenance.json").is_file():  # a store written before the digest was stored in it
        try:
            from ..files import read_text_file

            record = json.loads(read_text_file(run_dir / "provenance.json", "provenance.json"))
            old = record.get("model", {}).get("weights_sha256") if isinstance(record, dict) else None
        except (ValueError, AttributeError, InputError):
            old = None
        if isinstance(old, str):
            found = {"provenance.json": old}
    other = {name: d for name, d in found.items() if d != digest}
    if other:
        name, theirs = next(iter(sorted(other.items())))
        raise InputError(f"run directory {run_dir} holds results computed with other weights than {model}'s "
                         f"(weights SHA-256 {theirs[:16]}… in {name}, {digest[:16]}… now), whatever its config.json "
                         "says; use a new --out directory, or --overwrite to replace that run")


def _check_data_needs(metrics: Sequence[tuple[str, Any]], source: Any, target: str = "predicted") -> None:
    """Each metric's ground-truth needs (masks, boxes), and ``--target label``'s labels, against what the source's
    first image has."""
    if len(source) == 0:
        raise InputError("the data source has no images")
    probe = source.batch([0])
    if target == "label" and probe.get("labels") is None:
        raise InputError("--target label needs labels, which the data source does not provide; use --target "
                         "predicted")
    have = {k for k in ("masks", "boxes") if probe.get(k) is not None}
    for label, metric in metrics:
        need = set(getattr(metric, "needs", ())) & {"masks", "boxes"}
        any_of = set(getattr(metric, "needs_any", ()))
        if need - have or (any_of and not any_of & have):
            what = ", ".join(sorted(need - have)) or " or ".join(sorted(any_of, reverse=True))
            raise InputError(f"metric {label!r} needs {what}, which the data source does not provide")


def run_benchmark(config: BenchConfig, out: str | Path, model: nn.Module | None = None,
                  progress: bool = True, stop_after_units: int | None = None, overwrite: bool = False,
                  device: str | torch.device | None = None) -> Path:
    """Run (or resume) a benchmark into ``out``. Returns the run directory.

    ``device``: where the model runs (checked by :func:`vitlens.devices.check_device`; ``"cuda"`` under torchrun is
    this process's GPU, ``LOCAL_RANK``); ``None``: CUDA when there is a GPU, else the CPU. Progress counts maps (a
    method on an image), advanced after each method on a batch and naming the unit that runs, so a batch of many
    images and methods is never one silent step.

    ``model`` may be passed directly (otherwise ``config.model`` is loaded with :func:`vitlens.load_model`).
    ``stop_after_units`` stops early after that many new units (tests use it to simulate a crash).
    ``overwrite``: replace a run of another configuration in ``out`` (default: refuse it).
    """
    from .. import load_model
    from .report import write_report

    config.check()
    run_dir = Path(out)
    _check_out_dir(run_dir)
    device = _run_device(device)
    dist = init_distributed(device)
    rank, world = dist.rank, dist.world
    _check_config(run_dir, config, overwrite, write=False)  # refuse early, before any work
    torch.manual_seed(config.seed)
    if model is None:
        model = load_model(config.model)
        pause_point("model-loaded")
    net = model
    net = net.to(device).eval()
    source = open_source(config.data, net, n=config.n, seed=config.seed)
    methods = [(spec_label(m, o), get_method(m, **o)) for m, o in config.methods]
    metrics = [(spec_label(m, o), get_metric(m, **o)) for m, o in config.metrics]
    _check_data_needs(metrics, source, config.target)
    for _, method in methods:  # what a method needs beyond the model (AHA: its explainer weights), before writing
        getattr(method, "prepare", lambda model: None)(net)
    from ..api import weights_sha256

    digest = weights_sha256(net)
    if not overwrite:
        _check_weights(run_dir, digest, config.model)
    if rank == 0:  # everything is valid: only now the run directory is written
        _check_config(run_dir, config, overwrite)
        from ..api import run_provenance

        write_text(run_dir / "provenance.json", json.dumps(run_provenance(net, device), indent=2))
    if dist.active:
        dist.barrier()
        if rank != 0:
            _check_config(run_dir, config)
    store = ResultStore(run_dir, rank)
    store.record_weights(digest)
    done = store.done_units()
    mine = [i for i in range(len(source)) if i % world == rank]
    batches = [mine[s:s + config.batch_size] for s in range(0, len(mine), config.batch_size)]
    # batch-major: the methods of one batch run one after another and share what does not depend on the method
    # (the batch itself, the perturbation metrics' scores of the unperturbed and fully perturbed images)
    units = [(label, method, b) for b in batches for label, method in methods
             if any((label, i) not in done for i in b)]
    from tqdm.auto import tqdm

    # one step per map (a method on an image), advanced after each method on a batch: inside a batch of 25 images
    # and 7 methods the bar moves 7 times, and its first ETA comes after the first method's unit, not the batch's
    bar = tqdm(total=sum(len(b) for _, _, b in units), desc=f"bench (rank {rank})" if world > 1 else "bench",
               unit="map", disable=not progress or (rank != 0 and world > 1))
    written = 0
    stored_before = len(methods) * len(batches) - len(units)
    shared = _BatchShare(source, device, config.share)
    if units:
        bar.set_postfix_str(_unit_words(units[0]))
    try:
        for k, (label, method, idx) in enumerate(units):
            _run_unit(store, shared, net, label, method, metrics, idx, config, run_dir, device,
                      predict=label == methods[0][0])
            written += 1
            bar.update(len(idx))
            if k + 1 < len(units):  # what runs now, shown while it runs
                bar.set_postfix_str(_unit_words(units[k + 1]))
            pause_point(f"bench.unit.{stored_before + written}")
            if stop_after_units is not None and written >= stop_after_units:
                return run_dir
    finally:
        bar.close()
        store.close()
    dist.barrier()
    if rank == 0:
        ResultStore(run_dir, 0).merge()
        write_report(run_dir, config)
    dist.barrier()
    return run_dir


def _run_device(device: str | torch.device | None) -> torch.device:
    from ..devices import check_device

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(check_device(device))
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return dev


class _BatchShare:
    """The batch of the current unit and its :class:`~vitlens.metrics.perturbation.SharedScores`, kept while the
    next units are on the same images (``share=False``: loaded and computed again for every unit)."""

    def __init__(self, source: Any, device: torch.device, share: bool) -> None:
        self.source, self.device, self.share = source, device, share
        self.idx: list[int] | None = None
        self.batch: dict[str, Any] = {}
        self.x = torch.empty(0)
        self.scores: Any = None

    def get(self, idx: list[int]) -> tuple[dict[str, Any], Tensor, Any]:
        if not self.share or idx != self.idx:
            from ..metrics.perturbation import SharedScores

            self.batch = self.source.batch(idx)
            self.x = self.batch["x"].to(self.device)
            self.scores = SharedScores(self.x) if self.share else None
            self.idx = list(idx)
        return self.batch, self.x, self.scores


def _run_unit(store: ResultStore, shared: _BatchShare, model: nn.Module, label: str, method: Any,
              metrics: Sequence[tuple[str, Any]], idx: list[int], config: BenchConfig, run_dir: Path,
              device: torch.device, predict: bool = False) -> None:
    batch, x, scores = shared.get(idx)
    target = None if config.target == "predicted" else batch["labels"].to(device)
    t0 = time.perf_counter()
    exp = method.explain(model, x, target=target)
    seconds = time.perf_counter() - t0
    maps = exp.maps
    rows, curves = [], []
    for mlabel, metric in metrics:
        kwargs = {"model": model, "x": x, "targets": exp.targets}
        if scores is not None and getattr(metric, "shares_scores", False):
            kwargs["shared"] = scores
        for key in ("masks", "boxes"):
            if batch.get(key) is not None:
                kwargs[key] = batch[key].to(device)
        res = metric(maps, **kwargs)
        protocol = dumps(res.protocol)
        for out_name, values in res.values.items():
            for j, i in enumerate(idx):
                v = float(values[j])
                rows.append((i, batch["ids"][j], label, mlabel, out_name, None if np.isnan(v) else v,
                             int(res.higher_is_better[out_name]), protocol))
        if res.curves and res.curve_x is not None:
            xs = json.dumps([round(float(v), 6) for v in res.curve_x])
            for out_name, cv in res.curves.items():
                for j, i in enumerate(idx):
                    curves.append((i, label, mlabel, out_name, xs, json.dumps([float(v) for v in cv[j]])))
    per_image = seconds / len(idx)
    costs = [(i, label, exp.cost.forward_passes, exp.cost.backward_passes, per_image) for i in idx]
    show = [j for j, i in enumerate(idx) if i < config.show]
    if show:
        ex_dir = run_dir / "examples"
        ex_dir.mkdir(exist_ok=True)
        for j in show:
            with atomic_path(ex_dir / f"{safe_label(label)}__{idx[j]}.npy") as tmp:
                np.save(tmp, maps[j].cpu().numpy())
            pix = ex_dir / f"image__{idx[j]}.npy"
            if not pix.exists():
                with atomic_path(pix) as tmp:
                    np.save(tmp, batch["pixels"][j].cpu().numpy())
    store.write_unit(rows, costs, curves, _predictions(model, x, batch.get("labels"), idx) if predict else ())


def _predictions(model: nn.Module, x: Tensor, labels: Tensor | None, idx: list[int]) -> list[tuple]:
    """The model's own answer per image (for the report's accuracy and captions); none for non-classifiers."""
    from ..models.base import logits_of

    with torch.no_grad():
        logits = logits_of(model(x))
    if logits.ndim != 2:
        return []
    prob, pred = logits.float().softmax(-1).max(-1)
    lab = [None] * len(idx) if labels is None else [int(v) if int(v) >= 0 else None for v in labels.tolist()]
    return [(i, int(p), float(q), lab[j]) for j, (i, p, q) in enumerate(zip(idx, pred.tolist(), prob.tolist()))]


def check_before_loading(out: str | Path, methods: Sequence[tuple[str, dict[str, Any]]],
                         metrics: Sequence[tuple[str, dict[str, Any]]], config: BenchConfig | None = None,
                         overwrite: bool = False) -> None:
    """The usage mistakes a benchmark finds without its model, before the seconds a model takes to load: an
    unknown method or metric (with the closest names), a bad option, an --out that is a file or not writable, and
    (``config``) a run directory written by another configuration."""
    for name, opts in methods:
        get_method(name, **opts)
    for name, opts in metrics:
        get_metric(name, **opts)
    run_dir = Path(out)
    _check_out_dir(run_dir)
    if config is not None:
        config.check()
        _check_config(run_dir, config, overwrite, write=False)


def _unit_words(unit: tuple[str, Any, list[int]]) -> str:
    """``'gradskip on images 26-50'``: a unit of work as the progress bar shows it while it runs."""
    label, _, idx = unit
    return f"{label} on image{'s' if len(idx) > 1 else ''} {idx[0] + 1}" + (f"-{idx[-1] + 1}" if len(idx) > 1 else "")
