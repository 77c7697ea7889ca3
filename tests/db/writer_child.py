"""Child process for the crash and concurrency tests: commits real records in a loop, acking each.

usage: writer_child.py DB TARGET_JSON START COUNT SIDES   (SIDES: comma-separated n of the workloads)
       writer_child.py --zygote DB TARGET_JSON SIDES      then lines "go START COUNT" on stdin

Prints ``ack SEQ N`` after record SEQ (run time SEQ * 1e-6 s, workload side N) is committed.
The zygote imports TVM once and forks a fresh writer per "go" (it prints ``pid P`` first), so a kill
loop does not pay the TVM import each time; each writer opens its own connection after the fork.
"""
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from helpers import make_mod, make_record  # noqa: E402

from tvmfuse.db import open_database  # noqa: E402
from tvmfuse.target import resolve_target  # noqa: E402


def say(text: str) -> None:
    os.write(1, (text + "\n").encode())  # unbuffered: safe across fork and SIGKILL


def write(path: str, target_json: str, start: int, count: int, sides: str) -> None:
    db = open_database(path, target=resolve_target(target_json))
    mods = {int(n): make_mod(int(n)) for n in sides.split(",")}
    rng = random.Random(os.getpid() * 7919 + start)
    for seq in range(start, start + count):
        n = rng.choice(sorted(mods))
        db.commit_tuning_record(make_record(db, mods[n], seq * 1e-6, split=rng.choice([2, 4, 8])))
        say(f"ack {seq} {n}")
    db.close()
    say("done")


def zygote(path: str, target_json: str, sides: str) -> None:
    make_record  # TVM is imported; forks below start warm
    say("ready")
    for line in sys.stdin:
        _, start, count = line.split()
        pid = os.fork()
        if pid == 0:
            say(f"pid {os.getpid()}")
            try:
                write(path, target_json, int(start), int(count), sides)
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        say(f"exit {status}")


if __name__ == "__main__":
    if sys.argv[1] == "--zygote":
        zygote(*sys.argv[2:5])
    else:
        a = sys.argv[1:6]
        write(a[0], a[1], int(a[2]), int(a[3]), a[4])
