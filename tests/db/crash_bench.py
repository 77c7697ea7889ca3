"""Crash benchmark for the tuning database: SIGKILL a writer of real MetaSchedule records N times.

Each writer is forked from a warm process (TVM imported once), opens the database, commits records and
acks each one on stdout; it is killed at a random moment (often mid-transaction). After every kill the
database is reopened and checked: it opens, no acknowledged record is lost, the record count never goes
down, every record is linked to its own workload.

usage: python tests/db/crash_bench.py [--kills 100] [--seed 0] [--db PATH] [--json]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))   # beside the crash test's kill loop and helpers

from crashlib import kill_loop  # noqa: E402
from helpers import LLVM1  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-delay", type=float, default=0.25, help="kill within this many seconds of the fork")
    ap.add_argument("--db", type=Path, default=None, help="database file (default: a fresh temporary one)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    tmp = None
    if args.db is None:
        tmp = tempfile.TemporaryDirectory(prefix="tvmfuse-crash-")
        args.db = Path(tmp.name) / "crash.db"
    t0 = time.monotonic()
    res = kill_loop(args.db, json.dumps(LLVM1), args.kills, seed=args.seed, max_delay=args.max_delay,
                    log=None if args.json else (lambda s: print(s, flush=True)))
    res["seconds"] = round(time.monotonic() - t0, 1)
    res["lost_acknowledged"] = 0  # kill_loop asserts this after every kill
    print(json.dumps(res) if args.json else
          f"{res['kills']} kills, {res['acked']} acknowledged records, {res['records']} in the database, "
          f"none lost, count never went down ({res['seconds']} s)")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
