"""Cross-check of ``attnlrp`` and ``cplrp`` against LXT (the AttnLRP authors' library), in a separate interpreter.

LXT 2.x needs ``transformers<5`` and patches library classes process-wide, so it never runs in the project's
environment. Create its venv once (see docs/methods/attention_methods.md, "Cross-check against LXT")::

    python3 -m venv /work/lxt-venv
    /work/lxt-venv/bin/pip install -e . lxt 'transformers<5' timm torchvision

and run ``VITLENS_LXT_PYTHON=/work/lxt-venv/bin/python pytest tests/test_lxt_crosscheck.py -s``. ``scripts/setup.sh``
(the README's set-up command, also run by CI) creates ``.venv-lxt`` in the checkout, which is used when the variable
is not set; without either the test is skipped.

What is compared (one fresh interpreter per LXT configuration, because LXT's patches cannot be undone):

- ``torchvision-cp``: LXT's own default map for torchvision's ``VisionTransformer`` (identity rule on GELU, LayerNorm
  with a constant standard deviation, no gradient into the softmax through q and k = CP-LRP) against vitlens
  ``cplrp`` on a timm ViT with the same weights.
- ``hf-attnlrp`` / ``hf-cp``: HF ``ViTForImageClassification`` (transformers 4.x), patched with a map built only from
  LXT's own patch functions (``patch_attention`` = uniform rule on q, k, v; ``patch_cp_attention``;
  ``layer_norm_forward``; ``non_linear_forward`` on ``GELUActivation``) — LXT ships no map for HF ViT — against vitlens
  ``attnlrp`` / ``cplrp`` on the timm model and on that HF model (vitlens's transformers-4.x path).

Relevance is gradient × input at the first block's input (after the position embeddings), summed over channels, for
the predicted class logit; LXT's is read at the same tensor with a forward hook.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

#: real command-line processes, training or a sweep over every family: left out of `pytest -m "not slow"`
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
# scripts/setup.sh creates .venv-lxt next to .venv; VITLENS_LXT_PYTHON points elsewhere.
_DEFAULT_LXT = ROOT / ".venv-lxt" / "bin" / "python"
LXT_PYTHON = os.environ.get("VITLENS_LXT_PYTHON") or (str(_DEFAULT_LXT) if _DEFAULT_LXT.exists() else None)

SCRIPT = r'''
import json, sys
import torch
import torch.nn.functional as F

torch.set_num_threads(1)
mode = sys.argv[1]

from timm.models.vision_transformer import VisionTransformer
import vitlens


def timm_vit(seed, img, patch, dim, depth, heads):
    torch.manual_seed(seed)
    m = VisionTransformer(img_size=img, patch_size=patch, embed_dim=dim, depth=depth, num_heads=heads,
                          num_classes=7, qkv_bias=True).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("qkv.weight"):
                p[: 2 * dim].mul_(4.0)  # peaked attention, heads that differ
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
            if name in ("cls_token", "pos_embed"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return m


def to_torchvision(tm):
    from torchvision.models.vision_transformer import VisionTransformer as TV
    d = tm.embed_dim
    tv = TV(image_size=tm.patch_embed.img_size[0], patch_size=tm.patch_embed.patch_size[0],
            num_layers=len(tm.blocks), num_heads=tm.blocks[0].attn.num_heads, hidden_dim=d,
            mlp_dim=tm.blocks[0].mlp.fc1.out_features, num_classes=tm.num_classes).eval()
    sd = tm.state_dict()
    new = {"conv_proj.weight": sd["patch_embed.proj.weight"], "conv_proj.bias": sd["patch_embed.proj.bias"],
           "class_token": sd["cls_token"], "encoder.pos_embedding": sd["pos_embed"],
           "encoder.ln.weight": sd["norm.weight"], "encoder.ln.bias": sd["norm.bias"],
           "heads.head.weight": sd["head.weight"], "heads.head.bias": sd["head.bias"]}
    for i in range(len(tm.blocks)):
        p, q = f"blocks.{i}.", f"encoder.layers.encoder_layer_{i}."
        pairs = {"ln_1": "norm1", "ln_2": "norm2", "self_attention.out_proj": "attn.proj",
                 "mlp.0": "mlp.fc1", "mlp.3": "mlp.fc2"}
        for a, b in pairs.items():
            new[q + a + ".weight"] = sd[p + b + ".weight"]
            new[q + a + ".bias"] = sd[p + b + ".bias"]
        new[q + "self_attention.in_proj_weight"] = sd[p + "attn.qkv.weight"]
        new[q + "self_attention.in_proj_bias"] = sd[p + "attn.qkv.bias"]
    tv.load_state_dict(new, strict=True)
    return tv


def to_hf4(tm):
    from timm_to_hf import timm_to_hf_vit  # tests/timm_to_hf.py (on PYTHONPATH): transformers 4.x names
    return timm_to_hf_vit(tm, attn_implementation="eager")


def vitlens_tokens(model, x, method):
    e = vitlens.explain(model, x, method=method)
    return e, torch.cat([e.remainder[:, None], e.token_maps.flatten(1)], dim=1)  # CLS first, as LXT's tokens


def lxt_tokens(model, x, embed_module, call):
    box = {}

    def leaf(module, args, out):
        out = out.detach().requires_grad_(True)
        box["u"] = out
        return out

    h = embed_module.register_forward_hook(leaf)
    try:
        logits = call(model, x)
    finally:
        h.remove()
    y = logits.gather(1, logits.argmax(-1, keepdim=True)).sum()
    (g,) = torch.autograd.grad(y, [box["u"]])
    return (box["u"] * g).sum(-1).detach(), logits.detach()


def compare(ours, ref):
    diff = (ours - ref).abs().max().item()
    scale = ref.abs().max().item()
    corr = torch.corrcoef(torch.stack([ours.flatten(), ref.flatten()]))[0, 1].item()
    return {"max_abs_diff": diff, "rel_diff": diff / scale, "pearson": corr, "ref_max": scale,
            "ours_total": ours.sum(-1).tolist(), "ref_total": ref.sum(-1).tolist()}


configs = {"tiny": dict(seed=0, img=32, patch=8, dim=48, depth=3, heads=4),
           "small": dict(seed=5, img=64, patch=8, dim=96, depth=6, heads=6)}
report = {"mode": mode}
import lxt, transformers, torchvision
report["versions"] = {"lxt": getattr(lxt, "__version__", "2.x"), "transformers": transformers.__version__,
                      "torch": torch.__version__, "torchvision": torchvision.__version__}
prepared = []
for cname, cfg in configs.items():
    tm = timm_vit(**cfg)
    x = torch.randn(4, 3, cfg["img"], cfg["img"], generator=torch.Generator().manual_seed(cfg["seed"] + 7))
    other = to_torchvision(tm) if mode == "torchvision-cp" else to_hf4(tm)
    method = "attnlrp" if mode == "hf-attnlrp" else "cplrp"
    ours_e, ours = vitlens_tokens(tm, x, method)  # before LXT patches anything
    entry = {"method": method, "scores": ours_e.scores.tolist()}
    # near misses, to show the comparison tells the rules apart: the other attention rule, plain GELU gradient
    near = {"other_attention_rule": vitlens_tokens(tm, x, "cplrp" if method == "attnlrp" else "attnlrp")[1],
            "plain_gelu_gradient": torch.cat([
                (e := vitlens.explain(tm, x, method=method, activation_rule="gradient")).remainder[:, None],
                e.token_maps.flatten(1)], dim=1)}
    if mode != "torchvision-cp":
        _, ours_hf = vitlens_tokens(other, x, method)
        entry["vitlens_hf4_vs_timm"] = compare(ours_hf, ours)
    prepared.append((cname, tm, other, x, ours, entry, near))

from functools import partial

if mode == "torchvision-cp":
    import lxt.efficient
    from torchvision.models import vision_transformer
    lxt.efficient.monkey_patch(vision_transformer)  # LXT's default map for torchvision ViTs
else:
    import lxt.efficient
    from lxt.efficient.patches import (patch_attention, patch_cp_attention, patch_method, layer_norm_forward,
                                       non_linear_forward)
    from transformers.models.vit import modeling_vit
    from transformers.activations import GELUActivation
    attention = patch_attention if mode == "hf-attnlrp" else patch_cp_attention
    lxt.efficient.monkey_patch(modeling_vit, patch_map={
        modeling_vit: attention,
        torch.nn.LayerNorm: partial(patch_method, layer_norm_forward),
        GELUActivation: partial(patch_method, non_linear_forward, keep_original=True),
    })

for cname, tm, other, x, ours, entry, near in prepared:
    if mode == "torchvision-cp":
        ref, logits = lxt_tokens(other, x, other.encoder.dropout, lambda m, x: m(x))
    else:
        ref, logits = lxt_tokens(other, x, other.vit.embeddings, lambda m, x: m(pixel_values=x).logits)
    with torch.no_grad():
        entry["logits_max_diff"] = (logits - tm(x)).abs().max().item()
    entry["vitlens_vs_lxt"] = compare(ours, ref)
    entry["near_misses_rel_diff"] = {k: compare(v, ref)["rel_diff"] for k, v in near.items()}
    report[cname] = entry
print("RESULT " + json.dumps(report))
'''

MODES = ["torchvision-cp", "hf-attnlrp", "hf-cp"]


def run_lxt_script(text: str, mode: str, tmp_path: Path) -> dict:
    """Run a cross-check script in the LXT environment (one thread) and return the JSON of its ``RESULT`` line."""
    assert LXT_PYTHON is not None
    script = tmp_path / "lxt_script.py"
    script.write_text(text)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")]), OMP_NUM_THREADS="1")
    proc = subprocess.run([LXT_PYTHON, str(script), mode], capture_output=True, text=True, timeout=900, env=env,
                          cwd=str(tmp_path))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"cross-check failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    report = json.loads(lines[-1][len("RESULT "):])
    print(json.dumps(report, indent=1), file=sys.stderr)
    return report


@pytest.mark.skipif(not LXT_PYTHON, reason="set VITLENS_LXT_PYTHON to a python with lxt and transformers<5")
@pytest.mark.parametrize("mode", MODES)
def test_matches_lxt(mode, tmp_path):
    report = run_lxt_script(SCRIPT, mode, tmp_path)
    for cname in ("tiny", "small"):
        entry = report[cname]
        assert entry["logits_max_diff"] < 1e-4
        assert entry["vitlens_vs_lxt"]["rel_diff"] < 1e-5, (cname, entry)
        # the tolerance separates the rules: each near miss is far outside it
        assert min(entry["near_misses_rel_diff"].values()) > 1e-3, (cname, entry)
        if "vitlens_hf4_vs_timm" in entry:
            assert entry["vitlens_hf4_vs_timm"]["rel_diff"] < 1e-5, (cname, entry)
