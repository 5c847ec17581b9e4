"""Cost of a text-prompted GradSkip map of a vision–language model next to its floor, measured side by side in one run
(issue #52, item 6): ``docs/benchmarks/vlm_cost.md``.

Rows, per model, interleaved in every repeat (so machine noise hits them alike):

  (a) ``forward``          the image tower's forward and the score ``scale · cos(e(x), e(t)) + bias`` under
                           ``torch.no_grad()`` (the model's own attention path);
  (b) ``forward+backward`` the floor of any gradient method on this score: the same forward and an activation-only
                           backward ``torch.autograd.grad(score.sum(), input_of_first_block)`` (parameters frozen, the
                           first block's input made a leaf), with the model's own attention path;
  (c) ``gradskip``         ``vitlens.explain(vlm, x, "gradskip", target=vitlens.TextPrompt(prompts))``: the whole call
                           (binding the prompt: the cached text embeddings, the forward with capture, the backward, the
                           propagation).

The text embeddings of the prompts are computed once (the first call; row ``text encoding`` times that first
computation, of every prompt, on its own) and every later call reuses them: the script counts the text encoder's
calls over the whole run. Timings: median over ``--repeats`` interleaved repeats after a warm-up, one thread
(``torch.set_num_threads(1)``), per image; ratios are medians of the per-repeat ratios c/a and c/b.

Models (random weights, nothing downloaded): transformers ``CLIPModel`` with a CLIP ViT-B/16 vision tower (224 px,
12 layers, width 768, 12 heads; a 2-layer text tower: it runs once) and timm's CLIP ViT-B/16 image tower
``vit_base_patch16_clip_224`` with text embeddings (``VisionLanguageModel(tower, text_embeddings=...)``);
``--small`` uses ViT-S-sized towers (width 384, 6 heads) instead.

Usage::

    python benchmarks/vlm_cost.py --out docs/benchmarks/vlm_cost.md
    python benchmarks/vlm_cost.py --small --repeats 3 --batch 2      # quick check
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import shlex
import statistics
import sys
import time
from typing import Any, Callable

import torch
from torch import Tensor, nn

import vitlens
from vitlens.models.vlm import VisionLanguageModel

PROMPTS = ["a photo of a cat", "a photo of a dog"]


def _tokenizer() -> Any:
    """A word-level tokenizer built here (offline) for the transformers model's text tower."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[PAD]", "[UNK]", "[BOS]", "[EOS]", "a", "photo", "of", "cat", "dog"]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="[PAD]", unk_token="[UNK]", bos_token="[BOS]",
                                   eos_token="[EOS]")


def hf_clip(small: bool) -> VisionLanguageModel:
    from transformers import CLIPConfig, CLIPModel

    width, heads = (384, 6) if small else (768, 12)
    vision = dict(hidden_size=width, intermediate_size=4 * width, num_hidden_layers=12, num_attention_heads=heads,
                  image_size=224, patch_size=16)
    text = dict(vocab_size=9, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                max_position_embeddings=16, bos_token_id=2, eos_token_id=3, pad_token_id=0)
    torch.manual_seed(0)
    model = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=512)).eval()
    return VisionLanguageModel(model, _tokenizer())


def timm_clip(small: bool) -> VisionLanguageModel:
    import timm

    torch.manual_seed(0)
    kwargs = dict(embed_dim=384, num_heads=6) if small else {}
    tower = timm.create_model("vit_base_patch16_clip_224", pretrained=False, num_classes=512, **kwargs).eval()
    text = {p: torch.randn(512, generator=torch.Generator().manual_seed(i)) for i, p in enumerate(PROMPTS)}
    return VisionLanguageModel(tower, text_embeddings=text, scale=100.0)


def first_block(vlm: VisionLanguageModel) -> nn.Module:
    return vitlens.get_adapter(vlm).blocks()[0]


def score(vlm: VisionLanguageModel, x: Tensor, text: Tensor) -> Tensor:
    """``scale · cos + bias`` of image ``i`` against prompt ``i mod P``."""
    s = vlm.similarity(vlm(x), text)
    return s[torch.arange(x.shape[0]), torch.arange(x.shape[0]) % text.shape[0]]


def run_forward(vlm: VisionLanguageModel, x: Tensor, text: Tensor) -> None:
    with torch.no_grad():
        score(vlm, x, text)


def run_floor(vlm: VisionLanguageModel, x: Tensor, text: Tensor) -> None:
    """Forward + activation-only backward of the score to the first block's input, parameters frozen."""
    leaf: list[Tensor] = []

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            u = args[0].detach().requires_grad_(True)
            leaf.append(u)
            return (u, *args[1:]), kwargs
        key = "hidden_states" if "hidden_states" in kwargs else next(iter(kwargs))
        u = kwargs[key].detach().requires_grad_(True)
        leaf.append(u)
        return args, {**kwargs, key: u}

    flags = [p.requires_grad for p in vlm.parameters()]
    handle = first_block(vlm).register_forward_pre_hook(hook, with_kwargs=True)
    try:
        for p in vlm.parameters():
            p.requires_grad_(False)
        y = score(vlm, x, text)
        torch.autograd.grad(y.sum(), leaf[0])
    finally:
        handle.remove()
        for p, f in zip(vlm.parameters(), flags):
            p.requires_grad_(f)


def run_gradskip(vlm: VisionLanguageModel, x: Tensor) -> vitlens.Explanation:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(x.shape[0])]
    return vitlens.explain(vlm, x, "gradskip", target=vitlens.TextPrompt(prompts))


class TextCalls:
    """Counts the calls of the text encoder (``encode_text``'s encoding of prompts it has not seen)."""

    def __init__(self, vlm: VisionLanguageModel) -> None:
        self.calls, self.prompts = 0, 0
        original = vlm._encode

        def counted(texts: list[str]) -> Tensor:
            self.calls += 1
            self.prompts += len(texts)
            return original(texts)

        vlm._encode = counted  # type: ignore[method-assign]  # this instance only


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(name: str, vlm: VisionLanguageModel, batch: int, repeats: int) -> dict[str, Any]:
    x = torch.randn(batch, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    counter = TextCalls(vlm)
    t_text = timed(lambda: vlm.encode_text(PROMPTS)) if vlm.has_text_encoder else float("nan")
    text = vlm.encode_text(PROMPTS)
    e = run_gradskip(vlm, x)  # warm-up (and the check below)
    run_floor(vlm, x, text)
    run_forward(vlm, x, text)
    total = e.token_maps.double().sum((1, 2)) + e.remainder.double()
    completeness = float(((total - e.scores.double()).abs() / e.scores.double().abs()).max())
    rows: dict[str, list[float]] = {"forward": [], "forward+backward": [], "gradskip": []}
    for _ in range(repeats):
        rows["forward"].append(timed(lambda: run_forward(vlm, x, text)) / batch)
        rows["forward+backward"].append(timed(lambda: run_floor(vlm, x, text)) / batch)
        rows["gradskip"].append(timed(lambda: run_gradskip(vlm, x)) / batch)
    ratio_floor = [g / f for g, f in zip(rows["gradskip"], rows["forward+backward"])]
    ratio_fwd = [g / f for g, f in zip(rows["gradskip"], rows["forward"])]
    family = vitlens.get_adapter(vlm).family
    return {"name": name, "family": family, "batch": batch, "repeats": repeats,
            "median": {k: statistics.median(v) for k, v in rows.items()},
            "ratio_floor": statistics.median(ratio_floor), "ratio_forward": statistics.median(ratio_fwd),
            "ratio_floor_range": (min(ratio_floor), max(ratio_floor)), "text_seconds": t_text,
            "text_calls": counter.calls, "text_prompts": counter.prompts, "completeness": completeness,
            "calls_gradskip": repeats + 1, "passes": (e.cost.forward_passes, e.cost.backward_passes)}


def table(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    import transformers

    import timm

    lines = [
        "# Cost of a text-prompted GradSkip map (vision–language models)",
        "",
        "Written by `benchmarks/vlm_cost.py` (issue #52, item 6). Command: "
        f"`{' '.join(shlex.quote(a) for a in ['python', 'benchmarks/vlm_cost.py', *sys.argv[1:]])}`",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {platform.system()}, one thread "
        f"(`torch.set_num_threads(1)`); torch {torch.__version__}, transformers {transformers.__version__}, "
        f"timm {timm.__version__}, vitlens {vitlens.__version__}; {_dt.date.today().isoformat()}. "
        f"Batch {args.batch} images of 224×224, median per image over {args.repeats} interleaved repeats after a "
        "warm-up; random weights (the cost does not depend on them). Load average of the machine (other processes "
        f"sharing its {os.cpu_count()} cores) at the start and the end of the run: {args.load[0]:.1f} and "
        f"{os.getloadavg()[0]:.1f} — absolute times grow with it and the per-repeat ratios spread; the interleaved "
        "repeats' median ratio is the figure to read.",
        "",
        "The score explained is the model's own image–text score `scale · cos(e(x), e(t)) + bias`, one prompt per "
        f"image ({', '.join(repr(p) for p in PROMPTS)} in turn). *Floor*: the image tower's forward and an "
        "activation-only backward of that score to the first block's input, on the model's own attention path "
        "(transformers: SDPA; timm: fused). *GradSkip*: the whole `vitlens.explain` call.",
        "",
        "| model | adapter | forward (ms) | forward + backward (ms) | GradSkip (ms) | GradSkip ÷ floor "
        "(min–max over repeats) | GradSkip ÷ forward | map + remainder vs score (max rel.) | text encoder calls "
        "(prompts) over the run | text encoding, once (ms) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        m = r["median"]
        lo, hi = r["ratio_floor_range"]
        text_ms = "—" if r["text_seconds"] != r["text_seconds"] else f"{1000 * r['text_seconds']:.1f}"
        calls = (f"{r['text_calls']} ({r['text_prompts']}) over {r['calls_gradskip']} GradSkip calls"
                 if r["text_seconds"] == r["text_seconds"] else "— (embeddings given)")
        lines.append(f"| {r['name']} | `{r['family']}` | {1000 * m['forward']:.0f} | "
                     f"{1000 * m['forward+backward']:.0f} | {1000 * m['gradskip']:.0f} | **{r['ratio_floor']:.3f}** "
                     f"({lo:.3f}–{hi:.3f}) | {r['ratio_forward']:.2f} | {r['completeness']:.1e} | {calls} | {text_ms} |")
    lines += [
        "",
        "Target of issue #52: GradSkip ≤ 1.10 × the floor. The text embeddings are computed once per distinct prompt "
        "(the count above: one call of the text encoder for both prompts in the whole run, the first) and reused by "
        "every later call, so a prompt costs nothing per map.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--small", action="store_true", help="ViT-S-sized towers instead of ViT-B/16")
    p.add_argument("--models", default="hf,timm", help="comma-separated: hf (transformers CLIPModel), timm")
    p.add_argument("--out", default=None, help="write the markdown table here")
    args = p.parse_args(argv)
    args.load = os.getloadavg()
    torch.set_num_threads(1)
    builders = {"hf": ("transformers CLIPModel, ViT-%s/16 vision tower", hf_clip),
                "timm": ("timm vit_base_patch16_clip_224%s + text embeddings", timm_clip)}
    results = []
    for key in args.models.split(","):
        label, build = builders[key]
        name = label % ("S" if args.small else "B") if key == "hf" else label % (" (ViT-S width)" if args.small else "")
        r = measure(name, build(args.small), args.batch, args.repeats)
        print(f"{name}: floor {1000 * r['median']['forward+backward']:.0f} ms, gradskip "
              f"{1000 * r['median']['gradskip']:.0f} ms, ratio {r['ratio_floor']:.3f}, text calls {r['text_calls']}",
              flush=True)
        results.append(r)
    text = table(results, args)
    if args.out:
        from pathlib import Path

        Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
