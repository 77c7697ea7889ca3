"""`tvmfuse db ...` through typer's CliRunner on the db app: JSON shapes, tables, errors."""
import json

import pytest
from helpers import LLVM1, LLVM2, make_mod, make_record, target
from typer.testing import CliRunner

from tvmfuse.cli.db import app
from tvmfuse.db import open_database
from tvmfuse.db.ops import RECORD_FILE, WORKLOAD_FILE

runner = CliRunner()


def _run(*args, code=0):
    res = runner.invoke(app, [str(a) for a in args])
    assert res.exit_code == code, res.output
    return res


def _json(*args):
    return json.loads(_run(*args, "--json").stdout)


def _make(path, spec=LLVM1, n=6, sides=(8, 16)):
    db = open_database(path, target=target(spec))
    for i in range(n):
        db.commit_tuning_record(make_record(db, make_mod(sides[i % len(sides)]), (i + 1) * 1e-6))
    db.commit_tuning_record(make_record(db, make_mod(sides[0]), 1e10))  # a failed trial
    db.set_task_name(make_mod(sides[0]), "add8", model="tiny")
    db.close()
    return path


def test_info_json_and_table(tuned_copy, tmp_path):
    _make(tuned_copy, LLVM2)
    res = _json("info", tuned_copy)
    assert (res["records"], res["workloads"], res["failed"]) == (4 + 7, 3, 1)
    assert sorted(t["target"] for t in res["targets"]) == sorted([target(LLVM1).canonical,
                                                                  target(LLVM2).canonical])
    assert {m["model"] for m in res["models"]} == {"tiny", None}
    text = _run("info", tuned_copy).stdout
    assert "11 records (1 failed)" in text and "Targets" in text


def test_damaged_file_one_line_error(tmp_path):
    bad = tmp_path / "bad.db"
    bad.write_bytes(b"this is not a database at all" * 100)
    res = _run("info", bad, code=2)
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and str(bad) in lines[0] and "tvmfuse db recover" in lines[0]


def test_merge_dedupes_and_keeps_best(tmp_path):
    a = _make(tmp_path / "a.db")
    b = _make(tmp_path / "b.db", LLVM2)
    res = _json("merge", a, b, "--into", tmp_path / "m.db")
    assert res["records"] == 14 and res["added"] == 14
    again = _json("merge", a, b, "--into", tmp_path / "m.db")
    assert again["added"] == 0 and again["duplicates"] == 14 and again["records"] == 14
    m = open_database(tmp_path / "m.db", target=target(LLVM1), create=False)
    assert m.trials_spent(make_mod(8)) == 4 and m.best_run_secs(make_mod(8)) == pytest.approx(1e-6)
    assert m.info()["workloads"] == 2
    assert {w.task_name for w in m.list_workloads()} == {"add8", None}


def test_export_import_round_trip_with_torn_line(tuned_copy, tmp_path):
    out_dir = tmp_path / "msjson"
    res = _json("export", out_dir, "--db", tuned_copy)
    assert (res["workloads"], res["records"]) == (1, 4)
    lines = (out_dir / RECORD_FILE).read_text().splitlines()
    assert len(lines) == 4 and json.loads(lines[0])[0] == 0
    # MetaSchedule's own JSON database reads the export.
    from tvmfuse._tvm import ms
    msdb = ms.database.JSONDatabase(work_dir=str(out_dir), allow_missing=False)
    assert len(msdb) == 4
    # A killed MetaSchedule run leaves a torn last line: import skips it and keeps the rest.
    with open(out_dir / RECORD_FILE, "a") as f:
        f.write(lines[1][: len(lines[1]) // 2])
    res = _json("import", out_dir, "--db", tmp_path / "new.db", "--target", json.dumps(LLVM1))
    assert (res["added"], res["torn_lines"], res["records"]) == (4, 1, 4)
    again = _json("import", out_dir, "--db", tmp_path / "new.db", "--target", json.dumps(LLVM1))
    assert (again["added"], again["duplicates"]) == (0, 4)
    db = open_database(tmp_path / "new.db", target=target(LLVM1), create=False)
    src = open_database(tuned_copy, target=target(LLVM1), create=False)
    assert db.best_run_secs(make_mod(64)) == pytest.approx(src.best_run_secs(make_mod(64)))
    assert db.query_schedule(make_mod(64), db.target_info.target, "main") is not None
    assert (out_dir / WORKLOAD_FILE).exists()


def test_prune_keeps_top_k_and_spent_trials(tmp_path):
    path = _make(tmp_path / "p.db", n=10)
    res = _json("prune", path, "--top-k", "1")
    assert res == {"removed": 11 - 2, "records": 2}
    db = open_database(path, target=target(LLVM1), create=False)
    assert db.trials_spent(make_mod(8)) == 6 and db.trials_spent(make_mod(16)) == 5  # still spent
    assert db.best_run_secs(make_mod(8)) == pytest.approx(1e-6)
    assert db.best_run_secs(make_mod(16)) == pytest.approx(2e-6)
    stats = {w.task_name: w for w in db.list_workloads()}
    assert stats["add8"].failed == 1 and stats["add8"].trials == 6


def test_recover_cli(tmp_path):
    path = _make(tmp_path / "r.db")
    res = _json("recover", path, tmp_path / "saved.db")
    assert res["records"] == 7 and res["workloads"] == 2
    res = _run("recover", path, tmp_path / "saved.db", code=2)
    assert "exists" in res.output
