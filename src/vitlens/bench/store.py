"""Results storage for benchmark runs: SQLite files in the run directory, written as results are produced.

Each process writes its own shard (``shards/rank-R.sqlite``) so that several processes (``torchrun``) never contend
for one file and nothing depends on file locking over network filesystems. One *unit* of work — one method on one
batch of images, with every metric — is committed in one transaction, so a killed run leaves only whole units.
``merge`` folds all shards into ``results.sqlite``; the primary key makes every row unique (no duplicates, whatever
was resumed how often).

Damaged files: a shard that SQLite cannot read stops the run with a one-line :class:`DamagedFileError` naming it
(move it aside and rerun: its units are recomputed). ``results.sqlite`` only holds copies of shard rows, so a
damaged one is renamed to ``results.sqlite.damaged`` (its bytes are kept) and rebuilt from the shards.

Platform faults: a full disk, a read-only file or folder, or a file SQLite cannot open is an :class:`OSError` naming
the database (``cannot write or read PATH: the disk is full`` on the command line), never a bare
``sqlite3.OperationalError``; the unit being written is rolled back, so a rerun after freeing space resumes there.
"""

from __future__ import annotations

import errno
import json
import os
import sqlite3
import warnings
from pathlib import Path
from typing import Any, Iterable

from ..errors import DamagedFileError

__all__ = ["ResultStore", "SCHEMA"]

SCHEMA = """
CREATE TABLE IF NOT EXISTS results (
    image INTEGER NOT NULL,
    image_id TEXT NOT NULL,
    method TEXT NOT NULL,
    metric TEXT NOT NULL,
    output TEXT NOT NULL,
    value REAL,
    higher_is_better INTEGER NOT NULL,
    protocol TEXT NOT NULL,
    PRIMARY KEY (image, method, metric, output)
);
CREATE TABLE IF NOT EXISTS costs (
    image INTEGER NOT NULL,
    method TEXT NOT NULL,
    forward_passes REAL NOT NULL,
    backward_passes REAL NOT NULL,
    seconds REAL NOT NULL,
    PRIMARY KEY (image, method)
);
CREATE TABLE IF NOT EXISTS curves (
    image INTEGER NOT NULL,
    method TEXT NOT NULL,
    metric TEXT NOT NULL,
    output TEXT NOT NULL,
    x TEXT NOT NULL,
    y TEXT NOT NULL,
    PRIMARY KEY (image, method, metric, output)
);
CREATE TABLE IF NOT EXISTS predictions (
    image INTEGER PRIMARY KEY,
    predicted INTEGER NOT NULL,
    probability REAL NOT NULL,
    label INTEGER
);
"""


def _damaged(path: Path, err: Exception) -> DamagedFileError:
    if path.name == "results.sqlite":
        todo = "delete it and rerun the same command: it is rebuilt from shards/"
    else:
        todo = "move it aside and rerun the same command: the units it held are recomputed"
    return DamagedFileError(f"{path} is damaged ({err}); {todo}")


#: SQLite result codes that are faults of the platform (space, permissions, I/O), not of the file's contents
_PLATFORM = {"SQLITE_FULL": (errno.ENOSPC, "the disk is full (or the file system's quota is reached)"),
             "SQLITE_READONLY": (errno.EROFS, "the file or its folder is read-only"),
             "SQLITE_CANTOPEN": (errno.EACCES, "SQLite cannot open or create the file (folder missing or not "
                                               "writable?)"),
             "SQLITE_PERM": (errno.EACCES, "permission denied"),
             "SQLITE_IOERR": (errno.EIO, "an I/O error (is the disk full?)")}


def _platform_error(path: Path, err: sqlite3.Error) -> OSError | None:
    """The :class:`OSError` naming ``path`` for a SQLite error caused by the platform (full disk, read-only,
    cannot open, I/O error), or ``None`` when the error is of another kind (a damaged file, a lock)."""
    name = str(getattr(err, "sqlite_errorname", "") or "")
    for code, (num, why) in _PLATFORM.items():
        if name == code or name.startswith(code + "_"):
            return OSError(num, f"{why} ({err})", str(path))
    return None


def _connect(path: Path) -> sqlite3.Connection:
    try:
        con = sqlite3.connect(str(path), timeout=60)
    except sqlite3.Error as e:
        raise (_platform_error(path, e) or _damaged(path, e)) from None
    try:
        con.executescript(SCHEMA)
    except sqlite3.DatabaseError as e:
        con.close()
        if isinstance(e, sqlite3.OperationalError) and "locked" in str(e):
            raise
        raise (_platform_error(path, e) or _damaged(path, e)) from None
    return con


def _rebuild_if_damaged(run_dir: Path) -> None:
    """A damaged ``results.sqlite`` is set aside (``.damaged``) so that ``merge`` rebuilds it from the shards."""
    main = run_dir / "results.sqlite"
    if not main.exists():
        return
    try:
        con = _connect(main)
        try:
            con.execute("SELECT COUNT(*) FROM costs").fetchone()
        finally:
            con.close()
    except (DamagedFileError, sqlite3.DatabaseError) as e:
        aside = main.with_name("results.sqlite.damaged")
        os.replace(main, aside)
        warnings.warn(f"{main} was damaged ({e.__cause__ or e}); kept as {aside.name}, rebuilt from the shards",
                      RuntimeWarning, stacklevel=3)


class ResultStore:
    """The SQLite side of a run directory."""

    def __init__(self, run_dir: str | Path, rank: int = 0) -> None:
        self.run_dir = Path(run_dir)
        self.shard_dir = self.run_dir / "shards"
        self.shard_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.shard_dir / f"rank-{rank}.sqlite"
        if rank == 0:
            _rebuild_if_damaged(self.run_dir)
        self.con = _connect(self.path)

    def close(self) -> None:
        self.con.close()

    def _databases(self) -> list[Path]:
        paths = sorted(self.shard_dir.glob("rank-*.sqlite"))
        main = self.run_dir / "results.sqlite"
        return paths + ([main] if main.exists() else [])

    def done_units(self) -> set[tuple[str, int]]:
        """``(method, image)`` pairs already written in any shard or the merged file (units are atomic)."""
        done: set[tuple[str, int]] = set()
        for path in self._databases():
            con = _connect(path)
            try:
                done.update((m, int(i)) for i, m in con.execute("SELECT image, method FROM costs"))
            except sqlite3.DatabaseError as e:
                raise _damaged(path, e) from None
            finally:
                con.close()
        return done

    def write_unit(self, rows: Iterable[tuple], costs: Iterable[tuple], curves: Iterable[tuple] = (),
                   predictions: Iterable[tuple] = ()) -> None:
        """Write one unit atomically. ``rows``: (image, image_id, method, metric, output, value, higher, protocol),
        ``costs``: (image, method, fwd, bwd, seconds), ``curves``: (image, method, metric, output, x_json, y_json),
        ``predictions``: (image, predicted class, its probability, label or None) — the model's own answer."""
        try:
            with self.con:  # one transaction
                self.con.executemany("INSERT OR REPLACE INTO predictions VALUES (?,?,?,?)", list(predictions))
                self.con.executemany("INSERT OR REPLACE INTO results VALUES (?,?,?,?,?,?,?,?)", list(rows))
                self.con.executemany("INSERT OR REPLACE INTO curves VALUES (?,?,?,?,?,?)", list(curves))
                self.con.executemany("INSERT OR REPLACE INTO costs VALUES (?,?,?,?,?)", list(costs))
        except sqlite3.Error as e:
            fault = _platform_error(self.path, e)
            if fault is None:
                raise
            raise fault from None

    def merge(self) -> Path:
        """Fold every shard into ``results.sqlite`` (rows already there are kept, never duplicated)."""
        main = self.run_dir / "results.sqlite"
        _rebuild_if_damaged(self.run_dir)
        con = _connect(main)
        try:
            for shard in sorted(self.shard_dir.glob("rank-*.sqlite")):
                try:
                    con.execute("ATTACH DATABASE ? AS shard", (str(shard),))
                except sqlite3.DatabaseError as e:
                    raise _damaged(shard, e) from None
                try:
                    with con:
                        for table in ("results", "costs", "curves", "predictions"):
                            con.execute(f"INSERT OR IGNORE INTO {table} SELECT * FROM shard.{table}")
                except sqlite3.DatabaseError as e:
                    raise (_platform_error(main, e) or _damaged(shard, e)) from None
                finally:
                    con.execute("DETACH DATABASE shard")
        finally:
            con.close()
        return main


def read_rows(path: str | Path, query: str, args: tuple = ()) -> list[tuple[Any, ...]]:
    con = _connect(Path(path))
    try:
        return list(con.execute(query, args))
    finally:
        con.close()


def dumps(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, default=str)
