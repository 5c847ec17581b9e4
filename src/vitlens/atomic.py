"""Atomic file writes: a result, model, picture or checkpoint is either complete on disk or not there at all.

Each writer writes to a temporary file in the same folder (same filesystem, so the final ``os.replace`` is atomic),
then renames it over the target; on any failure (full disk, read-only folder, an exception, Ctrl-C) the temporary
is removed and the previous file, if any, is left untouched. The temporary keeps the target's extension (``np.save``
and PIL choose the format by it) and starts with a dot, so globs such as ``rank-*.sqlite`` never see it.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Iterator

from .pause import pause_point

__all__ = ["atomic_path", "write_text", "write_bytes", "save_torch", "temp_name", "write_failure"]


def temp_name(path: str | os.PathLike) -> Path:
    """The temporary used for ``path``: ``dir/.<stem>.tmp-<pid><suffix>``."""
    p = Path(path)
    return p.with_name(f".{p.stem}.tmp-{os.getpid()}{p.suffix}")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path to write; on success it replaces ``path``, on failure it is removed.

    >>> with atomic_path("out/x.png") as tmp:   # doctest: +SKIP
    ...     image.save(tmp)
    """
    target = Path(path)
    tmp = temp_name(target)
    try:
        yield tmp
        if not tmp.exists():
            raise FileNotFoundError(f"nothing was written to the temporary file for {target}")
        pause_point(f"write.{target.name}")
        os.replace(tmp, target)
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(e, OSError) and e.errno is not None and e.filename in (str(tmp), tmp, None):
            raise type(e)(e.errno, e.strerror, str(target)) from None  # name the file the user asked for
        raise


def write_text(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> Path:
    """``Path.write_text``, atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding=encoding)
    return Path(path)


def write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """``Path.write_bytes``, atomically."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def save_torch(obj: Any, path: str | os.PathLike) -> Path:
    """``torch.save``, atomically (a killed or failed save never leaves a truncated checkpoint)."""
    import errno

    import torch

    try:
        with atomic_path(path) as tmp:
            torch.save(obj, tmp)
    except RuntimeError as e:
        # torch's zip writer reports a full disk as "PytorchStreamWriter failed writing file ..." or, when the write
        # comes up short, "[enforce fail at inline_container.cc:…] . unexpected pos 576 vs 534"
        text = str(e)
        if not any(s in text for s in ("PytorchStreamWriter", "inline_container", "unexpected pos", "write")):
            raise
        raise write_failure(path, text) from None
    return Path(path)


def write_failure(path: str | os.PathLike, detail: str) -> OSError:
    """The :class:`OSError` for a write of ``path`` that a library reported in its own words (``detail``): it names
    the file and the disk, and says when that disk is (nearly) full (``ENOSPC``), else ``EIO``."""
    import errno
    import shutil

    folder = Path(path).parent
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        free = None
    why = " ".join((detail.splitlines() or ["write failed"])[0].split())[:120]
    if free is not None and free < 1 << 20:
        return OSError(errno.ENOSPC, f"disk full: {free:,} bytes free on the disk holding {folder}; free space or "
                                     f"choose another folder ({why})", str(path))
    room = "" if free is None else f", {free:,} bytes free now"
    return OSError(errno.EIO, f"write failed (disk full? the disk holding {folder}{room}) ({why})", str(path))
