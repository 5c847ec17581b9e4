"""The ``vitlens`` command line: ``demo``, ``explain``, ``bench``, ``report``, ``train-aha``, ``methods``, ``models``,
``conformance``.

Exit codes: 0 success; 2 usage error (a bad option, value, file or run directory: one line naming it); 1 runtime
failure (a damaged file, a full disk, missing weights: one line naming the file and what to do); 130 interrupted
(Ctrl-C: one line, finished results kept, and the command that resumes the run).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
from pathlib import Path
from typing import Any, Sequence

from .options import nonnegative_int, positive_int, seed_int

__all__ = ["main"]

DEMO_METHODS = "gradskip,aha:refine_steps=0,attnlrp,gae,rollout,inputxgradient,random"
DEMO_METRICS = "insertion_deletion:preset='aha',pointing_game:tolerance=4"


def _parse_options(pairs: Sequence[str], flag: str = "--option") -> dict[str, Any]:
    """``["alpha=0.3", "skip=fixed", "head_subset=('top', 0.25)"]`` → options dict (Python literals, else strings)."""
    from .options import parse_key_values

    return parse_key_values(pairs, flag)


def cmd_methods(args: argparse.Namespace) -> int:
    import vitlens

    infos = vitlens.describe_methods()
    if args.names:
        print("\n".join(i.name for i in infos))
        return 0
    width = max(len(i.name) for i in infos)
    cost_width = max(len(i.cost) for i in infos)
    print(f"{'method':<{width}}  {'cost per image (defaults)':<{cost_width}}  what")
    for i in infos:
        print(f"{i.name:<{width}}  {i.cost:<{cost_width}}  {i.description}")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    import vitlens

    infos = vitlens.list_models()
    width = max(len(i.name) for i in infos)
    for kind, title in (("bundled", "bundled (weights shipped, offline)"), ("packaged", "packaged weights"),
                        ("family", "families (load your own)")):
        rows = [i for i in infos if i.kind == kind]
        if rows:
            print(f"{title}:")
            for i in rows:
                size = f" [input {i.input_size[1]}x{i.input_size[2]} px]" if i.input_size else ""
                print(f"  {i.name:<{width}}  {i.description}{size}")
    return 0


def cmd_conformance(args: argparse.Namespace) -> int:
    from .explainers.support import conformance
    from .options import load_model_with_options

    report = conformance(load_model_with_options(args.model, _parse_options(args.model_option, "--model-option")))
    print(f"adapter: {report['adapter']} ({report['family']})")
    if report["fallback_reason"]:
        print(f"fallback: {report['fallback_reason']}")
    print(f"provides: {', '.join(report['provides'])}")
    print("lacks:")
    for cap, why in report["lacks"].items():
        print(f"  {cap}: {why}")
    print(f"methods that run: {', '.join(report['methods'])}")
    print("methods refused:")
    for name, why in report["refused"].items():
        print(f"  {name}: {why}")
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
    from vitlens.devices import option_device

    device = option_device(args.device)
    _check_bench_before_loading(args, model_kwargs)  # usage mistakes in one line, before the model loads
    torch.manual_seed(args.seed)  # random-weight models (pretrained=False) are the same in every process and rerun
    seeded = {"seed": args.seed} if args.model.startswith(("timm:", "hf:")) and "seed" not in model_kwargs else {}
    model = load_model_with_options(args.model, {**model_kwargs, **seeded})  # the seed is recorded with the model
    prompts = None
    if args.prompts is not None:  # a vision-language model classifying over prompts (docs/vlm.md)
        from vitlens.models.vlm import ZeroShotClassifier, read_prompts

        prompts = read_prompts(args.prompts)
        model = ZeroShotClassifier(model, prompts)
    data = _with_class_map(args.data, args.class_map)
    config = BenchConfig(
        model=args.model + ("" if not model_kwargs else " " + json.dumps(model_kwargs, sort_keys=True)),
        data=data, methods=split_specs(args.methods), metrics=split_specs(args.metrics or _default_metrics(data)),
        n=args.n, batch_size=args.batch, target=args.target, seed=args.seed, show=args.show, prompts=prompts,
    )
    run_dir = run_benchmark(config, args.out, model=model, progress=not args.quiet, overwrite=args.overwrite,
                            device=device)
    summary = Path(run_dir) / "summary.md"
    if summary.exists() and int(__import__("os").environ.get("RANK", "0")) == 0:
        print(summary.read_text())
        print(f"report: {Path(run_dir) / 'report.html'}")
    return 0


def _check_bench_before_loading(args: argparse.Namespace, model_kwargs: dict[str, Any]) -> None:
    """Unknown methods and metrics (with the closest names), bad options, an unusable --out and a run directory of
    another configuration, refused before the model loads (a vision-language run's configuration holds its prompts
    and is compared once they are read, after the model)."""
    from vitlens.bench import BenchConfig, split_specs
    from vitlens.bench.runner import check_before_loading

    data = _with_class_map(args.data, args.class_map)
    methods, metrics = split_specs(args.methods), split_specs(args.metrics or _default_metrics(data))
    config = None
    if getattr(args, "prompts", None) is None:
        config = BenchConfig(
            model=args.model + ("" if not model_kwargs else " " + json.dumps(model_kwargs, sort_keys=True)),
            data=data, methods=methods, metrics=metrics, n=args.n, batch_size=args.batch, target=args.target,
            seed=args.seed, show=args.show)
    check_before_loading(args.out, methods, metrics, config, args.overwrite)


def cmd_report(args: argparse.Namespace) -> int:
    """``vitlens report RUN``: the ranking table of a benchmark run for a paper, or the run's report rewritten.

    The run's store is only read (opened read-only) and checked first: an empty, foreign or damaged store, or a
    damaged ``config.json``, is one line and leaves every file as it was. Without ``--out`` the HTML format rewrites
    the report files the run derives from its store (:data:`~vitlens.bench.report.REPORT_FILES`); ``--out FILE``
    writes that one file, never a file of the run's own (its store, configuration, shards, examples, provenance),
    and replaces an existing FILE only with ``--overwrite``."""
    from vitlens.bench.report import summarise, table_text, write_report
    from vitlens.errors import InputError

    run = Path(args.run)
    if not (run / "results.sqlite").exists():
        raise InputError(f"{run} is not a benchmark run folder (no results.sqlite in it); give the --out folder of "
                         "a finished vitlens bench or vitlens demo")
    out = None if args.out is None else _report_out(run, Path(args.out), args.format, args.overwrite)
    if args.format == "html":
        if out is not None:
            write_report(run, out=out)
            print(f"report: {out}")
            return 0
        from .run_folders import folder_lock

        with folder_lock(run, "report"):
            paths = write_report(run)
        print(f"report: {paths['report']}  (tables: {run / 'summary.md'}, {run / 'summary.tex'})")
        return 0
    text = table_text(summarise(run), args.format, wide=getattr(args, "wide", False)) + "\n"
    if out is None:
        sys.stdout.write(text)
    else:
        from .atomic import write_text

        write_text(out, text)
        print(f"{args.format} table: {out}")
    return 0


def _report_out(run: Path, out: Path, fmt: str, overwrite: bool) -> Path:
    """``report --out``'s file, refused (one line) where it would write into the run's own files (inside the run
    folder only the format's own report file may be named: ``summary.md``, ``summary.tex`` or ``report.html``), or
    replace an existing file without ``--overwrite``."""
    from vitlens.errors import InputError

    own = {"markdown": "summary.md", "latex": "summary.tex", "html": "report.html"}[fmt]
    if not str(out).strip():
        raise InputError("--out is empty; name the file to write")
    if out.is_dir():
        raise InputError(f"--out {out} is a folder; name a file (e.g. {out / 'report.html'})")
    target = out.resolve()
    home = run.resolve()
    inside = target.parent == home or home in target.parents
    same = out.exists() and any(p.is_file() and os.path.samefile(p, out) for p in run.rglob("*"))
    if (inside or same) and not (target.parent == home and target.name == own):
        raise InputError(f"--out {out} is inside the run folder {run} (or a link to a file there) and is not its "
                         f"{own}; vitlens report never writes the run's own files (results, configuration, shards, "
                         "stored maps): choose a file outside the run folder")
    if (out.exists() or out.is_symlink()) and not overwrite:
        raise InputError(f"--out {out} exists; pass --overwrite to replace it, or choose another file")
    return out


def _default_metrics(data: str) -> str:
    """The pointing game where the data has ground-truth regions, insertion/deletion (needs none) elsewhere."""
    name, _, settings = data.partition(":")
    has_regions = name in ("scenes", "ade20k") or (name == "imagenet" and "boxes" in settings)
    return "pointing_game:tolerance=4" if has_regions else "insertion_deletion:preset='aha'"


def _with_class_map(data: str, class_map: str | None) -> str:
    if class_map is None:
        return data
    from vitlens.errors import InputError

    if not data.startswith("folder:"):
        raise InputError(f"--class-map is for --data folder:root=DIR, not {data!r}")
    return f"{data};class_map={str(Path(class_map))!r}"


_DESCRIPTIONS = {
    "demo": "The main job, offline: a small benchmark of a bundled model on freshly generated synthetic scenes "
            "(GradSkip, AHA, AttnLRP, GAE, rollout, input x gradient, a random map; insertion/deletion and the "
            "pointing game), printed as a table and written as an HTML report in --out. Rerun to resume.",
    "bench": "Every method x every metric over a data set, stored in SQLite as it goes (rerun the same command to "
             "resume), with the ranked table (summary.md, summary.tex, summary.csv), curves and report.html in "
             "--out. Works under torchrun. Metrics: insertion_deletion, pos_neg_perturbation, "
             "faithfulness_violation, saco, pointing_game, evidence, segmentation (docs/metrics.md).",
    "report": "Rewrite a benchmark run's report (html), or print its ranking table for a paper: markdown or a LaTeX "
              "tabular, with mean ± 95% interval, the best value per column and the methods statistically tied "
              "with it (Wilcoxon signed-rank test over images, alpha = 0.05).",
    "methods": "The registered methods: name, cost per image at default settings, and what each does.",
    "models": "The bundled models (weights shipped, loaded offline) and the model families vitlens supports.",
    "conformance": "What a model's adapter provides and lacks, the methods that run on it and why the others do not.",
}


def _model_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-option", action="append", default=[], metavar="KEY=VALUE",
                   help="argument for load_model, repeatable (e.g. pretrained=False, seed=0)")


def build_parser() -> argparse.ArgumentParser:
    import vitlens

    p = argparse.ArgumentParser(prog="vitlens", description="Faithful, fast attribution maps for vision transformers.")
    p.add_argument("--version", action="version", version=f"vitlens {vitlens.__version__}",
                   help="print the version and exit")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    d = sub.add_parser("demo", help="offline demo: a small benchmark of the bundled model with an HTML report",
                       description=_DESCRIPTIONS["demo"])
    d.add_argument("--model", default="shapes-vit", help="bundled model to benchmark (vitlens models)")
    d.add_argument("--n", type=positive_int, default=100, help="number of fresh scenes")
    d.add_argument("--seed", type=seed_int, default=2026, help="scene seed (the training data used other seeds)")
    d.add_argument("--methods", default=DEMO_METHODS, help="method specs (see vitlens bench)")
    d.add_argument("--metrics", default=DEMO_METRICS, help="metric specs (see vitlens bench)")
    d.add_argument("--batch", type=positive_int, default=25, help="images per unit of work")
    d.add_argument("--show", type=nonnegative_int, default=6, help="scenes shown in the overlay grid")
    d.add_argument("--quiet", action="store_true", help="no progress bar")
    d.add_argument("--out", default="vitlens-demo", help="run directory (rerun to resume)")
    d.add_argument("--overwrite", action="store_true", help="replace a demo run of other settings in --out")
    d.set_defaults(func=cmd_demo)

    from vitlens.cli_explain import add_explain_parser

    add_explain_parser(sub, Formatter)

    b = sub.add_parser("bench", help="methods x metrics over a data set; resumable; works under torchrun",
                       description=_DESCRIPTIONS["bench"])
    b.add_argument("--model", default="shapes-vit", help="bundled name, timm:<arch> or hf:<dir>")
    _model_option(b)
    b.add_argument("--data", default="scenes",
                   help="data source spec: scenes[:seed=N], planted, cues, mnist5k, imagenet:root=DIR, "
                        "bloodmnist:path=FILE, ade20k:root=DIR, folder:root=DIR (docs/benchmarking.md)")
    b.add_argument("--methods", nargs="+", default=["gradskip,inputxgradient,random"],
                   help="method specs: name or name:key=value;key=value, comma- or space-separated")
    b.add_argument("--metrics", nargs="+", default=None,
                   help="metric specs, same syntax (default: pointing_game:tolerance=4 for data with masks or boxes "
                        "- scenes, imagenet with boxes, ade20k - else insertion_deletion:preset='aha')")
    b.add_argument("--class-map", default=None, metavar="FILE",
                   help="for --data folder:root=DIR: map class folders to the model's classes ('folder: class' "
                        "per line, or JSON); folders not listed are matched to the model's class names")
    b.add_argument("--num-images", "--n", dest="n", type=positive_int, default=None,
                   help="number of images (default: the whole source); under torchrun write --num-images")
    b.add_argument("--batch", type=positive_int, default=25, help="images per unit of work")
    b.add_argument("--prompts", default=None, metavar="PROMPTS",
                   help="vision-language models (CLIP, SigLIP, shapes-clip): classify over these prompts instead of "
                        "classes, comma-separated or @FILE (one per line), one per class of the data in its class "
                        "order (docs/vlm.md)")
    b.add_argument("--target", choices=["predicted", "label"], default="predicted",
                   help="the class explained: the model's prediction or the true label")
    b.add_argument("--device", default="cpu",
                   help="torch device: cpu, cuda (under torchrun: each process's GPU), cuda:1, mps, or auto (cuda "
                        "when there is a GPU)")
    b.add_argument("--seed", type=seed_int, default=0,
                   help="torch seed set before the model is built and before the run (random weights with "
                        "pretrained=False, random maps); the scenes' own seed is --data scenes:seed=N")
    b.add_argument("--show", type=nonnegative_int, default=6, help="images shown as examples in the report")
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    b.add_argument("--out", required=True, help="run directory (rerun the same command to resume)")
    b.add_argument("--overwrite", action="store_true",
                   help="replace a run of another configuration in --out (default: refuse it)")
    b.set_defaults(func=cmd_bench)

    r = sub.add_parser("report", help="a benchmark run's ranking table for a paper (markdown, latex) or its report",
                       description=_DESCRIPTIONS["report"])
    r.add_argument("run", help="run directory of vitlens bench or vitlens demo (the one with results.sqlite)")
    r.add_argument("--format", choices=["html", "markdown", "latex"], default="html",
                   help="html: rewrite report.html and the tables in RUN (or write the page to --out); markdown or "
                        "latex: print the ranking table")
    r.add_argument("--out", default=None, metavar="FILE",
                   help="write the table (markdown, latex) or the self-contained HTML page (html) to FILE instead "
                        "(default: markdown/latex to standard output, html into RUN); never a file of the run's own")
    r.add_argument("--overwrite", action="store_true", help="replace an existing --out FILE (default: refuse)")
    r.add_argument("--wide", action="store_true",
                   help="latex: a table* across both columns with full column heads (default: a table that fits "
                        "one column, short heads spelled out in a legend under it)")
    r.set_defaults(func=cmd_report)

    from vitlens.aha.train import add_train_aha_parser

    add_train_aha_parser(sub)

    from vitlens.shapley.cli import add_train_shapley_parser

    add_train_shapley_parser(sub)

    m = sub.add_parser("methods", help="the registered methods, what they do and what they cost",
                       description=_DESCRIPTIONS["methods"])
    m.add_argument("--names", action="store_true", help="names only, one per line")
    m.set_defaults(func=cmd_methods)

    models = sub.add_parser("models", help="the bundled models and the supported model families",
                            description=_DESCRIPTIONS["models"])
    models.set_defaults(func=cmd_models)

    c = sub.add_parser("conformance", help="what a model's adapter provides and lacks, and the methods that run",
                       description=_DESCRIPTIONS["conformance"])
    c.add_argument("model", help="bundled name, timm:<arch> or hf:<dir>")
    _model_option(c)
    c.set_defaults(func=cmd_conformance)
    _use_formatter(p)
    return p


class Formatter(argparse.HelpFormatter):
    """``--help`` shows each option's default once: ``(default: X)`` is added unless the help text already says what
    the default is; flags, positionals and options without a default (``None``) show none."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if ("default" in text or not action.option_strings or default is None or default is False
                or default is argparse.SUPPRESS or (isinstance(default, list) and not default)):
            return text
        shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})"


def _use_formatter(parser: argparse.ArgumentParser) -> None:
    """Every (sub)parser formats its help with :class:`Formatter`."""
    parser.formatter_class = Formatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _use_formatter(child)


def _resume_command(argv: Sequence[str], command: str) -> str:
    """The command that continues an interrupted run: the same one (bench, demo), with ``--resume`` for train-aha and
    train-shapley;
    never with ``--overwrite`` (that would start over)."""
    args = [a for a in argv if a != "--overwrite"]
    if command in ("train-aha", "train-shapley") and "--resume" not in args:
        args.append("--resume")
    prog = "vitlens" if Path(sys.argv[0]).name == "vitlens" else "python -m vitlens.cli"
    return " ".join([prog, *(shlex.quote(a) for a in args)])


def _quiet_third_party() -> None:
    """HuggingFace hub / transformers progress bars and advisory logs stay out of vitlens' output."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's or ``kill``'s stop) raised like Ctrl-C, so that every clean-up that keeps finished work
    on Ctrl-C (checkpoints, stores, temporary files) runs for it too."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated()


def _out_of(argv: Sequence[str]) -> str | None:
    """``--out``'s value in ``argv`` (for the message of a run interrupted before its arguments were parsed)."""
    for i, a in enumerate(argv):
        if a == "--out" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--out="):
            return a[len("--out="):]
    return None


def _interrupted(argv: Sequence[str], args: argparse.Namespace | None, terminated: bool) -> int:
    """The one line for Ctrl-C / SIGTERM (what is kept and the command that resumes); exit code 130 / 143."""
    command = getattr(args, "command", None) or next((a for a in argv if not a.startswith("-")), "")
    out = getattr(args, "out", None) if args is not None else _out_of(argv)
    if out and command in ("bench", "demo", "train-aha", "train-shapley"):
        note = f"; finished results are kept in {out}; resume with: {_resume_command(argv, command)}"
    elif out:
        note = f"; the files written so far are in {out}"
    else:
        note = ""
    print(f"vitlens: {'terminated (SIGTERM)' if terminated else 'interrupted'}{note}", file=sys.stderr, flush=True)
    return 143 if terminated else 130


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (``vitlens ...``); returns the exit code. Ctrl-C at any point (argument parsing, model
    loading, a unit of work, writing, shutdown) gives one line and 130, never a traceback."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args: argparse.Namespace | None = None
    from vitlens.errors import DamagedFileError, VitlensError, WeightsUnavailableError

    from .pause import pause_point

    previous = _terminate_as_interrupt()
    try:
        pause_point("start")
        _quiet_third_party()
        parser = build_parser()
        args = parser.parse_args(argv)
        code = int(args.func(args) or 0)
        pause_point("shutdown")
        return code
    except KeyboardInterrupt as e:
        return _interrupted(argv, args, isinstance(e, Terminated))
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
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _terminate_as_interrupt() -> Any:
    """Turn SIGTERM into :class:`Terminated` while a command runs (main thread only); returns the previous handler
    (``None`` where it cannot be set)."""
    try:
        return signal.signal(signal.SIGTERM, _raise_terminated)
    except (ValueError, OSError):  # not the main thread
        return None


def run() -> None:
    """The ``vitlens`` program: :func:`main`, and no Ctrl-C after the command's own exit code is settled turning into
    a traceback during the interpreter's shutdown."""
    code = main()  # SIGTERM is handled inside, like Ctrl-C
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the run is over: its exit code stands
    sys.stdout.flush()
    sys.exit(code)


if __name__ == "__main__":  # pragma: no cover
    run()
