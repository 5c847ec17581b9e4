"""What ``vitlens explain`` explains: ``--target`` once, or one text target per ``--text`` prompt (its score, its
score against ``--versus``, or with ``--probability`` its zero-shot probability among all the ``--text`` prompts), each
with the output names it writes. The usage mistakes of these options are one-line :class:`vitlens.InputError`\\ s,
found before the model loads."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["prompt_runs", "safe_stem"]


def safe_stem(label: str) -> str:
    """``label`` as a part of a file name: letters, digits and ``-_=`` kept, everything else ``_``."""
    return "".join(c if c.isalnum() or c in "-_=" else "_" for c in label).strip("_")


def _check(args: argparse.Namespace, texts: list[str]) -> None:
    """One-line errors for the text options that contradict each other (before anything loads)."""
    from vitlens.errors import InputError

    versus = getattr(args, "versus", None)
    probability = bool(getattr(args, "probability", False))
    if not texts:
        if versus is not None:
            raise InputError("--versus needs --text: it is the prompt each --text prompt is contrasted with")
        if probability:
            raise InputError("--probability needs at least two --text prompts: it is each prompt's probability "
                             "among them")
        return
    if args.target is not None:
        raise InputError("--target and --text both given: a class index or text prompts, not both")
    if any(not t.strip() for t in texts) or len(set(texts)) != len(texts):
        raise InputError("--text: give each prompt once, and none empty")
    if probability and versus is not None:
        raise InputError("--probability and --versus both given: explain each prompt's probability among the --text "
                         "prompts, or its score against --versus, not both")
    if probability and len(texts) < 2:
        raise InputError(f"--probability needs at least two --text prompts (got 1, {texts[0]!r}): the probability "
                         "of one prompt among itself is always 1")
    if versus is not None and (not versus.strip() or versus in texts):
        raise InputError(f"--versus {versus!r}: give a non-empty prompt that is not one of the --text prompts")


def prompt_runs(args: argparse.Namespace, bases: list[str]) -> list[tuple[Any, list[str]]]:
    """``[(target, output bases)]``: ``--target`` once, or per ``--text`` prompt a :class:`vitlens.TextPrompt`
    (with ``--versus`` a :class:`vitlens.TextContrast`, with ``--probability`` a :class:`vitlens.TextProbability`
    among all the ``--text`` prompts) with the prompt in the file names (``cat.a_photo_of_a_dog.gradskip.png``)."""
    texts = list(args.text)
    _check(args, texts)
    if not texts:
        return [(args.target, bases)]
    import vitlens

    versus = getattr(args, "versus", None)
    probability = bool(getattr(args, "probability", False))
    runs, stems = [], set()
    for i, text in enumerate(texts):
        stem = safe_stem(text)[:48] or f"prompt{i + 1}"
        stem = stem if stem.casefold() not in stems else f"{stem}-{i + 1}"
        stems.add(stem.casefold())
        if probability:
            target: Any = vitlens.TextProbability(text, among=texts)
        elif versus is not None:
            target = vitlens.TextContrast(text, versus=versus)
        else:
            target = vitlens.TextPrompt(text)
        runs.append((target, [f"{b}.{stem}" for b in bases]))
    return runs
