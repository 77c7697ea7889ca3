"""The SQLite file under the tuning database: schema, crash-safety settings, workload identity.

Knows rows and TVM IR (for the structural-equality guard), not MetaSchedule's objects or targets'
meaning; :mod:`tvmfuse.db.database` binds a store to one target.

Crash safety
------------
* ``journal_mode=WAL``: a writer appends to the ``-wal`` file and a commit is one frame with a commit
  marker; a process killed mid-transaction leaves frames without the marker, which the next opener
  ignores. Readers never block the writer and see only committed transactions.
* ``synchronous=FULL``: the WAL is fsynced at every commit, so an acknowledged record survives a power
  loss too, not only a killed process. It costs one fsync per measured candidate (~1-10 ms), noise next
  to building and timing a candidate (>= 100 ms); NORMAL would be enough for SIGKILL alone.
* ``busy_timeout``: a second tuner or a reader waits for the write lock instead of failing.
* Write transactions are ``BEGIN IMMEDIATE`` (take the write lock up front), so "find the workload,
  else insert it" is atomic across processes and workload ids come from the database, never from a
  per-process counter (the mis-linking of MetaSchedule's JSON files).
"""
from __future__ import annotations

import sqlite3
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from tvmfuse._tvm import load_json, structural_equal, structural_hash
from tvmfuse.errors import DatabaseError

SCHEMA_VERSION = 1
SQLITE_MAGIC = b"SQLite format 3\x00"
BUSY_TIMEOUT_S = 60.0

# One statement per entry: executescript() would COMMIT the surrounding transaction.
SCHEMA = [
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    # A workload is target-independent IR; several rows may share a hash (a collision), equality decides.
    """CREATE TABLE IF NOT EXISTS workloads (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        shash TEXT NOT NULL,
        mod_json TEXT NOT NULL,
        created REAL NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS workloads_shash ON workloads(shash)",
    # Which workloads were committed for which target (has_workload), with the tuner's task name.
    """CREATE TABLE IF NOT EXISTS workload_targets (
        workload_id INTEGER NOT NULL REFERENCES workloads(id),
        target TEXT NOT NULL,
        device TEXT NOT NULL,
        task_name TEXT,
        model TEXT,
        created REAL NOT NULL,
        PRIMARY KEY (workload_id, target, device))""",
    """CREATE TABLE IF NOT EXISTS records (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        workload_id INTEGER NOT NULL REFERENCES workloads(id),
        target TEXT NOT NULL,
        device TEXT NOT NULL,
        failed INTEGER NOT NULL,
        mean_secs REAL,
        run_secs TEXT,
        record_json TEXT NOT NULL,
        record_key TEXT NOT NULL,
        tvmfuse_version TEXT,
        tvm_version TEXT,
        space_version TEXT,
        created REAL NOT NULL,
        space_key TEXT)""",
    "CREATE INDEX IF NOT EXISTS records_lookup ON records(workload_id, target, device, failed, mean_secs)",
    "CREATE INDEX IF NOT EXISTS records_key ON records(record_key)",
    # Trials deleted by `db prune` still count as spent, so a resumed tune does not spend them again.
    """CREATE TABLE IF NOT EXISTS pruned_trials (
        workload_id INTEGER NOT NULL REFERENCES workloads(id),
        target TEXT NOT NULL,
        device TEXT NOT NULL,
        trials INTEGER NOT NULL,
        failed INTEGER NOT NULL,
        PRIMARY KEY (workload_id, target, device))""",
    # Why trials failed: the builder's or the runner's message (its last line), for `tvmfuse inspect`.
    # Added after schema 1 shipped; a file opened read-only may lack it (readers treat that as empty).
    """CREATE TABLE IF NOT EXISTS trial_errors (
        workload_id INTEGER NOT NULL REFERENCES workloads(id),
        target TEXT NOT NULL,
        device TEXT NOT NULL,
        kind TEXT NOT NULL,
        message TEXT NOT NULL,
        created REAL NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS trial_errors_lookup ON trial_errors(workload_id, target, device)",
    # A whole model's tuned build timed against its untuned one, side by side, after tuning (tune's end-to-end
    # check); ``last_record`` is the newest record of the target then, so a check that later records outdate is
    # not applied. Added after schema 1 shipped, like trial_errors.
    """CREATE TABLE IF NOT EXISTS model_checks (
        model TEXT NOT NULL,
        target TEXT NOT NULL,
        device TEXT NOT NULL,
        tuned_ms REAL NOT NULL,
        untuned_ms REAL NOT NULL,
        last_record INTEGER NOT NULL,
        created REAL NOT NULL)""",
]
TABLES = ("meta", "workloads", "workload_targets", "records", "pruned_trials")


def damaged(path: Path | str, reason: str) -> DatabaseError:
    """The one-line error for a file that is not a readable tvmfuse database."""
    reason = (str(reason).strip().splitlines() or ["unknown error"])[0]
    return DatabaseError(f"tuning database {path} is damaged or not a tvmfuse database: {reason}",
                         hint=f"salvage it with `tvmfuse db recover {path} NEW.db`")


def _wrap(path: Path, err: sqlite3.Error) -> DatabaseError:
    msg = str(err)
    if "locked" in msg or "busy" in msg:
        return DatabaseError(f"tuning database {path} is busy: another process held its write lock "
                             f"for more than {BUSY_TIMEOUT_S:.0f} s")
    if isinstance(err, sqlite3.OperationalError) and ("readonly" in msg or "unable to open" in msg):
        return DatabaseError(f"cannot open tuning database {path}: {msg}")
    return damaged(path, msg)


class Store:
    """One connection to a tuning database file (thread-safe; one per process and file is enough).

    Parameters
    ----------
    path : the SQLite file; ``PATH-wal`` and ``PATH-shm`` live beside it while it is open.
    create : create the file and its tables when missing; otherwise a missing file is an error.
    check : run ``PRAGMA quick_check`` at open, so a damaged file fails here with one clear line
        instead of deep inside tuning.
    """

    def __init__(self, path: str | Path, *, create: bool = True, check: bool = True):
        self.path = Path(path)
        self._lock = threading.RLock()
        self._depth = 0  # nesting of transaction(): inner ones join the outer one
        self._mods: dict[int, Any] = {}  # workload id -> IRModule, loaded once
        self._by_hash: dict[str, list[int]] = {}
        self.on_rollback: list = []  # callables: drop caches that may name rolled-back ids
        if not self.path.exists():
            if not create:
                raise DatabaseError(f"tuning database not found: {self.path}")
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as err:
                above = self.path.absolute().parent
                while not above.exists():
                    above = above.parent
                why = f"{above} is a file" if not above.is_dir() else err.strerror or str(err)
                raise DatabaseError(f"cannot create tuning database {self.path}: folder {self.path.parent} "
                                    f"cannot be created ({why})") from None
        else:
            try:
                with open(self.path, "rb") as f:
                    head = f.read(len(SQLITE_MAGIC))
            except OSError as err:
                raise DatabaseError(f"cannot read tuning database {self.path}: {err.strerror}") from None
            if head and head != SQLITE_MAGIC:
                raise damaged(self.path, "not an SQLite file")
        try:
            self.conn = sqlite3.connect(str(self.path), timeout=BUSY_TIMEOUT_S, isolation_level=None,
                                        check_same_thread=False)
        except sqlite3.Error as err:
            raise _wrap(self.path, err) from None
        try:
            self._setup(create=create, check=check)
        except sqlite3.Error as err:
            self.conn.close()
            raise _wrap(self.path, err) from None
        except DatabaseError:
            self.conn.close()
            raise

    # -- connection ------------------------------------------------------------------------------
    def _setup(self, *, create: bool, check: bool) -> None:
        c = self.conn
        c.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
        mode = c.execute("PRAGMA journal_mode").fetchone()[0]
        if str(mode).lower() != "wal":
            # Switching needs a moment alone with the file; the busy handler does not cover it everywhere.
            deadline = time.monotonic() + BUSY_TIMEOUT_S
            while True:
                try:
                    c.execute("PRAGMA journal_mode = WAL")
                    break
                except sqlite3.OperationalError as err:
                    if "locked" not in str(err) or time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
        c.execute("PRAGMA synchronous = FULL")
        c.execute("PRAGMA foreign_keys = ON")
        if check:
            rows = c.execute("PRAGMA quick_check").fetchall()
            if [r[0] for r in rows] != ["ok"]:
                raise damaged(self.path, f"integrity check failed: {rows[0][0]}")
        have = {r[0] for r in c.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if "meta" not in have and have - {"sqlite_sequence"} and not set(TABLES) & have:
            raise damaged(self.path, "an SQLite file without tvmfuse's tables")
        # A file without tables is one whose creator was killed before its first commit: initialize it
        # (``create`` only decides whether a missing file may be created).
        if create or not have:
            with self.transaction():
                for stmt in SCHEMA:
                    c.execute(stmt)
                c.execute("INSERT OR IGNORE INTO meta(key, value) VALUES ('schema_version', ?)",
                          (str(SCHEMA_VERSION),))
        row = c.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        if row is None or int(row[0]) != SCHEMA_VERSION:
            raise damaged(self.path, f"schema version {row[0] if row else 'missing'}, "
                                     f"this tvmfuse reads {SCHEMA_VERSION}")
        self.keyed = self._add_space_key()

    def _add_space_key(self) -> bool:
        """Whether ``records`` has the ``space_key`` column (the search space's and template's digests of each
        record, ``tvmfuse.tune.spaces.space_key``), adding it to a file made before it existed. A file this process
        cannot write keeps its records without keys: none of them matches a keyed query."""
        def has() -> bool:
            return "space_key" in {r[1] for r in self.conn.execute("PRAGMA table_info(records)")}

        if has():
            return True
        try:
            with self.transaction() as c:
                if not has():   # another process may have added it meanwhile
                    c.execute("ALTER TABLE records ADD COLUMN space_key TEXT")
        except (sqlite3.Error, DatabaseError):
            pass   # read-only: the file stays as it is
        return has()

    def close(self) -> None:
        with self._lock:
            try:
                self.conn.close()
            except sqlite3.Error:
                pass

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """A write transaction (``BEGIN IMMEDIATE``); nested uses join the outermost one."""
        with self._lock:
            if self._depth:
                self._depth += 1
                try:
                    yield self.conn
                finally:
                    self._depth -= 1
                return
            try:
                self.conn.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as err:
                raise _wrap(self.path, err) from None
            self._depth = 1
            try:
                yield self.conn
            except BaseException:
                self._depth = 0
                try:
                    self.conn.execute("ROLLBACK")
                except sqlite3.Error:
                    pass
                self._forget_uncommitted()
                raise
            self._depth = 0
            try:
                self.conn.execute("COMMIT")
            except sqlite3.Error as err:
                self._forget_uncommitted()
                raise _wrap(self.path, err) from None

    def _forget_uncommitted(self) -> None:
        # Ids handed out inside a rolled-back transaction do not exist (and may be reused): drop caches.
        self._by_hash.clear()
        self._mods.clear()
        for f in self.on_rollback:
            f()

    def query(self, sql: str, params: tuple = ()) -> list[tuple]:
        with self._lock:
            try:
                return self.conn.execute(sql, params).fetchall()
            except sqlite3.Error as err:
                raise _wrap(self.path, err) from None

    def execute(self, sql: str, params: tuple = ()) -> sqlite3.Cursor:
        """Run one write statement inside the current (or a new) transaction."""
        with self.transaction() as c:
            try:
                return c.execute(sql, params)
            except sqlite3.Error as err:
                raise _wrap(self.path, err) from None

    # -- workloads -------------------------------------------------------------------------------
    def workload_mod(self, workload_id: int):
        """The IRModule of a workload row (loaded once per process)."""
        mod = self._mods.get(workload_id)
        if mod is None:
            rows = self.query("SELECT mod_json FROM workloads WHERE id=?", (workload_id,))
            if not rows:
                raise DatabaseError(f"tuning database {self.path} has no workload {workload_id}")
            mod = load_json(rows[0][0])
            self._mods[workload_id] = mod
        return mod

    def find_workload(self, mod, *, shash: str | None = None) -> int | None:
        """The id of the workload structurally equal to ``mod``, or None.

        Rows whose hash matches but whose IR differs (a hash collision) are never returned.
        """
        shash = shash if shash is not None else str(structural_hash(mod))
        ids = self._by_hash.get(shash)
        if ids is None or not any(self._equal(i, mod) for i in ids):
            ids = [r[0] for r in self.query("SELECT id FROM workloads WHERE shash=? ORDER BY id", (shash,))]
            self._by_hash[shash] = ids
        for wid in ids:
            if self._equal(wid, mod):
                return wid
        return None

    def _equal(self, workload_id: int, mod) -> bool:
        try:
            return structural_equal(self.workload_mod(workload_id), mod)
        except DatabaseError:
            raise
        except Exception:  # noqa: BLE001 - an unreadable IR row is simply not this workload
            return False

    def add_workload(self, mod, *, mod_json: str | None = None) -> int:
        """Find or insert ``mod``; atomic across processes (the lookup runs under the write lock)."""
        from tvmfuse._tvm import save_json

        shash = str(structural_hash(mod))
        wid = self.find_workload(mod, shash=shash)
        if wid is not None:
            return wid
        with self.transaction() as c:
            self._by_hash.pop(shash, None)  # another process may have inserted it meanwhile
            wid = self.find_workload(mod, shash=shash)
            if wid is None:
                cur = c.execute("INSERT INTO workloads(shash, mod_json, created) VALUES (?, ?, ?)",
                                (shash, mod_json if mod_json is not None else save_json(mod), time.time()))
                wid = int(cur.lastrowid)
                self._mods[wid] = mod
                self._by_hash.setdefault(shash, []).append(wid)
        return wid

    # -- whole-file summaries --------------------------------------------------------------------
    def targets(self) -> list[dict]:
        """Per (target, device): workloads, records, failed trials."""
        rows = self.query(
            """SELECT t.target, t.device, COUNT(DISTINCT t.workload_id),
                      (SELECT COUNT(*) FROM records r WHERE r.target=t.target AND r.device=t.device),
                      (SELECT COUNT(*) FROM records r WHERE r.target=t.target AND r.device=t.device
                                                      AND r.failed=1)
               FROM (SELECT workload_id, target, device FROM workload_targets
                     UNION SELECT workload_id, target, device FROM records) t
               GROUP BY t.target, t.device ORDER BY t.target, t.device""")
        return [{"target": t, "device": d, "workloads": w, "records": n, "failed": f}
                for t, d, w, n, f in rows]

    def models(self) -> list[dict]:
        """Per (target, device, model) as the tuner labelled workloads: workloads and records."""
        rows = self.query(
            """SELECT wt.target, wt.device, wt.model, COUNT(*),
                      SUM((SELECT COUNT(*) FROM records r WHERE r.workload_id=wt.workload_id
                           AND r.target=wt.target AND r.device=wt.device))
               FROM workload_targets wt GROUP BY wt.target, wt.device, wt.model
               ORDER BY wt.target, wt.device, wt.model""")
        return [{"target": t, "device": d, "model": m, "workloads": w, "records": int(n or 0)}
                for t, d, m, w, n in rows]

    def info(self) -> dict:
        """Counts over the whole file, every target."""
        (records, failed), = self.query("SELECT COUNT(*), COALESCE(SUM(failed), 0) FROM records")
        (workloads,), = self.query("SELECT COUNT(*) FROM workloads")
        try:
            size = self.path.stat().st_size
        except OSError:
            size = None
        return {"path": str(self.path), "records": records, "failed": int(failed), "workloads": workloads,
                "targets": self.targets(), "models": self.models(), "schema_version": SCHEMA_VERSION,
                "size_bytes": size}
