"""Reading files that strangers may have written: only regular files, and nothing in them runs as code.

Every file vitlens reads from a user's path or a run folder (pictures, class maps, checkpoints, caches, stored maps)
is opened here or checked with :func:`check_regular`:

* **Only regular files.** A FIFO (named pipe), socket or device would block the reader forever or never end; it is
  refused with one line naming what it is. :func:`open_regular` opens with ``O_NONBLOCK`` and checks the open file
  itself (``fstat``), so a file swapped for a pipe between the check and the open is refused too.
* **No unpickling.** :func:`load_torch_plain` reads ``torch.save`` files with ``torch.load(weights_only=True)``:
  tensors and plain containers (dict, list, tuple, str, numbers, None) only. A pickle that names any other object
  (``os.system``, a class) is refused before anything in it runs. NumPy arrays are allowed only where a caller passes
  ``numpy_arrays=True`` (checkpoints written before vitlens stored its NumPy random state as a tensor): they are
  rebuilt by NumPy's own array constructor, which runs no code from the file.
* **Text is bounded and decoded strictly** (:func:`read_text_file`): a binary or huge file is one line.
"""

from __future__ import annotations

import io
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO

from .errors import DamagedFileError, InputError, VitlensError

__all__ = ["check_regular", "code_refusal", "file_kind", "load_torch_plain", "open_regular", "read_text_file",
           "regular_files"]


def file_kind(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` is, in words (``'a FIFO (named pipe)'``, ``'a directory'``, ...)."""
    for test, words in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"),
                        (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
                        (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return words
    return "not a regular file"


def regular_files(found: list[Path], folder: str | os.PathLike) -> tuple[list[Path], str | None]:
    """``found`` (entries listed under ``folder``) without those that are not regular files (FIFOs, sockets, devices:
    opening one would block), and one line naming what was skipped (``None`` when nothing was)."""
    odd = [p for p in found if p.exists() and not p.is_file()]
    if not odd:
        return found, None
    n = len(odd)
    line = (f"skipped {n} entr{'y' if n == 1 else 'ies'} of folder '{folder}' that {'is' if n == 1 else 'are'} "
            f"not a regular file ('{odd[0]}'{', …' if n > 1 else ''})")
    return [p for p in found if p not in odd], line


def check_regular(path: str | os.PathLike, label: str, error: type[VitlensError] = InputError) -> Path:
    """``path`` if it is a regular file (or a link to one); else ``error`` saying what it is instead."""
    p = Path(path)
    try:
        mode = os.stat(p).st_mode
    except FileNotFoundError:
        raise error(f"{label}: no such file") from None
    except OSError as e:
        raise error(f"{label}: cannot read it ({e.strerror or e})") from None
    if not stat.S_ISREG(mode):
        raise error(f"{label} is {file_kind(mode)}, not a regular file; vitlens reads only regular files")
    return p


def open_regular(path: str | os.PathLike, label: str, error: type[VitlensError] = InputError) -> BinaryIO:
    """Open ``path`` for binary reading if it is a regular file; a FIFO, socket or device is ``error`` at once
    (opened without blocking, then checked with ``fstat``)."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise error(f"{label}: no such file") from None
    except IsADirectoryError:
        raise error(f"{label} is a directory, not a regular file") from None
    except OSError as e:  # a socket (ENXIO), permission denied, ...
        kind = ""
        try:
            kind = f" ({file_kind(os.stat(path).st_mode)})"
        except OSError:
            pass
        raise error(f"{label}: cannot open it{kind}: {e.strerror or e}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise error(f"{label} is {file_kind(mode)}, not a regular file; vitlens reads only regular files")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_text_file(path: str | os.PathLike, label: str, max_bytes: int = 16 << 20,
                   error: type[VitlensError] = InputError) -> str:
    """A regular UTF-8 text file of at most ``max_bytes``; a binary, oversized or non-regular file is ``error``."""
    with open_regular(path, label, error) as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise error(f"{label} is larger than {max_bytes >> 20} MiB; it is not a text file of this kind")
    if b"\x00" in data:
        raise error(f"{label} is a binary file, not UTF-8 text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{label} is not UTF-8 text (byte {e.start} cannot be decoded)") from None


def code_refusal(exc: BaseException) -> str | None:
    """For an error of ``torch.load(weights_only=True)``: the object the file asked to build (``'posix.system'``)
    when it was refused because that is not a tensor or a plain value, else ``None`` (the file is damaged)."""
    import re

    m = re.search(r"GLOBAL\s+([\w.]+)", str(exc))
    return m.group(1) if m and "weights_only" in str(exc) or m and "Weights only" in str(exc) else None


def _why(exc: BaseException) -> str:
    """One short line on why a file could not be read (for ``weights_only`` failures, the line with the reason)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()] or [type(exc).__name__]
    reason = next((ln for ln in lines if ln.startswith(("Unsupported", "Trying to load"))), lines[0])
    return f"{type(exc).__name__}: {reason[:120]}"


def load_torch_plain(path: str | os.PathLike, label: str, numpy_arrays: bool = False) -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU: tensors and plain containers only. Any failure is a
    one-line :class:`DamagedFileError` naming ``label``: a file that asks for code (a class, a function) says so and
    that nothing of it ran; a truncated or foreign file says it is damaged."""
    import torch

    with open_regular(path, label, DamagedFileError) as f:
        data = io.BytesIO(f.read())
    try:
        if numpy_arrays:
            with torch.serialization.safe_globals(_numpy_array_globals()):
                return torch.load(data, map_location="cpu", weights_only=True)
        return torch.load(data, map_location="cpu", weights_only=True)
    except (Exception, MemoryError) as e:  # UnpicklingError, EOFError, RuntimeError (zip), ...
        asked = code_refusal(e)
        if asked is not None:
            raise DamagedFileError(
                f"{label} was refused: it asks to build {asked}, and vitlens loads only tensors and plain values "
                "from a file (nothing of it was run); delete it, or rerun with --overwrite") from None
        raise DamagedFileError(f"{label} is damaged ({_why(e)}); delete it, or rerun with --overwrite") from None


def _numpy_array_globals() -> list[Any]:
    """What a pickled ``numpy.ndarray`` of numbers names: NumPy's array rebuilder, the array and dtype classes."""
    import importlib

    import numpy as np

    try:
        multiarray = importlib.import_module("numpy._core.multiarray")
    except ImportError:  # pragma: no cover - NumPy 1.x
        multiarray = importlib.import_module("numpy.core.multiarray")
    kinds = [type(np.dtype(t)) for t in ("uint8", "uint32", "int32", "int64", "float32", "float64", "bool")]
    return [multiarray._reconstruct, np.ndarray, np.dtype, *kinds]
