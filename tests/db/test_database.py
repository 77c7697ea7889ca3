"""The target-bound MetaSchedule database: round trip with a real tuning run, isolation, collision guard."""
import json
import sqlite3
from pathlib import Path

import pytest
from helpers import LLVM1, LLVM2, make_mod, make_record, mod_side, record_side, target

from tvmfuse._tvm import save_json, structural_equal
from tvmfuse.db import open_database
from tvmfuse.target import H200_CUDA


def test_tuned_records_round_trip_and_apply(tuned_db):
    db = open_database(tuned_db, target=target(), create=False)
    mod = make_mod(64)
    assert db.trials_spent(mod) == 4
    assert len(db) == 4
    rec = db.query_tuning_record(mod, db.target_info.target, "main")
    assert rec is not None
    assert sum(map(float, rec.run_secs)) / len(rec.run_secs) == pytest.approx(db.best_run_secs(mod))
    # The schedule applies to the workload and is the best one.
    sch = db.query_schedule(mod, db.target_info.target, "main")
    assert sch is not None and not structural_equal(sch.mod, mod)
    top = db.get_top_k(db.commit_workload(mod), 10)
    means = [sum(float(s) for s in r.run_secs) / len(r.run_secs) for r in top]
    assert means == sorted(means) and len(top) <= 4
    # MetaSchedule's own apply path sees the record (inside the database scope).
    from tvmfuse._tvm import ms
    with db.target_info.target, db:
        applied = ms.database.Database.current().query_ir_module(mod, db.target_info.target, "main")
    assert applied is not None and structural_equal(applied, sch.mod)
    # Inspection API.
    (stats,) = db.list_workloads()
    assert (stats.task_name, stats.model, stats.trials, stats.failed) == ("add64", "tiny", 4, 0)
    assert stats.best_secs == pytest.approx(db.best_run_secs(mod)) and stats.first_secs is not None
    rows = db.records(stats.workload_id)
    assert [r.id for r in rows] == sorted(r.id for r in rows) and len(rows) == 4
    assert rows[0].tvm_version and rows[0].record_target["kind"] == "llvm"
    db.close()


def test_failed_trials_kept_apart(tmp_path):
    db = open_database(tmp_path / "t.db", target=target())
    mod = make_mod(16)
    db.commit_tuning_record(make_record(db, mod, 1e10))   # MetaSchedule's failed build/run
    db.commit_tuning_record(make_record(db, mod, None))   # no run time at all
    assert db.best_run_secs(mod) is None
    assert db.query_tuning_record(mod, db.target_info.target, "main") is None
    assert db.get_top_k(db.commit_workload(mod), 5) == [] or len(db.get_top_k(db.commit_workload(mod), 5)) == 0
    db.commit_tuning_record(make_record(db, mod, 2e-5))
    assert db.trials_spent(mod) == 3
    assert db.best_run_secs(mod) == pytest.approx(2e-5)
    assert len(db.get_top_k(db.commit_workload(mod), 5)) == 1
    assert len(db.get_all_tuning_records()) == 3
    (stats,) = db.list_workloads()
    assert (stats.trials, stats.failed) == (3, 2)
    assert [r.failed for r in db.records(stats.workload_id)] == [True, True, False]
    assert len(db.records(stats.workload_id, include_failed=False)) == 1


@pytest.mark.parametrize("other", [LLVM2, H200_CUDA], ids=["llvm-2-cores", "cuda"])
def test_cross_target_isolation(tmp_path, other):
    path = tmp_path / "t.db"
    mod = make_mod(16)
    db1 = open_database(path, target=target(LLVM1))
    db1.commit_tuning_record(make_record(db1, mod, 1e-5))
    db2 = open_database(path, target=target(other))
    assert not db2.has_workload(mod)
    assert db2.trials_spent(mod) == 0 and db2.best_run_secs(mod) is None
    assert db2.query_tuning_record(mod, db2.target_info.target, "main") is None
    assert len(db2) == 0 and len(db2.get_all_tuning_records()) == 0
    assert len(db2.get_top_k(db2.commit_workload(mod), 5)) == 0
    assert db2.list_workloads()[0].trials == 0
    # The first database still sees its record, and both targets are listed in the file.
    assert db1.trials_spent(mod) == 1 and db1.has_workload(mod)
    assert {t["target"] for t in db1.targets()} == {target(LLVM1).canonical, target(other).canonical}


def test_same_target_other_device_is_isolated(tmp_path):
    path = tmp_path / "t.db"
    mod = make_mod(16)
    t1 = target(LLVM1)
    db1 = open_database(path, target=t1)
    db1.commit_tuning_record(make_record(db1, mod, 1e-5))
    from dataclasses import replace
    db2 = open_database(path, target=replace(t1, device="cpu:another machine x1"))
    assert db2.trials_spent(mod) == 0 and db2.query_tuning_record(mod, t1.target, "main") is None


def test_hash_collision_is_never_used(tmp_path):
    """A row with mod A's structural hash but mod B's IR must not answer for A."""
    path = tmp_path / "t.db"
    a, b = make_mod(16), make_mod(16, op="mul")
    db = open_database(path, target=target())
    wb = db.commit_workload(b)
    db.commit_tuning_record(make_record(db, b, 1e-6))
    db.close()
    from tvmfuse._tvm import structural_hash
    con = sqlite3.connect(path)
    con.execute("UPDATE workloads SET shash=?", (str(structural_hash(a)),))  # forge the collision
    con.commit()
    con.close()
    db = open_database(path, target=target())
    assert db.workload_id(a) is None
    assert db.trials_spent(a) == 0
    assert db.query_tuning_record(a, db.target_info.target, "main") is None
    assert not db.has_workload(a)
    db.commit_tuning_record(make_record(db, a, 5e-6))
    assert db.workload_id(a) != 1  # a new row, not the colliding one
    assert db.trials_spent(a) == 1 and db.best_run_secs(a) == pytest.approx(5e-6)
    rec = db.query_tuning_record(a, db.target_info.target, "main")
    assert structural_equal(rec.workload.mod, a)
    del wb


def test_structural_equality_not_text(tmp_path):
    """The same kernel built twice (fresh objects) is one workload."""
    db = open_database(tmp_path / "t.db", target=target())
    db.commit_tuning_record(make_record(db, make_mod(32), 1e-5))
    db.commit_tuning_record(make_record(db, make_mod(32), 2e-5))
    assert db.info()["workloads"] == 1
    assert db.trials_spent(make_mod(32)) == 2


def test_record_workload_link(tmp_path):
    db = open_database(tmp_path / "t.db", target=target())
    for n in (8, 16, 24):
        db.commit_tuning_record(make_record(db, make_mod(n), n * 1e-6))
    for rec in db.get_all_tuning_records():
        assert record_side(rec) == mod_side(rec.workload.mod)
    assert db.best_run_secs(make_mod(24)) == pytest.approx(24e-6)


def test_wrong_kind_record_is_refused(tmp_path):
    db = open_database(tmp_path / "t.db", target=target(LLVM1))
    cuda = open_database(tmp_path / "t.db", target=target(H200_CUDA))
    rec = make_record(cuda, make_mod(8), 1e-5)
    with pytest.raises(Exception, match="bound to llvm"):  # crosses the FFI as RuntimeError
        db.commit_tuning_record(rec)
    assert len(db) == 0


def test_saved_ir_is_tvm_json(tmp_path):
    db = open_database(tmp_path / "t.db", target=target())
    db.commit_workload(make_mod(8))
    con = sqlite3.connect(tmp_path / "t.db")
    (text,), = con.execute("SELECT mod_json FROM workloads").fetchall()
    assert json.loads(text).keys() >= {"root_index", "nodes"} and text == save_json(make_mod(8))


@pytest.mark.parametrize("where", ["below-a-file", "missing-folder"])
def test_a_database_that_cannot_be_created_is_a_database_error(tmp_path, where):
    from tvmfuse.errors import DatabaseError

    (tmp_path / "a_file").write_text("x")
    path = tmp_path / "a_file" / "t.db" if where == "below-a-file" else Path("/proc/nope/t.db")
    with pytest.raises(DatabaseError, match="cannot create tuning database") as info:
        open_database(path, target=target())
    assert ("a_file is a file" in str(info.value)) == (where == "below-a-file")
