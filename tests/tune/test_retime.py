"""A search's finalists timed again side by side (tvmfuse.tune.retime), on the real llvm runner and database."""
from __future__ import annotations

import json

import pytest

from tvmfuse.tune import TuneConfig


def _schedules(db, wid) -> dict[str, list]:
    out: dict[str, list] = {}
    for row in db.records(wid, include_failed=False):
        out.setdefault(json.dumps(row.trace, sort_keys=True), []).append(row)
    return out


@pytest.mark.slow
def test_the_tuned_example_ranks_its_records_by_side_by_side_times(tuned_example, llvm_target):
    """api.tune on llvm times each kernel's finalists again: the best record of every re-timed kernel holds the
    samples of the rounds (more than one trial's), and the records of one schedule share those times."""
    from tvmfuse.db import open_database
    from tvmfuse.tune.retime import FINALISTS, ROUNDS
    from tvmfuse.tune.samples import CPU_SAMPLES

    cfg, report = tuned_example
    assert report["retime_finalists"] == FINALISTS
    retimed = [k for k in report["kernels"] if k["retimed"] and "best_ms" in k["retimed"]]
    assert retimed and report["retimed"] == len(retimed)
    db = open_database(cfg.db, target=llvm_target)
    try:
        by_name = {s.task_name: s.workload_id for s in db.list_workloads()}
        for k in retimed:
            r = k["retimed"]
            assert r["rounds"] == ROUNDS and 2 <= r["finalists"] <= FINALISTS + 2 and not r["untimed"], r
            wid = by_name[k["name"]]
            best = db.best_record(wid)
            assert len(best.run_secs) > CPU_SAMPLES, best.run_secs   # the rounds' samples, not one trial's
            assert abs(best.mean_secs * 1e3 - k["best_ms"]) < 1e-9
            for rows in _schedules(db, wid).values():
                assert len({tuple(r.run_secs) for r in rows}) == 1   # one schedule, one set of times
            # the default is the first record; its reported time is its re-timed one
            assert abs(db.records(wid, include_failed=False)[0].mean_secs * 1e3 - r["first_ms"]) < 1e-9
            assert abs(k["baseline_ms"] - r["first_ms"]) < 1e-9
    finally:
        db.close()


@pytest.mark.slow
def test_a_lucky_record_is_timed_again_and_loses_its_luck(tmp_path, example_kernels, llvm_target):
    """A record whose trial ran in a quiet moment (here: given a nanosecond) is the first
    finalist; timed again beside the others it takes its own time back, and the build's best is another record
    unless its schedule really is the fastest."""
    from tvmfuse.db import open_database
    from tvmfuse.tune import tune_kernels
    from tvmfuse.tune.builder import close_builder, make_builder
    from tvmfuse.tune.retime import retime_finalists
    from tvmfuse.tune.samples import KeptSamplesRunner, local_runner

    heavy = max(example_kernels, key=lambda k: k.flops)
    db = open_database(tmp_path / "t.db", target=llvm_target)
    builder = make_builder(workers=1, timeout_s=600)
    try:
        (res,) = tune_kernels([heavy], target=llvm_target, database=db,
                              config=TuneConfig(trials=4, trials_per_kernel=4, trials_per_round=2, population=16,
                                                cost_model="random", check=False, retime_finalists=0,
                                                builder_timeout_s=600))
        assert res.retimed is None   # off
        wid = db.workload_id(heavy.mod)
        groups = _schedules(db, wid)
        assert len(groups) >= 2, "the search measured one schedule only"
        # the slowest schedule other than the first record's (the default, always a finalist): made lucky, it is
        # a finalist of its own beside the default
        first = min(r.id for rows in groups.values() for r in rows)
        slowest = max((rows for rows in groups.values() if all(r.id != first for r in rows)),
                      key=lambda rows: rows[0].mean_secs)
        # a time no call of a real kernel reaches: the trials' own times are no yardstick, as the search's trials
        # may have run beside another test's processes and the rounds in a quiet moment
        lucky = 1e-9
        db.retime_records([r.id for r in slowest], [lucky] * 3)
        assert db.best_record(wid).id == slowest[0].id
        report = retime_finalists(heavy, target=llvm_target, database=db, builder=builder,
                                  runner=KeptSamplesRunner(local_runner(30, gpu=False)), finalists=1, rounds=3)
        after = db.records(wid, include_failed=False)
        again = next(r for r in after if r.id == slowest[0].id)
    finally:
        close_builder(builder)
        db.close()
    assert again.mean_secs > 100 * lucky and len(again.run_secs) >= 3   # its own time, from the rounds
    assert report["best_before_ms"] == pytest.approx(lucky * 1e3)
    assert report["best_ms"] == pytest.approx(min(r.mean_secs for r in after) * 1e3)
    assert report["finalists"] >= 2   # the lucky one and the first record (the default) beside it


def test_retime_records_keeps_the_trial_and_refuses_failed_times(tmp_path, llvm_target, example_kernels):
    from tvmfuse._tvm import ms, tvm
    from tvmfuse.db import open_database
    from tvmfuse.errors import DatabaseError
    from tvmfuse.tune.defaults import default_template_schedule

    kernel = example_kernels[0]
    db = open_database(tmp_path / "t.db", target=llvm_target)
    try:
        sch = default_template_schedule(kernel.mod, llvm_target.target)
        sch = sch if sch is not None else tvm.s_tir.Schedule(kernel.mod)
        workload = db.ms_database.commit_workload(kernel.mod)
        args = ms.arg_info.ArgInfo.from_entry_func(sch.mod, True)
        db.ms_database.commit_tuning_record(ms.database.TuningRecord(sch.trace, workload, [2e-3, 4e-3],
                                                                     llvm_target.target, args))
        (row,) = db.records(db.workload_id(kernel.mod))
        key = db.store.query("SELECT record_key FROM records WHERE id=?", (row.id,))[0][0]
        db.retime_records([row.id], [1e-3, 1e-3, 4e-3])
        (after,) = db.records(db.workload_id(kernel.mod))
        assert after.mean_secs == pytest.approx(2e-3) and after.run_secs == [1e-3, 1e-3, 4e-3]
        assert json.loads(db.record_json(after))[1] == [1e-3, 1e-3, 4e-3]   # the record itself, for export
        assert db.store.query("SELECT record_key FROM records WHERE id=?", (row.id,))[0][0] == key
        with pytest.raises(DatabaseError):
            db.retime_records([row.id], [1e10])
        with pytest.raises(DatabaseError):
            db.retime_records([row.id + 1], [1e-3])
    finally:
        db.close()
