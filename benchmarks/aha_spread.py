"""Choose the spread of the token scores (``AHANet.spread``) of shipped AHA explainers on their own validation images.

A ``tokens``-pooled explainer gives one constant score per patch; the hard pixel-level metric then deletes the
pixels inside a patch in raster order. ``spread`` ``λ`` blends the constant cells with the same scores upsampled
bilinearly (:func:`vitlens.aha.network.pool_maps`), which orders each patch's pixels towards its higher-scored
neighbours. A training chooses ``λ`` on its validation images (:func:`vitlens.aha.validation.choose_spread`); this
script makes the same choice for an explainer trained before that existed, on the images its card was validated on
(the card's validation seed and count, the four references of its validation matrix), without retraining it.

Per model it prints insertion − deletion for each ``λ`` of ``vitlens.aha.network.SPREADS`` (the mean over the
references and each reference). ``λ = 0`` is measured again and must equal the number on the card (a check that
these are the card's images and protocol). ``--write`` stores the choice in the shipped explainer's JSON
(``arch.spread`` and the validation record) and renders its card again.

Usage::

    python benchmarks/aha_spread.py --models shapes-deit --threads 1
    python benchmarks/aha_spread.py --threads 1 --write      # every tokens-pooled shipped explainer
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from vitlens.aha import load_explainer
from vitlens.aha.card import model_card
from vitlens.aha.validation import choose_spread
from vitlens.images import data_config
from vitlens.runtime import DistributedRun

sys.path.insert(0, str(Path(__file__).resolve().parent))
from aha_protocols import MODELS  # noqa: E402
from aha_validation_gap import shipped, validation_images  # noqa: E402


def run_model(name: str, write: bool) -> dict:
    t0 = time.perf_counter()
    model, path, meta, net = shipped(name)
    v = meta["validation"]
    if net.output_pool != "tokens":
        print(f"{name}: output pooling {net.output_pool!r}, no token scores to spread")
        return {"model": name, "skipped": net.output_pool}
    x, mi = validation_images(name, model, meta, None)
    data = [(x[i], 0) for i in range(len(x))]  # the label is not read: validation explains the predicted class
    dc = data_config(model)
    refs = v.get("references") or ["mean"]
    before = net.spread
    net.spread = 0.0
    rec = choose_spread(net, data, DistributedRun(), None, references=refs, mean_std=(dc.mean, dc.std), mean_img=mi)
    card_score = v["difference" if v.get("output_pool") == meta["train"].get("pool") else "difference_tokens"]
    print(f"{name}: λ = 0 measured {rec['spread_scores']['0']:.4f}, card {card_score:.4f}; "
          + ", ".join(f"λ {k}: {s:.4f}" for k, s in rec["spread_scores"].items())
          + f" → λ = {rec['spread']:g} (was {before:g}); at λ: {rec.get('spread_refs')} "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)
    if abs(rec["spread_scores"]["0"] - card_score) > 1e-4:
        raise SystemExit(f"{name}: λ = 0 gives {rec['spread_scores']['0']:.4f}, the card {card_score:.4f}: "
                         "not the card's images or protocol")
    if write:
        meta["arch"]["spread"] = rec["spread"]
        meta["validation"].update(rec)
        path.with_suffix(".json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
        path.with_suffix(".md").write_text(model_card(meta, load_explainer(path, model)))
        print(f"  wrote {path.with_suffix('.json')} and its card")
    return {"model": name, **rec}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--write", action="store_true", help="store the choice in the shipped explainers and cards")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    for name in args.models:
        run_model(name, args.write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
