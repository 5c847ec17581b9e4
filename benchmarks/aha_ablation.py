"""AHA training ablations at one fixed budget: each row changes one thing of the ``tracked`` recipe (or is the
authors' recipe), trains an explainer for the same number of steps × images, and is validated with the hard metric on
the same held-out images under the validation matrix (the mean over the deletion references mean colour, black, blur
and per-pixel mean image, each also shown), so a choice that helps only under one protocol shows as such.

Every finished row is appended to ``--store`` (JSON lines) as soon as it is done, so an interrupted run resumes by
rerunning the same command (finished rows are read back, not retrained).

Usage::

    python benchmarks/aha_ablation.py                                    # all rows, prints the table
    python benchmarks/aha_ablation.py --rows tracked authors --steps 20  # a subset, quicker
    python benchmarks/aha_ablation.py --out docs/benchmarks/aha.md       # and writes its section of that page
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import shlex
import sys
import time
from pathlib import Path

import torch

import vitlens
from vitlens.aha.train import AHATrainConfig, train_aha

sys.path.insert(0, str(Path(__file__).resolve().parent))
from aha_sorter_error import print_section  # noqa: E402

START, END = "<!-- aha_ablation:start -->", "<!-- aha_ablation:end -->"
VAL_REFS = ("mean", "black", "blur", "meanimage")

#: row name -> (recipe, overrides, what it tests)
ROWS: dict[str, tuple[str, dict, str]] = {
    "tracked": ("tracked", {}, "the default recipe"),
    "authors": ("authors", {}, "the AHA authors' recipe"),
    "+gumbel": ("tracked", {"noise_scale": 1.0}, "Gumbel noise × 1 (the authors')"),
    "tau 1→0.3": ("tracked", {"tau_start": 1.0, "tau_end": 0.3}, "the authors' temperature"),
    "2 classes": ("tracked", {"classes_per_image": 2}, "top-1 + runner-up / label"),
    "mean ref only": ("tracked", {"references": ("mean",)}, "trained on the mean colour alone (the earlier recipe)"),
    "3 refs": ("tracked", {"references": ("black", "mean", "blur")}, "black/mean/blur (no mean image)"),
    "m=16 fixed": ("tracked", {"m": 16, "step_sampling": "fixed"}, "16 fixed curve points (28 passes/img)"),
    "lr 3e-4": ("tracked", {"lr": 3e-4}, "the authors' learning rate"),
    "width 64": ("tracked", {"width": 64}, "twice the decoder width"),
    "grid 8 only": ("tracked", {"grid_range": (8, 8), "grid_offset": False}, "no grid augmentation"),
    "pool tokens": ("tracked", {"pool": "tokens"}, "maps pooled per token in training"),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="digits-vit")
    p.add_argument("--data", default="digits", help="the training data of train-aha (scenes, digits, planted)")
    p.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--n-val", type=int, default=100)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--store", type=Path, default=Path("runs/aha_ablation.jsonl"))
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = vitlens.load_model(args.model)
    done: dict[str, dict] = {}
    if args.store.is_file():
        for line in args.store.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                if rec.get("steps") == args.steps and rec.get("batch_size") == args.batch_size \
                        and rec.get("n_val") == args.n_val and rec.get("model", "shapes-vit") == args.model \
                        and "references" in rec:
                    done[rec["row"]] = rec
    args.store.parent.mkdir(parents=True, exist_ok=True)
    for row in args.rows:
        if row in done:
            continue
        recipe, over, _ = ROWS[row]
        # every row on the same validation matrix, and the last step (not the best validation): one budget each
        cfg = AHATrainConfig.preset(recipe, **{"val_references": VAL_REFS, "select": "last", **over},
                                    steps=args.steps, batch_size=args.batch_size, n_val=args.n_val)
        t0 = time.perf_counter()
        res = train_aha(model, args.data, None, config=cfg, progress=False)
        v = res.validation or {}
        rec = {"row": row, "model": args.model, "steps": args.steps, "batch_size": args.batch_size,
               "n_val": args.n_val, "references": v.get("references") or ["mean"],
               **{k: val for k, val in v.items() if "@" in k},
               "deletion": v.get("deletion"), "insertion": v.get("insertion"), "difference": v.get("difference"),
               "difference_tokens": v.get("difference_tokens"),
               "seconds": round(time.perf_counter() - t0, 1),
               "s_per_step": round(res.seconds / max(1, res.step), 2),
               "final_loss": sum(h["loss"] for h in res.history[-5:]) / max(1, len(res.history[-5:]))}
        with args.store.open("a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")
        done[row] = rec
        print(f"{row}: ins-del {rec['difference']:.4f} ({rec['seconds']:.0f} s)", flush=True)
    lines = [START, "## Training ablations at one budget", "",
             f"Command: `python benchmarks/aha_ablation.py {' '.join(shlex.quote(a) for a in (argv or sys.argv[1:]))}` "
             f"— {_dt.date.today().isoformat()}, torch {torch.__version__}, {args.threads} thread(s), on a machine "
             "shared with other jobs (the seconds are only indicative).", "",
             f"Each row trains a {args.model} explainer for {args.steps} steps of {args.batch_size} training images "
             f"(`{args.data}`, seed 0) and is validated on the same {args.n_val} held-out images with the hard metric "
             "(21 points, predicted class, pixel map) under each deletion reference; the headline is their mean "
             "(what the shipped checkpoint is chosen on). One change per row against `tracked`.", "",
             "| row | what changes | ins − del, mean of 4 refs ↑ | mean colour | black | blur | mean image | "
             "token-pooled, mean of refs | s per step |", "|---|---|---|---|---|---|---|---|---|"]
    for row in args.rows:
        r = done[row]
        tok = r.get("difference_tokens")
        per = [r.get(f"difference@{k}") for k in ("mean", "black", "blur", "meanimage")]
        cells = " | ".join("" if v is None else f"{v:.4f}" for v in per)
        lines.append(f"| {row} | {ROWS[row][2]} | {r['difference']:.4f} | {cells} | "
                     f"{'' if tok is None else f'{tok:.4f}'} | {r['s_per_step']:.1f} |")
    lines += ["", END]
    print_section(lines, args.out, START, END)
    return 0


if __name__ == "__main__":
    sys.exit(main())
