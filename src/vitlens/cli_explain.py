"""``vitlens explain``: explain one's own images with one's own model and several methods.

Per input image and method: a figure on the original image (uncropped, at its own resolution, the parts the model
never saw left uncoloured) and one on the model's input view, each with a colour bar and a caption (class name,
probability; with --text the prompt and its image-text score); the maps (.npz: pixel map and token map) and a
provenance JSON. With several methods, one comparison grid per image. Output names follow the input's path relative
to the inputs' common folder, so two inputs never share an output name. One summary line per image (class and
probability, or the prompt and its score; cost), or --json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from .atomic import atomic_path, write_text
from .cli_prompts import prompt_runs
from .cli_prompts import safe_stem as _safe
from .options import load_model_with_options, nonnegative_int, parse_key_values, positive_int

__all__ = ["add_explain_parser", "cmd_explain", "output_bases", "prompt_runs"]


def add_explain_parser(sub: Any, formatter: type[argparse.HelpFormatter]) -> argparse.ArgumentParser:
    e = sub.add_parser("explain", formatter_class=formatter,
                       help="explain images with one or more methods; figures, maps and provenance per image",
                       description=__doc__.split("\n\n")[1].replace("\n", " "))
    e.add_argument("images", nargs="+", help="image files, or folders (every image under them)")
    e.add_argument("--model", required=True,
                   help="the model to explain (required): bundled name (vitlens models), efficientnet_lite0, "
                        "timm:<arch> or hf:<dir>")
    e.add_argument("--model-option", action="append", default=[], metavar="KEY=VALUE",
                   help="argument for load_model, repeatable (e.g. pretrained=False, num_classes=10)")
    e.add_argument("--methods", "--method", dest="methods", default="gradskip",
                   help="method specs, comma-separated: name or name:key=value;key=value (vitlens methods)")
    e.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="option for every method, repeatable (per-method options: --methods 'gradskip:alpha=0.3')")
    e.add_argument("--target", type=nonnegative_int, default=None, help="class index to explain (None: the predicted class)")
    e.add_argument("--text", action="append", default=[], metavar="PROMPT",
                   help="vision-language models (CLIP, SigLIP, shapes-clip): explain the image-text score of this "
                        "prompt instead of a class; repeatable, one figure per prompt (docs/vlm.md)")
    e.add_argument("--versus", default=None, metavar="PROMPT",
                   help="with --text: explain each prompt's score minus this prompt's (TextContrast); one naming "
                        "no object, e.g. 'a picture', localises far better (docs/vlm.md)")
    e.add_argument("--probability", action="store_true",
                   help="with two or more --text prompts: explain each prompt's zero-shot probability among them "
                        "(TextProbability; always positive, unlike a raw score)")
    e.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:1, mps, or auto")
    e.add_argument("--batch", type=positive_int, default=16,
                   help="images per batch (>= 1) on an accelerator; on the CPU each image is explained on its own "
                        "(progress and cost per image)")
    e.add_argument("--normalize", default="auto", choices=["auto", "signed", "positive", "abs", "minmax"],
                   help="colour scaling: auto = by what each method's values mean (signed: diverging, centred at "
                        "0; non-negative: from 0; probability-like: lowest to highest), the same on every image")
    e.add_argument("--style", default="auto", choices=["auto", "overlay", "blend", "abs"],
                   help="how maps are drawn: overlay = colours over the photo; blend = signed colours over the image in "
                        "grey; abs = |relevance| over the image in grey; auto = blend for pixel-level methods "
                        "(input x gradient, IG, ...), overlay for token-level ones")
    e.add_argument("--smooth", type=float, default=0.0, metavar="SIGMA",
                   help="Gaussian smoothing of the drawn maps, in pixels of the model's view (0 = none; maps saved "
                        "in .npz are never smoothed)")
    e.add_argument("--clip", type=float, default=99.5,
                   help="percentile where the colour scale ends (100 = the maximum)")
    e.add_argument("--format", default="png", choices=["png", "pdf", "svg"],
                   help="file format of the figures and grids (provenance: PNG text chunks, PDF subject, SVG "
                        "description, and always the JSON)")
    e.add_argument("--dpi", type=positive_int, default=None,
                   help="resolution of the figures in dots per inch (default: the least, from 100 up, at which "
                        "every panel is at least the model's input size)")
    e.add_argument("--shared-scale", action="store_true",
                   help="in the comparison grid, one colour scale for all methods of an image (methods whose "
                        "values compare), with its colour bar in map values")
    e.add_argument("--out", default="vitlens-out", help="output folder")
    e.add_argument("--overwrite", action="store_true",
                   help="replace outputs an earlier run left in --out (default: refuse to replace any file)")
    e.add_argument("--json", action="store_true", help="print one JSON record per image instead of a summary line")
    e.add_argument("--quiet", action="store_true", help="print nothing but errors")
    e.set_defaults(func=cmd_explain)
    return e


def _expand(paths: Sequence[str]) -> list[Path]:
    from vitlens.data.loaders import IMAGE_EXTENSIONS
    from vitlens.errors import InputError

    from vitlens.files import check_regular, regular_files

    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.suffix.lower() in IMAGE_EXTENSIONS
                           and not any(part.startswith(".") for part in f.relative_to(p).parts))
            found, skipped = regular_files(found, p)
            if skipped:
                print(f"vitlens: {skipped}", file=sys.stderr)
            if not found:
                raise InputError(f"folder '{p}' contains no images")
            out += found
        else:
            if p.exists():  # a FIFO, socket or device given as an image: refused before anything is written
                check_regular(p, f"'{p}'")
            out.append(p)
    return out


def output_bases(paths: Sequence[Path]) -> list[str]:
    """Output name (without suffix) per input: its path relative to the inputs' common folder, the extension kept
    (``cats/a.jpg`` → ``cats/a_jpg``), made unique when the same file is given twice."""
    resolved = [p.resolve() for p in paths]
    common = Path(os.path.commonpath([str(r.parent) for r in resolved])) if resolved else Path(".")
    seen: dict[str, int] = {}
    out = []
    for r in resolved:
        rel = r.relative_to(common)
        base = (rel.parent / f"{rel.stem}_{rel.suffix.lstrip('.').lower() or 'img'}").as_posix()
        count = seen.get(base.casefold(), 0)  # casefold: distinct on case-insensitive file systems too
        seen[base.casefold()] = count + 1
        out.append(base if count == 0 else f"{base}-{count + 1}")
    return out


def _specs(args: argparse.Namespace) -> list[tuple[str, str, dict[str, Any]]]:
    """(label, name, options) per method; ``--option`` pairs apply to every method."""
    from vitlens.bench.runner import spec_label, split_specs

    from vitlens.errors import InputError

    common = parse_key_values(args.option, "--option")
    out = []
    if not args.methods.strip():
        raise InputError("--methods is empty; name at least one method (vitlens methods lists them)")
    for name, opts in split_specs(args.methods):
        merged = {**common, **opts}
        out.append((spec_label(name, merged), name, merged))
    labels = [label for label, _, _ in out]
    if len(set(labels)) != len(labels):
        raise InputError(f"--methods lists the same method twice: {args.methods}")
    stems: dict[str, str] = {}
    for label in labels:  # file names are made of the labels: two labels, one file name would replace outputs
        other = stems.setdefault(_safe(label).casefold(), label)
        if other != label:
            raise InputError(f"--methods {other} and {label} would write the same files ({_safe(label)}.*); "
                             "give them settings that differ in letters or digits, or run them separately")
    return out


def _probabilities(model: Any, x: Any) -> Any:
    """Softmax of the model's logits ``(B, K)``, or ``None`` for models whose output is not ``(B, K)``."""
    import torch

    from vitlens.models.base import logits_of

    from vitlens.models import get_adapter

    if not get_adapter(model).provides("class_logits"):  # e.g. a vision-language model's image embeddings
        return None
    with torch.no_grad():
        logits = logits_of(model(x))
    return logits.float().softmax(-1).cpu() if logits.ndim == 2 else None


def _p(prob: float) -> str:
    return f"{prob:.2f}" if prob >= 0.01 else f"{prob:.1e}"


def _caption(cls: int, prob: float | None, names: list[str] | None, random_weights: bool = False) -> str:
    """``'tiger cat (class 282), p = 0.93'``; a model with random weights gets no class names (its outputs are
    no prediction) and says so."""
    nb = "\u00a0"  # "p = 0.93" is never split over two lines
    if random_weights:
        return f"class {cls}{'' if prob is None else f', p{nb}={nb}{_p(prob)}'} — random weights, not a prediction"
    name = names[cls] if names and 0 <= cls < len(names) else None
    text = f"{name} (class {cls})" if name else f"class {cls}"
    return text + ("" if prob is None else f", p{nb}={nb}{_p(prob)}")


def random_weights(model: Any) -> bool:
    """Whether a model loaded by :func:`vitlens.load_model` has random weights (``pretrained=False`` and no weights
    file): its class scores are no prediction."""
    source = getattr(model, "vitlens_source", None) or {}
    return source.get("pretrained") is False and not source.get("weights")


def cmd_explain(args: argparse.Namespace) -> int:
    import vitlens
    from vitlens import images as vimages
    from vitlens import viz
    from vitlens.data.classes import model_class_names
    from vitlens.errors import InputError

    if not str(args.out).strip():
        raise InputError("--out is empty; name the output folder (an empty name would write into the current one)")
    if args.dpi is not None and args.dpi > _MAX_DPI:
        raise InputError(f"--dpi {args.dpi} is more than {_MAX_DPI}: the figures would be gigapixels (the default "
                         "100 draws the 2048-px original at its own resolution)")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} is a file, not a directory; choose a directory for the outputs")
    specs = _specs(args)
    methods = [(label, vitlens.explainers.get_method(name, **opts)) for label, name, opts in specs]
    paths = _expand(args.images)
    bases = output_bases(paths)
    _check_before_loading(args, out, paths, bases, [label for label, _ in methods])  # usage mistakes: no model yet
    from vitlens.devices import option_device

    device = option_device(args.device)
    model_kwargs = parse_key_values(args.model_option, "--model-option")
    if args.model.startswith(("timm:", "hf:")):
        model_kwargs.setdefault("seed", 0)  # random weights (pretrained=False, a new head) are the same every run
    model = load_model_with_options(args.model, model_kwargs).to(device)
    cfg = vimages.data_config(model)
    names = model_class_names(model)
    untrained = random_weights(model)
    if not 0.0 <= args.smooth < float("inf"):
        raise InputError(f"--smooth must be a number >= 0 (pixels of the model's view), got {args.smooth}")
    if args.smooth > max(cfg.size_hw):
        raise InputError(f"--smooth {args.smooth:g} is more than the model's view ({cfg.size_hw[0]}x{cfg.size_hw[1]} "
                         "px): such a blur flattens the map; give a sigma of a few pixels")
    kinds = {label: type(method).value_kind_for(getattr(method, "options", {})) or None for label, method in methods}
    style: dict[str, Any] = {"normalize": args.normalize, "clip": None if args.clip >= 100 else args.clip,
                             "smooth": args.smooth, "kinds": kinds, "random_weights": untrained,
                             "min_panel_px": max(cfg.size_hw),
                             "styles": {label: viz.default_style(method.level, kinds[label]) if args.style == "auto"
                                        else args.style for label, method in methods},
                             "normalize_of": {label: viz.kind_normalize(kinds[label]) if args.normalize == "auto"
                                              else args.normalize for label, _ in methods}}
    runs = prompt_runs(args, bases)  # [(target, bases)]: once, or once per --text prompt
    _refuse_replacing(out, [f for _, b in runs for f in planned_files(b, [label for label, _ in methods], args.format)],
                      args.overwrite)
    from vitlens.run_folders import folder_lock

    with folder_lock(out, "explain"):
        from vitlens.api import model_provenance

        style["model_record"] = model_provenance(model, args.model, model_kwargs)  # once: it hashes the weights
        style["model_record"]["random_weights"] = untrained
        calls: list[dict[str, Any]] = []
        progress = _Progress(len(paths) * len(runs), methods, args.quiet,
                             "images explained" if len(runs) == 1 else f"explanations ({len(paths)} image(s) × "
                             f"{len(runs)} prompts)")
        try:
            for target, run_bases in runs:
                calls += _explain_all(args, out, paths, run_bases, methods, model, cfg, names, style, device, target,
                                      progress)
        finally:
            progress.close()
        write_text(out / RUN_SUMMARY, json.dumps({"model": args.model, "model_provenance": style["model_record"],
                                                  "device": str(device), "images": len(paths), "calls": calls,
                                                  "seconds": sum(c["seconds"] for c in calls)}, indent=2))
    return 0


#: the run's own record in --out: every explanation call (method, images, seconds, passes), the batch's cost where
#: it belongs (each image's JSON holds its share)
RUN_SUMMARY = "explain-run.json"


def _check_before_loading(args: argparse.Namespace, out: Path, paths: list[Path], bases: list[str],
                          labels: list[str]) -> None:
    """The usage mistakes found without the model (one line each, before the seconds a model takes to load): a
    missing image, a bad --smooth, outputs of an earlier run in --out."""
    from vitlens.errors import InputError

    missing = [p for p in paths if not p.exists()]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise InputError(f"'{missing[0]}': image file not found{more}; check the path")
    if not 0.0 <= args.smooth < float("inf"):
        raise InputError(f"--smooth must be a number >= 0 (pixels of the model's view), got {args.smooth}")
    files = [f for _, b in prompt_runs(args, bases) for f in planned_files(b, labels, args.format)]
    _refuse_replacing(out, files + [RUN_SUMMARY], args.overwrite)


class _Progress:
    """Progress of an explain run on stderr, per image and method, weighted by each method's declared passes per
    image (so the ETA holds when one method costs 4,000 passes and another 2): a live bar on a terminal, else one
    line per image (``[2/5] images explained, 41 s, ETA 27 s``). Nothing when quiet."""

    def __init__(self, images: int, methods: list, quiet: bool, unit: str = "images explained") -> None:
        self.weights = {label: _weight(method) for label, method in methods}
        self.total = images * sum(self.weights.values())
        self.images, self.done, self.quiet, self.unit = images, 0.0, quiet, unit
        self.finished = 0  # images explained (each prompt's run counts its images again)
        self.began = time.perf_counter()
        self.bar = None
        if not quiet and sys.stderr.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=round(self.total, 3), unit="pass", desc="explain", file=sys.stderr,
                            bar_format="{desc}: {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}]")

    def starting(self, label: str, first: int, last: int) -> None:
        """``label`` is about to explain images ``first``..``last`` (1-based): shown while it runs."""
        if self.bar is not None:
            where = f"image {first}" if first == last else f"images {first}-{last}"
            self.bar.set_description_str(f"explain {where} of {self.images}: {label}")

    def map_done(self, label: str, count: int, image: int) -> None:
        """``count`` images explained by ``label``; ``image``: the last of them (1-based)."""
        step = self.weights[label] * count
        self.done += step
        if self.bar is not None:
            self.bar.update(round(step, 3))

    def printing(self) -> Any:
        """A context in which stdout lines do not tear the live bar (it is cleared and redrawn)."""
        import contextlib

        if self.bar is None:
            return contextlib.nullcontext()
        from tqdm import tqdm

        return tqdm.external_write_mode(file=sys.stderr)

    def image_done(self) -> None:
        """One more image has its maps and figures (counted over every prompt's run)."""
        self.finished += 1
        done = self.finished
        if self.quiet or self.bar is not None:
            return
        elapsed = time.perf_counter() - self.began
        left = elapsed / max(self.done, 1e-9) * (self.total - self.done)
        eta = f", ETA {left:.0f} s" if done < self.images else ", done"
        print(f"[{done}/{self.images}] {self.unit}, {elapsed:.0f} s{eta}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _weight(method: Any) -> float:
    """A method's declared passes per image (a backward counted as two forwards); 1 when it cannot say yet."""
    import math

    try:
        cost = method.declared_cost()
        w = float(cost.get("forward", 1.0)) + 2.0 * float(cost.get("backward", 0.0))
    except Exception:  # a method whose cost depends on its first call (MDA) or on weights not loaded yet
        return 1.0
    return w if math.isfinite(w) and w > 0 else 1.0


def _text_caption(exp: Any, j: int, name_only: bool = False) -> str | None:
    """The caption of a map of a text target: the prompt (a contrast: ``“a ring” over “a disk”``) and the
    image-text score (a probability: ``P(“a ring”) among 3 prompts = 0.9``; ``name_only``: the prompt itself);
    ``None`` for class targets."""
    if not _is_text(exp):
        return None
    if name_only:
        prompts = exp.target.get("prompts") or []
        k = int(exp.targets[j])
        return str(prompts[k]) if 0 <= k < len(prompts) else None
    sep = " = " if exp.target.get("kind") == "TextProbability" else ", score = "
    return f"{_target_words(exp, j)}{sep}{float(exp.scores[j]):.3g}"


def _is_text(exp: Any) -> bool:
    """Whether an explanation's target is a text target (a prompt, a contrast of prompts, a prompt's probability
    among prompts, text embeddings)."""
    from vitlens.targets_text import TEXT_KINDS

    return exp.target.get("kind") in TEXT_KINDS


def _target_words(exp: Any, j: int) -> str:
    """What row ``j``'s map is for and against, for its colour bar: the prompt in quotes, or 'the class'."""
    from vitlens.viz import target_phrase

    return target_phrase(exp.target, int(exp.targets[j]), j)


def planned_files(bases: Sequence[str], labels: Sequence[str], ext: str = "png") -> list[str]:
    """Every file (relative to ``--out``) a run writes, in order; unique by construction (distinct input bases and
    distinct label stems, both checked before anything is written). ``ext``: the figures' format."""
    files = []
    for base in bases:
        for label in labels:
            stem = f"{base}.{_safe(label)}"
            files += [f"{stem}.{ext}", f"{stem}.view.{ext}", f"{stem}.npz", f"{stem}.json"]
        if len(labels) > 1:
            files.append(f"{base}.grid.{ext}")
    return files


def _refuse_replacing(out: Path, files: Sequence[str], overwrite: bool) -> None:
    from vitlens.errors import InputError

    dup = len(set(files)) != len(files) or len({f.casefold() for f in files}) != len(files)
    if dup:  # pragma: no cover - guarded by output_bases and _specs; a last check before anything is written
        raise InputError("two outputs of this run would share one file name; rename the inputs or the methods")
    if overwrite or not out.is_dir():
        return
    found = [f for f in files if (out / f).exists()]
    if found:
        more = f" and {len(found) - 1} more" if len(found) > 1 else ""
        raise InputError(f"--out {out} already holds {out / found[0]}{more} from an earlier run; pass --overwrite "
                         "to replace them, or choose another --out")


def _explain_all(args: argparse.Namespace, out: Path, paths: list[Path], bases: list[str], methods: list,
                 model: Any, cfg: Any, names: list[str] | None, style: dict[str, Any], device: Any,
                 target: Any = None, progress: "_Progress | None" = None) -> list[dict[str, Any]]:
    """Explain and write every image; returns one record per explanation call (its images, seconds, passes).

    On the CPU each image is explained on its own call (a batch saves little there, and progress and cost are then
    per image); on an accelerator a batch is one call per method, and each image's record holds its share."""
    from vitlens import images as vimages

    progress = progress or _Progress(len(paths), methods, True)
    calls: list[dict[str, Any]] = []
    one_by_one = _one_call_per_image(device)
    for start in range(0, len(paths), args.batch):
        chunk = list(range(start, min(start + args.batch, len(paths))))
        x = _load_chunk([paths[i] for i in chunk], cfg, start, len(paths)).to(device)
        probs = _probabilities(model, x)
        pixels = vimages.denormalize(x.cpu(), cfg)
        per_image: list[dict[str, tuple[Any, float, int]]] = [{} for _ in chunk]  # label -> (exp, seconds, row)
        for label, method in methods:
            parts = [[j] for j in range(len(chunk))] if one_by_one else [list(range(len(chunk)))]
            for rows in parts:
                progress.starting(label, chunk[rows[0]] + 1, chunk[rows[-1]] + 1)
                t0 = time.perf_counter()
                exp = method.explain(model, x[rows[0]:rows[-1] + 1], target=target)
                seconds = time.perf_counter() - t0
                calls.append({"method": label, "images": [str(paths[chunk[j]]) for j in rows], "seconds": seconds,
                              "model_calls": exp.cost.model_calls, "backward_calls": exp.cost.backward_calls,
                              "forward_passes_per_image": exp.cost.forward_passes,
                              "backward_passes_per_image": exp.cost.backward_passes})
                for k, j in enumerate(rows):
                    per_image[j][label] = (exp, seconds, k)
                progress.map_done(label, len(rows), chunk[rows[-1]] + 1)
        for j, i in enumerate(chunk):
            progress.starting("writing its figures", i + 1, i + 1)
            record = _write_image(paths[i], out / bases[i], pixels[j], per_image[j], probs[j:j + 1]
                                  if probs is not None else None, names, cfg, style, args)
            with progress.printing():
                _report_line(record, args)
            progress.image_done()
    return calls


def _one_call_per_image(device: Any) -> bool:
    """Whether each image gets its own explanation call: on the CPU (a batch saves little there, and progress and
    cost are then per image), not on an accelerator."""
    return getattr(device, "type", str(device)) == "cpu"


def _load_chunk(paths: list[Path], cfg: Any, start: int, total: int) -> Any:
    """The batch of ``paths`` (inputs ``start``.. of ``total``); an image that cannot be read is counted in the
    whole input list, not within its batch."""
    import re

    import vitlens
    from vitlens.errors import VitlensError

    try:
        return vitlens.load_images([str(p) for p in paths], cfg)
    except VitlensError as e:
        m = re.match(r"inputs\[(\d+)\]", str(e))
        if m is None or int(m.group(1)) >= len(paths):
            raise
        raise type(e)(f"image {start + int(m.group(1)) + 1} of {total}{str(e)[m.end():]}") from None


def _write_image(path: Path, base: Path, view: Any, results: dict[str, Any], probs: Any,
                 names: list[str] | None, cfg: Any, style: dict[str, Any], args: argparse.Namespace) -> dict:
    """Figures, maps and provenance of one image; ``results``: label → (explanation, its call's seconds, this
    image's row in it); ``probs``: this image's class probabilities ``(1, K)`` or ``None``."""
    import numpy as np

    from vitlens import viz
    from vitlens.explainers import display_label
    from vitlens.images import display_pixels

    # a huge photo is decoded and drawn at 2048 px on its longer side, never held at full size (the crop's geometry
    # is kept up to one display pixel); the figures, maps on the original and grids are bounded by it
    original = display_pixels(path, str(path), _MAX_SIDE)
    base.parent.mkdir(parents=True, exist_ok=True)
    from vitlens.api import file_sha256

    digest = file_sha256(path)
    record: dict[str, Any] = {"image": str(path), "model": args.model, "methods": {}}
    grid_maps: dict[str, Any] = {}
    untrained = style["random_weights"]
    names = None if untrained else names  # a random model's outputs are no prediction: no class names
    for label, (exp, seconds, j) in results.items():
        cls = int(exp.targets[j])
        prob = None if probs is None or cls >= probs.shape[1] else float(probs[0, cls])
        caption = _text_caption(exp, j) or _caption(cls, prob, names, untrained)
        stem = f"{base.name}.{_safe(label)}"
        meta = {"method": label, "model": args.model, "image": str(path), "target_class": str(cls),
                "random_weights": str(untrained)}
        kind = style["styles"][label]
        raw = exp.maps[j].cpu().numpy()
        drawn = viz.smooth_map(abs(raw) if kind == "abs" else raw, style["smooth"])
        on_original = viz.map_to_original(drawn, original.shape[:2], cfg)
        # one colour range, from the model's view, for both figures of this map
        # scaled by what the method's values mean (its declared kind), the same on every image
        scale = viz.map_scale(drawn, viz.style_normalize(kind, style["normalize_of"][label]), style["clip"])
        looks = {"scale": scale, "style": kind, "method": label, "min_panel_px": style["min_panel_px"],
                 "target": _target_words(exp, j)}
        shown = display_label(label)
        ext = args.format
        viz.save_figure(base.parent / f"{stem}.{ext}", original, on_original, title=shown,
                        caption=f"{caption} — on the original image (uncoloured: cropped away before the model)",
                        metadata=meta, dpi=args.dpi, **looks)
        viz.save_figure(base.parent / f"{stem}.view.{ext}", view, drawn, title=shown,
                        caption=f"{caption} — on the model's input view", metadata=meta, dpi=args.dpi, **looks)
        arrays = {"map": exp.maps[j].cpu().numpy()}
        if exp.token_maps is not None:
            arrays["token_map"] = exp.token_maps[j].cpu().numpy()
        with atomic_path(base.parent / f"{stem}.npz") as tmp:
            np.savez_compressed(tmp, **arrays)
        info = exp.provenance()
        share = seconds / len(exp)
        info["cost"] = {"forward_passes": exp.cost.forward_passes, "backward_passes": exp.cost.backward_passes,
                        "seconds": share, "seconds_are": "this image's share of one call on "
                        f"{len(exp)} image(s) (the calls: {RUN_SUMMARY})" if len(exp) > 1 else "this image's own call"}
        info.update({"image": str(path), "image_sha256": digest, "model": args.model,
                     "model_provenance": style["model_record"], "target_class": cls,
                     "target_name": _text_caption(exp, j, name_only=True) or (
                         names[cls] if names and cls < len(names) else None), "probability": prob,
                     "score": float(exp.scores[j]), "targets": [cls], "scores": [float(exp.scores[j])],
                     "remainder": None if exp.remainder is None else float(exp.remainder[j]),
                     "seconds_per_image": share, "random_weights": untrained,
                     "colour": {"style": kind, "normalize": style["normalize_of"][label], "clip": style["clip"],
                                "value_kind": style["kinds"][label],
                                "smooth_sigma": style["smooth"], "cmap": viz.default_cmap(scale.mode),
                                "scale": {"mode": scale.mode, "vmin": scale.vmin, "vmax": scale.vmax,
                                          "data_min": scale.data_min, "data_max": scale.data_max,
                                          "clipped_low": scale.clipped()[0], "clipped_high": scale.clipped()[1]}},
                     "files": {"figure": f"{stem}.{ext}", "view": f"{stem}.view.{ext}", "maps": f"{stem}.npz"}})
        write_text(base.parent / f"{stem}.json", json.dumps(info, indent=2))
        record["methods"][label] = {"class": cls, "name": info["target_name"], "probability": prob,
                                    "caption": _text_caption(exp, j),  # a text target's words; None for a class
                                    "forward_passes": exp.cost.forward_passes,
                                    "backward_passes": exp.cost.backward_passes,
                                    "seconds": share, "figure": str(base.parent / f"{stem}.{ext}")}
        grid_maps[label] = [exp.maps[j].cpu()]  # keyed by code label (styles); titled by display name below
    if len(results) > 1:
        first = next(iter(record["methods"].values()))
        first_exp, _, first_row = next(iter(results.values()))
        grid = base.parent / f"{base.name}.grid.{args.format}"
        viz.save_grid(grid, [view], grid_maps,
                      captions=[first["caption"] or _caption(first["class"], first["probability"], names, untrained)],
                      target=_target_words(first_exp, first_row),
                      row_labels=[path.name], col_size=2.2, metadata={"model": args.model, "image": str(path)},
                      normalize=style["normalize"], clip=style["clip"], styles=style["styles"], smooth=style["smooth"],
                      dpi=args.dpi, shared_scale=args.shared_scale)
        record["grid"] = str(grid)
    return record


_MAX_SIDE = 2048  # longest side of the original drawn in a figure
_MAX_DPI = 1200  # beyond print resolution; bounds a figure's pixels


def _report_line(record: dict[str, Any], args: argparse.Namespace) -> None:
    if args.quiet:
        return
    if args.json:
        print(json.dumps(record), flush=True)
        return
    first = next(iter(record["methods"].values()))
    what = first.get("caption") or (f"{first['name']} (class {first['class']})" if first["name"]
                                     else f"class {first['class']}")
    prob = "" if first["probability"] is None else f", p = {_p(first['probability'])}"
    costs = "; ".join(f"{label} {m['forward_passes']:g} fwd + {m['backward_passes']:g} bwd, "
                      f"{1000 * m['seconds']:.0f} ms" for label, m in record["methods"].items())
    where = record.get("grid") or first["figure"]
    print(f"{record['image']}: {what}{prob} | {costs} -> {where}", file=sys.stdout, flush=True)
