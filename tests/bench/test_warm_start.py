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
    kernels = [{"workload_hash": k["workload_hash"], "weight": k["weight"]} for k in report["kernels"]]
    assert all(warm_start_gpu._workload_ids(cfg.db, [k["workload_hash"]])[k["workload_hash"]] for k in kernels)
    curve = warm_start_gpu.speed_curve(cfg.db, kernels, start=0.0, end=float("inf"))
    best = sum(k["weight"] * k["best_ms"] for k in report["kernels"])
    assert curve and abs(curve[-1][1] - best) <= 1e-9 * best
    # the estimate starts once every kernel has a record, and only falls
    assert all(b[1] < a[1] for a, b in zip(curve, curve[1:])) and all(b[0] >= a[0] for a, b in zip(curve, curve[1:]))
    assert warm_start_gpu.reach(curve, curve[-1][1]) == curve[-1][0]
    assert warm_start_gpu.reach(curve, curve[0][1] * 2) == curve[0][0]
    assert warm_start_gpu.reach(curve, curve[-1][1] / 2) is None
    # records older than the run count from its start; none after its end
    late = warm_start_gpu.speed_curve(cfg.db, kernels, start=curve[-1][0] + 1e12, end=float("inf"))
    assert late == [(0.0, curve[-1][1])]
    assert warm_start_gpu.speed_curve(cfg.db, kernels, start=0.0, end=0.0) == []
