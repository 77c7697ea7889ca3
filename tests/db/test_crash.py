"""Crash safety and concurrency with real processes, real SQLite and real MetaSchedule records."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from crashlib import SIDES, WRITER, Lines, check_db, kill_loop, raw_counts
from helpers import LLVM1, make_mod, target

from tvmfuse.db import open_database

HERE = Path(__file__).resolve().parent
KILLS = 25


def test_sigkill_loop_never_loses_acknowledged_records(tmp_path):
    res = kill_loop(tmp_path / "k.db", json.dumps(LLVM1), KILLS, seed=1)
    assert res["kills"] == KILLS
    assert res["acked"] > KILLS  # the writers were killed mid-stream, not before they started
    # A writer that runs to completion afterwards still works on the crashed-into file.
    out = subprocess.run([sys.executable, str(WRITER), str(tmp_path / "k.db"), json.dumps(LLVM1), "9000000", "5",
                          SIDES], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("done"), out.stderr[-2000:]


def test_killed_tuning_run_resumes_without_respending(tmp_path):
    path, work = tmp_path / "tune.db", tmp_path / "work"
    child = [sys.executable, str(HERE / "tune_child.py"), str(path), str(work), "6"]
    p = subprocess.Popen(child, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
    lines = Lines(p.stdout)
    mod = make_mod(64)
    seen = 0
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:  # a reader polling while the tuner writes
            if path.exists():
                db = open_database(path, target=target(), create=False)
                n = db.trials_spent(mod)
                db.close()
                assert n >= seen
                seen = n
                if n >= 2:
                    break
            assert p.poll() is None, "the tuning run ended before it could be killed"
            time.sleep(0.2)
        assert seen >= 2, "the tuning run committed nothing in time"
    finally:
        os.killpg(p.pid, signal.SIGKILL)  # the tuner and its builder/runner workers
        p.wait()
    assert lines.drain()[0] == "spent 0"
    db = open_database(path, target=target(), create=False)
    after_kill = db.trials_spent(mod)
    assert 2 <= after_kill < 6
    db.close()
    out = subprocess.run(child, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"spent {after_kill}" in out.stdout and "finished 6" in out.stdout
    db = open_database(path, target=target(), create=False)
    assert db.trials_spent(mod) == 6 and db.best_run_secs(mod) is not None
    assert db.list_workloads()[0].task_name == "add64"


def test_two_concurrent_writers_do_not_mislink(tmp_path):
    path = tmp_path / "two.db"
    n = 60
    procs = [subprocess.Popen([sys.executable, str(WRITER), str(path), json.dumps(LLVM1), str(start), str(n), SIDES],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for start in (0, 1000)]
    last = 0
    while any(p.poll() is None for p in procs):  # a third process reading meanwhile
        if path.exists():
            try:
                count, _ = raw_counts(path)
            except Exception:  # noqa: BLE001 - the tables may not exist yet
                count = 0
            assert count >= last
            last = count
        time.sleep(0.05)
    acked = {}
    for p in procs:
        out, err = p.communicate()
        assert p.returncode == 0, err.decode()[-2000:]
        for line in out.decode().splitlines():
            if line.startswith("ack "):
                _, seq, side = line.split()
                acked[int(seq)] = int(side)
    assert len(acked) == 2 * n
    assert check_db(path, json.dumps(LLVM1), acked, 0) == 2 * n
    assert raw_counts(path) == (2 * n, len(SIDES.split(",")))  # each workload once, ids from the DB
