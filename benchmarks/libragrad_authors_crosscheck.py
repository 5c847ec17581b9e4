"""The numbers tests/test_libragrad.py pins: the LibraGrad authors' code on tests/conftest.py's ``tiny_vit()``
weights, next to vitlens' ``libragrad_inputxgradient`` and the gradient at the last block's input.

Their code is their timm fork (GitHub NightMachinery/pytorch-image-models-libragrad-v1), PyNight
(NightMachinery/PyNight) and decompv (NightMachinery/decompv-libragrad-v1); it runs in a scratch venv that sees the
project's packages, with theirs first on ``PYTHONPATH`` (their ``timm`` shadows the project's)::

    python -m venv /tmp/libra_venv
    echo /path/to/vitlens/.venv/lib/python3.11/site-packages > /tmp/libra_venv/lib/python3.11/site-packages/zz.pth
    /tmp/libra_venv/bin/pip install "ipython<9" pytz blend_modes einops kornia icecream brish humanize ipykernel \\
        datasets jax pytictoc scikit-image        # what their modules import
    # checkouts of the three repositories in /tmp/libra_src (timm fork at the top, pynight_src/, decompv_src/)
    # 1. in the project's venv: write the weights and the batch
    python benchmarks/libragrad_authors_crosscheck.py --write /tmp/libra_xcheck
    # 2. in the scratch venv: their gradients (stdin from /dev/null: their code opens ipdb on an exception)
    PYTHONPATH=/tmp/libra_src:/tmp/libra_src/pynight_src:/tmp/libra_src/decompv_src \\
        /tmp/libra_venv/bin/python benchmarks/libragrad_authors_crosscheck.py --authors /tmp/libra_xcheck < /dev/null
    # 3. in the project's venv: compare
    python benchmarks/libragrad_authors_crosscheck.py --compare /tmp/libra_xcheck
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write(folder: str) -> None:
    sys.path[:0] = [os.path.join(ROOT, "src"), os.path.join(ROOT, "tests")]
    from conftest import tiny_vit

    os.makedirs(folder, exist_ok=True)
    torch.save({k: v.clone() for k, v in tiny_vit().state_dict().items()}, os.path.join(folder, "tiny.pt"))
    torch.save(torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0)), os.path.join(folder, "x.pt"))


def authors(folder: str) -> None:
    """Their VisionTransformer with the weights; gradients under their NG and LX1 (LibraGrad preset) modes."""
    from timm.models.decomposition import configure_gradient_modes
    from timm.models.vision_transformer import VisionTransformer

    m = VisionTransformer(img_size=32, patch_size=8, embed_dim=48, depth=3, num_heads=4, num_classes=5, qkv_bias=True)
    m.load_state_dict(torch.load(os.path.join(folder, "tiny.pt")))
    m.eval()
    x = torch.load(os.path.join(folder, "x.pt"))
    out = {}
    for brand in ("NG", "LX1"):
        configure_gradient_modes(gradient_mode_brand=brand, softmax_mode="S0", mlp_mul_gbrand=None,
                                 model_name="vit_tiny_patch16_224")
        feats = {}
        hook = m.blocks[-1].register_forward_pre_hook(lambda mod, a: feats.__setitem__("u", a[0]))
        xg = x.clone().requires_grad_(True)
        logits = m(xg)
        hook.remove()
        c = logits.argmax(-1)
        gx, gu = torch.autograd.grad(logits[torch.arange(len(c)), c].sum(), [xg, feats["u"]])
        out[brand] = {"logits": logits.detach(), "grad_x": gx, "grad_u_last": gu, "targets": c}
    torch.save(out, os.path.join(folder, "authors.pt"))


def compare(folder: str) -> None:
    sys.path[:0] = [os.path.join(ROOT, "src"), os.path.join(ROOT, "tests")]
    from conftest import tiny_vit

    from vitlens.explainers import get_method
    from vitlens.explainers._libragrad import libra_rules
    from vitlens.models import get_adapter

    a = torch.load(os.path.join(folder, "authors.pt"))
    m, x = tiny_vit(), torch.load(os.path.join(folder, "x.pt"))
    print("logits", float((m(x) - a["LX1"]["logits"]).abs().max()))
    for brand, name in (("NG", "inputxgradient"), ("LX1", "libragrad_inputxgradient")):
        ref = (x * a[brand]["grad_x"]).sum(1)
        print(brand, name, float((get_method(name).explain(m, x).maps - ref).abs().max()), float(ref.abs().max()))
    feats = {}
    hook = m.blocks[-1].register_forward_pre_hook(lambda mod, args: feats.__setitem__("u", args[0]))
    with libra_rules(get_adapter(m)):
        xg = x.clone().requires_grad_(True)
        logits = m(xg)
    hook.remove()
    (gu,) = torch.autograd.grad(logits[torch.arange(2), logits.argmax(-1)].sum(), feats["u"])
    print("grad_u_last", float((gu - a["LX1"]["grad_u_last"]).abs().max()), float(gu.abs().max()))
    print("AUTHORS_IXG", [f"{float(v):.7e}" for v in (x * a["LX1"]["grad_x"]).sum(1)[:, ::8, ::8].flatten()])
    print("AUTHORS_GRAD_U", [f"{float(v):.7e}" for v in a["LX1"]["grad_u_last"][:, ::5, ::12].flatten()])


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--write")
    g.add_argument("--authors")
    g.add_argument("--compare")
    args = p.parse_args()
    if args.write:
        write(args.write)
    elif args.authors:
        authors(args.authors)
    else:
        compare(args.compare)
