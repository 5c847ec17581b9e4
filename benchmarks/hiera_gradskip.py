"""GradSkip on Hiera: the two measurements quoted in ``docs/methods/gradskip.md`` (Hiera), in one script.

``cost``: paired CPU-time ratios GradSkip ÷ the fused floor (the model as built, forward plus the backward of the top
logit to the input; also ÷ the floor that stops at block 0's input), one process, one thread, interleaved, median and
range over the pairs, with the completeness error of the maps. Models: ``tiny224`` (timm ``hiera_tiny_224``),
``hf224`` (``HieraForImageClassification(HieraConfig())``, the same layout), ``small`` (a 64-px, 8-block timm
``Hiera``); random weights, torch's default init (timm zeroes the classifier).

``pool``: the hand-back through the max, ``gxa`` (default) vs ``argmax``: each map's Pearson correlation with the
model's own occlusion response (each 4×4-pixel patch zeroed, drop of the predicted class's logit) and the least
correlation of its float16 map with the float32 one, on the tiny models of ``tests/test_gradskip_hiera.py`` and the
two catalogue rows (8 images of 32 px each).

Usage::

    python benchmarks/hiera_gradskip.py cost --model tiny224 --pairs 9
    python benchmarks/hiera_gradskip.py pool
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from typing import Callable

import torch
from torch import Tensor, nn


def build(spec: str) -> tuple[nn.Module, int]:
    """The model ``spec`` names and its input size."""
    torch.manual_seed(0)
    if spec == "hf224":
        import transformers

        return transformers.HieraForImageClassification(transformers.HieraConfig()).eval(), 224
    import timm

    if spec == "tiny224":
        return timm.create_model("hiera_tiny_224", pretrained=False, weight_init="skip",
                                 head_init_scale=1.0).eval(), 224
    return timm.create_model("hiera_tiny_224", pretrained=False, img_size=64, embed_dim=32, num_heads=1,
                             stages=(1, 2, 4, 1), q_pool=3, mask_unit_size=(8, 8), weight_init="skip",
                             head_init_scale=1.0).eval(), 64


def _logits(model: nn.Module, x: Tensor) -> Tensor:
    out = model(x) if not hasattr(model, "config") else model(pixel_values=x)
    return out if isinstance(out, Tensor) else out.logits


def _first_block(model: nn.Module) -> nn.Module:
    return model.blocks[0] if hasattr(model, "blocks") else model.hiera.encoder.stages[0].layers[0]


def rows(model: nn.Module, x: Tensor) -> dict[str, Callable[[], None]]:
    """The timed calls: the floor to the input, the floor to block 0's input, GradSkip."""
    import vitlens

    def floor_input() -> None:
        xi = x.clone().requires_grad_(True)
        out = _logits(model, xi)
        torch.autograd.grad(out.gather(1, out.argmax(1, keepdim=True)).sum(), xi)

    box: dict[str, Tensor] = {}

    def leaf(module: nn.Module, args: tuple) -> tuple:
        box["u"] = args[0].detach().requires_grad_(True)
        return (box["u"], *args[1:])

    def floor_block0() -> None:
        handle = _first_block(model).register_forward_pre_hook(leaf)
        try:
            out = _logits(model, x)
            torch.autograd.grad(out.gather(1, out.argmax(1, keepdim=True)).sum(), box["u"])
        finally:
            handle.remove()

    def gradskip() -> None:
        exp = vitlens.explain(model, x, method="gradskip")
        assert exp.cost.model_calls == 1 and exp.cost.backward_calls == 1

    return {"floor_input": floor_input, "floor_block0": floor_block0, "gradskip": gradskip}


def cost(spec: str, pairs: int, batch: int) -> None:
    import vitlens

    torch.set_num_threads(1)
    model, size = build(spec)
    for p in model.parameters():
        p.requires_grad_(False)
    x = torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(1))
    calls = rows(model, x)
    times: dict[str, list[float]] = {r: [] for r in calls}
    for i in range(pairs + 1):  # the first round is a warm-up
        for r, f in calls.items():
            t0 = time.process_time()
            f()
            if i:
                times[r].append(time.process_time() - t0)
    for ref in ("floor_input", "floor_block0"):
        ratios = [a / b for a, b in zip(times["gradskip"], times[ref])]
        print(f"{spec}, batch {batch}: gradskip / {ref}: median {statistics.median(ratios):.3f} "
              f"(range {min(ratios):.3f}-{max(ratios):.3f}, {pairs} pairs; {ref} median "
              f"{statistics.median(times[ref]) * 1e3:.0f} ms CPU)")
    exp = vitlens.explain(model, x, method="gradskip")
    y = exp.scores.double()
    err = ((exp.token_maps.sum((1, 2)).double() - y).abs() / y.abs()).max()
    per_block = ((exp.extras["layer_totals"].double() - y[:, None]).abs().max() / y.abs().min())
    print(f"{spec}: completeness relative error {float(err):.2e}, per block {float(per_block):.2e}")


def _corr(a: Tensor, b: Tensor) -> Tensor:
    a, b = a.flatten(1).double(), b.flatten(1).double()
    a, b = a - a.mean(1, keepdim=True), b - b.mean(1, keepdim=True)
    return (a * b).sum(1) / (a.norm(dim=1) * b.norm(dim=1)).clamp_min(1e-300)


def _occlusion(model: nn.Module, x: Tensor, cls: Tensor) -> Tensor:
    """``(B, 8, 8)``: the drop of the class logit when each 4×4-pixel patch of a 32-px image is zeroed."""
    with torch.no_grad():
        y0 = _logits(model, x).gather(1, cls[:, None])[:, 0]
        drops = torch.zeros(x.shape[0], 8, 8)
        for i in range(8):
            for j in range(8):
                xo = x.clone()
                xo[:, :, 4 * i:4 * i + 4, 4 * j:4 * j + 4] = 0
                drops[:, i, j] = y0 - _logits(model, xo).gather(1, cls[:, None])[:, 0]
    return drops


def pool() -> None:
    import vitlens
    from vitlens.explainers import get_method
    from vitlens.explainers.gradskip_hiera import POOL_RULES, attribute_mask_units
    from vitlens.models.families import build as build_family
    from vitlens.targets import ClassLogit

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from test_gradskip_hiera import _hf, _timm

    torch.set_num_threads(1)
    models = {"timm test": _timm(), "timm test seed 1": _timm(seed=1), "timm no-expand-proj": _timm("no-expand-proj"),
              "timm layerscale": _timm("layerscale"), "HF test": _hf(), "HF test seed 1": _hf(seed=1),
              "timm catalogue": build_family("timm Hiera"), "HF catalogue": build_family("HF Hiera")}
    method = get_method("gradskip")
    x = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    every: dict[str, list[float]] = {r: [] for r in POOL_RULES}
    for name, model in models.items():
        with torch.no_grad():
            cls = _logits(model, x).argmax(1)
        drops = _occlusion(model, x, cls)
        line, maps = [name], {}
        for rule in POOL_RULES:
            maps[rule] = attribute_mask_units(method, vitlens.get_adapter(model), x, ClassLogit(cls.tolist()),
                                              pool_rule=rule)[0].values
            half = copy.deepcopy(model).half()
            vh = attribute_mask_units(method, vitlens.get_adapter(half), x.half(), ClassLogit(cls.tolist()),
                                      pool_rule=rule)[0].values
            c = _corr(maps[rule], drops)
            every[rule] += c.tolist()
            line.append(f"{rule}: occlusion corr. median {float(c.median()):.3f}, float16 corr. min "
                        f"{float(_corr(vh, maps[rule]).min()):.4f}")
        line.append(f"gxa~argmax median {float(_corr(maps['gxa'], maps['argmax']).median()):.3f}")
        print(" | ".join(line))
    for rule, cs in every.items():
        print(f"{rule}, all {len(cs)} images: occlusion corr. median {statistics.median(cs):.3f}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    c = sub.add_parser("cost")
    c.add_argument("--model", choices=("tiny224", "hf224", "small"), default="tiny224")
    c.add_argument("--pairs", type=int, default=9)
    c.add_argument("--batch", type=int, default=2)
    sub.add_parser("pool")
    args = ap.parse_args(argv)
    if args.what == "cost":
        cost(args.model, args.pairs, args.batch)
    else:
        pool()


if __name__ == "__main__":
    main()
