"""Colour bars that tell the truth, and text that wraps between phrases (used by :mod:`vitlens.viz.figures`).

A bar is in the map's values, in one number format (a shared power of ten in its label where needed), with arrows
at an end the scale clipped; :func:`clip_note` says in words what was clipped (the percentile the scale ends at, the
map's true range) or hidden (values below 0 on a scale from 0).
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping, Sequence
from typing import Any

from matplotlib.cm import ScalarMappable
from matplotlib.colors import Colormap, Normalize
from matplotlib.figure import Figure

from ..targets_text import TEXT_KINDS
from .pixels import Scale

__all__ = ["colorbar_label", "target_phrase", "tick_labels", "clip_note", "wrap_phrases", "add_colorbar", "bar_label"]

_NB = "\u00a0"  # no-break space: "p = 0.93" is never split at a line end


def _kind_units(units: str, value_kind: str | None) -> str:
    """The default units word (``'relevance'``) for what a method's values are."""
    if units != "relevance":
        return units
    return {"probability": "class probability (mean over masks)", "score": "score",
            "nonnegative": "relevance"}.get(str(value_kind), units)


#: what a signed map's colours are for and against when the target is a class
CLASS_TARGET = "the class"



def _quoted(text: Any) -> str:
    return f"\u201c{text}\u201d"


def target_phrase(target: Mapping[str, Any] | None = None, prompt: int = 0, row: int = 0) -> str:
    """What a map explains, in words, for a colour bar or a caption: ``'the class'`` for a class target; for a text
    target the prompt in quotes (``'“a ring”'``), a contrast ``'“a ring” over “a disk”'`` (``'over 0.5·“a disk”'``
    when its gamma is not 1), a zero-shot probability ``'P(“a ring”) among 3 prompts'``, precomputed text embeddings
    ``'the text embedding'``.

    Args:
        target: the target's description (:attr:`vitlens.Explanation.target`, ``Target.describe()``); ``None`` or
            a class target's: the class.
        prompt: the index of the image's prompt in ``target['prompts']`` (the explanation's ``targets[j]``).
        row: the image's row in the explanation (for a contrast with one ``versus`` prompt per image).
    """
    kind = (target or {}).get("kind")
    if kind not in TEXT_KINDS or target is None:
        return CLASS_TARGET
    prompts = target.get("prompts") or []
    if kind == "TextEmbedding" or not 0 <= int(prompt) < len(prompts):
        return "the text embedding"
    text = _quoted(prompts[int(prompt)])
    versus = target.get("versus")
    if kind == "TextContrast" and versus is not None:
        other = versus[row] if isinstance(versus, (list, tuple)) and 0 <= row < len(versus) else versus
        gamma = float(target.get("gamma", 1.0))
        text += f" over {'' if gamma == 1.0 else f'{gamma:g}·'}{_quoted(other)}"
    if kind == "TextProbability":
        text = f"P({text}) among {len(target.get('among') or prompts)} prompts"
    return text


def colorbar_label(mode: str, units: str = "relevance", value_kind: str | None = None,
                   target: str | None = None) -> str:
    """What the colours mean, in words, for a scaling mode (see :func:`vitlens.viz.scale_map`) and, when known,
    what the method's values are (:data:`vitlens.explainers.VALUE_KINDS`). ``target``: what a signed map is for and
    against (:func:`target_phrase`, e.g. ``'“a ring”'``); ``None``: the class."""
    units = _kind_units(units, value_kind)
    if mode == "signed":
        return f"{units}: blue against {target or CLASS_TARGET}, red for it, white = 0"
    if mode == "positive":
        return f"{units} (≥ 0): 0 to highest"
    if mode == "abs":
        return f"|{units}|, sign ignored"
    if mode == "minmax":
        return f"{units}: lowest to highest"
    return units


_SUPERSCRIPT = str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹")


def tick_labels(values: Sequence[float], signed: bool = False) -> tuple[list[str], str]:
    """One number format for all ticks of a bar: ``(labels, factor)``. Values between 1e-3 and 1e4 get fixed
    decimals (three significant digits of the largest); others are written as mantissas of one shared power of ten,
    returned as ``factor`` (``'×10⁻⁴'``) for the bar's label. ``signed``: positive ticks get a ``+``."""
    vals = [float(v) for v in values]
    big = max((abs(v) for v in vals), default=0.0)
    factor = ""
    if big > 0 and not 1e-3 <= big < 1e4:
        exp = int(math.floor(math.log10(big)))
        vals = [v / 10.0 ** exp for v in vals]
        big /= 10.0 ** exp
        factor = "×10" + str(exp).translate(_SUPERSCRIPT)
    decimals = 0 if big == 0 else max(0, 2 - int(math.floor(math.log10(big))))
    out = []
    for v in vals:
        text = f"{abs(v):.{decimals}f}"
        if float(text) == 0.0:
            out.append("0")
            continue
        out.append(("−" if v < 0 else "+" if signed else "") + text)
    return out, factor


def _num(v: float) -> str:
    return f"{v:.3g}".replace("-", "−")


def clip_note(scale: Scale, units: str = "relevance", relative: bool = False, below_zero: bool = False,
              clipped: tuple[bool, bool] | None = None) -> str:
    """What a colour bar cut or hides, in words (empty when nothing): the percentile the scale ends at when values
    lie beyond it (drawn in the end colours, the bar's arrows), and values below 0 on a scale from 0.
    ``relative``: the bar stands for several maps, each scaled on its own (``below_zero``: one of them has
    values < 0)."""
    low, high = scale.clipped() if clipped is None else clipped
    notes = []
    if (low or high) and scale.clip is not None:
        what = f"|{units}|" if scale.mode in ("signed", "abs") else units
        if relative:
            notes.append(f"ends at its {scale.clip:g}th percentile (arrows: beyond)")
        else:
            (lo, hi), factor = tick_labels([scale.data_min, scale.data_max])
            rng = f"{lo} to {hi}" + (f" {factor}" if factor else "")
            notes.append(f"scale ends at the {scale.clip:g}th percentile of {what} (values {rng}; beyond: arrows)")
    if scale.mode == "positive" and (below_zero or scale.data_min < 0):
        notes.append("values below 0 drawn as 0" + ("" if relative else f" (min {_num(scale.data_min)})"))
    elif scale.mode == "minmax" and relative and below_zero:  # the bar's words would hide the sign
        notes.append("some values below 0 (at the low end)")
    return "; ".join(notes)


def wrap_phrases(text: str, width: int) -> str:
    """Wrap ``text`` into lines of at most ``width`` characters, breaking between phrases (after ``,``/``;``,
    before ``—`` or an opening parenthesis, outside parentheses) rather than inside one; a phrase longer than a line
    is wrapped at spaces. No-break spaces are kept together."""
    phrases, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch == "("
        if ch == ")":
            depth = max(0, depth - 1)
        nxt = text[i + 1:i + 2]
        cut_after = depth == 0 and ch in ",;" and nxt == " "
        cut_before = nxt == " " and (text[i + 2:i + 3] in ("—", "(") and (depth == 0 or text[i + 2] == "("))
        if cut_after or cut_before:
            phrases.append(text[start:i + 1])
            start = i + 2
    phrases.append(text[start:])
    lines: list[str] = []
    for phrase in (p for p in phrases if p):
        if lines and len(lines[-1]) + 1 + len(phrase) <= width:
            lines[-1] += " " + phrase
        elif len(phrase) <= width:
            lines.append(phrase)
        else:
            lines += textwrap.wrap(phrase, width, break_long_words=False, break_on_hyphens=False)
    return "\n".join(lines)


def _bar_ticks(scale: Scale) -> tuple[list[float], list[str], str]:
    """Tick positions (map values), their labels in one format, and the shared power of ten."""
    if scale.mode == "signed":
        ticks = [-scale.vmax, -scale.vmax / 2, 0.0, scale.vmax / 2, scale.vmax]
    elif scale.mode in ("positive", "abs"):
        ticks = [0.0, scale.vmax / 2, scale.vmax]
    else:
        ticks = [scale.vmin, (scale.vmin + scale.vmax) / 2, scale.vmax]
    labels, factor = tick_labels(ticks, signed=scale.mode == "signed")
    return ticks, labels, factor


def add_colorbar(fig: Figure, axes: Any, cmap: Colormap, scale: Scale, units: str, relative: bool,
                  location: str = "right", fontsize: float = 8, wrap: int = 34, value_kind: str | None = None,
                  low: bool | None = None, high: bool | None = None, below_zero: bool = False,
                  with_note: bool = True, target: str | None = None) -> str:
    """A colour bar beside ``axes`` (``location='right'``) or drawn into the axes ``axes`` (``'bottom'``; ``'side'``:
    vertical, into ``axes``). Absolute bars are in map values; ``relative`` ones (several maps, each on its own
    scale) in words. Arrows mark a clipped end (``low``/``high``, default: from ``scale``); what was clipped
    (:func:`clip_note`) goes into the bar's label with ``with_note``, and is returned either way. ``target``: what
    the map explains (:func:`target_phrase`; ``None``: the class)."""
    clipped = scale.clipped()
    low = clipped[0] if low is None else low
    high = clipped[1] if high is None else high
    extend = {(False, False): "neither", (True, False): "min", (False, True): "max", (True, True): "both"}[(low, high)]
    flat = not scale.vmax > scale.vmin
    if relative or flat:
        norm = Normalize(0.0, 1.0)
        if scale.mode == "signed":
            ticks, labels = [0.0, 0.5, 1.0], ["−max", "0", "+max"]
        elif flat and not relative:
            ticks, labels = [0.5], tick_labels([scale.vmax])[0]
        else:
            ticks, labels = [0.0, 1.0], ["0" if scale.mode in ("abs", "positive") else "min", "max"]
        factor = ""
    else:
        norm = Normalize(scale.vmin, scale.vmax)
        ticks, labels, factor = _bar_ticks(scale)
    mappable = ScalarMappable(norm=norm, cmap=cmap)
    if location == "right":
        bar = fig.colorbar(mappable, ax=axes, location="right", fraction=0.05, aspect=25, extend=extend)
    else:
        bar = fig.colorbar(mappable, cax=axes, orientation="horizontal" if location == "bottom" else "vertical",
                           extend=extend)
    bar.set_ticks(ticks, labels=labels, fontsize=fontsize - 1)
    if location in ("right", "side"):  # wrap to the bar's height so the label is never cut
        wrap = max(20, int(fig.get_figheight() * (12 if location == "right" else 9)))
    label, note = bar_label(scale, units, relative, value_kind, (low, high), below_zero, with_note, wrap, factor,
                            target)
    bar.set_label(label, fontsize=fontsize)
    return note


def bar_label(scale: Scale, units: str, relative: bool, value_kind: str | None, clipped: tuple[bool, bool],
              below_zero: bool = False, with_note: bool = True, wrap: int = 34, factor: str = "",
              target: str | None = None) -> tuple[str, str]:
    """A colour bar's label wrapped between phrases, and the note on what it clipped (:func:`clip_note`);
    ``target``: what the map explains (:func:`target_phrase`; ``None``: the class)."""
    label = colorbar_label(scale.mode, units, value_kind, target) + (f" ({factor})" if factor else "")
    if relative:
        label += "; each map on its own scale"
    note = clip_note(scale, _kind_units(units, value_kind), relative, below_zero, clipped)
    if note and with_note:
        label += "; " + note
    return wrap_phrases(label, wrap), note


