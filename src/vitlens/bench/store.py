"""Results storage for benchmark runs: SQLite files in the run directory, written as results are produced.

Each process writes its own shard (``shards/rank-R.sqlite``) so that several processes (``torchrun``) never contend
for one file and nothing depends on file locking over network filesystems. One *unit* of work — one method on one
batch of images, with every metric — is committed in one transaction, so a killed run leaves only whole units.
``merge`` folds all shards into ``results.sqlite``; the primary key makes every row unique (no duplicates, whatever
was resumed how often).
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any, Iterable

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


def _connect(path: Path) -> sqlite3.Connection:
    con = sqlite3.connect(str(path), timeout=60)
    con.executescript(SCHEMA)
    return con


class ResultStore:
    """The SQLite side of a run directory."""

    def __init__(self, run_dir: str | Path, rank: int = 0) -> None:
        self.run_dir = Path(run_dir)
        self.shard_dir = self.run_dir / "shards"
        self.shard_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.shard_dir / f"rank-{rank}.sqlite"
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
            finally:
                con.close()
        return done

    def write_unit(self, rows: Iterable[tuple], costs: Iterable[tuple], curves: Iterable[tuple] = (),
                   predictions: Iterable[tuple] = ()) -> None:
        """Write one unit atomically. ``rows``: (image, image_id, method, metric, output, value, higher, protocol),
        ``costs``: (image, method, fwd, bwd, seconds), ``curves``: (image, method, metric, output, x_json, y_json),
        ``predictions``: (image, predicted class, its probability, label or None) — the model's own answer."""
        with self.con:  # one transaction
            self.con.executemany("INSERT OR REPLACE INTO predictions VALUES (?,?,?,?)", list(predictions))
            self.con.executemany("INSERT OR REPLACE INTO results VALUES (?,?,?,?,?,?,?,?)", list(rows))
            self.con.executemany("INSERT OR REPLACE INTO curves VALUES (?,?,?,?,?,?)", list(curves))
            self.con.executemany("INSERT OR REPLACE INTO costs VALUES (?,?,?,?,?)", list(costs))

    def merge(self) -> Path:
        """Fold every shard into ``results.sqlite`` (rows already there are kept, never duplicated)."""
        main = self.run_dir / "results.sqlite"
        con = _connect(main)
        try:
            for shard in sorted(self.shard_dir.glob("rank-*.sqlite")):
                con.execute("ATTACH DATABASE ? AS shard", (str(shard),))
                with con:
                    for table in ("results", "costs", "curves", "predictions"):
                        con.execute(f"INSERT OR IGNORE INTO {table} SELECT * FROM shard.{table}")
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
