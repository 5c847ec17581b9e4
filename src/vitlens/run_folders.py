"""Run folders that are never silently replaced, and checkpoints that are read back or named as damaged.

Used by ``train-aha`` (:mod:`vitlens.aha.train`): a folder that holds an earlier run is continued (``resume``) or
replaced (``overwrite``) only when asked; a checkpoint that cannot be read is one error naming the file.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from .errors import DamagedFileError, InputError

__all__ = ["guard_run_folder", "load_checkpoint", "optimizer_at_step", "folder_lock", "LOCK_NAME"]


def guard_run_folder(out: Path, checkpoint: Path, outputs: Sequence[Path], resume: bool, overwrite: bool) -> None:
    """Refuse to replace the run in ``out`` (its ``checkpoint`` and ``outputs``) unless resuming or overwriting.

    ``resume`` needs the checkpoint (resuming without one would retrain and replace finished outputs);
    ``overwrite`` deletes the earlier run's files (only those) so that nothing of it is mixed into the new one.
    """
    if resume and overwrite:
        raise InputError("--resume continues the run in --out and --overwrite replaces it: pass one of them")
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} is a file, not a folder")
    mine = [checkpoint, *outputs]
    for p in mine:  # a pipe or device in place of a run file would block the reader or be silently replaced
        if p.exists() and not p.is_file():
            from .files import check_regular

            check_regular(p, f"{p} (a file of the run in --out)")
    found = [p.name for p in mine if p.exists()]
    if resume and not found:
        raise InputError(f"--resume: {out} has no {checkpoint.name} to continue; drop --resume to start a new run")
    if not found or (resume and checkpoint.exists()):
        return
    if not overwrite:
        if resume:
            raise InputError(f"--resume: {out} has no {checkpoint.name} to continue (it holds {', '.join(found)}); "
                             "pass --overwrite to train a new run there")
        raise InputError(f"{out} already holds a run ({', '.join(found)}); pass --resume to continue it, or "
                         "--overwrite to replace it")
    for p in mine:
        p.unlink(missing_ok=True)


def load_checkpoint(path: Path, keys: Iterable[str]) -> dict[str, Any]:
    """A checkpoint that must hold ``keys``, read without unpickling (:func:`vitlens.files.load_torch_plain`:
    tensors and plain values; the NumPy random state of checkpoints written before it was stored as a tensor). A
    truncated, garbled or foreign file, or one that asks to build any other object (a planted pickle: nothing of it
    runs), is a one-line :class:`DamagedFileError` naming it."""
    from .files import load_torch_plain

    label = f"checkpoint {path}"
    ck = load_torch_plain(path, label, numpy_arrays=True)
    missing = sorted(set(keys) - set(ck)) if isinstance(ck, dict) else ["(not a dict)"]
    if missing:
        raise DamagedFileError(f"{label} is damaged (not a checkpoint of this kind: no {', '.join(missing)}); "
                               "delete it to restart, or rerun with --overwrite")
    return ck


def optimizer_at_step(opt: Any, sched: Any, history: Sequence[Any], step: int) -> bool:
    """Whether optimiser, LR scheduler and history all stand at ``step``: a checkpoint taken now is a whole step
    (an interrupt inside a step, between ``opt.step()`` and the bookkeeping, is not)."""
    counts = {int(st["step"]) for st in opt.state.values() if "step" in st}
    return counts <= {step} and int(sched.last_epoch) == step and len(history) == step


LOCK_NAME = ".vitlens.lock"


def _alive(pid: int) -> bool:
    import os

    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a process of another user holds it
        return True
    return True


@contextlib.contextmanager
def folder_lock(out: Path, command: str) -> Iterator[Path]:
    """Hold ``out/.vitlens.lock`` (holding the process id) while ``command`` writes into ``out``: a second run into
    the same folder while the first is alive is refused with one line naming the lock and its process; a lock left
    by a process that no longer runs (killed) is taken over. The lock is removed when the block ends (and ``out``
    too if this call created it and nothing was written)."""
    import os

    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} is a file, not a folder")
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    lock = out / LOCK_NAME
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                pid = int(lock.read_text().split()[0])
            except (OSError, ValueError, IndexError):
                pid = -1
            if _alive(pid):
                raise InputError(f"{out} is in use by another {command} run (process {pid}, lock {lock}); wait for "
                                 "it to finish or choose another --out") from None
            lock.unlink(missing_ok=True)  # stale: its process is gone
            continue
        with os.fdopen(fd, "w") as f:
            f.write(f"{os.getpid()} {command}\n")
        break
    else:  # pragma: no cover - another process took the stale lock between our two tries
        raise InputError(f"{out} is in use by another {command} run (lock {lock}); choose another --out")
    try:
        yield lock
    finally:
        with contextlib.suppress(OSError):
            if lock.read_text().split()[0] == str(os.getpid()):
                lock.unlink()
        if created:  # a run refused before writing anything leaves no empty folder behind
            with contextlib.suppress(OSError):
                out.rmdir()
