"""benchmarks/warm_start_gpu.py's reading of a run's database: the model's estimated time over tuning time."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

warm_start_gpu = pytest.importorskip("warm_start_gpu")


@pytest.mark.slow
def test_the_speed_curve_ends_at_the_sum_of_each_kernels_best_record(tuned_example):
    cfg, report = tuned_example
    kernels = [{"name": k["name"], "workload_hash": k["workload_hash"], "weight": k["weight"]}
               for k in report["kernels"]]
    assert all(warm_start_gpu._workload_ids(cfg.db, [k["workload_hash"]])[k["workload_hash"]] for k in kernels)
    events = warm_start_gpu.record_events(cfg.db, kernels, start=0.0, end=float("inf"))
    curve = warm_start_gpu.speed_curve(kernels, events)
    best = sum(k["weight"] * k["best_ms"] for k in report["kernels"])
    assert curve and abs(curve[-1][1] - best) <= 1e-9 * best
    # the estimate starts once every kernel has a record, and only falls
    assert all(b[1] < a[1] for a, b in zip(curve, curve[1:])) and all(b[0] >= a[0] for a, b in zip(curve, curve[1:]))
    assert warm_start_gpu.reach(curve, curve[-1][1]) == curve[-1][0]
    assert warm_start_gpu.reach(curve, curve[0][1] * 2) == curve[0][0]
    assert warm_start_gpu.reach(curve, curve[-1][1] / 2) is None
    # records older than the run count from its start; none after its end
    late = warm_start_gpu.record_events(cfg.db, kernels, start=curve[-1][0] + 1e12, end=float("inf"))
    assert warm_start_gpu.speed_curve(kernels, late) == [(0.0, curve[-1][1])]
    assert warm_start_gpu.speed_curve(kernels, warm_start_gpu.record_events(cfg.db, kernels, 0.0, 0.0)) == []


def test_a_kernel_one_run_never_reached_is_left_out_of_both_and_named():
    """Under a time budget a run may end before its cheapest kernels get a trial (ResNet-50 at 240 s: 3 of 29):
    they run their untuned default, whose speed no record gives; the comparison sums the kernels both runs
    measured, and names the others."""
    kernels = [{"name": n, "workload_hash": h, "weight": w, "status": "tuned", "had_records": False}
               for n, h, w in (("conv", "a1", 2), ("pool", "b2", 1))]
    cold = {"run": "cold", "tune_s": 100.0, "kernels": kernels, "events": [[(10.0, 4.0), (50.0, 3.0)], [(60.0, 1.0)]]}
    warm = {"run": "warm", "tune_s": 100.0, "kernels": kernels, "events": [[(5.0, 3.1)], []]}
    res = warm_start_gpu.summary({"cold": cold, "warm": warm})
    assert res["kernels_compared"] == 1 and res["left_out"] == ["pool"]
    assert res["final_ms"] == 6.0 and res["cold"]["t90_s"] == 50.0 and res["warm"]["t90_s"] == 5.0
    assert res["warm_t90_over_cold_tune"] == 0.05
    assert warm_start_gpu.summary({"cold": cold}) == {}
