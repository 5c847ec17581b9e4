"""GradSkip in float16 / bfloat16 on every supported family: correlation with the float32 map of the same weights,
and completeness in each dtype (tiny random-weight catalogue models, 4 images).

    python benchmarks/family_precision.py [--out docs/benchmarks/family_precision.md]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

import vitlens
from vitlens.explainers.support import working_methods
from vitlens.models.families import FAMILIES, build


def corr(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.flatten(1).double(), b.flatten(1).double()
    return float(torch.nn.functional.cosine_similarity(a - a.mean(1, keepdim=True), b - b.mean(1, keepdim=True)).min())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    rows = ["| family | fp32: max abs(Σ + rem − y) | fp16: min corr | fp16: max abs(Σ + rem − y) | bf16: min corr | "
            "bf16: max abs(Σ + rem − y) |", "|---|---|---|---|---|---|"]
    for fam in FAMILIES:
        if fam.note == "refused" or "gradskip" not in working_methods(build(fam.name)):
            continue
        ref = vitlens.explain(build(fam.name), x, method="gradskip")
        err32 = (ref.token_maps.sum((1, 2)).double() + ref.remainder.double() - ref.scores.double()).abs().max()
        cells = [f"{float(err32):.1e}"]
        for dt in (torch.float16, torch.bfloat16):
            e = vitlens.explain(build(fam.name).to(dt), x, method="gradskip")
            err = (e.token_maps.sum((1, 2)).double() + e.remainder.double() - e.scores.double()).abs().max()
            cells += [f"{corr(e.maps, ref.maps):.4f}", f"{float(err):.1e}"]
        rows.append(f"| {fam.name} | " + " | ".join(cells) + " |")
    text = ("# GradSkip in half precision, per family\n\n"
            "Each family's tiny random-weight catalogue model (`vitlens.models.families`, attention sharpened), cast "
            "to float16 / bfloat16; 4 random 32×32 images; min over images of the Pearson correlation with the "
            "float32 map of the same weights, and the completeness error in that dtype (the propagation runs in "
            f"float32). Command: `python benchmarks/family_precision.py` ({time.strftime('%Y-%m-%d')}, torch "
            f"{torch.__version__}).\n\n" + "\n".join(rows) + "\n")
    print(text)
    if a.out:
        Path(a.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
