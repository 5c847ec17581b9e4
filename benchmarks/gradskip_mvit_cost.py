"""GradSkip on timm MViTv2: completeness, per-block conservation and cost next to the fused floor, in one run.

Per model: the largest relative completeness error ``|map.sum() + remainder − y| / |y|`` and per-block conservation
error (``layer_totals`` against ``y``) over the batch, and the paired wall-time ratio GradSkip ÷ floor, where the
floor is a forward and an activation-only backward of the top logit to the input (``torch.autograd.grad``, parameters
frozen, the model as built: MViTv2 has no fused attention path to switch). Each pair runs the two in alternating
order after a warm-up; the median and quartiles of the per-pair ratios are reported (times on a shared machine are
only meaningful paired).

Models: two 3-stage tiny MViTv2 (depths 1-2-1, width 16, 2-4-8 heads, 32 px; mean readout and CLS) and, with
``--big``, timm's ``mvitv2_tiny`` at 224 px (random weights, ``pretrained=False``: nothing is downloaded). All with
``vitlens.models.families.trained_like`` parameters.

Usage::

    python benchmarks/gradskip_mvit_cost.py                  # the tiny models, batch 2, 40 pairs
    python benchmarks/gradskip_mvit_cost.py --big --pairs 8  # also mvitv2_tiny at 224 px
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from torch import nn


def _floor(model: nn.Module, x: torch.Tensor) -> None:
    """Forward + activation-only backward of the top logit to the input, parameters frozen."""
    flags = [p.requires_grad for p in model.parameters()]
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        xx = x.clone().requires_grad_(True)
        out = model(xx)
        torch.autograd.grad(out.gather(1, out.argmax(1)[:, None]).sum(), xx)
    finally:
        for p, f in zip(model.parameters(), flags):
            p.requires_grad_(f)


def measure(name: str, model: nn.Module, x: torch.Tensor, pairs: int) -> dict[str, Any]:
    """One row: completeness and conservation errors of GradSkip on ``x``, and the paired cost ratios."""
    import vitlens

    model.eval()
    exp = vitlens.explain(model, x, method="gradskip")  # also the warm-up
    _floor(model, x)
    y = exp.scores.double()
    total = exp.token_maps.sum((1, 2)).double() + exp.remainder.double()
    layers = exp.extras["layer_totals"].double()
    ratios = []
    for i in range(pairs):
        t = {}
        for which in (("floor", "gradskip") if i % 2 == 0 else ("gradskip", "floor")):
            start = time.perf_counter()
            if which == "floor":
                _floor(model, x)
            else:
                vitlens.explain(model, x, method="gradskip")
            t[which] = time.perf_counter() - start
        ratios.append(t["gradskip"] / t["floor"])
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return {"model": name, "batch": int(x.shape[0]), "pairs": pairs,
            "completeness": float(((total - y).abs() / y.abs()).max()),
            "conservation": float(((layers - y[:, None]).abs() / y.abs()[:, None]).max()),
            "ratio_median": statistics.median(ratios), "ratio_q1": q[0], "ratio_q3": q[2]}


def models(big: bool) -> list[tuple[str, nn.Module, tuple[int, int]]]:
    """The measured models: ``(name, model, input size)``."""
    import timm
    from timm.models.mvitv2 import MultiScaleVit, MultiScaleVitCfg

    from vitlens.models.families import trained_like

    out = []
    for cls in (False, True):
        torch.manual_seed(0)
        cfg = MultiScaleVitCfg(depths=(1, 2, 1), embed_dim=16, num_heads=2, stride_q=((1, 1), (2, 2), (2, 2)),
                               use_cls_token=cls)
        out.append((f"tiny 3-stage 32 px, {'CLS' if cls else 'mean'} readout",
                    trained_like(MultiScaleVit(cfg, img_size=32, num_classes=5)), (32, 32)))
    if big:
        torch.manual_seed(0)
        out.append(("mvitv2_tiny 224 px", trained_like(timm.create_model("mvitv2_tiny", pretrained=False)),
                    (224, 224)))
    return out


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--big", action="store_true", help="also timm's mvitv2_tiny at 224 px")
    ap.add_argument("--pairs", type=int, default=40, help="paired floor/GradSkip runs per model")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    rows = []
    try:
        for name, model, hw in models(args.big):
            x = torch.randn(args.batch, 3, *hw, generator=torch.Generator().manual_seed(1))
            r = measure(name, model, x, args.pairs)
            rows.append(r)
            print(f"{r['model']}: completeness {r['completeness']:.1e}, per-block conservation "
                  f"{r['conservation']:.1e}; GradSkip / floor {r['ratio_median']:.2f} "
                  f"(IQR {r['ratio_q1']:.2f}-{r['ratio_q3']:.2f}, {r['pairs']} pairs, batch {r['batch']})")
    finally:
        torch.set_num_threads(threads)
    return rows


if __name__ == "__main__":
    main()
