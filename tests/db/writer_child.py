"""Child process for the crash and concurrency tests: commits real records in a loop, acking each.

usage: writer_child.py DB TARGET_JSON START COUNT SIDES   (SIDES: comma-separated n of the workloads)
Prints ``ack SEQ N`` after record SEQ (run time SEQ * 1e-6 s, workload side N) is committed.
"""
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from helpers import make_mod, make_record  # noqa: E402

from tvmfuse.db import open_database  # noqa: E402
from tvmfuse.target import resolve_target  # noqa: E402


def main() -> None:
    path, target_json, start, count, sides = sys.argv[1:6]
    db = open_database(path, target=resolve_target(target_json))
    mods = {int(n): make_mod(int(n)) for n in sides.split(",")}
    rng = random.Random(os.getpid())
    print("ready", flush=True)
    for seq in range(int(start), int(start) + int(count)):
        n = rng.choice(sorted(mods))
        db.commit_tuning_record(make_record(db, mods[n], seq * 1e-6, split=rng.choice([2, 4, 8])))
        print(f"ack {seq} {n}", flush=True)
    db.close()
    print("done", flush=True)


if __name__ == "__main__":
    main()
