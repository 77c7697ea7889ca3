"""Stage 5: the tuning database (records keyed by workload + target + device + search space and template digests).

A crash-safe SQLite file (see :mod:`tvmfuse.db.store` for the durability argument) that
MetaSchedule uses directly as its ``Database``; :func:`open_database` binds it to one target.
File-level operations (info, merge, export, import, prune, recover) live in :mod:`tvmfuse.db.ops`.
"""
from __future__ import annotations

import functools
from pathlib import Path

from tvmfuse.db.database import FAILED_SECS, RecordRow, TuningDatabase, WorkloadStats
from tvmfuse.db.store import Store
from tvmfuse.target import TargetInfo

DEFAULT_PATH = Path("tuning_logs") / "tvmfuse.db"

__all__ = ["DEFAULT_PATH", "FAILED_SECS", "RecordRow", "TuningDatabase", "WorkloadStats", "open_database",
           "open_store"]


def open_database(path: str | Path = DEFAULT_PATH, *, target: TargetInfo, create: bool = True,
                  space_version: str | None = None, check: bool = True, keyed: bool = True,
                  spaces_dir: str | Path | None = None) -> TuningDatabase:
    """Open (or create) a tuning database bound to one target and device.

    Parameters
    ----------
    path : the SQLite file (default ``tuning_logs/tvmfuse.db``).
    target : the resolved target; only records of ``target.canonical`` on ``target.device`` are seen.
    create : create a missing file; otherwise a missing file raises DatabaseError.
    space_version : search-space version stamped on every record committed through this handle.
    check : run SQLite's quick integrity check at open.
    keyed : key each workload's records by the digests of the target's search-space file and of the code of the
        template that tunes it (``tvmfuse.tune.spaces.space_key``): records are committed under the current key,
        and records made under another (an older template or space file) are not seen. False: every record of
        the target and device.
    spaces_dir : the folder of the space files the key is taken from (default: the package's ``search_spaces``).

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
    key = None
    if keyed:
        from tvmfuse.tune.spaces import SpaceError, load_spaces, space_key

        try:
            spaces = load_spaces(target.kind, spaces_dir)
        except SpaceError:   # a target kind without a space file is tuned in MetaSchedule's own space
            spaces = None
        key = functools.partial(space_key, spaces=spaces)
    store = Store(path, create=create, check=check)
    return TuningDatabase(store, target, space_version, space_key=key)


def open_store(path: str | Path = DEFAULT_PATH, *, create: bool = False, check: bool = True) -> Store:
    """Open the file without binding a target (whole-file reads and maintenance)."""
    return Store(path, create=create, check=check)
