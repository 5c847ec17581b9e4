"""Text-prompted localisation on the proving ground: explain the bundled ``shapes-clip``'s image–text score for a
prompt naming one object of a multi-object scene, and check the map against that object's exact mask.

    python benchmarks/vlm_localisation.py [--n 200] [--seed 30000] [--out docs/benchmarks/vlm_localisation.md]

Protocol (fresh held-out scenes, never seen in training: ``make_multi_scenes(n, seed, min_objects=2,
max_objects=4)``):

* for every object present in a scene, the prompt ``"a <class>"`` is explained (the model's own score,
  ``logit_scale.exp() · cosine``, through :class:`vitlens.TextPrompt`); each (scene, object) is one pair;
* **pointing game**: the map's maximum (64×64 pixels) lies in the object's exact visible mask (no tolerance);
* **relevance in object**: the share of the map's positive relevance inside that mask;
* **prompt sensitivity**: over ordered pairs (a, b) of different objects of the same scene whose map for
  ``"a <a>"`` points into a, the share whose map for ``"a <b>"`` points into b (the maximum moves with the prompt);
* **object pointing** (object level): of the scene's objects, the named one has the highest mean relevance per
  pixel; and the prompt sensitivity of that answer; judged against **the model's own grounding**: removing the
  named object exactly (:func:`vitlens.data.multiscenes.make_multi_scene_pairs` with ``position``) lowers the
  explained target more than removing any other object of the scene;
* with ``--rise-masks N``: RISE (N masks) on the zero-shot probability, a black-box reference that reads the model
  by perturbation, through the class prompts as classes (``vitlens.ZeroShotClassifier``).

Proportions get Wilson 95% intervals (pairs treated as independent); the mean relevance in object gets a 95%
percentile bootstrap interval that resamples scenes (2,000 resamples, seed 0), since the pairs of a scene share an
image. Writes the Markdown table to ``--out``, the per-method numbers as CSV beside it under
``benchmarks/results/vlm_localisation.csv`` (``--csv``) and a figure of GradSkip maps for two prompts per scene.
"""

from __future__ import annotations

import argparse
import csv
import platform
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import vitlens
from vitlens.bench.report_stats import wilson_interval
from vitlens.data import CLASS_NAMES
from vitlens.data.multiscenes import MultiScenes, make_multi_scene_pairs, make_multi_scenes
from vitlens.errors import VitlensError
from vitlens.metrics import energy_inside, pointing_game
from vitlens.models.zoo import SHAPES_MEAN, SHAPES_STD

METHODS = ["gradskip", "legrad", "attnlrp", "gae", "gradcam", "rollout", "random"]
#: Black-box methods that need class logits: run with the class prompts as classes (``vitlens.ZeroShotClassifier``)
#: on the zero-shot probability target only (``--rise-masks``), as a reference that reads the model by perturbation.
CLASSIFIER_METHODS = ("rise",)
ROOT = Path(__file__).resolve().parents[1]


def pairs_of(present: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scene index, class)`` of every present object, ``(P,)`` each, scene-major."""
    scene, cls = torch.nonzero(present, as_tuple=True)
    return scene, cls


#: ``--zero-shot``'s target label: the prompt's zero-shot probability among the class prompts
ZERO_SHOT = "zero-shot probability"


def explain_pairs(model: torch.nn.Module, x: torch.Tensor, scene: torch.Tensor, cls: torch.Tensor, method: str,
                  chunk: int, versus: str | None = None, layers: list[torch.Tensor] | None = None,
                  **options: object) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Maps ``(P, H, W)`` and explained scores ``(P,)`` of the prompt ``"a <cls>"`` on scene ``scene`` for every pair
    (with ``versus``: its contrast against that prompt, ``vitlens.TextContrast``; ``versus=ZERO_SHOT``: its softmax
    probability among the prompts of every class, ``vitlens.TextProbability``), and the seconds it took. With
    ``layers`` (a list, GradSkip only) the explanations' ``layer_relevance`` ``(P, L+1, T)`` is appended to it.
    A method of :data:`CLASSIFIER_METHODS` explains the same probability through ``ZeroShotClassifier`` and
    ``ClassProbability`` (zero-shot target only); ``options`` go to the method."""
    vlm = vitlens.VisionLanguageModel(model)
    among = [f"a {c}" for c in CLASS_NAMES]
    if method in CLASSIFIER_METHODS and versus != ZERO_SHOT:
        raise ValueError(f"{method} needs class logits: it runs on the zero-shot probability target only")
    classifier = vitlens.ZeroShotClassifier(vlm, among) if method in CLASSIFIER_METHODS else None
    maps, scores = [], []
    t0 = time.perf_counter()
    for a in range(0, len(scene), chunk):
        idx = slice(a, a + chunk)
        texts = [f"a {CLASS_NAMES[int(c)]}" for c in cls[idx]]
        if classifier is not None:
            e = vitlens.explain(classifier, x[scene[idx]], method=method, target=vitlens.ClassProbability(cls[idx]),
                                **options)
        else:
            target = (vitlens.TextPrompt(texts) if versus is None else vitlens.TextProbability(texts, among)
                      if versus == ZERO_SHOT else vitlens.TextContrast(texts, versus=versus))
            e = vitlens.explain(vlm, x[scene[idx]], method=method, target=target, **options)
        maps.append(e.maps.detach().float())
        scores.append(e.scores.detach().float())
        if layers is not None:
            layers.append(e.extras["layer_relevance"].detach().float())
    seconds = time.perf_counter() - t0
    if layers is not None:
        layers[:] = [torch.cat(layers)]
    return torch.cat(maps), torch.cat(scores), seconds


def pointing_by_depth(layers: torch.Tensor, masks: torch.Tensor, prefix: int, grid: tuple[int, int]) -> list[float]:
    """Pointing game of GradSkip's relevance at the input of each block (``layers``: ``layer_relevance``
    ``(P, L+1, T)``; the patch tokens upsampled as the map is), block 0 (the map itself) first; the readout (all
    relevance on the readout tokens) left out."""
    from vitlens.explainers.base import upsample_tokens

    out = []
    for d in range(layers.shape[1] - 1):
        tokens = layers[:, d, prefix:].reshape(-1, *grid)
        out.append(float(pointing_game(upsample_tokens(tokens, tuple(masks.shape[-2:])), masks).float().mean()))
    return out


def object_pointing(maps: torch.Tensor, label_maps: torch.Tensor, present: torch.Tensor, cls: torch.Tensor
                    ) -> torch.Tensor:
    """``(P,)`` bool: of the objects of pair ``p``'s scene (``label_maps``, ``present``: that scene's, per pair), the
    named class ``cls[p]`` has the highest mean map value per visible pixel."""
    hits = []
    for m, lab, pres, c in zip(maps, label_maps, present, cls.tolist()):
        objs = torch.nonzero(pres).flatten().tolist()
        density = torch.stack([m[lab == k + 1].mean() for k in objs])
        hits.append(objs[int(density.argmax())] == c)
    return torch.tensor(hits)


def sensitivity(scene: torch.Tensor, hits: torch.Tensor) -> tuple[int, int]:
    """Over ordered pairs (a, b) of different objects of one scene with a hit for a: ``(hits for b, such pairs)``."""
    k, n = 0, 0
    for s in scene.unique():
        h = hits[scene == s].bool()
        m = len(h)
        n += int(h.sum()) * (m - 1)
        k += sum(int(h[b]) for a in range(m) if h[a] for b in range(m) if b != a)
    return k, n


def object_row(hits: torch.Tensor, scene: torch.Tensor) -> dict:
    """Object pointing (``hits``: ``(P,)`` bool) and its prompt sensitivity, with Wilson intervals."""
    ok, on = sensitivity(scene, hits)
    return {"object": float(hits.float().mean()), "object_ci": wilson_interval(int(hits.sum()), len(hits)),
            "object_sensitivity": ok / on if on else float("nan"), "object_sensitivity_ci": wilson_interval(ok, on)}


def bootstrap_mean(values: torch.Tensor, scene: torch.Tensor, reps: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile interval of the mean of ``values``, resampling scenes with replacement."""
    rng = np.random.default_rng(seed)
    ids = scene.unique().numpy()
    sums = np.array([float(values[scene == s].sum()) for s in ids])
    counts = np.array([int((scene == s).sum()) for s in ids])
    draws = rng.integers(0, len(ids), size=(reps, len(ids)))
    means = sums[draws].sum(1) / counts[draws].sum(1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def zero_shot_check(model: torch.nn.Module, x: torch.Tensor, present: torch.Tensor) -> float:
    """Share of (present, absent) class pairs whose prompts the model ranks correctly on these scenes."""
    with torch.no_grad():
        img = F.normalize(model.get_image_features(x), dim=-1)
        txt = F.normalize(model.encode_text([f"a {c}" for c in CLASS_NAMES]), dim=-1)
        s = img @ txt.T
    right = (s[:, :, None] > s[:, None, :]) & present[:, :, None] & ~present[:, None, :]
    return float(right.sum() / (present[:, :, None] & ~present[:, None, :]).sum())


def target_label(kind: str | None) -> str:
    """A target kind as the tables name it: ``prompt``, ``prompt − "<versus>"`` or the zero-shot probability."""
    return "prompt" if kind in (None, "prompt") else kind if kind == ZERO_SHOT else f'prompt − "{kind}"'


def removal_grounding(model: torch.nn.Module, args: argparse.Namespace, scenes: MultiScenes, scene: torch.Tensor,
                      cls: torch.Tensor, kinds: list[str | None]) -> dict[str, torch.Tensor]:
    """The model's own object-level grounding, a reference for a map's object-level answer (not a bound): for
    each (scene, object) pair, is the named object the one whose exact removal
    (:func:`vitlens.data.multiscenes.make_multi_scene_pairs` with ``position``: the scene without it, everything else
    identical) lowers the explained target most among the scene's objects? ``(P,)`` bool per target: where a map
    that paints every object with the drop its removal causes would point."""
    mean = torch.tensor(SHAPES_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(SHAPES_STD).view(1, 3, 1, 1)
    among = [f"a {c}" for c in CLASS_NAMES]
    versus = [v for v in kinds if v not in (None, ZERO_SHOT)]
    with torch.no_grad():
        txt = F.normalize(model.encode_text(among + versus), dim=-1)

        def values(images: torch.Tensor) -> dict[str, torch.Tensor]:  # (n, K) explained value per class prompt
            s = model.logit_scale.exp() * F.normalize(model.get_image_features((images - mean) / std), dim=-1) @ txt.T
            k = len(among)
            out = {"prompt": s[:, :k], ZERO_SHOT: s[:, :k].softmax(-1)}
            out.update({v: s[:, :k] - s[:, k + i, None] for i, v in enumerate(versus)})
            return out

        full = values(scenes.images)
        drops = [{key: full[key] - v for key, v in values(make_multi_scene_pairs(
            args.n, seed=args.seed, min_objects=2, max_objects=4, position=j)[1].images).items()}
            for j in range(scenes.objects.shape[1])]
    out = {}
    for kind in kinds:
        key = "prompt" if kind is None else kind
        right = []
        for s_, c in zip(scene.tolist(), cls.tolist()):
            order = [int(o) for o in scenes.objects[s_] if o >= 0]
            d = torch.stack([drops[j][key][s_, c] for j in range(len(order))])
            right.append(order[int(d.argmax())] == c)
        out[key] = torch.tensor(right)
    return out


def figure(path: Path, images: torch.Tensor, label_maps: torch.Tensor, rows: list[tuple[int, list[int]]],
           maps: dict[tuple[int, int], torch.Tensor], target: str = "prompt") -> None:
    """Each row: a scene, then GradSkip's map for two of its objects' prompts (the object's outline in white)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(rows), 3, figsize=(6.6, 2.3 * len(rows)), squeeze=False)
    for r, (s, classes) in enumerate(rows):
        axes[r, 0].imshow(images[s].permute(1, 2, 0).numpy())
        axes[r, 0].set_title(f"scene {s}", fontsize=8)
        for j, c in enumerate(classes):
            ax = axes[r, j + 1]
            m = maps[(s, c)]
            ax.imshow(m.numpy(), cmap="inferno")
            ax.contour((label_maps[s] == c + 1).numpy(), levels=[0.5], colors="white", linewidths=0.8)
            yx = divmod(int(m.argmax()), m.shape[1])
            ax.plot(yx[1], yx[0], "c+", markersize=9, markeredgewidth=2)
            ax.set_title(f"GradSkip: \"a {CLASS_NAMES[c]}\"" + ("" if target == "prompt" else f"\n({target})"),
                         fontsize=8)
    for ax in axes.flat:
        ax.set_xticks([])
        ax.set_yticks([])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def depth_figure(path: Path, images: torch.Tensor, label_maps: torch.Tensor, pairs: list[tuple[int, int, int]],
                 layers: torch.Tensor, prefix: int, grid: tuple[int, int], target: str) -> None:
    """Each row: a scene and GradSkip's relevance on the patch tokens at the input of each block, from the last
    block's input to block 0's (the map), for one named object (outlined in white)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    depths = list(range(layers.shape[1] - 2, -1, -1))  # the readout (all on the readout tokens) left out
    fig, axes = plt.subplots(len(pairs), len(depths) + 1, figsize=(1.55 * (len(depths) + 1), 1.7 * len(pairs)),
                             squeeze=False)
    for r, (s, c, i) in enumerate(pairs):  # scene, named class, index of the pair
        axes[r, 0].imshow(images[s].permute(1, 2, 0).numpy())
        axes[r, 0].set_title(f"\"a {CLASS_NAMES[c]}\"", fontsize=7)
        for j, d in enumerate(depths):
            ax = axes[r, j + 1]
            ax.imshow(layers[i, d, prefix:].reshape(grid).numpy(), cmap="inferno",
                      extent=(0, images.shape[-1], images.shape[-2], 0))
            ax.contour((label_maps[s] == c + 1).numpy(), levels=[0.5], colors="white", linewidths=0.6)
            ax.set_title("map (block 0)" if d == 0 else f"block {d} input", fontsize=7)
    for ax in axes.flat:
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle(f"GradSkip's relevance by depth (target: {target})", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    if args.weights:  # a candidate (e.g. a run folder's export) before it is shipped
        from vitlens.models.zoo import BUNDLED
        from vitlens.training.common import load_stored

        model = load_stored(BUNDLED["shapes-clip"].build, Path(args.weights))
    else:
        model = vitlens.load_model("shapes-clip")
    scenes = make_multi_scenes(args.n, seed=args.seed, min_objects=2, max_objects=4)
    mean = torch.tensor(SHAPES_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(SHAPES_STD).view(1, 3, 1, 1)
    x = (scenes.images - mean) / std
    scene, cls = pairs_of(scenes.present)
    masks = scenes.label_maps[scene] == (cls + 1)[:, None, None]
    auc = zero_shot_check(model, x, scenes.present)
    methods = [m for m in args.methods if m in vitlens.methods()]
    skipped = [m for m in args.methods if m not in methods]
    rows, gradskip_maps, refused, figure_target = [], None, [], "prompt"
    gradskip_layers: list[torch.Tensor] | None = None
    depth: dict[str, list[float]] = {}
    tower = vitlens.get_adapter(vitlens.VisionLanguageModel(model))  # the image tower's token layout
    prefix, grid = tower.num_prefix_tokens, tower.grid(tuple(x.shape[-2:]))
    kinds = [None, *args.versus, *([ZERO_SHOT] if args.zero_shot else [])]
    grounding = removal_grounding(model, args, scenes, scene, cls, kinds)
    for key, right in grounding.items():
        print(f"model [{key}]: removing the named object lowers the target most in {int(right.sum())}/{len(right)} "
              "pairs", flush=True)
    black_box = [("rise", ZERO_SHOT)] if args.zero_shot and args.rise_masks > 0 and "rise" in vitlens.methods() else []
    for method, versus in [(m, v) for v in kinds for m in methods] + black_box:
        layers: list[torch.Tensor] | None = [] if method == "gradskip" else None
        options = {"n_masks": args.rise_masks, "grid_size": grid[0]} if method == "rise" else {}
        try:
            maps, scores, seconds = explain_pairs(model, x, scene, cls, method, args.chunk, versus, layers, **options)
        except VitlensError as exc:  # a method that refuses a text target says why in one line
            if versus is None:
                refused.append(f"{method} ({str(exc).splitlines()[0]})")
            print(f"{method}: refused: {exc}", flush=True)
            continue
        hits = pointing_game(maps, masks)
        obj = object_pointing(maps, scenes.label_maps[scene], scenes.present[scene], cls)
        near = pointing_game(maps, masks, tolerance=args.tolerance)
        inside = energy_inside(maps, masks)
        k, n = sensitivity(scene, hits)
        rows.append({
            "method": method, "target": target_label(versus),
            "pairs": len(scene), "pointing": float(hits.mean()),
            "pointing_ci": wilson_interval(int(hits.sum()), len(hits)), "near": float(near.mean()),
            "near_ci": wilson_interval(int(near.sum()), len(near)), "inside": float(inside.mean()),
            "inside_ci": bootstrap_mean(inside, scene), "sensitivity": k / n if n else float("nan"),
            "sensitivity_ci": wilson_interval(k, n), "sensitivity_n": n, "seconds": seconds,
            **object_row(obj, scene),
        })
        print(f"{method} [{rows[-1]['target']}]: pointing {rows[-1]['pointing']:.3f} (±{args.tolerance:.1f} px "
              f"{rows[-1]['near']:.3f}) inside {rows[-1]['inside']:.3f} "
              f"sensitivity {rows[-1]['sensitivity']:.3f} ({n} pairs); object pointing {rows[-1]['object']:.3f} "
              f"sensitivity {rows[-1]['object_sensitivity']:.3f} [{seconds:.0f} s]", flush=True)
        if layers:
            depth[target_label(versus)] = pointing_by_depth(layers[0], masks, prefix, grid)
        if method == "gradskip":  # the figure shows the last target's (--zero-shot, else --versus, else the prompt)
            gradskip_maps, figure_target, gradskip_layers = maps, rows[-1]["target"], layers
    removal = {key: object_row(right, scene) for key, right in grounding.items()}
    write(args, rows, skipped, refused, auc, len(scene), figure_target, removal, depth)
    picks = [(s, torch.nonzero(scenes.present[s]).flatten().tolist()[:2]) for s in range(args.n)
             if int(scenes.present[s].sum()) >= 3][:4]
    if gradskip_maps is not None:
        lookup = {(int(s), int(c)): gradskip_maps[i] for i, (s, c) in enumerate(zip(scene, cls))}
        figure(Path(args.out).with_suffix(".png"), scenes.images, scenes.label_maps, picks, lookup, figure_target)
    if gradskip_layers and picks:
        index = {(int(s), int(c)): i for i, (s, c) in enumerate(zip(scene, cls))}
        depth_figure(Path(args.out).with_name(Path(args.out).stem + "_depth.png"), scenes.images, scenes.label_maps,
                     [(s, cs[0], index[(s, cs[0])]) for s, cs in picks], gradskip_layers[0], prefix, grid,
                     figure_target)


def _ci(lo_hi: tuple[float, float]) -> str:
    return f"[{lo_hi[0]:.3f}, {lo_hi[1]:.3f}]"


def write(args: argparse.Namespace, rows: list[dict], skipped: list[str], refused: list[str], auc: float,
          pairs: int, figure_target: str = "prompt", grounding: dict[str, dict] | None = None,
          depth: dict[str, list[float]] | None = None) -> None:
    out = Path(args.out)
    lines = [
        "# Text-prompted localisation on shapes-clip",
        "",
        "Written by `benchmarks/vlm_localisation.py` — rerun with",
        "",
        f"    python benchmarks/vlm_localisation.py --n {args.n} --seed {args.seed}"
        + "".join(f" --versus {shlex.quote(v)}" for v in args.versus)
        + (" --zero-shot" if args.zero_shot else "")
        + (f" --rise-masks {args.rise_masks}" if args.zero_shot and args.rise_masks > 0 else "")
        + (f" --weights {args.weights}" if args.weights else ""),
        "",
        f"The bundled `shapes-clip` (CLIP-style; image tower a timm ViT, see docs/models.md) on {args.n} fresh "
        f"2–4-object scenes (`make_multi_scenes(n={args.n}, seed={args.seed}, min_objects=2, max_objects=4)`, never "
        f"seen in training): for every present object the prompt `\"a <class>\"` is explained "
        f"(`vitlens.TextPrompt`, the model's score `logit_scale.exp() · cosine`): {pairs} (scene, object) pairs. "
        f"On these scenes the model ranks a present class's prompt above an absent one's in {auc:.1%} of "
        "(present, absent) pairs.",
        "",
        "- **pointing**: the map's maximum (64×64 px) lies in the named object's exact visible mask (no tolerance);",
        f"- **pointing ±{args.tolerance:.1f} px**: the same with the original pointing game's tolerance (15 px at "
        f"224 px, scaled to 64 px): a maximum within {args.tolerance:.1f} px of the mask counts;",
        "- **relevance in object**: share of the map's positive relevance inside that mask (mean over pairs);",
        "- **prompt sensitivity**: over ordered pairs (a, b) of different objects of one scene whose map for "
        "`\"a <a>\"` points into a, the share whose map for `\"a <b>\"` points into b (n = such pairs);",
        "- 95% intervals: Wilson for proportions (pairs treated as independent), a scene-resampling percentile "
        "bootstrap (2,000 resamples) for the mean relevance in object.",
        "",
        *([f"- target `prompt − \"{args.versus[0]}\"`: the contrast of the prompt against a prompt that names no "
           "object (`vitlens.TextContrast(\"a <class>\", versus=...)`), which takes out of the score what every "
           "image shares with every prompt (the rows marked so)."] if args.versus else []),
        *([f"- target `{ZERO_SHOT}`: the prompt's softmax probability among the prompts of all "
           f"{len(CLASS_NAMES)} classes (`vitlens.TextProbability(\"a <class>\", among=prompts)`, the same number as "
           "`ZeroShotClassifier` with `ClassProbability`): always positive, so a map's maximum is where the evidence "
           "for the prompt is (a raw score can be negative, and a GradSkip map carries the sign of the score it "
           "explains)."] if args.zero_shot else []),
        *([f"- `rise` (zero-shot probability only): RISE with {args.rise_masks} random masks on the token grid, "
           "the class prompts as classes (`vitlens.ZeroShotClassifier` with `ClassProbability`, the same number): a "
           f"black-box reference that reads the model by {args.rise_masks} forward passes per pair, where the other "
           "methods take one forward and one backward pass."] if args.zero_shot and args.rise_masks > 0 else []),
        "",
        f"| method | target | pointing | 95% CI | pointing ±{args.tolerance:.1f} px | 95% CI | relevance in object | "
        "95% CI | prompt sensitivity | 95% CI | n (sens.) | time (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        *(f"| {r['method']} | {r['target']} | {r['pointing']:.3f} | {_ci(r['pointing_ci'])} | {r['near']:.3f} | "
          f"{_ci(r['near_ci'])} | {r['inside']:.3f} | "
          f"{_ci(r['inside_ci'])} | {r['sensitivity']:.3f} | {_ci(r['sensitivity_ci'])} | {r['sensitivity_n']} | "
          f"{r['seconds']:.0f} |" for r in rows),
        "",
        "**Object level.** *Object pointing*: of the scene's objects, the named one has the highest mean relevance "
        "per pixel (chance: one over the number of objects, about 0.35 here); *object sensitivity*: the prompt "
        "sensitivity of that answer. The rows *model* give **the model's own grounding**, measured without any "
        "map: the share of pairs in which removing the named object exactly "
        "(`make_multi_scene_pairs(..., position=j)`: the scene without it, everything else identical) lowers the "
        "explained target more than removing any other object of the scene (a map painting every object with the "
        "drop its removal causes points there), and the prompt sensitivity of that answer. It is the model's answer "
        "to one question (each object removed alone), a reference rather than a bound: a map that reads the model "
        "under other perturbations can agree with the prompt more often.",
        "",
        "| method | target | object pointing | 95% CI | object sensitivity | 95% CI |",
        "|---|---|---|---|---|---|",
        *(f"| {r['method']} | {r['target']} | {r['object']:.3f} | {_ci(r['object_ci'])} | "
          f"{r['object_sensitivity']:.3f} | {_ci(r['object_sensitivity_ci'])} |" for r in rows),
        *(f"| model (removal) | {target_label(key)} | {r['object']:.3f} | {_ci(r['object_ci'])} | "
          f"{r['object_sensitivity']:.3f} | {_ci(r['object_sensitivity_ci'])} |"
          for key, r in (grounding or {}).items()),
        "",
        *(["**GradSkip by depth.** Pointing game of GradSkip's relevance at the input of each block "
           "(`exp.extras[\"layer_relevance\"]`, patch tokens upsampled as the map is; block 0's input is the map): "
           "where the relevance lies before the early blocks' attention has spread it over the tokens it mixes.",
           "",
           "| target | " + " | ".join(f"block {d}" for d in range(len(next(iter(depth.values()))))) + " |",
           "|---|" + "---|" * len(next(iter(depth.values()))),
           *(f"| {t} | " + " | ".join(f"{v:.3f}" for v in vals) + " |" for t, vals in depth.items()),
           ""] if depth else []),
        f"Targets of issue 52 for GradSkip: pointing ≥ 0.9 and prompt sensitivity ≥ 0.9. Time: wall-clock seconds "
        f"for all {pairs} maps on {args.threads} CPU thread{'s' if args.threads > 1 else ''} of a shared machine "
        "(indicative only).",
        "",
        f"![GradSkip maps for two prompts per scene]({out.with_suffix('.png').name}) (GradSkip, target "
        f"`{figure_target}`; white: the named object's mask, cyan +: the map's maximum)",
        "",
        f"![GradSkip's relevance by depth]({out.stem}_depth.png) (GradSkip, target `{figure_target}`: the relevance on "
        "the patch tokens at the input of each block, last block first; the last column is the map)",
        "",
        f"Software: torch {torch.__version__}, python {platform.python_version()}; "
        f"{'methods not registered, skipped: ' + ', '.join(skipped) if skipped else 'every listed method is registered'}.",
        *([f"Refused the text target (no row): {'; '.join(refused)}."] if refused else []),
        "",
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines), encoding="utf-8")
    csv_path = Path(args.csv)
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    with csv_path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["method", "target", "pairs", "pointing", "pointing_lo", "pointing_hi", "pointing_near",
                    "pointing_near_lo", "pointing_near_hi", "inside", "inside_lo", "inside_hi",
                    "sensitivity", "sensitivity_lo", "sensitivity_hi", "sensitivity_n", "seconds", "object_pointing",
                    "object_pointing_lo", "object_pointing_hi", "object_sensitivity", "object_sensitivity_lo",
                    "object_sensitivity_hi"])
        for r in rows:
            w.writerow([r["method"], r["target"], r["pairs"], r["pointing"], *r["pointing_ci"], r["near"], *r["near_ci"],
                        r["inside"], *r["inside_ci"],
                        r["sensitivity"], *r["sensitivity_ci"], r["sensitivity_n"], round(r["seconds"], 1),
                        r["object"], *r["object_ci"], r["object_sensitivity"], *r["object_sensitivity_ci"]])
    print(f"wrote {out} and {csv_path}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=200, help="scenes (default 200)")
    p.add_argument("--seed", type=int, default=30_000, help="data seed of the scenes (default 30000)")
    p.add_argument("--methods", nargs="+", default=METHODS, help="methods (unregistered ones are skipped and named)")
    p.add_argument("--versus", action="append", default=[], metavar="TEXT",
                   help="also explain each prompt's contrast against this prompt (e.g. \"a picture\")")
    p.add_argument("--zero-shot", action="store_true",
                   help="also explain each prompt's zero-shot probability among the class prompts")
    p.add_argument("--tolerance", type=float, default=15 * 64 / 224,
                   help="pixels of the second pointing column (default: the original 15 px at 224 px, scaled to 64)")
    p.add_argument("--rise-masks", type=int, default=0, metavar="N",
                   help="with --zero-shot, also RISE with N masks on the token grid, the class prompts as classes "
                        "(a black-box reference: N forward passes per pair; default 0: not run)")
    p.add_argument("--chunk", type=int, default=64, help="pairs per explain call (memory knob)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--csv", default=str(ROOT / "benchmarks" / "results" / "vlm_localisation.csv"))
    p.add_argument("--weights", default=None, help="shapes-clip weights to use instead of the bundled ones")
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "vlm_localisation.md"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
