"""Damaged files: one clear line naming the file and `tvmfuse db recover`; recover salvages what it can."""
import os
import sqlite3

import pytest
from helpers import make_mod, make_record, mod_side, record_side, target

from tvmfuse.db import open_database
from tvmfuse.db.ops import recover
from tvmfuse.errors import DatabaseError


def _filled(path, n=300):
    db = open_database(path, target=target())
    mods = [make_mod(s) for s in (8, 16, 24)]
    with db.batch():
        for i in range(n):
            db.commit_tuning_record(make_record(db, mods[i % 3], (i + 1) * 1e-6))
    db.close()  # the last connection checkpoints the WAL into the file
    assert not os.path.exists(f"{path}-wal")
    return path


def _assert_one_line_error(path):
    with pytest.raises(DatabaseError) as info:
        open_database(path, target=target(), create=False)
    msg = str(info.value)
    assert "\n" not in msg and str(path) in msg and "tvmfuse db recover" in msg
    return msg


def test_garbage_file(tmp_path):
    path = tmp_path / "garbage.db"
    path.write_bytes(os.urandom(10000))
    assert "not an SQLite file" in _assert_one_line_error(path)
    with pytest.raises(DatabaseError, match="nothing can be recovered"):
        recover(src=path, dest=tmp_path / "new.db")


def test_foreign_sqlite_file(tmp_path):
    path = tmp_path / "other.db"
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE people (name TEXT)")
    con.commit()
    con.close()
    assert "without tvmfuse's tables" in _assert_one_line_error(path)


def test_missing_file(tmp_path):
    with pytest.raises(DatabaseError, match="not found"):
        open_database(tmp_path / "nope.db", target=target(), create=False)


def test_truncated_file_is_reported_and_recovered(tmp_path):
    path = _filled(tmp_path / "full.db")
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(int(size * 0.6))
    _assert_one_line_error(path)
    res = recover(src=path, dest=tmp_path / "saved.db")
    assert 0 < res["records"] < 300 and res["workloads"] == 3 and res["errors"]
    db = open_database(tmp_path / "saved.db", target=target(), create=False)
    recs = db.get_all_tuning_records()
    assert len(recs) == res["records"]
    for rec in recs:  # every salvaged record is whole and linked to its own workload
        assert record_side(rec) == mod_side(rec.workload.mod)
    assert db.query_schedule(make_mod(8), db.target_info.target, "main") is not None
    assert path.stat().st_size == int(size * 0.6)  # the damaged source is left as it was


def test_corrupted_page_in_the_middle(tmp_path):
    path = _filled(tmp_path / "full.db")
    data = bytearray(path.read_bytes())
    page = 4096
    mid = (len(data) // page // 2) * page
    data[mid:mid + page] = os.urandom(page)
    path.write_bytes(bytes(data))
    _assert_one_line_error(path)
    res = recover(src=path, dest=tmp_path / "saved.db")
    assert res["records"] > 0
    db = open_database(tmp_path / "saved.db", target=target(), create=False)
    for rec in db.get_all_tuning_records():
        assert record_side(rec) == mod_side(rec.workload.mod)


def test_recover_healthy_file_keeps_everything(tmp_path):
    path = _filled(tmp_path / "full.db", n=30)
    res = recover(src=path, dest=tmp_path / "copy.db")
    assert (res["records"], res["workloads"], res["errors"]) == (30, 3, [])
    db = open_database(tmp_path / "copy.db", target=target(), create=False)
    assert db.trials_spent(make_mod(8)) == 10
    with pytest.raises(DatabaseError, match="exists"):
        recover(src=path, dest=tmp_path / "copy.db")
