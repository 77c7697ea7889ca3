"""Child process: a real MetaSchedule tuning run (replay-trace, tiny) into a tvmfuse database.

usage: tune_child.py DB WORK_DIR TOTAL_TRIALS   -- tunes only the trials the database has not spent yet
Prints ``spent K`` before tuning and ``finished K`` after.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from helpers import make_mod, target  # noqa: E402

from tvmfuse._tvm import ensure_tensor_intrinsics, ms  # noqa: E402
from tvmfuse.tune.builder import close_builder, make_builder  # noqa: E402
from tvmfuse.db import open_database  # noqa: E402


def tune(db, mod, work_dir: str, trials: int) -> None:
    ensure_tensor_intrinsics("llvm")
    task = ms.ExtractedTask("add64", mod, db.target_info.target, [mod], 1)
    ctxs, weights = ms.relax_integration.extracted_tasks_to_tune_contexts([task], work_dir, strategy="replay-trace")
    builder = make_builder(workers=1, timeout_s=60)   # the tuner's (one set of workers for the run)
    try:
        ms.tune_tasks(tasks=ctxs, task_weights=weights, work_dir=work_dir, max_trials_global=trials,
                      num_trials_per_iter=2, builder=builder, runner=ms.runner.LocalRunner(timeout_sec=30),
                      database=db.ms_database, cost_model="random")
    finally:
        close_builder(builder)


def main() -> None:
    path, work_dir, total = sys.argv[1], sys.argv[2], int(sys.argv[3])
    db = open_database(path, target=target())
    mod = make_mod(64)
    spent = db.trials_spent(mod)
    print(f"spent {spent}", flush=True)
    if spent < total:
        db.set_task_name(mod, "add64", model="tiny")
        tune(db, mod, work_dir, total - spent)
    print(f"finished {db.trials_spent(mod)}", flush=True)


if __name__ == "__main__":
    main()
