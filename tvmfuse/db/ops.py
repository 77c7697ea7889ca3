"""Whole-file operations on tuning databases: info, merge, export, import, prune, recover.

Each is a library call (the CLI ``tvmfuse db ...`` only parses and prints) returning a plain dict.
"""
from __future__ import annotations

import json
import shutil
import sqlite3
import tempfile
import time
from pathlib import Path

from tvmfuse._tvm import load_json, ms, record_from_json, structural_hash
from tvmfuse.db.database import record_key, split_run_secs
from tvmfuse.db.store import SQLITE_MAGIC, Store
from tvmfuse.errors import DatabaseError
from tvmfuse.target import TargetInfo

WORKLOAD_FILE = "database_workload.json"
RECORD_FILE = "database_tuning_record.json"

_RECORD_COLS = ("workload_id", "target", "device", "failed", "mean_secs", "run_secs", "record_json", "record_key",
                "tvmfuse_version", "tvm_version", "space_version", "created", "space_key")


def _record_cols(have_key: bool) -> str:
    """The SELECT list of :data:`_RECORD_COLS` on a records table that has the ``space_key`` column or not (a file
    made before it, opened read-only: its records have no key)."""
    return ", ".join(c if c != "space_key" or have_key else "NULL" for c in _RECORD_COLS)


def info(*, path: str | Path) -> dict:
    """Counts of a database file: ``records``, ``failed``, ``workloads``, per ``targets`` and ``models``."""
    store = Store(path, create=False)
    try:
        return store.info()
    finally:
        store.close()


def _select_where(target: str | None, device: str | None, alias: str = "") -> tuple[str, tuple]:
    conds, params = [], []
    if target is not None:
        conds.append(f"{alias}target=?")
        params.append(target)
    if device is not None:
        conds.append(f"{alias}device=?")
        params.append(device)
    return (" AND ".join(conds) or "1"), tuple(params)


# -- merge ---------------------------------------------------------------------------------------
def _copy_into(src: Store, dest: Store) -> dict:
    """Copy every workload and record of ``src`` into ``dest`` (one transaction), deduplicating."""
    added = duplicates = workloads_added = 0
    with dest.transaction() as c:
        wmap: dict[int, int] = {}
        for sid, shash, mod_json in src.query("SELECT id, shash, mod_json FROM workloads ORDER BY id"):
            same = c.execute("SELECT id FROM workloads WHERE shash=? AND mod_json=? ORDER BY id LIMIT 1",
                             (shash, mod_json)).fetchall()
            if same:  # identical text: no need to parse the IR
                wmap[sid] = same[0][0]
                continue
            before = c.execute("SELECT COUNT(*) FROM workloads").fetchone()[0]
            wmap[sid] = dest.add_workload(src.workload_mod(sid), mod_json=mod_json)
            workloads_added += c.execute("SELECT COUNT(*) FROM workloads").fetchone()[0] - before
        for wid, target, device, task, model, created in src.query(
                "SELECT workload_id, target, device, task_name, model, created FROM workload_targets"):
            c.execute("INSERT OR IGNORE INTO workload_targets(workload_id, target, device, task_name, model, created)"
                      " VALUES (?, ?, ?, ?, ?, ?)", (wmap[wid], target, device, task, model, created))
            c.execute("UPDATE workload_targets SET task_name=COALESCE(task_name, ?), model=COALESCE(model, ?) "
                      "WHERE workload_id=? AND target=? AND device=?", (task, model, wmap[wid], target, device))
        for row in src.query(f"SELECT {_record_cols(src.keyed)} FROM records ORDER BY id"):
            rec = dict(zip(_RECORD_COLS, row))
            rec["workload_id"] = wmap[rec["workload_id"]]
            if c.execute("SELECT 1 FROM records WHERE record_key=? AND target=? AND device=? LIMIT 1",
                         (rec["record_key"], rec["target"], rec["device"])).fetchall():
                duplicates += 1
                continue
            added += 1
            c.execute(f"INSERT INTO records({', '.join(_RECORD_COLS)}) VALUES ({', '.join('?' * len(_RECORD_COLS))})",
                      tuple(rec[k] for k in _RECORD_COLS))
        for wid, target, device, trials, failed in src.query(
                "SELECT workload_id, target, device, trials, failed FROM pruned_trials"):
            c.execute("INSERT INTO pruned_trials(workload_id, target, device, trials, failed) VALUES (?, ?, ?, ?, ?) "
                      "ON CONFLICT(workload_id, target, device) DO UPDATE SET "
                      "trials=MAX(trials, excluded.trials), failed=MAX(failed, excluded.failed)",
                      (wmap[wid], target, device, trials, failed))
    return {"added": added, "duplicates": duplicates, "workloads_added": workloads_added}


def merge(*, sources: list[str | Path], dest: str | Path) -> dict:
    """Merge databases into ``dest`` (created if missing).

    Workloads are matched by structural equality; a trial already in ``dest`` (same workload, target,
    device, trace and measured times) is not copied again, so merging is idempotent. Queries always
    answer with the best record, so the best of all sources wins.

    Returns
    -------
    dict with ``added``, ``duplicates``, ``workloads_added`` and ``records`` (in dest).
    """
    out = Store(dest, create=True)
    totals = {"added": 0, "duplicates": 0, "workloads_added": 0}
    try:
        for src_path in sources:
            if Path(src_path).resolve() == Path(dest).resolve():
                continue
            src = Store(src_path, create=False)
            try:
                for k, v in _copy_into(src, out).items():
                    totals[k] += v
            finally:
                src.close()
        totals["records"] = out.info()["records"]
        return totals
    finally:
        out.close()


# -- MetaSchedule JSON files ---------------------------------------------------------------------
def export_json(*, path: str | Path, out_dir: str | Path, target: str | None = None,
                device: str | None = None, include_failed: bool = True) -> dict:
    """Write MetaSchedule's ``database_workload.json`` and ``database_tuning_record.json``.

    Parameters
    ----------
    target, device : only records of this canonical target JSON / device identity (default: all).
        MetaSchedule's JSON database ignores targets when queried, so export one target at a time when
        the file holds several.
    """
    store = Store(path, create=False)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    where, params = _select_where(target, device)
    if not include_failed:
        where += " AND failed=0"
    try:
        rows = store.query(f"SELECT workload_id, record_json FROM records WHERE {where} ORDER BY id", params)
        index: dict[int, int] = {}
        wlines, rlines = [], []
        for wid, rec_json in rows:
            if wid not in index:
                index[wid] = len(wlines)
                wl = ms.database.Workload(store.workload_mod(wid)).as_json()
                wlines.append(json.dumps(wl, separators=(",", ":")))
            rlines.append(json.dumps([index[wid], json.loads(rec_json)], separators=(",", ":")))
        for name, lines in ((WORKLOAD_FILE, wlines), (RECORD_FILE, rlines)):
            tmp = out_dir / (name + ".tmp")
            tmp.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
            tmp.replace(out_dir / name)
        return {"workloads": len(wlines), "records": len(rlines),
                "files": [str(out_dir / WORKLOAD_FILE), str(out_dir / RECORD_FILE)]}
    finally:
        store.close()


def _json_lines(path: Path) -> tuple[list, int]:
    """Parsed lines of a JSON-lines file and the number of unreadable ones (a torn last line)."""
    good, bad = [], 0
    if not path.exists():
        return good, bad
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                good.append(json.loads(line))
            except json.JSONDecodeError:
                bad += 1
    return good, bad


def import_json(*, path: str | Path, src_dir: str | Path, target: TargetInfo) -> dict:
    """Import MetaSchedule JSON files (``src_dir/database_*.json``) into ``path`` under ``target``.

    MetaSchedule's records carry a Target but no device identity; they are filed under ``target``
    (canonical JSON and this machine's device). Unreadable lines (a torn last line of a killed run)
    are skipped and counted; a trial already present is not added twice.
    """
    from tvmfuse.db import open_database

    src_dir = Path(src_dir)
    wfile, rfile = src_dir / WORKLOAD_FILE, src_dir / RECORD_FILE
    if not wfile.exists():
        raise DatabaseError(f"no MetaSchedule workload file {wfile}")
    wl_json, bad_w = _json_lines(wfile)
    rec_json, bad_r = _json_lines(rfile)
    workloads = []
    for obj in wl_json:
        try:
            workloads.append(ms.database.Workload.from_json(obj))
        except Exception:  # noqa: BLE001 - a damaged line is skipped, not fatal
            workloads.append(None)
            bad_w += 1
    db = open_database(path, target=target)
    added = duplicates = skipped = 0
    try:
        with db.batch():
            shash_of: dict[int, str] = {}
            for obj in rec_json:
                try:
                    idx, body = int(obj[0]), obj[1]
                    workload = workloads[idx]
                    if workload is None:
                        raise IndexError(idx)
                    rec = record_from_json(body, workload)
                except Exception:  # noqa: BLE001
                    skipped += 1
                    continue
                if idx not in shash_of:
                    db.commit_workload(workload.mod)
                    shash_of[idx] = str(structural_hash(workload.mod))
                key = record_key(shash_of[idx], target.canonical, target.device, body[0], body[1])
                if db.store.query("SELECT 1 FROM records WHERE record_key=? AND target=? AND device=? LIMIT 1",
                                  (key, target.canonical, target.device)):
                    duplicates += 1
                    continue
                db.commit_tuning_record(rec)
                added += 1
        return {"added": added, "duplicates": duplicates, "skipped": skipped,
                "torn_lines": bad_w + bad_r, "records": len(db)}
    finally:
        db.close()


# -- prune ---------------------------------------------------------------------------------------
def prune(*, path: str | Path, top_k: int, target: str | None = None, device: str | None = None,
          vacuum: bool = True) -> dict:
    """Keep the ``top_k`` best valid records per workload, target and device; drop the rest.

    Dropped trials still count in ``trials_spent`` (table ``pruned_trials``), so pruning does not make
    a resumed tune spend its budget again.
    """
    if top_k < 0:
        raise DatabaseError("--top-k must be >= 0")
    store = Store(path, create=False)
    where, params = _select_where(target, device)
    try:
        with store.transaction() as c:
            before = c.execute("SELECT COUNT(*) FROM records").fetchone()[0]
            # the best of each space key: a build reads only the current key's records, whatever the older ones ran
            groups = c.execute(f"SELECT DISTINCT workload_id, target, device, space_key FROM records WHERE {where}",
                               params).fetchall()
            for wid, tgt, dev, key in groups:
                keep = {r[0] for r in c.execute(
                    "SELECT id FROM records WHERE workload_id=? AND target=? AND device=? AND space_key IS ? "
                    "AND failed=0 ORDER BY mean_secs, id LIMIT ?", (wid, tgt, dev, key, top_k))}
                drop = [(rid, failed) for rid, failed in c.execute(
                    "SELECT id, failed FROM records WHERE workload_id=? AND target=? AND device=? AND space_key IS ?",
                    (wid, tgt, dev, key)) if rid not in keep]
                if not drop:
                    continue
                c.executemany("DELETE FROM records WHERE id=?", [(rid,) for rid, _ in drop])
                c.execute("INSERT INTO pruned_trials(workload_id, target, device, trials, failed) "
                          "VALUES (?, ?, ?, ?, ?) ON CONFLICT(workload_id, target, device) DO UPDATE SET "
                          "trials=trials+excluded.trials, failed=failed+excluded.failed",
                          (wid, tgt, dev, len(drop), sum(f for _, f in drop)))
            after = c.execute("SELECT COUNT(*) FROM records").fetchone()[0]
        if vacuum:
            try:
                store.conn.execute("VACUUM")
            except sqlite3.Error:
                pass  # another process is reading: the space is reused later anyway
        return {"removed": before - after, "records": after}
    finally:
        store.close()


# -- recover -------------------------------------------------------------------------------------
_COLUMNS = {
    "workloads": ("id", "shash", "mod_json", "created"),
    "workload_targets": ("workload_id", "target", "device", "task_name", "model", "created"),
    "records": ("id",) + _RECORD_COLS,
    "pruned_trials": ("workload_id", "target", "device", "trials", "failed"),
}
_MISS_LIMIT = 2000  # consecutive unreadable rowids before a table is given up


def _salvage_table(conn: sqlite3.Connection, table: str, errors: list[str]) -> list[tuple]:
    """Rows of ``table`` that can still be read: a scan, then row-by-row past a damaged page (a column the file
    predates reads as NULL)."""
    try:
        have = {r[1] for r in conn.execute(f"PRAGMA table_info({table})")}
    except sqlite3.Error:
        have = set(_COLUMNS[table])
    cols = ", ".join(c if c in have or not have else "NULL" for c in _COLUMNS[table])
    rows: dict[int, tuple] = {}
    last = 0
    try:
        cur = conn.execute(f"SELECT rowid, {cols} FROM {table} NOT INDEXED ORDER BY rowid")
        while True:
            row = cur.fetchone()
            if row is None:
                return list(rows.values())
            rows[row[0]] = row[1:]
            last = row[0]
    except sqlite3.Error as err:
        errors.append(f"{table}: {str(err).splitlines()[0]} after rowid {last}")
    hi = None
    try:
        hi = conn.execute("SELECT seq FROM sqlite_sequence WHERE name=?", (table,)).fetchone()
        hi = hi[0] if hi else None
    except sqlite3.Error:
        pass
    rowid, misses = last + 1, 0
    while misses < _MISS_LIMIT and (hi is None or rowid <= hi):
        try:
            row = conn.execute(f"SELECT rowid, {cols} FROM {table} WHERE rowid=?", (rowid,)).fetchone()
        except sqlite3.Error:
            row = None
        if row is None:
            misses += 1
        else:
            rows[row[0]] = row[1:]
            misses = 0
        rowid += 1
    return list(rows.values())


def _pad_truncated(path: Path) -> None:
    """Give a truncated file back its missing pages as zeros.

    SQLite refuses even the table list of a file shorter than its header says; zero pages instead read
    as damaged pages, which the row-by-row salvage steps over.
    """
    with open(path, "r+b") as f:
        head = f.read(100)
        if len(head) < 100:
            return
        page = int.from_bytes(head[16:18], "big")
        page = 65536 if page == 1 else page
        pages = int.from_bytes(head[28:32], "big")
        size = f.seek(0, 2)
        want = max(pages * page, -(-size // page) * page) if page >= 512 else size
        if want > size and want < (1 << 34):
            f.truncate(want)


def recover(*, src: str | Path, dest: str | Path) -> dict:
    """Salvage the readable workloads and records of a damaged database into a new file ``dest``.

    ``src`` is not modified (it is read from a copy). A workload whose IR does not load or whose hash
    does not match its IR is dropped, and so are the records that point at it.
    """
    src, dest = Path(src), Path(dest)
    if not src.exists():
        raise DatabaseError(f"tuning database not found: {src}")
    if dest.exists():
        raise DatabaseError(f"{dest} exists; recover writes a new file")
    with open(src, "rb") as f:
        if f.read(len(SQLITE_MAGIC)) != SQLITE_MAGIC:
            raise DatabaseError(f"{src} is not an SQLite file: nothing can be recovered from it")
    errors: list[str] = []
    tables: dict[str, list[tuple]] = {}
    with tempfile.TemporaryDirectory(prefix="tvmfuse-recover-") as tmp:
        copy = Path(tmp) / "src.db"
        shutil.copyfile(src, copy)
        wal = Path(f"{src}-wal")
        if wal.exists():
            shutil.copyfile(wal, Path(f"{copy}-wal"))
        _pad_truncated(copy)
        conn = sqlite3.connect(str(copy), isolation_level=None)
        try:
            try:
                present = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            except sqlite3.Error as err:
                raise DatabaseError(f"{src}: its table list is unreadable ({str(err).splitlines()[0]}); "
                                    "nothing can be recovered with SQLite") from None
            for table in _COLUMNS:
                tables[table] = _salvage_table(conn, table, errors) if table in present else []
        finally:
            conn.close()

    out = Store(dest, create=True)
    kept_w: set[int] = set()
    dropped_w = dropped_r = 0
    try:
        with out.transaction() as c:
            for wid, shash, mod_json, created in tables["workloads"]:
                try:
                    ok = str(structural_hash(load_json(mod_json))) == shash
                except Exception:  # noqa: BLE001 - a damaged IR row
                    ok = False
                if not ok:
                    dropped_w += 1
                    continue
                c.execute("INSERT INTO workloads(id, shash, mod_json, created) VALUES (?, ?, ?, ?)",
                          (wid, shash, mod_json, created))
                kept_w.add(wid)
            for row in tables["workload_targets"]:
                if row[0] in kept_w:
                    c.execute("INSERT OR IGNORE INTO workload_targets(workload_id, target, device, task_name, "
                              "model, created) VALUES (?, ?, ?, ?, ?, ?)", row)
            for row in tables["records"]:
                rec = dict(zip(_COLUMNS["records"], row))
                try:
                    body = json.loads(rec["record_json"])
                    valid = rec["workload_id"] in kept_w and isinstance(body, list) and len(body) >= 2
                    _, failed, mean = split_run_secs(body[1]) if valid else (None, None, None)
                except (TypeError, ValueError):
                    valid = False
                if not valid:
                    dropped_r += 1
                    continue
                rec["failed"], rec["mean_secs"] = int(failed), mean  # recomputed from the record itself
                c.execute(f"INSERT INTO records({', '.join(_COLUMNS['records'])}) "
                          f"VALUES ({', '.join('?' * len(_COLUMNS['records']))})",
                          tuple(rec[k] for k in _COLUMNS["records"]))
            for row in tables["pruned_trials"]:
                if row[0] in kept_w:
                    c.execute("INSERT OR IGNORE INTO pruned_trials(workload_id, target, device, trials, failed) "
                              "VALUES (?, ?, ?, ?, ?)", row)
        return {"workloads": len(kept_w), "records": out.info()["records"], "dropped_workloads": dropped_w,
                "dropped_records": dropped_r, "errors": errors, "dest": str(dest), "time": time.time()}
    finally:
        out.close()
