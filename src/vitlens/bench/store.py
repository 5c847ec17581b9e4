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

__all__ = ["ResultStore", "SCHEMA", "TABLES", "read_rows", "check_store", "stored_weights", "WEIGHTS_KEY"]

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
CREATE TABLE IF NOT EXISTS meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
"""

#: the tables every results store has (``meta``, which holds the weights' digest, is missing in stores written
#: before it existed)
TABLES = ("results", "costs", "curves", "predictions")


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
    if path.exists() and not path.is_file():  # a FIFO or device in the run folder: SQLite would block reading it
        from ..files import check_regular

        check_regular(path, str(path), DamagedFileError)
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
                        has_meta = con.execute("SELECT 1 FROM shard.sqlite_master WHERE type = 'table' AND "
                                               "name = 'meta'").fetchone() is not None
                        for table in TABLES + (("meta",) if has_meta else ()):
                            con.execute(f"INSERT OR IGNORE INTO {table} SELECT * FROM shard.{table}")
                except sqlite3.DatabaseError as e:
                    raise (_platform_error(main, e) or _damaged(shard, e)) from None
                finally:
                    con.execute("DETACH DATABASE shard")
        finally:
            con.close()
        return main

    def record_weights(self, digest: str) -> None:
        """Store the SHA-256 of the model's weights (:func:`vitlens.api.weights_sha256`) in this shard: a later run
        into the same folder is matched to these results by it (:func:`stored_weights`), not by a model name."""
        with self.con:
            self.con.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (WEIGHTS_KEY, digest))


WEIGHTS_KEY = "weights_sha256"


def _connect_ro(path: Path) -> sqlite3.Connection:
    """A read-only connection (nothing is created or changed in ``path``: no schema, no journal)."""
    from ..files import check_regular

    check_regular(path, str(path), DamagedFileError)
    try:
        return sqlite3.connect(f"{Path(path).resolve().as_uri()}?mode=ro", uri=True, timeout=60)
    except sqlite3.Error as e:
        raise (_platform_error(path, e) or _damaged(path, e)) from None


def read_rows(path: str | Path, query: str, args: tuple = ()) -> list[tuple[Any, ...]]:
    """The rows of ``query`` on the store ``path``, opened read-only."""
    con = _connect_ro(Path(path))
    try:
        return list(con.execute(query, args))
    except sqlite3.DatabaseError as e:
        raise (_platform_error(Path(path), e) or _damaged(Path(path), e)) from None
    finally:
        con.close()


def _columns() -> dict[str, list[str]]:
    """Table → column names of :data:`SCHEMA`."""
    con = sqlite3.connect(":memory:")
    try:
        con.executescript(SCHEMA)
        return {t: [r[1] for r in con.execute(f"PRAGMA table_info({t})")] for t in TABLES + ("meta",)}
    finally:
        con.close()


#: (table, column, SQLite storage classes allowed): what :func:`check_store` checks value by value
_TYPES = (("results", "image", ("integer",)), ("results", "value", ("real", "integer", "null")),
          ("results", "higher_is_better", ("integer",)), ("results", "method", ("text",)),
          ("results", "metric", ("text",)), ("results", "output", ("text",)), ("results", "protocol", ("text",)),
          ("costs", "image", ("integer",)), ("costs", "method", ("text",)),
          ("costs", "forward_passes", ("real", "integer")), ("costs", "backward_passes", ("real", "integer")),
          ("costs", "seconds", ("real", "integer")), ("curves", "x", ("text",)), ("curves", "y", ("text",)),
          ("predictions", "image", ("integer",)), ("predictions", "predicted", ("integer",)),
          ("predictions", "probability", ("real", "integer")), ("predictions", "label", ("integer", "null")))


def check_store(path: str | Path, need_rows: bool = True) -> None:
    """Refuse, with one line naming ``path``, a results store ``vitlens report`` cannot trust: not a regular file,
    empty (0 bytes), not SQLite (damaged), foreign (tables or columns of another schema), a value of the wrong kind
    (text where a number belongs, a protocol or curve that is not JSON), or (``need_rows``) no results at all.
    The store is opened read-only: nothing in it is created or changed."""
    import math

    path = Path(path)
    from ..files import check_regular

    check_regular(path, f"results store {path}", DamagedFileError)
    if path.stat().st_size == 0:
        raise DamagedFileError(f"results store {path} is empty (0 bytes): it holds no benchmark results; rerun the "
                               "vitlens bench command of this folder")
    con = _connect_ro(path)
    try:
        try:
            have = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        except sqlite3.DatabaseError as e:
            raise _damaged(path, e) from None
        for table, cols in _columns().items():
            if table not in have:
                if table == "meta":
                    continue
                raise DamagedFileError(f"{path} is not a vitlens results store (it has no {table!r} table; tables: "
                                       f"{', '.join(sorted(have)) or 'none'})")
            found = [r[1] for r in con.execute(f"PRAGMA table_info({table})")]
            lacking = [c for c in cols if c not in found]
            if lacking:
                raise DamagedFileError(f"{path} is not a vitlens results store (table {table!r} has no column "
                                       f"{', '.join(lacking)})")
        for table, col, kinds in _TYPES:
            allowed = ", ".join(f"'{k}'" for k in kinds)
            bad = con.execute(f"SELECT quote({col}), typeof({col}) FROM {table} WHERE typeof({col}) NOT IN "
                              f"({allowed}) LIMIT 1").fetchone()
            if bad is not None:
                raise DamagedFileError(f"{path} is damaged: {table}.{col} holds {bad[1]} {bad[0][:60]} where "
                                       f"{' or '.join(kinds)} belongs; rerun the benchmark into a new --out")
        for (proto,) in con.execute("SELECT DISTINCT protocol FROM results"):
            try:
                ok = isinstance(json.loads(proto), dict)
            except ValueError:
                ok = False
            if not ok:
                raise DamagedFileError(f"{path} is damaged: results.protocol {proto[:60]!r} is not a JSON object")
        for x, y in con.execute("SELECT x, y FROM curves"):
            try:
                xs, ys = json.loads(x), json.loads(y)
                ok = all(isinstance(v, list) and all(isinstance(a, (int, float)) and not isinstance(a, bool)
                                                     and math.isfinite(a) for a in v) for v in (xs, ys)) \
                    and len(xs) == len(ys)
            except ValueError:
                ok = False
            if not ok:
                raise DamagedFileError(f"{path} is damaged: a curve is not two lists of finite numbers of one "
                                       f"length ({x[:40]!r}, {y[:40]!r})")
        if need_rows:
            counts = [con.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in ("results", "costs")]
            if not any(counts):
                raise DamagedFileError(f"results store {path} holds no results (its results and costs tables are "
                                       "empty): the benchmark finished no unit of work; rerun its vitlens bench "
                                       "command")
    except sqlite3.DatabaseError as e:
        raise (_platform_error(path, e) or _damaged(path, e)) from None
    finally:
        con.close()


def stored_weights(run_dir: str | Path) -> dict[str, str]:
    """Database file name → the weights' SHA-256 recorded in it, for every store of ``run_dir`` that holds one
    (shards and ``results.sqlite``; read-only)."""
    run_dir = Path(run_dir)
    found: dict[str, str] = {}
    paths = sorted((run_dir / "shards").glob("rank-*.sqlite")) + [run_dir / "results.sqlite"]
    for path in paths:
        if not path.is_file() or path.stat().st_size == 0:
            continue
        con = _connect_ro(path)
        try:
            row = con.execute("SELECT value FROM meta WHERE key = ?", (WEIGHTS_KEY,)).fetchone()
        except sqlite3.DatabaseError:  # no meta table (an older store) or a damaged file (the run reports it)
            row = None
        finally:
            con.close()
        if row is not None:
            found[str(path.relative_to(run_dir))] = str(row[0])
    return found


def dumps(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, default=str)
