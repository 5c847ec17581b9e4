"""What an AHA map (``refine_steps=0``) costs against one forward of the target, and where the difference goes.

Per repeat, on the same batch and interleaved: one no-grad forward of the target (``model(x)``), the AHA map
(``explain(model, x, method="aha", refine_steps=0)`` with the model's shipped explainer), and its two parts alone:
the backbone pass (``AHANet.features``: the target's forward with the feature hooks, giving features and logits) and
the decoder (no grad). Reported: medians over ``--repeats`` of ms per image and of the per-repeat ratios to the
forward (with their range), and what is neither part (``map − features − decoder``: the explainer's bookkeeping).
``--clock cpu`` (default) times the process's CPU time, which a loaded machine disturbs less than wall time.

Usage: ``python benchmarks/aha_map_cost.py [--models shapes-vit shapes-deit] [--batch 25] [--repeats 9]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import vitlens
from vitlens.aha import load_explainer, shipped_explainer
from vitlens.explainers import get_method
from vitlens.images import data_config


def measure(name: str, batch: int, repeats: int, clock) -> dict[str, list[float]]:
    model = vitlens.load_model(name).eval()
    shipped = shipped_explainer(model)
    if shipped is None:
        raise SystemExit(f"{name} has no shipped AHA explainer")
    net = load_explainer(shipped[1], model)
    hw = data_config(model).size_hw
    x = torch.randn(batch, 3, *hw, generator=torch.Generator().manual_seed(0))
    aha = get_method("aha", explainer=net, refine_steps=0)
    with torch.no_grad():
        feats, logits = net.features(x)
    classes = logits.argmax(-1)

    def forward() -> None:
        with torch.no_grad():
            model(x)

    def features() -> None:
        with torch.no_grad():
            net.features(x)

    def decoder() -> None:
        with torch.no_grad():
            net.decoder(feats, classes, hw)

    parts = {"forward": forward, "map": lambda: aha.explain(model, x), "features": features, "decoder": decoder}
    times: dict[str, list[float]] = {k: [] for k in parts}
    for r in range(repeats + 1):  # the first round warms up
        for k, fn in parts.items():
            t0 = clock()
            fn()
            if r:
                times[k].append(clock() - t0)
    times["rest"] = [m - f - d for m, f, d in zip(times["map"], times["features"], times["decoder"])]
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["shapes-vit", "shapes-deit"])
    p.add_argument("--batch", type=int, default=25)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    args = p.parse_args()
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    print("| model | batch | forward (ms/image) | map (ms/image) | map ÷ forward (median [range]) | features ÷ forward | "
          "decoder ÷ forward | rest ÷ forward | clock |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.models:
        t = measure(name, args.batch, args.repeats, clock)

        def ratio(k: str) -> list[float]:
            return [a / f for a, f in zip(t[k], t["forward"])]

        m = ratio("map")
        per_image = {k: 1e3 * statistics.median(v) / args.batch for k, v in t.items()}
        print(f"| {name} | {args.batch} | {per_image['forward']:.2f} | {per_image['map']:.2f} | "
              f"{statistics.median(m):.2f} [{min(m):.2f}–{max(m):.2f}] | {statistics.median(ratio('features')):.2f} | "
              f"{statistics.median(ratio('decoder')):.2f} | {statistics.median(ratio('rest')):.2f} | {args.clock} |")


if __name__ == "__main__":
    main()
