"""Stage 4: the tuning database (records keyed by workload + target + device).

Interim implementation: MetaSchedule's JSON files beside ``path`` (``PATH.workloads.json`` and
``PATH.records.json``), bound to one target. The crash-safe SQLite database replaces it behind the
same interface: ``open_database(path, target=...)`` returning a MetaSchedule ``Database`` with
``trials_spent`` and ``best_run_secs``.
"""
from __future__ import annotations

from pathlib import Path

from tvmfuse._tvm import ms, tvm
from tvmfuse.errors import DatabaseError
from tvmfuse.target import TargetInfo

_FAILED = 1e9  # MetaSchedule stores a failed trial as 1e10 s


class _JSONDatabaseView:
    def __init__(self, db, target: TargetInfo):
        self.ms_database = db
        self.target = target

    def _records(self, mod: tvm.IRModule):
        if not self.ms_database.has_workload(mod):
            return []
        workload = self.ms_database.commit_workload(mod)
        return list(self.ms_database.get_top_k(workload, 1 << 30))

    def trials_spent(self, mod: tvm.IRModule) -> int:
        return len(self._records(mod))

    def best_run_secs(self, mod: tvm.IRModule) -> float | None:
        best = None
        for rec in self._records(mod):
            secs = [float(s) for s in (rec.run_secs or [])]
            if secs and max(secs) < _FAILED:
                mean = sum(secs) / len(secs)
                best = mean if best is None else min(best, mean)
        return best

    def close(self) -> None:
        pass


def open_database(path: str | Path, *, target: TargetInfo, create: bool = True) -> _JSONDatabaseView:
    path = Path(path)
    if not create and not Path(f"{path}.records.json").exists():
        raise DatabaseError(f"tuning database not found: {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        db = ms.database.JSONDatabase(path_workload=f"{path}.workloads.json",
                                      path_tuning_record=f"{path}.records.json",
                                      allow_missing=create)
    except Exception as err:  # noqa: BLE001
        raise DatabaseError(f"cannot open tuning database {path}: {str(err).splitlines()[0]}") from None
    return _JSONDatabaseView(db, target)
