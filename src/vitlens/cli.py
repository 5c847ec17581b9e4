"""The ``vitlens`` command line: ``demo``, ``explain``, ``bench``, ``train-aha``, ``methods``.

Exit codes: 0 success; 2 usage error (a bad option, value, file or run directory: one line naming it); 1 runtime
failure (a damaged file, a full disk, missing weights: one line naming the file and what to do); 130 interrupted
(Ctrl-C: one line, finished results kept, and the command that resumes the run).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any, Sequence

from .options import nonnegative_int, positive_int

__all__ = ["main"]

DEMO_METHODS = "gradskip,attnlrp,gae,rollout,inputxgradient,random"
DEMO_METRICS = "insertion_deletion:preset='aha',pointing_game:tolerance=4"


def _parse_options(pairs: Sequence[str], flag: str = "--option") -> dict[str, Any]:
    """``["alpha=0.3", "skip=fixed", "head_subset=('top', 0.25)"]`` → options dict (Python literals, else strings)."""
    from .options import parse_key_values

    return parse_key_values(pairs, flag)


def _label_names(model: Any) -> list[str] | None:
    cfg = getattr(model, "pretrained_cfg", None) or {}
    names = cfg.get("label_names") if isinstance(cfg, dict) else None
    if names:
        return list(names)
    id2label = getattr(getattr(model, "config", None), "id2label", None)
    if id2label:
        return [id2label[i] for i in sorted(id2label)]
    return None


def cmd_methods(args: argparse.Namespace) -> int:
    import vitlens

    for name in vitlens.methods():
        print(name)
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    import numpy as np

    import vitlens
    from vitlens import images as vimages
    from vitlens import viz

    model = vitlens.load_model(args.model)
    cfg = vimages.data_config(model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    options = _parse_options(args.option)
    names = _label_names(model)
    paths = [Path(p) for p in args.images]
    from tqdm.auto import tqdm

    for start in tqdm(range(0, len(paths), args.batch), desc=f"explain ({args.method})", unit="batch",
                      disable=len(paths) <= args.batch):
        chunk = paths[start:start + args.batch]
        x = vitlens.load_images([str(p) for p in chunk], cfg)
        target = None if args.target is None else args.target
        exp = vitlens.explain(model, x, method=args.method, target=target, **options)
        pixels = vimages.denormalize(x, cfg)
        for i, path in enumerate(chunk):
            stem = out / f"{path.stem}_{args.method}"
            viz.save_overlay(f"{stem}.png", pixels[i], exp.maps[i])
            arrays = {"map": exp.maps[i].numpy()}
            if exp.token_maps is not None:
                arrays["token_map"] = exp.token_maps[i].numpy()
            np.savez_compressed(f"{stem}.npz", **arrays)
            cls = int(exp.targets[i])
            record = exp.provenance()
            record.update({
                "image": str(path), "model": args.model, "target_class": cls,
                "target_name": names[cls] if names and cls < len(names) else None,
                "score": float(exp.scores[i]),
                "remainder": None if exp.remainder is None else float(exp.remainder[i]),
                "targets": [cls], "scores": [float(exp.scores[i])],
                "files": {"overlay": f"{stem.name}.png", "maps": f"{stem.name}.npz"},
            })
            Path(f"{stem}.json").write_text(json.dumps(record, indent=2))
            label = record["target_name"] or cls
            print(f"{path}: class {label} (score {float(exp.scores[i]):.4g}) -> {stem}.png")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """The README's main job: a small benchmark of the bundled model on fresh scenes, with the HTML report."""
    import torch

    import vitlens
    from vitlens.bench import BenchConfig, run_benchmark, split_specs

    torch.manual_seed(0)
    model = vitlens.load_model(args.model)
    data = f"scenes:seed={args.seed}"
    config = BenchConfig(model=args.model, data=data, methods=split_specs(args.methods),
                         metrics=split_specs(args.metrics), n=args.n, batch_size=args.batch, show=args.show)
    print(f"vitlens demo: {args.model} on {args.n} fresh synthetic scenes (seed {args.seed}); methods "
          f"{', '.join(m for m, _ in config.methods)}; nothing is downloaded")
    run_dir = run_benchmark(config, args.out, model=model, progress=not args.quiet, overwrite=args.overwrite)
    print((Path(run_dir) / "summary.md").read_text())
    print(f"report: {Path(run_dir) / 'report.html'}  (overlays: {Path(run_dir) / 'examples.png'})")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    import torch

    import vitlens  # noqa: F401
    from vitlens.bench import BenchConfig, run_benchmark, split_specs

    from .options import load_model_with_options

    model_kwargs = _parse_options(args.model_option, "--model-option")
    torch.manual_seed(args.seed)  # random-weight models (pretrained=False) are the same in every process and rerun
    model = load_model_with_options(args.model, model_kwargs)
    config = BenchConfig(
        model=args.model + ("" if not model_kwargs else " " + json.dumps(model_kwargs, sort_keys=True)),
        data=args.data, methods=split_specs(args.methods), metrics=split_specs(args.metrics),
        n=args.n, batch_size=args.batch, target=args.target, seed=args.seed, show=args.show,
    )
    run_dir = run_benchmark(config, args.out, model=model, progress=not args.quiet, overwrite=args.overwrite)
    summary = Path(run_dir) / "summary.md"
    if summary.exists() and int(__import__("os").environ.get("RANK", "0")) == 0:
        print(summary.read_text())
        print(f"report: {Path(run_dir) / 'report.html'}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    import vitlens

    p = argparse.ArgumentParser(prog="vitlens", description="Faithful, fast attribution maps for vision transformers.")
    p.add_argument("--version", action="version", version=f"vitlens {vitlens.__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="offline demo: a small benchmark of the bundled model with an HTML report")
    d.add_argument("--model", default="shapes-vit")
    d.add_argument("--n", type=positive_int, default=100, help="number of fresh scenes")
    d.add_argument("--seed", type=int, default=2026, help="scene seed (the training data used other seeds)")
    d.add_argument("--methods", default=DEMO_METHODS, help="method specs (see vitlens bench)")
    d.add_argument("--metrics", default=DEMO_METRICS, help="metric specs (see vitlens bench)")
    d.add_argument("--batch", type=positive_int, default=25)
    d.add_argument("--show", type=nonnegative_int, default=6, help="scenes shown in the overlay grid")
    d.add_argument("--quiet", action="store_true")
    d.add_argument("--out", default="vitlens-demo", help="run directory (rerun to resume)")
    d.add_argument("--overwrite", action="store_true", help="replace a demo run of other settings in --out")
    d.set_defaults(func=cmd_demo)

    e = sub.add_parser("explain", help="explain images and save overlays, maps and provenance")
    e.add_argument("images", nargs="+", help="image files")
    e.add_argument("--model", default="shapes-vit", help="bundled name, timm:<arch> or hf:<dir>")
    e.add_argument("--method", default="gradskip")
    e.add_argument("--target", type=nonnegative_int, default=None, help="class index (default: the predicted class)")
    e.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="method option, repeatable")
    e.add_argument("--batch", type=positive_int, default=16, help="images per call (>= 1)")
    e.add_argument("--out", default="vitlens-out")
    e.set_defaults(func=cmd_explain)

    b = sub.add_parser("bench", help="methods x metrics over a data set; resumable; works under torchrun")
    b.add_argument("--model", default="shapes-vit", help="bundled name, timm:<arch> or hf:<dir>")
    b.add_argument("--model-option", action="append", default=[], metavar="KEY=VALUE",
                   help="argument for load_model (e.g. pretrained=False), repeatable")
    b.add_argument("--data", default="scenes", help="data source spec, e.g. scenes or scenes:seed=7")
    b.add_argument("--methods", nargs="+", default=["gradskip,inputxgradient,random"],
                   help="method specs: name or name:key=value;key=value, comma- or space-separated")
    b.add_argument("--metrics", nargs="+", default=["pointing_game:tolerance=4"], help="metric specs, same syntax")
    b.add_argument("--num-images", "--n", dest="n", type=positive_int, default=None,
                   help="number of images (default: the whole source); under torchrun write --num-images")
    b.add_argument("--batch", type=positive_int, default=25, help="images per unit of work")
    b.add_argument("--target", choices=["predicted", "label"], default="predicted")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--show", type=nonnegative_int, default=6, help="images shown as examples in the report")
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    b.add_argument("--out", required=True, help="run directory (rerun the same command to resume)")
    b.add_argument("--overwrite", action="store_true",
                   help="replace a run of another configuration in --out (default: refuse it)")
    b.set_defaults(func=cmd_bench)

    from vitlens.aha.train import add_train_aha_parser

    add_train_aha_parser(sub)

    m = sub.add_parser("methods", help="list the registered methods")
    m.set_defaults(func=cmd_methods)
    return p


def _resume_command(argv: Sequence[str], command: str) -> str:
    """The command that continues an interrupted run: the same one (bench, demo), with ``--resume`` for train-aha;
    never with ``--overwrite`` (that would start over)."""
    args = [a for a in argv if a != "--overwrite"]
    if command == "train-aha" and "--resume" not in args:
        args.append("--resume")
    prog = "vitlens" if Path(sys.argv[0]).name == "vitlens" else "python -m vitlens.cli"
    return " ".join([prog, *(shlex.quote(a) for a in args)])


def _quiet_third_party() -> None:
    """HuggingFace hub / transformers progress bars and advisory logs stay out of vitlens' output."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


def main(argv: Sequence[str] | None = None) -> int:
    _quiet_third_party()
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    from vitlens.errors import DamagedFileError, VitlensError, WeightsUnavailableError

    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        out = getattr(args, "out", None)
        if out and args.command in ("bench", "demo", "train-aha"):
            note = f"; finished results are kept in {out}; resume with: {_resume_command(argv, args.command)}"
        elif out:
            note = f"; the files written so far are in {out}"
        else:
            note = ""
        print(f"vitlens: interrupted{note}", file=sys.stderr)
        return 130
    except (DamagedFileError, WeightsUnavailableError) as e:
        print(f"vitlens: error: {e}", file=sys.stderr)
        return 1
    except VitlensError as e:
        print(f"vitlens: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # full disk, read-only mount, a folder that is a file...
        if isinstance(e, FileExistsError) and e.filename:
            print(f"vitlens: error: {e.filename} exists and is not a directory; choose another --out", file=sys.stderr)
            return 2
        where = f" {e.filename}" if e.filename else ""
        print(f"vitlens: error: cannot write or read{where}: {e.strerror or e}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
