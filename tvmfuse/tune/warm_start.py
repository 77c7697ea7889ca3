"""Warm start: the cost model of a run learns the database's measurements before its first trial.

A run's kernels are often new workloads, but the database holds records of the same kernel classes at other
shapes and from other models (and, on a resumed run, of the same kernels). Each record is replayed on its workload
and handed to the cost model with its measured time, as if the run had measured it, so the model's first
predictions are already fitted (the XGBoost model predicts at random until it holds its warm-up samples).
"""
from __future__ import annotations

import logging

from tvmfuse._tvm import ms, tvm

log = logging.getLogger("tvmfuse.tune")


def warm_start(model, database, target, *, max_records: int = 512, per_workload: int = 32) -> int:
    """Update ``model`` (a MetaSchedule cost model) with up to ``max_records`` valid records of ``database``'s
    bound target, at most ``per_workload`` of each workload (the newest), and return how many it took. A record
    whose trace no longer replays (a changed template) is skipped."""
    taken = 0
    for stats in reversed(database.list_workloads()):   # the newest workloads first
        if taken >= max_records:
            break
        rows = database.records(stats.workload_id, include_failed=False)[-per_workload:]
        if not rows:
            continue
        mod = database.workload_mod(stats.workload_id)
        args = ms.arg_info.ArgInfo.from_prim_func(mod["main"])
        candidates, results = [], []
        for row in rows[: max_records - taken]:
            try:
                sch = tvm.s_tir.Schedule(database.schedule_of(row, mod))
            except Exception:  # noqa: BLE001 - a trace of an older template: nothing to learn from it
                continue
            candidates.append(ms.MeasureCandidate(sch, args))
            results.append(ms.runner.RunnerResult(run_secs=[float(s) for s in row.run_secs], error_msg=None))
        if not candidates:
            continue
        context = ms.TuneContext(mod=mod, target=target.target, task_name=stats.task_name or "warm-start",
                                 num_threads=1)
        model.update(context, candidates, results)
        taken += len(candidates)
    if taken:
        log.info("cost model warm-started with %d records of the database", taken)
    return taken
