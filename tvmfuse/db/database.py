"""The MetaSchedule database on a :class:`~tvmfuse.db.store.Store`, bound to one target and device.

Every query sees only records measured for the bound target (canonical JSON) on the bound device
identity; MetaSchedule's own databases ignore the target (apache/tvm#15549). A handle given a ``space_key``
(``open_database``'s default) also sees only the records of each workload made under the current key: the digests
of the search space file and of the code of the template that tunes it, so a changed template or space never serves
a record made with the old one.
"""
from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import tvmfuse
from tvmfuse._tvm import derived_object, ms, record_from_json, record_to_json, tvm, tvm_version
from tvmfuse.db.store import Store
from tvmfuse.errors import DatabaseError
from tvmfuse.target import TargetInfo

log = logging.getLogger(__name__)

# MetaSchedule stores a failed build or run as run_secs = [1e10]; anything this slow is a failure.
FAILED_SECS = 1e9


@dataclass(frozen=True)
class WorkloadStats:
    """One workload as tuned for the bound target.

    Attributes
    ----------
    workload_id : the database's id (stable across processes)
    shash : structural hash of the workload's IR, as text
    task_name : MetaSchedule task name the tuner recorded, if any
    model : model label the tuner recorded, if any
    trials : trials spent (valid + failed, including pruned ones)
    failed : failed trials (build or run errors, timeouts)
    best_secs : best mean run time of a valid record, seconds
    first_secs : mean run time of the first valid record (the untuned starting point)
    first_time, last_time : UNIX times of the first and last record
    """

    workload_id: int
    shash: str
    task_name: str | None
    model: str | None
    trials: int
    failed: int
    best_secs: float | None
    first_secs: float | None
    first_time: float | None
    last_time: float | None


_CAUSE = re.compile(r"error|check failed|cuda_|timeout|terminated|out of memory|exception|invalid|failed",
                    re.IGNORECASE)


def error_line(message: str) -> str:
    """The line of a build/run error message that says why: the last one naming an error (MetaSchedule's
    runner ends CUDA failures with a launch-configuration line, which alone says nothing), else the last."""
    lines = [ln.strip() for ln in str(message).splitlines() if ln.strip()]
    if not lines:
        return "no message"
    return next((ln for ln in reversed(lines) if _CAUSE.search(ln)), lines[-1])


@dataclass(frozen=True)
class RecordRow:
    """One measured trial as stored.

    Attributes
    ----------
    id, workload_id : database ids
    failed : True for a build/run failure
    mean_secs : mean of ``run_secs`` (None when failed)
    run_secs : measured times in seconds (None when MetaSchedule gave none)
    trace : the schedule trace as MetaSchedule's JSON (a list)
    record_target : the target the record itself carries (TVM's JSON export)
    created : UNIX time of the commit
    """

    id: int
    workload_id: int
    failed: bool
    mean_secs: float | None
    run_secs: list[float] | None
    trace: list
    record_target: dict | None
    args_info: list | None
    tvmfuse_version: str | None
    tvm_version: str | None
    space_version: str | None
    created: float
    space_key: str | None = None


def record_key(shash: str, target: str, device: str, trace_json, run_secs) -> str:
    """Identity of a trial for de-duplication (merge, import): same workload, target, device, trace and
    measured times. Re-measurements of one trace are distinct trials (they count as spent)."""
    secs = None if run_secs is None else [float(x) for x in run_secs]
    text = json.dumps([shash, target, device, trace_json, secs], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def split_run_secs(run_secs) -> tuple[list[float] | None, bool, float | None]:
    """(run_secs as floats, failed, mean) with MetaSchedule's failure conventions."""
    secs = None if run_secs is None else [float(s) for s in run_secs]
    failed = not secs or max(secs) >= FAILED_SECS
    return secs, failed, None if failed else sum(secs) / len(secs)


@derived_object
class TuningDatabase(ms.database.PyDatabase):
    """A MetaSchedule database on SQLite, bound to one target and device.

    Pass ``db.ms_database`` (the object itself) to ``ms.tune_tasks(database=...)`` or use it in a
    ``with db:`` scope for ``MetaScheduleApplyDatabase``. Use :func:`tvmfuse.db.open_database`.
    """

    def __init__(self, store: Store, target: TargetInfo, space_version: str | None = None,
                 space_key: Callable | None = None):
        super().__init__()
        self.store = store
        self.target_info = target
        self.space_version = space_version
        self._key = (target.canonical, target.device)
        self._space_key = space_key   # workload IRModule -> its records' key; None: every record of the target
        self._space_keys: dict[int, str] = {}
        self._workloads: dict[int, ms.database.Workload] = {}
        self._linked: set[int] = set()
        store.on_rollback.append(self._forget)

    def _forget(self) -> None:
        self._workloads.clear()
        self._linked.clear()
        self._space_keys.clear()

    def space_key_of(self, workload_id: int, mod=None) -> str | None:
        """The key the records of a workload are made and read under (None: this handle is not keyed)."""
        if self._space_key is None:
            return None
        key = self._space_keys.get(workload_id)
        if key is None:
            key = self._space_key(mod if mod is not None else self.store.workload_mod(workload_id))
            self._space_keys[workload_id] = key
        return key

    def _keyed(self, workload_id: int, mod=None) -> tuple[str, tuple]:
        """The SQL condition (and its parameters) on ``records`` that keeps a workload's records of the current key."""
        if self._space_key is None:
            return "", ()
        if not self.store.keyed:   # a read-only file older than the keys: none of its records is keyed
            return " AND 0", ()
        return " AND space_key=?", (self.space_key_of(workload_id, mod),)

    def _current(self, workload_id: int, space_key: str | None) -> bool:
        return self._space_key is None or (self.store.keyed and space_key == self.space_key_of(workload_id))

    # -- tvmfuse interface -----------------------------------------------------------------------
    @property
    def ms_database(self):
        """The MetaSchedule ``Database`` object (this database itself)."""
        return self._outer()

    @property
    def path(self):
        return self.store.path

    def close(self) -> None:
        self.store.close()

    def workload_id(self, mod) -> int | None:
        """The database id of ``mod``'s workload, or None if it was never committed."""
        return self.store.find_workload(mod)

    def trials_spent(self, mod) -> int:
        """Trials (valid + failed, pruned included) recorded for ``mod`` under the bound target."""
        wid = self.workload_id(mod)
        if wid is None:
            return 0
        cond, key = self._keyed(wid, mod)
        (n,), = self.store.query("SELECT COUNT(*) FROM records WHERE workload_id=? AND target=? AND device=?" + cond,
                                 (wid, *self._key, *key))
        pruned = self.store.query(
            "SELECT trials FROM pruned_trials WHERE workload_id=? AND target=? AND device=?", (wid, *self._key))
        return int(n) + sum(int(r[0]) for r in pruned)

    def best_run_secs(self, mod) -> float | None:
        """Best mean run time (seconds) of a valid record of ``mod`` under the bound target."""
        wid = self.workload_id(mod)
        if wid is None:
            return None
        cond, key = self._keyed(wid, mod)
        (best,), = self.store.query(
            "SELECT MIN(mean_secs) FROM records WHERE workload_id=? AND target=? AND device=? AND failed=0" + cond,
            (wid, *self._key, *key))
        return None if best is None else float(best)

    def reject_record(self, record_id: int) -> None:
        """Mark a record invalid: its schedule computed wrong results. Its run times become MetaSchedule's
        failure value in the record itself, so merge, import and recover keep it invalid; it still counts
        as a spent trial and is never applied."""
        with self.store.transaction() as c:
            row = c.execute("SELECT record_json FROM records WHERE id=?", (record_id,)).fetchone()
            if row is None:
                raise DatabaseError(f"no record {record_id} in {self.store.path}")
            body = json.loads(row[0])
            body[1] = [FAILED_SECS * 10]
            c.execute("UPDATE records SET failed=1, mean_secs=NULL, run_secs=?, record_json=? WHERE id=?",
                      (json.dumps(body[1]), json.dumps(body, separators=(",", ":")), record_id))

    def retime_records(self, record_ids: list[int], run_secs: list[float]) -> None:
        """Give valid records the times of a later measurement (``run_secs``, seconds): a search's finalists timed
        again side by side (:mod:`tvmfuse.tune.retime`). Each keeps its id and record key (the trial it was); its
        mean and the times in the record itself change, so builds, merges and exports rank it by the new ones."""
        secs, failed, mean = split_run_secs(run_secs)
        if failed:
            raise DatabaseError("a record is retimed with valid times only")
        with self.store.transaction() as c:
            for rid in record_ids:
                row = c.execute("SELECT record_json FROM records WHERE id=? AND failed=0", (rid,)).fetchone()
                if row is None:
                    raise DatabaseError(f"no valid record {rid} in {self.store.path}")
                body = json.loads(row[0])
                body[1] = secs
                c.execute("UPDATE records SET mean_secs=?, run_secs=?, record_json=? WHERE id=?",
                          (mean, json.dumps(secs), json.dumps(body, separators=(",", ":")), rid))

    def record_error(self, mod, kind: str, message: str) -> None:
        """Keep why one trial of ``mod`` failed (``kind``: build | run) beside its failed record."""
        wid = self._commit(mod)
        line = error_line(message)
        with self.store.transaction() as c:
            c.execute("INSERT INTO trial_errors(workload_id, target, device, kind, message, created) "
                      "VALUES (?, ?, ?, ?, ?, ?)", (wid, *self._key, kind, line[:300], time.time()))

    def trial_errors(self, workload_id: int) -> dict[tuple[str, str], int]:
        """(kind, message) -> failed trials of a workload under the bound target; empty for files that predate
        the table."""
        try:
            rows = self.store.query("SELECT kind, message, COUNT(*) FROM trial_errors WHERE workload_id=? AND "
                                    "target=? AND device=? GROUP BY kind, message ORDER BY COUNT(*) DESC",
                                    (workload_id, *self._key))
        except DatabaseError:
            return {}
        return {(k, m): int(n) for k, m, n in rows}

    def last_record_id(self) -> int:
        """The id of the newest record of the bound target (0: none)."""
        rows = self.store.query("SELECT MAX(id) FROM records WHERE target=? AND device=?", self._key)
        return int(rows[0][0] or 0) if rows else 0

    def record_model_check(self, model: str, *, tuned_ms: float, untuned_ms: float) -> None:
        """Keep a whole model's tuned and untuned times, timed side by side (``model``: the fused module's key,
        :func:`tvmfuse.compile.model_check.model_key`), as of the newest record now."""
        with self.store.transaction() as c:
            c.execute("INSERT INTO model_checks(model, target, device, tuned_ms, untuned_ms, last_record, created) "
                      "VALUES (?, ?, ?, ?, ?, ?, ?)",
                      (model, *self._key, float(tuned_ms), float(untuned_ms), self.last_record_id(), time.time()))

    def model_check(self, model: str) -> dict | None:
        """The newest end-to-end check of ``model`` under the bound target, with ``current``: no record came
        after it; None where there is none (or the file predates the table)."""
        try:
            rows = self.store.query("SELECT tuned_ms, untuned_ms, last_record, created FROM model_checks WHERE "
                                    "model=? AND target=? AND device=? ORDER BY created DESC LIMIT 1",
                                    (model, *self._key))
        except DatabaseError:
            return None
        if not rows:
            return None
        tuned, untuned, last, created = rows[0]
        return {"tuned_ms": float(tuned), "untuned_ms": float(untuned), "created": float(created),
                "current": int(last) == self.last_record_id()}

    def set_task_name(self, mod, name: str, *, model: str | None = None) -> None:
        """Record the MetaSchedule task name (and a model label) of ``mod`` for the bound target."""
        wid = self._commit(mod)
        self.store.execute("UPDATE workload_targets SET task_name=?, model=COALESCE(?, model) "
                           "WHERE workload_id=? AND target=? AND device=?", (name, model, wid, *self._key))

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Group many commits into one transaction (import, merge); all or nothing."""
        with self.store.transaction():
            yield

    # -- read API for inspect --------------------------------------------------------------------
    def list_workloads(self) -> list[WorkloadStats]:
        """Every workload committed or measured for the bound target, oldest first (a keyed handle counts each
        workload's records of its current key, and the trials pruned from it)."""
        rows = self.store.query(
            """SELECT w.id, w.shash, wt.task_name, wt.model,
                      COALESCE((SELECT trials FROM pruned_trials p WHERE p.workload_id=w.id AND p.target=?1
                                                        AND p.device=?2), 0),
                      COALESCE((SELECT failed FROM pruned_trials p WHERE p.workload_id=w.id AND p.target=?1
                                                        AND p.device=?2), 0)
               FROM workloads w
               LEFT JOIN workload_targets wt ON wt.workload_id=w.id AND wt.target=?1 AND wt.device=?2
               WHERE wt.workload_id IS NOT NULL
                  OR EXISTS (SELECT 1 FROM records r WHERE r.workload_id=w.id AND r.target=?1 AND r.device=?2)
               ORDER BY w.id""", self._key)
        out = []
        for wid, shash, task, model, pruned, pruned_failed in rows:
            cond, key = self._keyed(wid)
            where, params = "workload_id=? AND target=? AND device=?" + cond, (wid, *self._key, *key)
            (n, failed, best, first_time, last_time), = self.store.query(
                "SELECT COUNT(*), COALESCE(SUM(failed), 0), MIN(CASE WHEN failed=0 THEN mean_secs END), MIN(created), "
                f"MAX(created) FROM records WHERE {where}", params)
            first = self.store.query(f"SELECT mean_secs FROM records WHERE {where} AND failed=0 ORDER BY id LIMIT 1",
                                     params)
            out.append(WorkloadStats(workload_id=wid, shash=shash, task_name=task, model=model, trials=n + pruned,
                                     failed=failed + pruned_failed, best_secs=best,
                                     first_secs=first[0][0] if first else None, first_time=first_time,
                                     last_time=last_time))
        return out

    def records(self, workload_id: int, *, include_failed: bool = True) -> list[RecordRow]:
        """The trials of one workload under the bound target, in commit order."""
        cond, key = self._keyed(workload_id)
        rows = self.store.query(
            "SELECT id, workload_id, failed, mean_secs, run_secs, record_json, tvmfuse_version, tvm_version, "
            f"space_version, created, {'space_key' if self.store.keyed else 'NULL'} FROM records "
            "WHERE workload_id=? AND target=? AND device=?" + cond
            + ("" if include_failed else " AND failed=0") + " ORDER BY id", (workload_id, *self._key, *key))
        out = []
        for rid, wid, failed, mean, run_secs, rec_json, fv, tv, sv, created, skey in rows:
            rec = json.loads(rec_json)
            out.append(RecordRow(id=rid, workload_id=wid, failed=bool(failed), mean_secs=mean,
                                 run_secs=None if run_secs is None else json.loads(run_secs), trace=rec[0],
                                 record_target=rec[2] if len(rec) > 2 else None,
                                 args_info=rec[3] if len(rec) > 3 else None, tvmfuse_version=fv,
                                 tvm_version=tv, space_version=sv, created=created, space_key=skey))
        return out

    def best_record(self, workload_id: int) -> RecordRow | None:
        """The valid record a build applies (fastest mean, the earliest on ties), or None."""
        rows = self.records(workload_id, include_failed=False)
        return min(rows, key=lambda r: (r.mean_secs, r.id)) if rows else None

    def record_json(self, row: RecordRow) -> str:
        """One stored record as MetaSchedule's JSON text (its trace, run times, target)."""
        (rec_json,), = self.store.query("SELECT record_json FROM records WHERE id=?", (row.id,))
        return rec_json

    def schedule_of(self, row: RecordRow, mod):
        """The scheduled IRModule of one stored record: its trace replayed on ``mod`` (the workload)."""
        record = self._to_record(self.record_json(row), self._workload(row.workload_id, mod))
        sch = tvm.s_tir.Schedule(mod)
        record.trace.apply_to_schedule(sch, remove_postproc=False)
        return sch.mod

    def workload_mod(self, workload_id: int):
        """The IRModule of a workload."""
        return self.store.workload_mod(workload_id)

    def targets(self) -> list[dict]:
        """Every (target, device) in the file with its counts (not only the bound one)."""
        return self.store.targets()

    def info(self) -> dict:
        """Whole-file counts plus the bound target."""
        return {**self.store.info(), "bound_target": self._key[0], "bound_device": self._key[1]}

    # -- MetaSchedule Database interface ---------------------------------------------------------
    def _workload(self, wid: int, mod=None) -> ms.database.Workload:
        w = self._workloads.get(wid)
        if w is None:
            w = ms.database.Workload(mod if mod is not None else self.store.workload_mod(wid))
            self._workloads[wid] = w
        return w

    def _commit(self, mod) -> int:
        wid = self.store.add_workload(mod)
        if wid not in self._linked:
            self.store.execute("INSERT OR IGNORE INTO workload_targets(workload_id, target, device, created) "
                               "VALUES (?, ?, ?, ?)", (wid, *self._key, time.time()))
            self._linked.add(wid)
        return wid

    def has_workload(self, mod) -> bool:
        wid = self.store.find_workload(mod)
        if wid is None:
            return False
        return bool(self.store.query(
            "SELECT 1 FROM workload_targets WHERE workload_id=? AND target=? AND device=? "
            "UNION ALL SELECT 1 FROM records WHERE workload_id=? AND target=? AND device=? LIMIT 1",
            (wid, *self._key, wid, *self._key)))

    def commit_workload(self, mod) -> ms.database.Workload:
        wid = self._commit(mod)
        return self._workload(wid, mod)

    def commit_tuning_record(self, record) -> None:
        rec_target = record.target
        if rec_target is not None and str(rec_target.kind.name) != self.target_info.kind:
            raise DatabaseError(f"a {rec_target.kind.name} record was committed to a database bound to "
                                f"{self.target_info.kind} ({self.store.path})")
        secs, failed, mean = split_run_secs(record.run_secs)
        rec_json = record_to_json(record)
        mod = record.workload.mod
        with self.store.transaction() as c:
            wid = self._commit(mod)
            (shash,), = c.execute("SELECT shash FROM workloads WHERE id=?", (wid,)).fetchall()
            c.execute(
                "INSERT INTO records(workload_id, target, device, failed, mean_secs, run_secs, record_json, "
                "record_key, tvmfuse_version, tvm_version, space_version, created, space_key) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (wid, *self._key, int(failed), mean, None if secs is None else json.dumps(secs),
                 json.dumps(rec_json, separators=(",", ":")), record_key(shash, *self._key, rec_json[0], rec_json[1]),
                 tvmfuse.__version__, tvm_version(), self.space_version, time.time(), self.space_key_of(wid, mod)))

    def _to_record(self, rec_json: str, workload) -> ms.database.TuningRecord:
        return record_from_json(json.loads(rec_json), workload)

    def get_top_k(self, workload, top_k: int) -> list:
        if top_k <= 0:
            return []
        wid = self.store.find_workload(workload.mod)
        if wid is None:
            return []
        cond, key = self._keyed(wid, workload.mod)
        rows = self.store.query(
            "SELECT record_json FROM records WHERE workload_id=? AND target=? AND device=? AND failed=0" + cond
            + " ORDER BY mean_secs, id LIMIT ?", (wid, *self._key, *key, int(top_k)))
        return [self._to_record(r[0], workload) for r in rows]

    def get_all_tuning_records(self) -> list:
        rows = self.store.query(f"SELECT workload_id, record_json, {'space_key' if self.store.keyed else 'NULL'} "
                                "FROM records WHERE target=? AND device=? ORDER BY id", self._key)
        return [self._to_record(j, self._workload(wid)) for wid, j, key in rows if self._current(wid, key)]

    def query_tuning_record(self, mod, target, workload_name=None):
        if target is not None and str(target.kind.name) != self.target_info.kind:
            log.warning("tuning database %s is bound to %s; no record for a %s target", self.store.path,
                        self.target_info.kind, target.kind.name)
            return None
        wid = self.store.find_workload(mod)
        if wid is None:
            return None
        cond, key = self._keyed(wid, mod)
        rows = self.store.query(
            "SELECT record_json FROM records WHERE workload_id=? AND target=? AND device=? AND failed=0" + cond
            + " ORDER BY mean_secs, id LIMIT 1", (wid, *self._key, *key))
        return self._to_record(rows[0][0], self._workload(wid, mod)) if rows else None

    def __len__(self) -> int:
        if self._space_key is None:
            (n,), = self.store.query("SELECT COUNT(*) FROM records WHERE target=? AND device=?", self._key)
            return int(n)
        col = "space_key" if self.store.keyed else "NULL"
        rows = self.store.query(f"SELECT workload_id, {col}, COUNT(*) FROM records WHERE target=? AND device=? "
                                f"GROUP BY workload_id, {col}", self._key)
        return sum(int(n) for wid, key, n in rows if self._current(wid, key))
