"""Stage 4: the tuning database (records keyed by workload + target + device).

A crash-safe SQLite file (see :mod:`tvmfuse.db.store` for the durability argument) that
MetaSchedule uses directly as its ``Database``; :func:`open_database` binds it to one target.
File-level operations (info, merge, export, import, prune, recover) live in :mod:`tvmfuse.db.ops`.
"""
from __future__ import annotations

from pathlib import Path

from tvmfuse.db.database import FAILED_SECS, RecordRow, TuningDatabase, WorkloadStats
from tvmfuse.db.store import Store
from tvmfuse.target import TargetInfo

DEFAULT_PATH = Path("tuning_logs") / "tvmfuse.db"

__all__ = ["DEFAULT_PATH", "FAILED_SECS", "RecordRow", "TuningDatabase", "WorkloadStats", "open_database",
           "open_store"]


def open_database(path: str | Path = DEFAULT_PATH, *, target: TargetInfo, create: bool = True,
                  space_version: str | None = None, check: bool = True) -> TuningDatabase:
    """Open (or create) a tuning database bound to one target and device.

    Parameters
    ----------
    path : the SQLite file (default ``tuning_logs/tvmfuse.db``).
    target : the resolved target; only records of ``target.canonical`` on ``target.device`` are seen.
    create : create a missing file; otherwise a missing file raises DatabaseError.
    space_version : search-space version stamped on every record committed through this handle.
    check : run SQLite's quick integrity check at open.

    Returns
    -------
    TuningDatabase
        A MetaSchedule ``Database`` (``.ms_database`` is the object itself) with ``trials_spent``,
        ``best_run_secs``, ``set_task_name``, ``list_workloads``, ``records``, ``info`` and ``close``.

    Raises
    ------
    tvmfuse.errors.DatabaseError
        The file is missing (``create=False``), not SQLite, damaged, or busy beyond the timeout.
    """
    store = Store(path, create=create, check=check)
    return TuningDatabase(store, target, space_version)


def open_store(path: str | Path = DEFAULT_PATH, *, create: bool = False, check: bool = True) -> Store:
    """Open the file without binding a target (whole-file reads and maintenance)."""
    return Store(path, create=create, check=check)
