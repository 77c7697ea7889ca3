"""The kill loop shared by tests/db/test_crash.py and its long run, tests/db/crash_bench.py."""
from __future__ import annotations

import os
import queue
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
WRITER = HERE / "writer_child.py"
SIDES = "8,16,24,32"


class Lines:
    """Lines of a child's stdout, read by a thread so the parent never blocks on them."""

    def __init__(self, stream):
        self.q: queue.Queue = queue.Queue()
        self.t = threading.Thread(target=self._pump, args=(stream,), daemon=True)
        self.t.start()

    def _pump(self, stream):
        for raw in stream:
            self.q.put(raw.decode().strip())
        self.q.put(None)

    def get(self, timeout: float):
        return self.q.get(timeout=timeout)

    def drain(self) -> list[str]:
        out = []
        while True:
            try:
                line = self.q.get_nowait()
            except queue.Empty:
                return out
            if line is not None:
                out.append(line)


def check_db(path: Path, target_json: str, acked: dict[int, int], last_count: int) -> int:
    """Reopen after a kill: it opens, every acked record is there, linked to its workload; returns count."""
    from helpers import mod_side, record_side

    from tvmfuse.db import open_database
    from tvmfuse.target import resolve_target

    db = open_database(path, target=resolve_target(target_json), create=False)
    try:
        count = len(db)
        assert count >= last_count, f"record count went down: {last_count} -> {count}"
        seqs = {}
        for rec in db.get_all_tuning_records():
            seq = round(float(rec.run_secs[0]) / 1e-6)
            assert record_side(rec) == mod_side(rec.workload.mod), f"record {seq} mis-linked"
            seqs[seq] = record_side(rec)
        lost = [s for s in acked if s not in seqs]
        assert not lost, f"acknowledged records lost: {lost[:10]}"
        assert all(seqs[s] == n for s, n in acked.items()), "an acked record changed workload"
        return count
    finally:
        db.close()


def kill_loop(path: Path, target_json: str, kills: int, *, seed: int = 0, max_delay: float = 0.25,
              log=None) -> dict:
    """Fork ``kills`` writers from a warm zygote and SIGKILL each at a random moment."""
    rng = random.Random(seed)
    z = subprocess.Popen([sys.executable, str(WRITER), "--zygote", str(path), target_json, SIDES],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    lines = Lines(z.stdout)
    acked: dict[int, int] = {}
    count = 0
    killed_mid_run = 0
    try:
        assert lines.get(120) == "ready"
        for k in range(kills):
            z.stdin.write(f"go {k * 100000} 100000\n".encode())
            z.stdin.flush()
            first = lines.get(60)
            assert first.startswith("pid "), first
            pid = int(first.split()[1])
            exited = False
            if k % 2:
                # every other writer is killed at a moment counted from its first acknowledged commit, so it dies
                # mid-stream however long its start (connection, the workload's first commit) takes on this
                # machine; the others at a moment counted from their start, their first commit included
                line = lines.get(60)
                if line.startswith("ack "):
                    _, seq, n = line.split()
                    acked[int(seq)] = int(n)
                exited = line.startswith("exit ")
            if not exited:
                time.sleep(rng.uniform(0, max_delay))
                os.kill(pid, signal.SIGKILL)
            while not exited:
                line = lines.get(60)
                if line.startswith("exit "):
                    break
                if line.startswith("ack "):
                    _, seq, n = line.split()
                    acked[int(seq)] = int(n)
            killed_mid_run += 1
            if path.exists():
                count = check_db(path, target_json, acked, count)
            if log:
                log(f"kill {k + 1}/{kills}: {len(acked)} acked, {count} records")
    finally:
        z.kill()
        z.wait()
    return {"kills": killed_mid_run, "acked": len(acked), "records": count}


def raw_counts(path: Path) -> tuple[int, int]:
    con = sqlite3.connect(path)
    try:
        return tuple(con.execute("SELECT (SELECT COUNT(*) FROM records), (SELECT COUNT(*) FROM workloads)")
                     .fetchone())
    finally:
        con.close()


__all__ = ["kill_loop", "check_db", "Lines", "raw_counts", "WRITER", "SIDES"]
