"""Class names of a model, and matching the folder names of one's own labelled images to them.

``espresso/`` and ``tiger_cat/`` must become the model's classes 967 and 282, not 0 and 1. :func:`match_folders`
matches each folder name to the model's class names — bundled names, ``pretrained_cfg["label_names"]``, HuggingFace
``config.id2label``, or for 1000-class models the ImageNet-1k names (every comma-separated synonym, e.g.
``"tabby, tabby cat"``) and WordNet ids (``n02123159``) — ignoring case, ``_``, ``-`` and spaces. A class map file
(``--class-map FILE``) says it explicitly; what cannot be matched is a one-line error naming the folder.
"""

from __future__ import annotations

import difflib
import json
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import InputError

__all__ = ["model_class_names", "match_folders", "read_class_map"]


def _num_classes(model: Any) -> int | None:
    for attr in ("num_classes",):
        n = getattr(model, attr, None)
        if isinstance(n, int):
            return n
    config = getattr(model, "config", None)
    n = getattr(config, "num_labels", None)
    return n if isinstance(n, int) else None


def model_class_names(model: Any) -> list[str] | None:
    """The model's output class names in logit order, or ``None`` when it has none.

    From ``pretrained_cfg["label_names"]``, else HuggingFace ``config.id2label`` (unless generic ``LABEL_k``), else,
    for 1000-class models, the ImageNet-1k names (timm's bundled metadata; no download).
    """
    cfg = getattr(model, "pretrained_cfg", None) or {}
    names = cfg.get("label_names") if isinstance(cfg, dict) else None
    if names:
        return [str(n) for n in names]
    id2label = getattr(getattr(model, "config", None), "id2label", None)
    if id2label:
        labels = [str(id2label[i]) for i in sorted(id2label, key=int)]
        if not all(re.fullmatch(r"LABEL_\d+", s) for s in labels):
            return labels
    if _num_classes(model) == 1000:
        try:
            from ..models.efficientnet import imagenet_class_names

            return imagenet_class_names()
        except ImportError:  # timm missing
            return None
    return None


def _imagenet_wnids(model: Any, count: int) -> list[str] | None:
    if count != 1000:
        return None
    try:
        from timm.data import ImageNetInfo
    except ImportError:
        return None
    info = ImageNetInfo("imagenet-1k")
    return [info.index_to_label_name(i) for i in range(1000)]


def _key(text: str) -> str:
    return re.sub(r"[\s_\-]+", " ", str(text).strip().lower())


def _aliases(names: Sequence[str], wnids: Sequence[str] | None) -> dict[str, set[int]]:
    """Normalised alias → the class indices it names (more than one: ambiguous, e.g. ImageNet's two 'crane's)."""
    table: dict[str, set[int]] = {}
    for i, name in enumerate(names):
        for alias in {name, *name.split(",")}:
            if alias.strip():
                table.setdefault(_key(alias), set()).add(i)
        table.setdefault(_key(str(i)), set()).add(i)
    for i, wnid in enumerate(wnids or []):
        table.setdefault(_key(wnid), set()).add(i)
    return table


def read_class_map(path: str | Path) -> dict[str, str | int]:
    """A class map file: JSON ``{"folder": class}`` or lines ``folder: class`` / ``folder = class`` (``#`` comments).
    A class is a class index or a class name."""
    from ..files import read_text_file

    p = Path(path)
    if not p.exists():
        raise InputError(f"class map file '{p}' not found")
    text = read_text_file(p, f"class map '{p}'", max_bytes=4 << 20)  # a regular UTF-8 text file, or one line
    if p.suffix.lower() == ".json" or text.lstrip().startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InputError(f"class map '{p}' is not valid JSON: {exc.msg} (line {exc.lineno})") from None
        if not isinstance(data, dict):
            raise InputError(f"class map '{p}' must be a JSON object {{\"folder\": class}}")
        return {str(k): v for k, v in data.items()}
    out: dict[str, str | int] = {}
    for n, line in enumerate(text.splitlines(), start=1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        folder, sep, cls = (line.partition(":") if ":" in line else line.partition("="))
        if not sep or not folder.strip() or not cls.strip():
            raise InputError(f"class map '{p}' line {n}: expected 'folder: class', got {line!r}")
        value = cls.strip()
        out[folder.strip()] = int(value) if value.isdigit() else value
    return out


def _resolve(folder: str, wanted: str | int, table: dict[str, set[int]], count: int | None, names: Any) -> int:
    if isinstance(wanted, int) or (isinstance(wanted, str) and wanted.strip().isdigit()):
        k = int(wanted)
        if count is not None and not 0 <= k < count:
            raise InputError(f"class map: folder '{folder}' -> class {k}, but the model has {count} classes")
        return k
    if not names:
        raise InputError(f"class map: folder '{folder}' -> {wanted!r}, but the model has no class names; "
                         "use class indices")
    hits = table.get(_key(str(wanted)), set())
    if len(hits) == 1:
        return next(iter(hits))
    if hits:
        raise InputError(f"class map: {wanted!r} names {len(hits)} classes ({', '.join(map(str, sorted(hits)))}); "
                         "use the class index")
    close = difflib.get_close_matches(_key(str(wanted)), list(table), n=3)
    raise InputError(f"class map: folder '{folder}' -> {wanted!r} is not a class of the model"
                     + (f" (close: {', '.join(close)})" if close else ""))


def match_folders(folders: Sequence[str], model: Any, class_map: Mapping[str, str | int] | str | Path | None = None
                  ) -> dict[str, int]:
    """Folder name → the model's class index.

    Args:
        folders: class folder names (e.g. ``['espresso', 'tiger_cat']``).
        model: the model whose classes the labels refer to.
        class_map: explicit ``folder → class`` (index or name), or the path of a class map file
            (:func:`read_class_map`); folders it does not list are matched by name.

    Raises:
        InputError: a folder matches no class, or several (one line, naming the folder, the closest class names and
            the ``--class-map`` way out).
    """
    names = model_class_names(model)
    count = len(names) if names else _num_classes(model)
    table = _aliases(names or [], _imagenet_wnids(model, len(names or [])))
    explicit = read_class_map(class_map) if isinstance(class_map, (str, Path)) else dict(class_map or {})
    unknown = sorted(set(explicit) - set(folders))
    if unknown:
        raise InputError(f"class map names folder(s) {', '.join(unknown)} that are not in the image folder")
    if not names and not explicit:
        if all(f.isdigit() for f in folders):
            return {f: _resolve(f, f, table, count, names) for f in folders}
        order = sorted(folders)
        print(f"vitlens: note: the model has no class names; class folders are numbered in sorted order "
              f"({', '.join(f'{f}={k}' for k, f in enumerate(order[:4]))}{', ...' if len(order) > 4 else ''}); "
              "pass a class map to say otherwise", file=sys.stderr)
        return {f: k for k, f in enumerate(order)}
    out: dict[str, int] = {}
    for folder in folders:
        if folder in explicit:
            out[folder] = _resolve(folder, explicit[folder], table, count, names)
            continue
        hits = table.get(_key(folder), set()) if names else set()
        if len(hits) == 1:
            out[folder] = next(iter(hits))
        elif hits:
            raise InputError(f"folder '{folder}' names {len(hits)} of the model's classes "
                             f"({', '.join(str(h) for h in sorted(hits))}); say which with --class-map FILE")
        else:
            close = difflib.get_close_matches(_key(folder), [k for k in table if not k.isdigit()], n=3)
            raise InputError(
                f"folder '{folder}' matches none of the model's {count} class names"
                + (f" (closest: {', '.join(repr(c) for c in close)})" if close else "")
                + "; rename it or map it with --class-map FILE ('folder: class' per line)")
    return out
